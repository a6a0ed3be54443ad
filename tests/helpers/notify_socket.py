"""A socket that plays systemd's part in the notify protocol (``$NOTIFY_SOCKET``).

``NotifySocket.bind(path)`` (or ``NotifySocket.abstract(name)``) binds a Unix
datagram socket the way systemd's ``/run/systemd/notify`` is bound, with
``SO_PASSCRED`` so each datagram carries its sender's pid, as systemd uses it
for ``NotifyAccess=main``. ``address`` is the value for ``NOTIFY_SOCKET``.
Reads never block: :meth:`NotifySocket.receive` takes what has arrived, and
:meth:`NotifySocket.wait_for` waits for a datagram with a deadline.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["Notification", "NotifySocket"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Notification:
    """One datagram: its ``KEY=VALUE`` fields and the pid that sent it."""

    fields: dict[str, str]
    pid: int
    raw: bytes

    def has(self, key: str, value: str = "1") -> bool:
        """Whether the datagram carries ``KEY=value``."""
        return self.fields.get(key) == value


class NotifySocket:
    """The manager's end: every datagram received so far is in ``received``."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self._sock = sock
        self.address = address
        """The ``NOTIFY_SOCKET`` value naming this socket."""
        self.received: list[Notification] = []

    @classmethod
    def bind(cls, path: Path) -> NotifySocket:
        """A socket at ``path`` (a path name, as systemd's own)."""
        return cls(cls._socket(str(path)), str(path))

    @classmethod
    def abstract(cls, name: str) -> NotifySocket:
        """A Linux abstract socket; its ``NOTIFY_SOCKET`` is ``@name``."""
        return cls(cls._socket(b"\0" + name.encode()), f"@{name}")

    @staticmethod
    def _socket(address: str | bytes) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(address)
        sock.setblocking(False)
        return sock

    def receive(self) -> list[Notification]:
        """Every datagram that arrived since the last call (never waits)."""
        new = []
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
            except BlockingIOError:
                break
            pid = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            new.append(Notification(fields, pid, data))
        self.received.extend(new)
        return new

    def wait_for(
        self,
        check: Callable[[Notification], bool],
        *,
        deadline: float,
        what: str,
        alive: Callable[[], None] | None = None,
    ) -> Notification:
        """The first datagram (already received or arriving within ``deadline``
        seconds) that ``check`` accepts, received the moment it arrives (a test
        can look at the daemon right then); ``alive`` may raise to stop early."""
        end = time.monotonic() + deadline
        while True:
            if alive is not None:
                alive()
            self.receive()
            found = next((n for n in self.received if check(n)), None)
            if found is not None:
                return found
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} not within {deadline}s")
            # Wakes when a datagram arrives; ``alive`` is asked again every 0.05 s.
            select.select([self._sock], [], [], min(left, 0.05))

    def index(self, key: str, value: str = "1") -> int:
        """Where the first ``KEY=value`` is in ``received`` (what is pending
        received first); -1 when none came."""
        self.receive()
        return next((i for i, n in enumerate(self.received) if n.has(key, value)), -1)

    def count(self, key: str, value: str = "1") -> int:
        """How many datagrams carrying ``KEY=value`` came (what is pending
        received first)."""
        self.receive()
        return sum(1 for n in self.received if n.has(key, value))

    def close(self) -> None:
        """Close the socket (a path stays behind in its temp folder)."""
        self._sock.close()

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
