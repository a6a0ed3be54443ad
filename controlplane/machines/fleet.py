"""Every account's machines as the periodic checks see them, without a scan each time.

The schedule waker (every ``wake_check_seconds``) and the offline gauge (every
minute) each listed every account's machines: a LIST per account and a GET per
machine, again and again, for a fleet where nothing changed. This process is
the store's only writer (the fence makes it so), so what it has not written
has not changed: :class:`FleetView` keeps one listing and lists again only
when the registry wrote a machine record that changes who is in the fleet (a
revocation, a join rolled back: :attr:`MachineRegistry.generation`), when told
(an account deletion finished: :meth:`changed`), or after ``refresh`` seconds
(an hour by default: what a bucket writer or an operator's hand changed is seen
within that, and the cost per machine is one GET an hour). A join adds its
machine to the view as it is written (:meth:`MachineRegistry.on_join`): a
fleet joining machine after machine costs no listing of all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from controlplane.access.principals import Principal
from controlplane.integrity.records import Machine
from controlplane.machines.registry import MachineRegistry

__all__ = ["DEFAULT_REFRESH", "FleetView"]

#: Seconds a listing is used before the store is listed again regardless.
DEFAULT_REFRESH = 3600.0

_EVERYONE = Principal("control-plane", "operator")


class FleetView:
    """The last listing of every account's machines, listed again only when stale."""

    def __init__(
        self,
        machines: MachineRegistry,
        *,
        refresh: float = DEFAULT_REFRESH,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._machines = machines
        self._refresh = refresh
        self._monotonic = monotonic
        self._listed: list[Machine] | None = None
        self._listed_at = 0.0
        self._generation = -1
        self._stale = True
        self._joined: list[Machine] = []
        machines.on_join(self._joined.append)
        self.listings = 0
        """How many times the store was listed (for tests and the bench)."""

    def changed(self) -> None:
        """List again at the next use (something this view cannot see changed)."""
        self._stale = True

    async def machines(self) -> list[Machine]:
        """Every account's machines (revoked ones included, flagged)."""
        generation = self._machines.generation
        if (
            self._listed is None
            or self._stale
            or generation != self._generation
            or self._monotonic() - self._listed_at >= self._refresh
        ):
            # Marked fresh before the listing: a change during it marks it stale
            # again (or moves the generation), so it is never lost.
            self._stale = False
            self._generation = generation
            # Joins written during the listing are kept, whether it saw them or not.
            self._joined.clear()
            try:
                listed = await self._machines.list(_EVERYONE)
            except BaseException:
                self._stale = True  # the next use tries again
                raise
            self._listed, self._listed_at = listed, self._monotonic()
            self.listings += 1
        if self._joined:
            known = {m.machine_id for m in self._listed}
            self._listed.extend(m for m in self._joined if m.machine_id not in known)
            self._joined.clear()
        return list(self._listed)
