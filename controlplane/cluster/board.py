"""The presence board: every replica's view of the presence bucket, without I/O.

:class:`~controlplane.cluster.replica.Replica` feeds it each entry its watch of
the bucket sees (:meth:`PresenceBoard.apply`). Keys (see the replica module):
``m.<machine id>`` (who holds the machine's link) and ``r.<replica id>`` (a
live replica, its intents' owner token and the link address machines dial it
at). JetStream drops an expired entry without telling watchers, so each entry
is given its own expiry here (the TTL less its age when read) and an entry
past it counts as gone.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Callable
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
    """Monotonic time after which the entry counts as gone."""


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
        self._replicas: dict[str, tuple[str, float]] = {}  # id -> (owner, expires)
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
        """Who else holds ``machine_id``'s link now (None: no other replica)."""
        held = self._holders.get(machine_id)
        if held is None or held.replica == self._replica_id:
            return None
        if held.expires <= self._monotonic():
            return None
        return held

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
                logger.warning("replica %s is gone (no refresh within %.1fs)", rid, self._ttl)
                if self._on_replica_gone is not None:
                    self._on_replica_gone(rid)

    def apply(
        self, key: str, value: bytes | None, deleted: bool, created: dt.datetime | None
    ) -> None:
        """One entry (or its deletion) as the watch saw it; ``created``: when it
        was written (an entry read at start may be near its end already)."""
        age = max(0.0, (utc_now() - created).total_seconds()) if created is not None else 0.0
        expires = self._monotonic() + self._ttl - age
        try:
            data = json.loads(value or b"{}") if not deleted else {}
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        if key.startswith("m."):
            self._machine(key[2:], data, deleted, expires)
        elif key.startswith("r."):
            rid = key[2:]
            if deleted:
                self._links.pop(rid, None)
                if self._replicas.pop(rid, None) is not None and self._on_replica_gone:
                    self._on_replica_gone(rid)
                return
            added = rid not in self._replicas and rid != self._replica_id
            self._replicas[rid] = (str(data.get("owner", "")), expires)
            link = data.get("link", "")
            # Another replica's word, handed on to machines: only a plain host:port.
            self._links[rid] = link if isinstance(link, str) and _is_hostport(link) else ""
            if added and self.on_replica_added is not None:
                self.on_replica_added(rid)

    def _machine(
        self, machine_id: str, data: dict[str, object], deleted: bool, expires: float
    ) -> None:
        held = self._holders.get(machine_id)
        if self.on_machine_changed is not None and (
            deleted or held is None or held.replica != data.get("replica")
        ):
            self.on_machine_changed(machine_id)
        if deleted:
            self._holders.pop(machine_id, None)
            return
        try:
            self._holders[machine_id] = Holder(
                replica=str(data["replica"]),
                account_id=str(data.get("account", "")),
                last_seen_at=parse_time(str(data["seen"])),
                version=str(data.get("version", "")),
                agent_count=int(str(data.get("agents", 0))),
                expires=expires,
            )
        except (KeyError, ValueError, TypeError):
            return


def _is_hostport(text: str) -> bool:
    if len(text) > MAX_ADDRESS or not text.isprintable() or any(c.isspace() for c in text):
        return False
    try:
        split_hostport(text, "link", allow_port_zero=False)
    except ConfigError:
        return False
    return True
