"""The presence board: every replica's view of the presence buckets, without I/O.

:class:`~controlplane.cluster.replica.Replica` feeds it each entry its watches
of the buckets see (:meth:`PresenceBoard.apply`). Keys (see the replica module):
``m.<machine id>`` (who holds the machine's link; no expiry) and ``r.<replica
id>`` (a live replica, its intents' owner token and the link address machines
dial it at; expires). JetStream drops an expired entry without telling
watchers, so each ``r.`` entry is given its own expiry here (the TTL less its
age when read) and an entry past it counts as gone. A machine entry counts only
while the replica it names does: a dead replica's machines read as offline
within the TTL though their entries stay until swept (:meth:`orphans`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controlplane.integrity.records import parse_time
from shared.config import split_hostport
from shared.errors import ConfigError
from shared.timestamps import utc_now

__all__ = ["MAX_ADDRESS", "Holder", "PresenceBoard"]

logger = logging.getLogger(__name__)

#: The longest link address handed on (a DNS name of 253 characters and a port).
MAX_ADDRESS = 261


@dataclass(frozen=True)
class Holder:
    """A machine linked to another replica, as its presence entry says."""

    replica: str
    account_id: str
    last_seen_at: dt.datetime
    version: str
    agent_count: int
    expires: float
    """Monotonic time after which the entry counts as gone (its replica's)."""
    revision: int = 0
    """The entry's revision in the links bucket (what a sweep deletes on)."""
    applied: float = 0.0
    """Monotonic time it was first seen here at this revision."""


class PresenceBoard:
    """Who holds which machine, and which replicas are alive (module doc)."""

    def __init__(
        self,
        replica_id: str,
        owner: str,
        ttl: float,
        *,
        on_replica_gone: Callable[[str], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        link_address: str = "",
    ) -> None:
        self.on_replica_added: Callable[[str], None] | None = None
        """Called with another replica's id when its entry first appears (or
        reappears after it was taken for gone); not for a refresh."""
        self._replica_id = replica_id
        self._link = link_address
        self._owner = owner
        self._ttl = ttl
        self._on_replica_gone = on_replica_gone
        self._monotonic = monotonic
        self._holders: dict[str, Holder] = {}
        self._by_replica: dict[str, set[str]] = {}  # replica id -> machines it holds
        self._replicas: dict[str, tuple[str, float]] = {}  # id -> (owner, expires)
        # id -> when it last refreshed its entry (wall time): a machine linked to it
        # was heard by it since about then (its link ends within a few heartbeats
        # of silence, and the entry with it), so listings show it as last seen.
        self._refreshed: dict[str, dt.datetime] = {}
        self._links: dict[str, str] = {}  # id -> its link address ("": it names none)
        self.on_machine_changed: Callable[[str], None] | None = None
        """Called with a machine's id when its entry appears, moves to another
        replica or goes (the store's record of it was rewritten there); not for
        a mere refresh."""

    @property
    def others(self) -> int:
        """Other replicas seen alive."""
        return sum(1 for rid in self._replicas if rid != self._replica_id)

    def holder(self, machine_id: str) -> Holder | None:
        """Who else holds ``machine_id``'s link now (None: no other replica, or
        the one its entry names is gone)."""
        held = self._holders.get(machine_id)
        if held is None or held.replica == self._replica_id:
            return None
        alive = self._replicas.get(held.replica)
        if alive is None or alive[1] <= self._monotonic():
            return None
        refreshed = self._refreshed.get(held.replica, held.last_seen_at)
        return dataclasses.replace(
            held, last_seen_at=max(held.last_seen_at, refreshed), expires=alive[1]
        )

    def entry(self, machine_id: str) -> Holder | None:
        """The machine's entry as last seen, whoever it names, alive or not."""
        return self._holders.get(machine_id)

    def alive(self, replica_id: str) -> bool:
        """Whether ``replica_id``'s entry is present and not expired (this one's too)."""
        entry = self._replicas.get(replica_id)
        return entry is not None and entry[1] > self._monotonic()

    @property
    def sweeper(self) -> bool:
        """Whether this replica sweeps dead replicas' machine entries: the live one
        with the smallest id (views may differ for a moment: the sweep's deletes
        are conditional, so two sweepers are harmless)."""
        now = self._monotonic()
        live = [rid for rid, (_, expires) in self._replicas.items() if expires > now]
        return min([*live, self._replica_id]) == self._replica_id

    def orphans(self) -> list[tuple[str, int]]:
        """``(machine id, revision)`` of the machine entries naming a replica that
        is gone, each seen here for a TTL at least (an entry written by a replica
        whose own entry this board has not read yet is not one)."""
        now = self._monotonic()
        out: list[tuple[str, int]] = []
        for rid, machines in self._by_replica.items():
            if rid == self._replica_id or self.alive(rid):
                continue
            for machine_id in machines:
                held = self._holders[machine_id]
                if held.applied + self._ttl <= now and held.revision:
                    out.append((machine_id, held.revision))
        return out

    def keep_machines(self, present: Iterable[str]) -> None:
        """A fresh read of the links bucket saw only ``present``: forget the rest
        (deleted while the watch was away)."""
        keep = set(present)
        for machine_id in [m for m in self._holders if m not in keep]:
            self._drop_machine(machine_id)
            if self.on_machine_changed is not None:
                self.on_machine_changed(machine_id)

    def link_addresses(self, most: int) -> tuple[str, ...]:
        """The link addresses of the live replicas: this one's first, then the
        others' in the order of their ids; at most ``most``, repeats and
        replicas that name none left out."""
        now = self._monotonic()
        others = sorted(
            rid
            for rid, (_, expires) in self._replicas.items()
            if rid != self._replica_id and expires > now
        )
        out: list[str] = []
        for link in (self._link, *(self._links.get(rid, "") for rid in others)):
            if link and link not in out and len(out) < most:
                out.append(link)
        return tuple(out)

    def owner_alive(self, owner: str) -> bool:
        """Whether a live replica (this one included) owns intents of ``owner``."""
        now = self._monotonic()
        return owner == self._owner or any(
            o == owner and expires > now for o, expires in self._replicas.values()
        )

    def drop_gone(self) -> None:
        """Forget replicas whose entry expired, telling ``on_replica_gone``."""
        now = self._monotonic()
        for rid, (_, expires) in list(self._replicas.items()):
            if expires <= now and rid != self._replica_id:
                del self._replicas[rid]
                self._links.pop(rid, None)
                self._refreshed.pop(rid, None)
                logger.warning("replica %s is gone (no refresh within %.1fs)", rid, self._ttl)
                if self._on_replica_gone is not None:
                    self._on_replica_gone(rid)

    def apply(
        self,
        key: str,
        value: bytes | None,
        deleted: bool,
        created: dt.datetime | None,
        revision: int = 0,
    ) -> None:
        """One entry (or its deletion) as a watch saw it; ``created``: when it was
        written (a replica's entry read at start may be near its end already)."""
        written = created if created is not None else utc_now()
        age = max(0.0, (utc_now() - written).total_seconds())
        expires = self._monotonic() + self._ttl - age
        try:
            data = json.loads(value or b"{}") if not deleted else {}
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        if key.startswith("m."):
            self._machine(key[2:], data, deleted, revision)
        elif key.startswith("r."):
            rid = key[2:]
            if deleted:
                self._links.pop(rid, None)
                self._refreshed.pop(rid, None)
                if self._replicas.pop(rid, None) is not None and self._on_replica_gone:
                    self._on_replica_gone(rid)
                return
            added = rid not in self._replicas and rid != self._replica_id
            self._replicas[rid] = (str(data.get("owner", "")), expires)
            self._refreshed[rid] = written
            link = data.get("link", "")
            # Another replica's word, handed on to machines: only a plain host:port.
            self._links[rid] = link if isinstance(link, str) and _is_hostport(link) else ""
            if added and self.on_replica_added is not None:
                self.on_replica_added(rid)

    def _machine(
        self, machine_id: str, data: dict[str, object], deleted: bool, revision: int
    ) -> None:
        held = self._holders.get(machine_id)
        if self.on_machine_changed is not None and (
            deleted or held is None or held.replica != data.get("replica")
        ):
            self.on_machine_changed(machine_id)
        self._drop_machine(machine_id)
        if deleted:
            return
        try:
            entry = Holder(
                replica=str(data["replica"]),
                account_id=str(data.get("account", "")),
                last_seen_at=parse_time(str(data["seen"])),
                version=str(data.get("version", "")),
                agent_count=int(str(data.get("agents", 0))),
                expires=0.0,
                revision=revision,
                applied=self._monotonic(),
            )
        except (KeyError, ValueError, TypeError):
            return
        self._holders[machine_id] = entry
        self._by_replica.setdefault(entry.replica, set()).add(machine_id)

    def _drop_machine(self, machine_id: str) -> None:
        held = self._holders.pop(machine_id, None)
        if held is not None:
            machines = self._by_replica.get(held.replica)
            if machines is not None:
                machines.discard(machine_id)
                if not machines:
                    del self._by_replica[held.replica]


def _is_hostport(text: str) -> bool:
    if len(text) > MAX_ADDRESS or not text.isprintable() or any(c.isspace() for c in text):
        return False
    try:
        split_hostport(text, "link", allow_port_zero=False)
    except ConfigError:
        return False
    return True
