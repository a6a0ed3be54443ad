"""Agent rosters: the ids of each machine's agents, as the machine last told them.

A machine sends its roster on its link (after the welcome, when it changes,
and before a clean goodbye): the ids of the agents it runs prompts for, active
or archived, never their names. It is kept as ONE object per machine,
``accounts/<a>/rosters/<mc>.json`` (MAC'd by the store like every record),
written only by that machine's live link, so a plain put.

``prompt send`` for an OFFLINE machine checks the roster: an agent not on it
is NOT_FOUND and an archived one FAILED_PRECONDITION, and nothing is queued.
An online machine decides itself (its roster may be a heartbeat old); a
machine that never sent a roster (an older release) has every prompt queued.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Final

from controlplane.integrity.records import _Record, decode, encode, roster_key
from shared.errors import AgentsError, IntegrityError, InvalidState, NotFound
from shared.ids import is_valid_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = ["MAX_ROSTER", "AgentRosters", "Roster"]

logger = logging.getLogger(__name__)

#: Most agent ids one roster may hold (link.proto names the same bound).
MAX_ROSTER: Final = 100_000
#: Rosters kept in memory; past it the cache starts again (they are re-read).
_CACHE_SIZE: Final = 10_000


@dataclass(frozen=True)
class Roster(_Record):
    """One machine's agents by state, as stored."""

    machine_id: str
    active: tuple[str, ...]
    archived: tuple[str, ...]
    reported_at: dt.datetime


@dataclass(frozen=True)
class _Known:
    active: frozenset[str]
    archived: frozenset[str]


class AgentRosters:
    """Reports from links and checks for sends; one instance per daemon."""

    def __init__(self, store: ObjectStore, *, clock: Clock = utc_now) -> None:
        self._store = store
        self._clock = clock
        # machine id -> its roster (None: it never sent one), as last read or written.
        self._known: dict[str, _Known | None] = {}

    def _remember(self, machine_id: str, known: _Known | None) -> None:
        if len(self._known) >= _CACHE_SIZE:
            self._known.clear()
        self._known[machine_id] = known

    async def report(
        self,
        account_id: str,
        machine_id: str,
        active: tuple[str, ...],
        archived: tuple[str, ...],
    ) -> None:
        """Store the roster a machine sent when it differs from the one stored.

        A roster over :data:`MAX_ROSTER` ids or with a malformed id is ignored
        (logged; the stored one stays); a store failure is logged, never raised:
        the link goes on either way.
        """
        if len(active) + len(archived) > MAX_ROSTER:
            logger.warning("machine %s: roster of over %d ids ignored", machine_id, MAX_ROSTER)
            return
        if not all(is_valid_id("agent", a) for a in (*active, *archived)):
            logger.warning("machine %s: roster with a malformed agent id ignored", machine_id)
            return
        known = _Known(frozenset(active), frozenset(archived) - frozenset(active))
        try:
            if await self._load(account_id, machine_id) == known:
                return
            record = Roster(
                machine_id=machine_id,
                active=tuple(sorted(known.active)),
                archived=tuple(sorted(known.archived)),
                reported_at=self._clock(),
            )
            await self._store.put(roster_key(account_id, machine_id), encode(record))
        except AgentsError as e:
            logger.warning("machine %s: cannot store its agent roster: %s", machine_id, e)
            return
        self._remember(machine_id, known)
        logger.info(
            "machine %s: roster of %d active and %d archived agents stored",
            machine_id,
            len(known.active),
            len(known.archived),
        )

    def forget(self, machine_id: str) -> None:
        """Read the machine's roster again when next asked (replicas: it linked or
        unlinked at another one, which wrote what it reported)."""
        self._known.pop(machine_id, None)

    async def check(self, account_id: str, machine_id: str, agent_id: str) -> None:
        """Refuse a prompt for an agent the machine's roster does not run: NotFound
        when it is not on it, InvalidState when archived. No roster: no refusal."""
        known = await self._load(account_id, machine_id)
        if known is None:
            return
        if agent_id in known.archived:
            raise InvalidState(
                f"agent {agent_id}", f"archived on machine {machine_id} (unarchive it first)"
            )
        if agent_id not in known.active:
            raise NotFound("agent", agent_id)

    async def _load(self, account_id: str, machine_id: str) -> _Known | None:
        if machine_id in self._known:
            return self._known[machine_id]
        key = roster_key(account_id, machine_id)
        try:
            record = Roster.from_dict(decode(await self._store.get(key), key))
            known: _Known | None = _Known(frozenset(record.active), frozenset(record.archived))
        except NotFound:
            known = None
        except (IntegrityError, TypeError, ValueError) as e:
            # Forged or damaged: as if never reported (today's behaviour); fsck reports it.
            logger.warning("roster %s ignored: %s", key, e)
            known = None
        self._remember(machine_id, known)
        return known
