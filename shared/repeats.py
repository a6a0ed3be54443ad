"""How a refusal is logged when a client keeps trying: one line per minute, not per try.

A refused credential or join token is one WARNING line naming its id
(controlplane.access.authz, controlplane.machines.pairing). A script left
running with a revoked credential, or a machine retrying a spent token, would
repeat that line at every try and bury everything else in the log.
:class:`RepeatLimit` keeps the first line of each kind (the same logger
message and the same ids) at WARNING, turns repeats within ``every`` seconds
into DEBUG lines, and when the next WARNING of that kind is due says how many
were held back, so nothing is hidden, only folded.

The kinds it remembers are bounded (:data:`MAX_KINDS`, least recently seen
dropped first): a flood of distinct forged ids cannot grow the daemon's memory,
and costs at most one WARNING each.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["EVERY", "MAX_KINDS", "RepeatLimit"]

#: Seconds between two WARNING lines of one kind.
EVERY: Final = 60.0
#: Kinds remembered at once.
MAX_KINDS: Final = 4096


@dataclass
class _Seen:
    warned_at: float
    held: int = 0


class RepeatLimit:
    """Folds repeated WARNING lines of one kind (see the module doc)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: float = EVERY,
        max_kinds: int = MAX_KINDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every = every
        self._max = max_kinds
        self._monotonic = monotonic
        self._seen: OrderedDict[tuple[object, ...], _Seen] = OrderedDict()

    def warning(self, msg: str, *args: Any, extra: Mapping[str, str] | None = None) -> None:
        """Log ``msg % args`` at WARNING, or at DEBUG when the same kind was warned
        of less than ``every`` seconds ago. The kind is the message and ``extra``."""
        now = self._monotonic()
        kind = (msg % args if args else msg, *sorted((extra or {}).items()))
        seen = self._seen.get(kind)
        if seen is not None and now - seen.warned_at < self._every:
            seen.held += 1
            self._seen.move_to_end(kind)
            self._logger.debug(msg + " (again)", *args, extra=extra, stacklevel=2)
            return
        if seen is not None and seen.held:
            self._logger.warning(
                msg + " (and %d more like it in the last %.0f s)",
                *args,
                seen.held,
                now - seen.warned_at,
                extra=extra,
                stacklevel=2,
            )
        else:
            self._logger.warning(msg, *args, extra=extra, stacklevel=2)
        self._seen[kind] = _Seen(now)
        self._seen.move_to_end(kind)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
