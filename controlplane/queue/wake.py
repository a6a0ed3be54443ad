"""Waking stopped machines for their schedules, and for prompts that wait.

A joined machine reports the soonest fire time of its schedules with every
heartbeat; presence keeps it, also once the machine is offline. Every
``interval`` this checks the offline machines: one whose next fire time is
less than ``lead`` away (or past) gets its provider asked to start it, through
:class:`~controlplane.queue.starter.MachineStarter` (debounced per machine, the same
path a queued prompt takes). So does one whose queue holds a prompt
(:meth:`MachineStarter.start_if_waiting`): a start that failed or a machine
that stopped again before it connected is asked again, once a debounce window
is over. A machine without a provider is never woken; ``machine list`` says so.

Store requests: the fleet as last listed (:mod:`controlplane.machines.fleet`),
each offline machine's presence, provider settings and (with a provider) queue
listing once per process; a check of an idle fleet reads nothing. A check
that fails (the store is gone) is logged as one warning line until a check
works again, then one line says so (:class:`shared.outage.OutageLog`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

from controlplane.integrity.records import Machine
from controlplane.machines.fleet import FleetView
from controlplane.machines.presence import MachineStatus, PresenceRegistry
from controlplane.queue.starter import MachineStarter
from shared.outage import OutageLog
from shared.store.causes import set_cause
from shared.timestamps import Clock, utc_now

__all__ = ["ScheduleWaker"]

logger = logging.getLogger(__name__)


class ScheduleWaker:
    """Asks providers to start offline machines shortly before a schedule fires, or
    while prompts wait for them."""

    def __init__(
        self,
        fleet: FleetView,
        presence: PresenceRegistry,
        starter: MachineStarter,
        *,
        lead: float,
        interval: float,
        clock: Clock = utc_now,
        on_wake: Callable[[], None] | None = None,
    ) -> None:
        # The fleet as last listed and the presence as last written: a check of
        # an idle fleet reads nothing from the store (machines.fleet).
        self._fleet = fleet
        self._presence = presence
        self._starter = starter
        self._lead = dt.timedelta(seconds=lead)
        self._interval = interval
        self._clock = clock
        self._on_wake = on_wake

    def wake_at(self, status: MachineStatus) -> dt.datetime | None:
        """When the machine is to be started for its next fire (None: nothing comes)."""
        if status.next_fire_at is None:
            return None
        return status.next_fire_at - self._lead

    async def check(self) -> list[str]:
        """Ask for every offline machine whose wake time has come, or for which a
        prompt waits; return their ids."""
        now = self._clock()
        woken: list[str] = []
        for machine in await self._fleet.machines():
            if machine.revoked or self._presence.online(machine.machine_id):
                continue
            if await self._schedule_due(machine, now):
                logger.info(
                    "machine %s: a schedule fires soon; asking its provider", machine.machine_id
                )
                woken.append(machine.machine_id)
                if self._on_wake is not None:
                    self._on_wake()
            elif await self._starter.start_if_waiting(machine):
                logger.info(
                    "machine %s: prompts wait for it; asking its provider", machine.machine_id
                )
                woken.append(machine.machine_id)
        return woken

    async def _schedule_due(self, machine: Machine, now: dt.datetime) -> bool:
        """Whether the machine's next fire is close, and a request was made now."""
        status = await self._presence.status(machine)
        at = self.wake_at(status)
        if at is None or at > now:
            return False
        if status.next_fire_at is not None and status.next_fire_at < now:
            # Passed already: the machine missed it whatever we do (its next
            # start handles missed fires by their policy). Waking for it
            # would start the machine at every check, for a presence record
            # that is stale, or an older copy a bucket writer put back.
            return False
        if not await self._starter.has_provider(machine.account_id, machine.machine_id):
            return False
        return self._starter.try_request(machine.account_id, machine.machine_id)

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled (its own task)."""
        set_cause("wake")
        outage = OutageLog(logger, "checking machines to wake")
        while True:
            try:
                await self.check()
            except Exception as e:  # the next tick tries again; a bug gets its traceback
                outage.failed(e)
            else:
                outage.recovered()
            await asyncio.sleep(self._interval)  # a period, not synchronisation
