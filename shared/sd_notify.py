"""systemd's notify protocol (``sd_notify(3)``), spoken without libsystemd.

A unit with ``Type=notify`` gives its main process ``$NOTIFY_SOCKET``: a Unix
datagram socket, named by a path, or with a leading ``@`` a Linux abstract
socket. Each notification is one datagram of ``KEY=VALUE`` lines:

- ``READY=1``: the start finished. systemd holds the unit "activating" (and
  ``systemctl start`` and every ``After=`` unit waiting) until it comes; a
  daemon sends it once it answers on its listeners, not merely once it runs.
- ``STOPPING=1``: the stop began (the drain); the unit shows "deactivating".
- ``STATUS=<text>``: one line shown by ``systemctl status``: what it is doing.
- ``WATCHDOG=1``: still alive. With ``WatchdogSec=``, systemd gives the process
  ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the pid it is meant for) and kills
  a started unit that sends none for that long (SIGABRT), and ``Restart=``
  starts it again.

Contract of this module:

- Nothing here reads the environment: each daemon's config module builds a
  :class:`NotifyConfig` with :meth:`NotifyConfig.from_env`. Without
  ``$NOTIFY_SOCKET`` (not under systemd, or another ``Type=``) a
  :class:`Notifier` sends nothing and opens no socket.
- Sending never raises and never blocks the event loop: the socket is
  non-blocking, so a datagram the manager cannot take now (its queue full) or a
  socket that is gone is dropped; such failures are one warning line per
  outage (:mod:`shared.outage`), not one per ping.
- The watchdog pings (:meth:`Notifier.pinging`) come from a task on the event
  loop, every half ``$WATCHDOG_USEC`` as ``sd_watchdog_enabled(3)`` advises: a
  loop blocked for longer than ``WatchdogSec=`` sends none, and systemd
  restarts the daemon. A thread would keep pinging for a hung daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from shared.errors import ConfigError, InvalidState
from shared.outage import OutageLog

__all__ = ["NotifyConfig", "Notifier"]

logger = logging.getLogger(__name__)

#: Characters of a STATUS line kept: systemd reads a datagram into a buffer of
#: 4096 bytes (PIPE_BUF) and ignores a longer one; a character is at most 4.
_MAX_STATUS = 1000


@dataclass(frozen=True)
class NotifyConfig:
    """Where to send notifications and how often to ping; off by default."""

    socket: str = ""
    """``$NOTIFY_SOCKET``: a path, or ``@name`` for an abstract socket; empty: off."""

    watchdog_seconds: float = 0.0
    """``$WATCHDOG_USEC`` in seconds (systemd's ``WatchdogSec=``) when it is meant
    for this process; pings go every half of it. 0: no watchdog."""

    @property
    def enabled(self) -> bool:
        """Whether notifications are sent at all."""
        return bool(self.socket)

    def validate(self) -> NotifyConfig:
        """Raise ConfigError naming the bad field; return self."""
        if self.socket and not _supported(self.socket):
            raise ConfigError(
                "notify_socket", f"must be an absolute path or @name, got {self.socket[:40]!r}"
            )
        if not (math.isfinite(self.watchdog_seconds) and self.watchdog_seconds >= 0):
            raise ConfigError(
                "watchdog_seconds", f"must be 0 (off) or more, got {self.watchdog_seconds!r}"
            )
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str], pid: int) -> NotifyConfig:
        """Read ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID`` as
        systemd sets them for the process ``pid``.

        Never refuses a start: a value systemd would not set (a relative path, a
        watchdog that is not a positive number) is logged and treated as unset,
        as libsystemd does. A ``$WATCHDOG_PID`` other than ``pid`` means the
        watchdog is another process's (we inherited the variables): no pings.
        """
        address = env.get("NOTIFY_SOCKET", "")
        if address and not _supported(address):
            logger.warning(
                "NOTIFY_SOCKET=%r is neither an absolute path nor @name: not notifying systemd",
                address[:40],
            )
            address = ""
        return cls(socket=address, watchdog_seconds=_watchdog_seconds(env, pid))


def _supported(address: str) -> bool:
    # What sd_notify(3) accepts besides vsock (a VM's manager, never a service's).
    return address.startswith(("/", "@")) and "\0" not in address


def _watchdog_seconds(env: Mapping[str, str], pid: int) -> float:
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return 0.0
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        logger.debug("WATCHDOG_PID=%s is not this process (%d): no watchdog pings", owner, pid)
        return 0.0
    if not (usec.isascii() and usec.isdigit() and int(usec) > 0):
        logger.warning("WATCHDOG_USEC=%r is not a positive number: no watchdog pings", usec[:20])
        return 0.0
    return int(usec) / 1_000_000


def _one_line(text: str) -> str:
    # A STATUS value ends at the newline: the rest would read as other fields.
    return " ".join(text.split())[:_MAX_STATUS]


class Notifier:
    """Tells the service manager what the daemon is doing (see the module doc)."""

    def __init__(self, config: NotifyConfig) -> None:
        self.config = config.validate()
        self._address: str | bytes | None = None
        if config.socket.startswith("@"):
            self._address = b"\0" + config.socket[1:].encode()
        elif config.socket:
            self._address = config.socket
        self._outage = OutageLog(logger, "systemd notification")

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``KEY=VALUE`` each) in one datagram; True when it went.

        False, with nothing sent, without a socket or fields; False and logged
        (once per outage) when the socket refused it.
        """
        if self._address is None or not fields:
            return False
        data = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(data, self._address)
        except OSError as e:
            self._outage.failed(
                InvalidState(f"notify {self.config.socket}", e.strerror or type(e).__name__)
            )
            return False
        self._outage.recovered()
        return True

    def ready(self, status: str = "") -> bool:
        """``READY=1``: the daemon answers on its listeners (with a status line)."""
        return self.send("READY=1", *self._status(status))

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1``: the drain begins (with a status line)."""
        return self.send("STOPPING=1", *self._status(status))

    def status(self, text: str) -> bool:
        """``STATUS=``: one line saying what the daemon is doing."""
        return self.send(*self._status(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the daemon is alive."""
        return self.send("WATCHDOG=1")

    @staticmethod
    def _status(text: str) -> tuple[str, ...]:
        line = _one_line(text)
        return (f"STATUS={line}",) if line else ()

    async def keep_alive(self) -> None:
        """Ping every half watchdog interval, forever; returns at once without a
        watchdog. Runs on the event loop on purpose (see the module doc)."""
        interval = self.config.watchdog_seconds / 2
        if not self.config.enabled or interval <= 0:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)

    @contextlib.asynccontextmanager
    async def pinging(self) -> AsyncIterator[None]:
        """Run :meth:`keep_alive` as a task for the duration of the block."""
        task = asyncio.create_task(self.keep_alive(), name="systemd-watchdog")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
