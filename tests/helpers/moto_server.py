"""Run moto's S3 server as a real subprocess, and a header-stripping proxy.

``moto_server()`` starts ``python -m moto.server`` on a free port of
127.0.0.1, waits (with a deadline) until it answers, yields its endpoint URL
and kills it at teardown. ``stripping_proxy(upstream)`` is a tiny real HTTP
proxy that forwards to ``upstream`` minus the ``If-None-Match``/``If-Match``
headers: a stand-in for an S3-compatible server that ignores conditional writes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.helpers.poll import poll_until
from tests.helpers.processes import stop_process

__all__ = ["free_port", "moto_server", "moto_server_proc", "start_moto", "stripping_proxy"]

START_DEADLINE = 30.0


def free_port() -> int:
    """Return a port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status < 500)
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, grace=5)


@contextlib.contextmanager
def moto_server(
    deadline: float = START_DEADLINE, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Yield the endpoint URL of a fresh moto server subprocess (S3, EC2, ...).

    ``env`` adds to the server's environment, e.g. ``INITIAL_NO_AUTH_ACTION_COUNT=0``
    for a server that checks credentials.
    """
    with moto_server_proc(deadline, env) as (url, _proc):
        yield url


@contextlib.contextmanager
def moto_server_proc(
    deadline: float = START_DEADLINE, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As :func:`moto_server`, also yielding the process (benches read its CPU time).

    ``python -m moto.server`` runs werkzeug with ``threaded=True``: one thread per
    request, all under one GIL, so the server does at most one core of work.
    """
    for _ in range(3):  # the free port may be taken before moto binds it
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            # False once the process has exited (port taken?): try another port.
            up = _wait_moto(proc, url, deadline)
            if not up:
                continue
            yield url, proc
            return
        finally:
            _stop(proc)
    raise RuntimeError("moto server failed to start three times")


def _wait_moto(proc: subprocess.Popen[bytes], url: str, deadline: float) -> bool:
    """Wait until moto answers (True) or exits (False); TimeoutError after ``deadline``."""
    return (
        poll_until(
            lambda: "exited" if proc.poll() is not None else _answers(url + "/moto-api/") and "up",
            deadline=deadline,
            what="moto server",
            fail=lambda: TimeoutError(f"moto server did not answer within {deadline}s"),
        )
        == "up"
    )


def start_moto(port: int, deadline: float = START_DEADLINE) -> subprocess.Popen[bytes]:
    """Start moto's server on ``127.0.0.1:port`` and wait (deadline) until it answers.

    For tests that freeze (SIGSTOP), kill and restart the store: the caller
    owns the process and must kill it at teardown.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def failed() -> RuntimeError:
        _stop(proc)
        return RuntimeError(f"moto server did not start on port {port}")

    def answers() -> bool:
        if proc.poll() is not None:
            raise failed()
        return _answers(f"http://127.0.0.1:{port}/moto-api/")

    poll_until(answers, deadline=deadline, what="moto server", fail=failed)
    return proc


_DROPPED = frozenset(
    {"if-none-match", "if-match", "connection", "keep-alive", "proxy-connection", "host"}
)
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


_INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error.</Message></Error>"
)


def _handler(
    upstream: str,
    *,
    strip: bool = True,
    seen: list[str] | None = None,
    fail_conditional: bool = False,
) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)
    dropped = _DROPPED if strip else _DROPPED - {"if-none-match", "if-match"}

    class StripConditions(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The answer goes out as two writes (headers, then body): with Nagle's
        # algorithm the body waits for the client's delayed ACK, 40 ms a request.
        disable_nagle_algorithm = True

        def _forward(self) -> None:
            if seen is not None:
                seen.append(f"{self.command} {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conditional = "If-None-Match" in self.headers or "If-Match" in self.headers
            if fail_conditional and self.command == "PUT" and conditional:
                # Like some S3-compatible servers: a 500 for a header they do not implement.
                self.send_response(500)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_INTERNAL_ERROR)))
                self.end_headers()
                self.wfile.write(_INTERNAL_ERROR)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
            headers["Host"] = target.netloc
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in _HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep test output clean

    return StripConditions


@contextlib.contextmanager
def stripping_proxy(upstream: str) -> Iterator[str]:
    """Yield the URL of a proxy to ``upstream`` that drops conditional headers."""
    with _proxy(_handler(upstream)) as url:
        yield url


@contextlib.contextmanager
def failing_conditions_proxy(upstream: str) -> Iterator[str]:
    """Yield the URL of a proxy to ``upstream`` that answers 500 to every conditional PUT."""
    with _proxy(_handler(upstream, strip=False, fail_conditional=True)) as url:
        yield url


@contextlib.contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, list[str]]]:
    """Yield the URL of a faithful proxy to ``upstream`` and the requests it forwarded."""
    seen: list[str] = []
    with _proxy(_handler(upstream, strip=False, seen=seen)) as url:
        yield url, seen


@contextlib.contextmanager
def _proxy(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="strip-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
