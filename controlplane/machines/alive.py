"""The control plane's own "alive" stamps: what lets presence skip per-machine refreshes.

A machine's stored presence (:mod:`controlplane.machines.presence`) is written
when something about it changes, and says ``online`` while its link is up. A
control plane killed without a goodbye leaves such records behind; when was
each machine last seen then? Refreshing every record every few minutes answered
that at a cost of machines x time (12 writes an hour per machine). Instead the
process stamps ``cp/alive.json`` once per ``presence_write_interval``: one write
for the whole fleet. A record left ``online`` by the process of epoch E was
seen until at least E's last stamp (its link would have been closed, and the
record written offline, otherwise), within one interval of when E died.

The stamp keeps the last stamp of the few epochs before too (:data:`KEPT`), so a
record left by a process two restarts back still finds its own. Each process
reads the stamps at start, before its first write, and copies them forward.
The record is MAC'd like every object; one that is missing or refused only
costs precision (last seen falls back to the record's own time).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any, Final

from controlplane.integrity import jsonstore
from controlplane.integrity.records import encode, parse_time, utc_iso
from shared.errors import AgentsError, IntegrityError, NotFound
from shared.outage import OutageLog
from shared.store.base import ObjectStore
from shared.store.causes import store_cause
from shared.timestamps import Clock, utc_now

__all__ = ["ALIVE_KEY", "KEPT", "AliveStamps"]

logger = logging.getLogger(__name__)

ALIVE_KEY: Final = "cp/alive.json"
#: Epochs whose last stamp is kept (this process's and the ones before it).
KEPT: Final = 8


class AliveStamps:
    """This process's stamps, and the last stamp of each recent epoch."""

    def __init__(self, store: ObjectStore, epoch: int, clock: Clock = utc_now) -> None:
        self._store = store
        self._epoch = epoch
        self._clock = clock
        self._last: dict[int, dt.datetime] = {}

    async def load(self) -> None:
        """Read the stamps earlier processes left (at start, before :meth:`stamp`)."""
        try:
            data = await jsonstore.read(self._store, ALIVE_KEY)
        except (NotFound, IntegrityError):
            return  # none yet, or refused (counted by the store): no better guess
        self._last = _parse(data.get("epochs"))

    def last_alive(self, epoch: int) -> dt.datetime | None:
        """When the process of ``epoch`` last stamped (None: unknown)."""
        return self._last.get(epoch)

    async def stamp(self) -> None:
        """Stamp now: this epoch's entry, with the kept ones of the epochs before."""
        self._last[self._epoch] = self._clock()
        kept = sorted(self._last)[-KEPT:]
        self._last = {epoch: self._last[epoch] for epoch in kept}
        data = {"epochs": {str(epoch): utc_iso(at) for epoch, at in self._last.items()}}
        with store_cause("presence"):
            await self._store.put(ALIVE_KEY, encode(data))

    async def keep(self, interval: float) -> None:
        """Stamp every ``interval`` seconds until cancelled (its own task)."""
        # The next one may land; presence only loses precision meanwhile. One
        # warning while the store fails, not one per interval.
        outage = OutageLog(logger, f"{ALIVE_KEY}: cannot stamp")
        while True:
            await asyncio.sleep(interval)  # a period, not synchronisation
            try:
                await self.stamp()
            except AgentsError as e:
                outage.failed(e)
            else:
                outage.recovered()


def _parse(raw: Any) -> dict[int, dt.datetime]:
    out: dict[int, dt.datetime] = {}
    if not isinstance(raw, dict):
        return out
    for epoch, at in raw.items():
        try:
            out[int(epoch)] = parse_time(str(at))
        except ValueError:
            continue
    return out
