"""How a periodic job logs its failures: one line per outage, not one per tick.

A job that runs every few seconds against the store (the control plane's
self-check, its schedule waker, its alive stamps) fails at every tick while the
store is gone. :class:`OutageLog` turns that into lines an operator can read:

- the first failure: one WARNING line, ``"<what>: <error>"``, without a
  traceback for our own errors (:class:`~shared.errors.AgentsError`: the
  message says what is wrong); anything else is a bug and gets its traceback;
- the same failure again: a DEBUG line, and a WARNING reminder every
  ``remind`` seconds (with how long it has lasted and how many ticks failed);
- a different failure: a WARNING line again (the problem changed);
- the first success after failures: one INFO line saying it works again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from shared.errors import AgentsError

__all__ = ["REMIND", "OutageLog"]

#: Seconds between two warnings about the same failure.
REMIND: Final = 3600.0


class OutageLog:
    """The failures of one periodic job, logged once per outage (see the module doc)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        remind: float = REMIND,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._remind = remind
        self._monotonic = monotonic
        self._message: str | None = None
        self._since = 0.0
        self._warned_at = 0.0
        self.failures = 0
        """Failed ticks since the last success."""

    @property
    def failing(self) -> bool:
        """Whether the last tick failed."""
        return self.failures > 0

    def failed(self, error: BaseException) -> None:
        """One tick failed with ``error``."""
        now = self._monotonic()
        message = str(error) or type(error).__name__
        if self.failures == 0:
            self._since = now
        self.failures += 1
        if message == self._message and now - self._warned_at < self._remind:
            self._logger.debug("%s: %s (failing again)", self._what, message)
            return
        if message == self._message:
            self._logger.warning(
                "%s: %s (failing for %.0f s, %d tries)",
                self._what,
                message,
                now - self._since,
                self.failures,
            )
        else:
            # Our own errors say what is wrong; anything else is a bug: its traceback.
            self._logger.warning(
                "%s: %s",
                self._what,
                message,
                exc_info=None if isinstance(error, AgentsError) else error,
            )
        self._message = message
        self._warned_at = now

    def recovered(self) -> None:
        """One tick worked: after failures, say so once."""
        if self.failures == 0:
            return
        self._logger.info(
            "%s: works again (after %d failed tries over %.0f s)",
            self._what,
            self.failures,
            self._monotonic() - self._since,
        )
        self.failures = 0
        self._message = None
