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

A caller whose failure line has a format of its own (the machine link's
``"control link to %s failed (attempt %d), …"``, which bench/connect.py
counts) passes it as ``line``: the same format at every level, a reminder
with how long and how many appended, and no traceback (the line says what
failed). ``key`` says which failures are "the same" when the message alone
would tell each attempt apart. ``extra`` (ids: ``machine_id``) goes on every
record (shared.logs writes it into the line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

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

    def failed(
        self,
        error: BaseException,
        *,
        line: tuple[str, tuple[Any, ...]] | None = None,
        key: str | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """One tick failed with ``error``; ``line`` (format, arguments), ``key`` and
        ``extra``: see the module doc."""
        now = self._monotonic()
        text = str(error) or type(error).__name__
        message = text if key is None else key
        msg, args = line if line is not None else ("%s: %s", (self._what, text))
        if self.failures == 0:
            self._since = now
        self.failures += 1
        if message == self._message and now - self._warned_at < self._remind:
            again = msg if line is not None else msg + " (failing again)"
            self._logger.debug(again, *args, extra=extra, stacklevel=2)
            return
        if message == self._message:
            self._logger.warning(
                msg + " (failing for %.0f s, %d tries)",
                *args,
                now - self._since,
                self.failures,
                extra=extra,
                stacklevel=2,
            )
        else:
            # Our own errors say what is wrong; anything else is a bug: its traceback
            # (unless the caller's line already says what failed).
            bug = line is None and not isinstance(error, AgentsError)
            self._logger.warning(
                msg, *args, exc_info=error if bug else None, extra=extra, stacklevel=2
            )
        self._message = message
        self._warned_at = now

    def recovered(self, *, extra: Mapping[str, object] | None = None) -> None:
        """One tick worked: after failures, say so once."""
        if self.failures == 0:
            return
        self._logger.info(
            "%s: works again (after %d failed tries over %.0f s)",
            self._what,
            self.failures,
            self._monotonic() - self._since,
            extra=extra,
            stacklevel=2,
        )
        self.failures = 0
        self._message = None
