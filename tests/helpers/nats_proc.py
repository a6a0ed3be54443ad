"""Run a real ``nats-server`` (JetStream on) as a subprocess for cluster tests.

``nats_server(tmp)`` starts ``nats-server -a 127.0.0.1 -p <free port> -js -sd
<tmp>`` and yields its ``nats://`` URL once the port accepts connections
(polled with a deadline), stopping it at teardown. :class:`NatsProc` exposes
the process too, for tests that stop NATS to see the replicas do without it.
The binary comes from the Debian package ``nats-server`` (scripts/test
installs it when missing).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.moto_server import free_port
from tests.helpers.poll import poll_until
from tests.helpers.processes import stop_process

__all__ = ["NatsProc", "nats_binary", "nats_server"]

START_DEADLINE = 15.0


def nats_binary() -> str | None:
    """The nats-server executable, or None when it is not installed."""
    return shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
    )


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        return s.recv(4).startswith(b"INFO")  # the server's greeting
    return False


class NatsProc:
    """One nats-server on a free loopback port; :meth:`start` / :meth:`stop`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start it (again, on the same port and folder once it ran); its URL."""
        exe = nats_binary()
        if exe is None:
            raise RuntimeError("nats-server is not installed (apt-get install nats-server)")
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # the free port may be taken before the server binds it
            port = self.port or free_port()
            log = (self.folder / "nats.log").open("ab")
            proc = subprocess.Popen(
                [exe, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(self.folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            try:
                poll_until(
                    lambda p=proc, n=port: p.poll() is not None or _accepts(n),
                    deadline=START_DEADLINE,
                    what="nats-server accepting connections",
                )
            except TimeoutError:
                stop_process(proc, grace=2)
                raise
            if proc.poll() is None:
                self.port, self.proc = port, proc
                return self.url
        raise RuntimeError(f"nats-server did not start; see {self.folder / 'nats.log'}")

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after a grace)."""
        if self.proc is not None:
            proc, self.proc = self.proc, None
            stop_process(proc, grace=5)


@contextlib.contextmanager
def nats_server(folder: Path) -> Iterator[NatsProc]:
    """A started :class:`NatsProc` keeping JetStream's files in ``folder``."""
    nats = NatsProc(folder)
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()
