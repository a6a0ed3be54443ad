"""A real HTTP proxy in front of moto's S3 server that kills a process between writes.

``crash_proxy(upstream)`` yields a :class:`CrashProxy`. Point the control plane's
store endpoint at ``proxy.url``; ``proxy.arm(pid, after=n)`` makes the proxy
SIGKILL ``pid`` right after the server accepted the n-th object write (PUT or
DELETE of a key outside ``_probe/``) counted from the arming, before the
answer goes back: exactly "S3 took the write, then the process died".
``proxy.writes`` lists the writes seen since arming (``"PUT key"``);
``proxy.seen(method, key_part)`` tells whether any request of that method on
such a key arrived (a test's barrier: "the daemon got that far").
``proxy.arm_before(pid, "DELETE", "/queue/")`` instead kills ``pid`` when the
first such write ARRIVES, and never forwards it: "the process died just
before that write"; ``proxy.arm_after(pid, "PUT", "cp/deployment")`` once
such a write was accepted; ``proxy.arm_after_batches(pid, n)`` once the n-th
multi-object delete (``POST ?delete``, which the writes above do not count) was.

``proxy.flaky(rate, seed=...)`` makes S3 flaky instead: with probability
``rate`` a write (PUT, POST or DELETE outside ``_probe/``) is FORWARDED and
then answered 503 SlowDown in place of moto's answer (the write landed, its
answer was lost), and with probability ``rate`` a read (GET or HEAD, a listing
included) is answered 503 without being forwarded. The draws come from one
``random.Random(seed)`` in the order requests arrive, so a seed replays the
same decisions for the same sequence of requests; ``proxy.injected`` counts
what was injected (``"write"``, ``"read"``) and ``proxy.passed`` what was not.
``proxy.flaky(0)`` stops it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

__all__ = ["CrashProxy", "crash_proxy"]

_DROPPED = frozenset({"connection", "keep-alive", "proxy-connection", "host"})
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})
_WRITES = frozenset({"PUT", "POST", "DELETE"})
_READS = frozenset({"GET", "HEAD"})


def _key_of(path: str) -> str:
    """The object key of a path-style request (``/<bucket>/<key>``), or "" for the bucket."""
    parts = unquote(urlsplit(path).path).split("/", 2)
    return parts[2] if len(parts) == 3 else ""


def slow_down_body(request_id: int) -> bytes:
    """S3's XML error body of a 503 SlowDown."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        "<Message>Please reduce your request rate.</Message>"
        f"<RequestId>flaky-{request_id}</RequestId></Error>"
    ).encode()


class CrashProxy:
    """State shared with the handler threads."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.url = ""
        self.writes: list[str] = []
        self.crashed = threading.Event()
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._after = 0
        self._before: tuple[int, str, str] | None = None
        self._after_match: tuple[int, str, str] | None = None
        self._after_batches: tuple[int, int] | None = None
        self._requests: list[tuple[str, str]] = []
        self._rate = 0.0
        self._random = random.Random(0)
        self.injected = {"write": 0, "read": 0}
        self.passed = {"write": 0, "read": 0}

    def flaky(self, rate: float, *, seed: int = 0) -> None:
        """Fail writes after forwarding, and reads instead, each with probability
        ``rate`` (0 stops it); the counts start again."""
        if not 0 <= rate < 1:
            raise ValueError("rate is a probability below 1")
        with self._lock:
            self._rate = rate
            self._random = random.Random(seed)
            self.injected = {"write": 0, "read": 0}
            self.passed = {"write": 0, "read": 0}

    def _draw(self, kind: str) -> bool:
        with self._lock:
            if self._rate <= 0:
                return False
            fail = self._random.random() < self._rate
            (self.injected if fail else self.passed)[kind] += 1
            return fail

    def fails_read(self, method: str, path: str) -> bool:
        """Whether this read is answered 503 instead of being forwarded."""
        return method in _READS and not _key_of(path).startswith("_probe/") and self._draw("read")

    def fails_write(self, method: str, path: str) -> bool:
        """Whether this write, forwarded, gets a 503 in place of S3's answer."""
        if method not in _WRITES or "/_probe/" in f"/{_key_of(path)}":
            return False
        return self._draw("write")

    def seen(self, method: str, key_part: str) -> bool:
        """Whether a ``method`` request for a key containing ``key_part`` arrived."""
        with self._lock:
            return any(m == method and key_part in path for m, path in self._requests)

    def saw(self, method: str, path: str) -> None:
        """Record one request (the handler calls it for each)."""
        with self._lock:
            self._requests.append((method, unquote(urlsplit(path).path)))

    def arm(self, pid: int, after: int) -> None:
        """Kill ``pid`` once the ``after``-th write from now was accepted."""
        with self._lock:
            self.writes = []
            self.crashed.clear()
            self._pid, self._after = pid, after

    def arm_before(self, pid: int, method: str, key_part: str) -> None:
        """Kill ``pid`` when a ``method`` write of a key containing ``key_part`` arrives."""
        with self._lock:
            self.crashed.clear()
            self._before = (pid, method, key_part)

    def arm_after(self, pid: int, method: str, key_part: str) -> None:
        """Kill ``pid`` once a ``method`` write of a key containing ``key_part`` was accepted."""
        with self._lock:
            self.crashed.clear()
            self._after_match = (pid, method, key_part)

    def arm_after_batches(self, pid: int, n: int) -> None:
        """Kill ``pid`` once the ``n``-th multi-object delete from now was accepted."""
        with self._lock:
            self.crashed.clear()
            self._after_batches = (pid, n)

    def disarm(self) -> None:
        """Stop counting; nothing will be killed."""
        with self._lock:
            self._pid = None
            self._before = None
            self._after_match = None
            self._after_batches = None

    def _kill(self, pid: int) -> bool:
        """SIGKILL ``pid`` (gone already is fine) and say so; True."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.crashed.set()
        return True

    def _after_batch(self, method: str, path: str, status: int) -> bool:
        """Count an accepted multi-object delete; True when the process was killed."""
        query = [part.partition("=")[0] for part in urlsplit(path).query.split("&")]
        if method != "POST" or "delete" not in query or status >= 300:
            return False
        with self._lock:
            if self._after_batches is None:
                return False
            pid, left = self._after_batches
            if left > 1:
                self._after_batches = (pid, left - 1)
                return False
            self._after_batches = None
        return self._kill(pid)

    def before_write(self, method: str, path: str) -> bool:
        """True when the writer was killed instead of this write being forwarded."""
        write = self._counts(method, path)
        with self._lock:
            if write is None or self._before is None:
                return False
            pid, want, part = self._before
            if method != want or part not in write:
                return False
            self._before = None
        return self._kill(pid)

    def _counts(self, method: str, path: str) -> str | None:
        if method not in ("PUT", "DELETE") or "uploadId=" in path or "partNumber=" in path:
            return None
        # Path style: /<bucket>/<key>; keys of the store probe do not count.
        key = _key_of(path)
        if not key or "/_probe/" in f"/{key}":
            return None
        return f"{method} {key}"

    def after_write(self, method: str, path: str, status: int) -> bool:
        """Record an accepted write; True when the process was killed because of it."""
        if self._after_batch(method, path, status):
            return True
        write = self._counts(method, path)
        if write is None or status >= 300:
            return False
        with self._lock:
            match = self._after_match
            if match is not None and method == match[1] and match[2] in write:
                self._after_match = None
                return self._kill(match[0])
            if self._pid is None:
                return False
            self.writes.append(write)
            if len(self.writes) < self._after:
                return False
            pid, self._pid = self._pid, None
        return self._kill(pid)


def _handler(proxy: CrashProxy) -> type[BaseHTTPRequestHandler]:
    target = proxy.upstream

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The answer goes out as two writes (headers, then body): with Nagle's
        # algorithm the body waits for the client's delayed ACK, 40 ms a request.
        disable_nagle_algorithm = True

        def _forward(self) -> None:
            try:
                self._relay()
            except OSError:
                self.close_connection = True  # the client died (killed): nothing to answer

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROPPED}
            headers["Host"] = target.netloc
            proxy.saw(self.command, self.path)
            if proxy.before_write(self.command, self.path):
                self.close_connection = True
                return  # the writer is dead before its write: none reaches S3
            if proxy.fails_read(self.command, self.path):
                self._slow_down()
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            finally:
                conn.close()
            if proxy.after_write(self.command, self.path, response.status):
                self.close_connection = True
                return  # the writer is dead: no answer
            if proxy.fails_write(self.command, self.path):
                self._slow_down()  # S3 took the write; its answer is lost
                return
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in _HOP:
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _slow_down(self) -> None:
            body = slow_down_body(threading.get_ident())
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    return Handler


@contextlib.contextmanager
def crash_proxy(upstream: str) -> Iterator[CrashProxy]:
    """Run a :class:`CrashProxy` to ``upstream`` on a free loopback port."""
    proxy = CrashProxy(upstream)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="crash-proxy", daemon=True)
    thread.start()
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield proxy
    finally:
        proxy.disarm()
        proxy.flaky(0)
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
