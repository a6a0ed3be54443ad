"""The prompt queue: prompts for stopped machines, sealed, in order, in the store.

One object per prompt at ``accounts/<a>/queue/<m>/<seq>.sealed`` (``seq`` zero
padded so key order is sequence order). The prompt text is sealed to the
machine's X25519 box key (:func:`shared.crypto.seal_bytes`) before anything is
written: the control plane, its logs and its bucket never hold it in the clear.
The object also carries the prompt id, agent id, send time and a hash of the
idempotency key, so listings and replays need no text.

Each send writes exactly ONE object, claimed by a conditional create
(``if_none_match``): that put is the commit point, so no intent record is
needed; a lost race for a sequence number moves on to the next one. The object
is deleted only after the machine acknowledged the prompt durably; a crash in
between redelivers it and the machine deduplicates by prompt id.

An idempotency key outlives the acknowledgement: before a keyed entry is
deleted, its outcome is recorded (controlplane.queue.idempotency), so a send retried
after the ack (its reply was lost) answers the first prompt's id and queues
nothing until the key's time to live is over. The delete stays the
acknowledgement's commit point.

Limits: depth per machine (:class:`~shared.errors.QuotaExceeded`), prompt size
(:class:`~shared.errors.TooLarge`) and time to live (an expired prompt is
dropped on the next read of the queue, with an audit record and a metric).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from controlplane.access.principals import Principal
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine, _Record, decode, encode
from controlplane.machines.registry import MachineRegistry
from controlplane.machines.rosters import AgentRosters
from controlplane.queue.idempotency import AckedPrompt, AcknowledgedKeys
from shared.crypto import prompt_aad, seal_bytes
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    InvalidState,
    NotFound,
    PreconditionFailed,
    QuotaExceeded,
    TooLarge,
)
from shared.ids import new_id, validate_id
from shared.store.base import ObjectStore, delete_keys
from shared.timestamps import Clock, utc_now

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_PROMPT_BYTES",
    "DEFAULT_TTL",
    "Acknowledgement",
    "PromptQueue",
    "QueueLimits",
    "QueuedPrompt",
    "SendResult",
    "queue_prefix",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_DEPTH: Final = 1000
DEFAULT_MAX_PROMPT_BYTES: Final = 1024 * 1024
DEFAULT_TTL: Final = dt.timedelta(days=7)
#: Longest idempotency key accepted (it is hashed, never stored).
MAX_IDEMPOTENCY_KEY: Final = 200
#: Digits of the sequence number in the key (lexical order = numeric order).
_SEQ_DIGITS: Final = 20
#: Queue entries read at once while listing a queue.
_READS_AT_ONCE: Final = 8
#: Seconds a machine record read for a send serves the next sends.
_MACHINE_CACHE_SECONDS: Final = 5.0
_MACHINE_CACHE_SIZE: Final = 10_000
#: Hex digits of the idempotency hash kept in the key.
_TAG_DIGITS: Final = 16
#: Sequence claims tried before giving up under contention.
_CLAIM_ATTEMPTS: Final = 20


def queue_prefix(account_id: str, machine_id: str) -> str:
    """Prefix of one machine's queued prompts."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/queue/{validate_id('machine', machine_id, 'machine_id')}/"


def _entry_key(account_id: str, machine_id: str, seq: int, idempotency: str = "") -> str:
    # The first 16 hex digits of the idempotency hash ride in the key, so a send
    # finds a replay from the listing alone (the body holds the whole hash).
    tag = f"-{idempotency[:_TAG_DIGITS]}" if idempotency else ""
    return f"{queue_prefix(account_id, machine_id)}{seq:0{_SEQ_DIGITS}d}{tag}.sealed"


def _parse_key(key: str) -> tuple[int, str] | None:
    """(sequence number, idempotency tag or "") of an entry key, or None."""
    name = key.rsplit("/", 1)[-1]
    stem, _, ext = name.partition(".")
    seq, _, tag = stem.partition("-")
    if ext != "sealed" or len(seq) != _SEQ_DIGITS or not seq.isdigit():
        return None
    if tag and (len(tag) != _TAG_DIGITS or any(c not in "0123456789abcdef" for c in tag)):
        return None
    return int(seq), tag


def _idem_hash(machine_id: str, key: str) -> str:
    # Hashed so the caller's key (which may be meaningful text) is never stored.
    return hashlib.sha256(f"{machine_id}\0{key}".encode()).hexdigest() if key else ""


@dataclass(frozen=True)
class QueueLimits:
    """Per-machine queue limits (see the module doc)."""

    max_depth: int = DEFAULT_MAX_DEPTH
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    ttl: dt.timedelta = DEFAULT_TTL


@dataclass(frozen=True)
class QueuedPrompt(_Record):
    """One queued prompt as stored (the text only sealed)."""

    prompt_id: str
    account_id: str
    machine_id: str
    agent_id: str
    created_at: dt.datetime
    sealed_prompt: bytes
    idempotency: str = ""
    """SHA-256 of machine id and idempotency key, or empty."""
    seq: int = 0
    """Sequence number (from the key; not trusted from the body)."""

    @property
    def size(self) -> int:
        """Bytes of the sealed prompt."""
        return len(self.sealed_prompt)


@dataclass(frozen=True)
class Acknowledgement:
    """A machine's answer to one delivered entry."""

    entry: QueuedPrompt
    run_id: str = ""
    refused: str = ""
    """The machine's reason for refusing the prompt for good; empty when it stored it."""


@dataclass(frozen=True)
class SendResult:
    """What a send answers: the prompt id and its state ("queued", or for a key
    replayed after the acknowledgement "acknowledged" or "refused")."""

    prompt_id: str
    state: str
    entry: QueuedPrompt | None = None
    """The entry written; None for a replayed idempotency key."""
    account_id: str = ""
    """The machine's account."""
    run_id: str = ""
    reason: str = ""


class PromptQueue:
    """Queued prompts of every machine; one instance per daemon."""

    def __init__(
        self,
        store: ObjectStore,
        machines: MachineRegistry,
        auditor: Auditor,
        *,
        limits: QueueLimits | None = None,
        clock: Clock = utc_now,
        on_outcome: Callable[[str], None] | None = None,
        rosters: AgentRosters | None = None,
        may_expire: Callable[[], bool] = lambda: True,
    ) -> None:
        self._store = store
        self._rosters = rosters
        # False while our clock disagrees with the store's (integrity.clock):
        # nothing queued is deleted for its age until they agree again.
        self._may_expire = may_expire
        self._machines = machines
        self._audit = auditor
        self._limits = limits or QueueLimits()
        self._clock = clock
        self._on_outcome = on_outcome
        # Each machine's queue as this process knows it: seq -> idempotency tag.
        # Loaded by one LIST at first use, kept up to date by our own sends, acks
        # and listings, so a send costs one PUT; a lost sequence claim (another
        # writer) reloads it. Also what the depth and age gauges and `waiting` read.
        self._views: dict[str, dict[int, str]] = {}
        self._acked = AcknowledgedKeys(
            store, ttl=self._limits.ttl, clock=clock, may_expire=may_expire
        )
        # Machine records for sends: (monotonic time read, record), see _machine.
        self._recent_machines: dict[str, tuple[float, Machine]] = {}

    def depth(self) -> int:
        """Prompts queued over every machine, as this process last saw them."""
        return sum(len(v) for v in self._views.values())

    def oldest_age(self) -> float:
        """Seconds the oldest queued prompt has waited (0 with none); a sequence
        number is its send time in microseconds, or just above an older one."""
        oldest = min((min(v) for v in self._views.values() if v), default=None)
        if oldest is None:
            return 0.0
        return max(0.0, self._clock().timestamp() - oldest / 1_000_000)

    async def waiting(self, machine: Machine) -> bool:
        """Whether a prompt waits in the machine's queue, as this process knows it.

        From the view of the machine's keys (see ``_views``): one LIST the first
        time this process needs it, none afterwards, so a periodic check of an
        idle fleet costs the store nothing. A queue whose newest entry is past
        the time to live does not count (it is dropped at its next read), unless
        expiries wait for the clocks to agree.
        """
        view = await self._view(machine)
        if not view:
            return False
        if not self._may_expire():
            return True
        # A sequence number is its send time in microseconds (or just above an
        # older one): the newest entry is the youngest prompt.
        age = self._clock().timestamp() - max(view) / 1_000_000
        return age <= self._limits.ttl.total_seconds()

    async def _view(self, machine: Machine, *, reload: bool = False) -> dict[int, str]:
        view = self._views.get(machine.machine_id)
        if view is None or reload:
            view = {seq: tag for _key, seq, tag in await self._keys(machine)}
            self._views[machine.machine_id] = view
        return view

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def _machine(self, principal: Principal, machine_id: str) -> Machine:
        # A record read in the last few seconds serves again (two GETs saved per
        # send); visibility is checked each time, and a revoke by this daemon
        # is seen at once (MachineRegistry.is_revoked).
        now = time.monotonic()
        cached = self._recent_machines.get(machine_id)
        if cached is not None and now - cached[0] < _MACHINE_CACHE_SECONDS:
            machine = cached[1]
            principal.visible_account(machine.account_id, "machine", machine_id)
            if self._machines.is_revoked(machine_id):
                raise NotFound("machine", machine_id)
        else:
            machine = await self._machines.get(principal, machine_id)
            if len(self._recent_machines) >= _MACHINE_CACHE_SIZE:
                self._recent_machines.clear()
            self._recent_machines[machine_id] = (now, machine)
        if machine.revoked:
            raise NotFound("machine", machine_id)
        if not machine.box_public_key:
            raise InvalidState(f"machine {machine_id}", "has no box key to seal prompts to")
        return machine

    async def send(
        self,
        principal: Principal,
        machine_id: str,
        agent_id: str,
        text: str,
        idempotency_key: str = "",
        *,
        check_roster: bool = False,
    ) -> SendResult:
        """Seal ``text`` to the machine and queue it; the same idempotency key
        answers the first prompt's id and state and queues nothing. With
        ``check_roster`` (an offline machine), an agent the machine's roster
        does not run is refused first (controlplane.machines.rosters)."""
        validate_id("agent", agent_id, "agent_id")
        size = len(text.encode("utf-8"))
        if not text.strip():
            raise InvalidArgument("text", "must not be empty")
        if "\0" in text:  # as the machine refuses it: a prompt is text
            raise InvalidArgument("text", "must not contain a NUL character")
        if size > self._limits.max_prompt_bytes:
            raise TooLarge("text", self._limits.max_prompt_bytes, size)
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY or not idempotency_key.isprintable():
            raise InvalidArgument(
                "idempotency_key", f"must be at most {MAX_IDEMPOTENCY_KEY} printable characters"
            )
        machine = await self._machine(principal, machine_id)
        idem = _idem_hash(machine_id, idempotency_key)
        # Depth and the last sequence number come from the view of the keys (no
        # reads): an unkeyed send costs one PUT. A keyed one lists the queue first:
        # an idempotency key is checked against the store, never a cache (a put
        # whose answer was lost landed without this process's view learning it).
        view = await self._view(machine, reload=bool(idem))
        if idem:
            replay = await self._replay(machine, view, idem)
            if replay is not None:
                self._count("replayed")
                return SendResult(replay.prompt_id, "queued", None, machine.account_id)
            # Checked second: while both exist (an ack between its two writes)
            # they name the same prompt.
            done = await self._acked.find(machine.account_id, machine_id, idem)
            if done is not None:
                self._count("replayed")
                return SendResult(
                    done.prompt_id, done.state, None, machine.account_id, done.run_id, done.reason
                )
        if check_roster and self._rosters is not None:
            try:
                await self._rosters.check(machine.account_id, machine_id, agent_id)
            except AgentsError:
                self._count("refused_agent")
                raise
        if len(view) >= self._limits.max_depth:
            # Expired entries still have keys: drop them (a full read), then recount.
            if len(await self._entries(machine)) >= self._limits.max_depth:
                self._count("refused")
                raise QuotaExceeded(f"prompt queue of machine {machine_id}", self._limits.max_depth)
        prompt_id = new_id("prompt")
        sealed = seal_bytes(
            text.encode("utf-8"),
            [machine.box_public_key],
            aad=prompt_aad(prompt_id, agent_id),
        )
        # Microseconds of the send time, or one past the last entry: increasing
        # even after the queue was drained empty (a key is never reused).
        micros = int(self._clock().timestamp() * 1_000_000)
        seq = max(micros, max(view, default=0) + 1)
        record = QueuedPrompt(
            prompt_id=prompt_id,
            account_id=machine.account_id,
            machine_id=machine_id,
            agent_id=agent_id,
            created_at=self._clock(),
            sealed_prompt=sealed,
            idempotency=idem,
        )
        body = encode(record)
        for _ in range(_CLAIM_ATTEMPTS):
            try:
                # THE COMMIT POINT: the one create-once put of the entry.
                await self._store.put(
                    _entry_key(machine.account_id, machine_id, seq, idem),
                    body,
                    if_none_match=True,
                )
            except PreconditionFailed:
                # Another writer claimed it: learn its queue again, take the next one.
                view = await self._view(machine, reload=True)
                seq = max(seq, max(view, default=0)) + 1
                continue
            self._count("queued")
            view[seq] = idem[:_TAG_DIGITS]
            logger.info("prompt %s queued for machine %s (seq %d)", prompt_id, machine_id, seq)
            return SendResult(
                prompt_id, "queued", dataclasses.replace(record, seq=seq), machine.account_id
            )
        raise InvalidState(f"prompt queue of machine {machine_id}", "too much contention")

    async def queued(self, principal: Principal, machine_id: str) -> list[QueuedPrompt]:
        """The machine's queued prompts, oldest first (expired ones dropped)."""
        return await self._entries(await self._machine(principal, machine_id))

    async def pending(
        self, account_id: str, machine_id: str, skip: set[int] | None = None
    ) -> list[QueuedPrompt]:
        """What to deliver to a connected machine, in sequence order; entries
        whose sequence number is in ``skip`` (already in flight) are not read."""
        machine = await self._machines.load_any(account_id, machine_id)
        if machine is None:
            return []
        return await self._entries(machine, skip or set())

    async def acknowledged(
        self, entry: QueuedPrompt, *, run_id: str = "", refused: str = ""
    ) -> None:
        """The machine stored ``entry`` durably (with ``run_id``), or refused it for
        good (``refused`` is its reason): delete it."""
        [failed] = await self.acknowledged_many([Acknowledgement(entry, run_id, refused)])
        if failed is not None:
            raise failed

    async def acknowledged_many(self, acks: Sequence[Acknowledgement]) -> list[AgentsError | None]:
        """Delete acknowledged entries: one DELETE for one, batched DeleteObjects
        for more (see controlplane.queue.acks). A keyed entry's outcome is recorded
        first (see the module doc); an entry whose record failed is not deleted
        (delivered and acknowledged again) and its error is in its place in the
        answer, None for each deleted one. A failed delete raises: all stay queued."""
        limit = asyncio.Semaphore(_READS_AT_ONCE)

        async def record(ack: Acknowledgement) -> AgentsError | None:
            e = ack.entry
            if not e.idempotency:
                return None
            done = AckedPrompt(
                prompt_id=e.prompt_id,
                account_id=e.account_id,
                machine_id=e.machine_id,
                agent_id=e.agent_id,
                created_at=e.created_at,
                idempotency=e.idempotency,
                state="refused" if ack.refused else "acknowledged",
                run_id=ack.run_id,
                reason=ack.refused,
            )
            try:
                async with limit:
                    await self._acked.record(done, e.seq)
            except AgentsError as err:
                return err
            return None

        # Each record before its entry's delete. One failed record keeps only its
        # own entry queued (before, it failed the batch: under a flaky store a
        # drain of a hundred was delivered again whole, and again).
        failed = await asyncio.gather(*(record(a) for a in acks))
        recorded = [a for a, err in zip(acks, failed, strict=True) if err is None]
        keys = [
            _entry_key(a.entry.account_id, a.entry.machine_id, a.entry.seq, a.entry.idempotency)
            for a in recorded
        ]
        # THE COMMIT POINT of an acknowledgement: its entry's delete. Deleting a
        # missing key succeeds: a second ack (redelivery) is harmless.
        if len(keys) == 1:
            await self._store.delete(keys[0])
        elif keys:
            await delete_keys(self._store, keys)
        for a in recorded:
            self._views.get(a.entry.machine_id, {}).pop(a.entry.seq, None)
            self._count("refused_by_machine" if a.refused else "acknowledged")
        return list(failed)

    async def _keys(self, machine: Machine) -> list[tuple[str, int, str]]:
        """(key, seq, tag) of every entry, in sequence order."""
        out = []
        async for info in self._store.list(queue_prefix(machine.account_id, machine.machine_id)):
            parsed = _parse_key(info.key)
            if parsed is not None:
                out.append((info.key, *parsed))
        return out

    async def _replay(
        self, machine: Machine, view: dict[int, str], idem: str
    ) -> QueuedPrompt | None:
        for seq, tag in sorted(view.items()):
            if tag != idem[:_TAG_DIGITS]:
                continue
            key = _entry_key(machine.account_id, machine.machine_id, seq, idem)
            entry = await self._read(machine, key, seq)
            if entry is not None and entry.idempotency == idem:
                return entry
        return None

    async def _read(self, machine: Machine, key: str, seq: int) -> QueuedPrompt | None:
        """One entry, or None when gone, damaged, forged or another machine's."""
        try:
            data = decode(await self._store.get(key), key)
            entry = dataclasses.replace(QueuedPrompt.from_dict(data), seq=seq)
        except NotFound:
            return None  # acknowledged meanwhile
        except (IntegrityError, TypeError, ValueError) as e:
            # A forged or damaged entry is never delivered; fsck reports it.
            logger.warning("queue entry %s skipped: %s", key, e)
            return None
        if entry.machine_id != machine.machine_id or entry.account_id != machine.account_id:
            logger.warning("queue entry %s names another machine: skipped", key)
            return None
        return entry

    async def _entries(self, machine: Machine, skip: set[int] | None = None) -> list[QueuedPrompt]:
        """Every readable entry not in ``skip``, in sequence order; expired ones dropped."""
        skip = skip or set()
        now = self._clock()
        out: list[QueuedPrompt] = []
        keys = await self._keys(machine)
        self._views[machine.machine_id] = {seq: tag for _key, seq, tag in keys}
        wanted = [(key, seq) for key, seq, _tag in keys if seq not in skip]
        # Reads overlap (bounded): a connect drains a long queue at the store's
        # pace, not one round trip per prompt. The order stays sequence order.
        limit = asyncio.Semaphore(_READS_AT_ONCE)

        async def read(key: str, seq: int) -> QueuedPrompt | None:
            async with limit:
                return await self._read(machine, key, seq)

        entries = await asyncio.gather(*(read(key, seq) for key, seq in wanted))
        for (key, _seq), entry in zip(wanted, entries, strict=True):
            if entry is None:
                continue
            if now - entry.created_at > self._limits.ttl and self._may_expire():
                await self._expire(key, entry)
                continue
            out.append(entry)
        try:
            await self._acked.sweep(machine.account_id, machine.machine_id)
        except AgentsError as e:
            logger.warning("machine %s: expired idempotency keys kept: %s", machine.machine_id, e)
        return out

    async def _expire(self, key: str, entry: QueuedPrompt) -> None:
        try:
            await self._store.delete(key)
        except AgentsError as e:
            logger.warning("expire %s: %s", key, e)
            return
        self._views.get(entry.machine_id, {}).pop(entry.seq, None)
        await self._audit.record(
            "control-plane", "prompt.expire", entry.prompt_id, entry.account_id
        )
        self._count("expired")
        logger.info("prompt %s for machine %s expired", entry.prompt_id, entry.machine_id)
