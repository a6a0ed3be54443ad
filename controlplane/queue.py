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

Limits: depth per machine (:class:`~shared.errors.QuotaExceeded`), prompt size
(:class:`~shared.errors.TooLarge`) and time to live (an expired prompt is
dropped on the next read of the queue, with an audit record and a metric).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from controlplane.audit import Auditor, Clock, utcnow
from controlplane.authz import Principal
from controlplane.machines import MachineRegistry
from controlplane.records import Machine, _Record, decode, encode
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
from shared.store.base import ObjectStore

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_PROMPT_BYTES",
    "DEFAULT_TTL",
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
#: Sequence claims tried before giving up under contention.
_CLAIM_ATTEMPTS: Final = 20


def queue_prefix(account_id: str, machine_id: str) -> str:
    """Prefix of one machine's queued prompts."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/queue/{validate_id('machine', machine_id, 'machine_id')}/"


def _entry_key(account_id: str, machine_id: str, seq: int) -> str:
    return f"{queue_prefix(account_id, machine_id)}{seq:0{_SEQ_DIGITS}d}.sealed"


def _seq_of(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    stem, dot, ext = name.partition(".")
    if ext != "sealed" or len(stem) != _SEQ_DIGITS or not stem.isdigit():
        return None
    return int(stem)


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
class SendResult:
    """What a send answers: the prompt id and its state ("queued")."""

    prompt_id: str
    state: str
    entry: QueuedPrompt | None = None
    """The entry written; None for a replayed idempotency key."""


class PromptQueue:
    """Queued prompts of every machine; one instance per daemon."""

    def __init__(
        self,
        store: ObjectStore,
        machines: MachineRegistry,
        auditor: Auditor,
        *,
        limits: QueueLimits | None = None,
        clock: Clock = utcnow,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._machines = machines
        self._audit = auditor
        self._limits = limits or QueueLimits()
        self._clock = clock
        self._on_outcome = on_outcome
        # What this process last saw queued, per machine: seq -> send time (gauges).
        self._seen: dict[str, dict[int, dt.datetime]] = {}

    def depth(self) -> int:
        """Prompts queued over every machine, as this process last saw them."""
        return sum(len(s) for s in self._seen.values())

    def oldest_age(self) -> float:
        """Seconds the oldest queued prompt has waited (0 with none)."""
        times = [t for s in self._seen.values() for t in s.values()]
        return max(0.0, (self._clock() - min(times)).total_seconds()) if times else 0.0

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def _machine(self, principal: Principal, machine_id: str) -> Machine:
        machine = await self._machines.get(principal, machine_id)
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
    ) -> SendResult:
        """Seal ``text`` to the machine and queue it; the same idempotency key
        answers the first prompt's id and state and queues nothing."""
        validate_id("agent", agent_id, "agent_id")
        size = len(text.encode("utf-8"))
        if not text:
            raise InvalidArgument("text", "must not be empty")
        if size > self._limits.max_prompt_bytes:
            raise TooLarge("text", self._limits.max_prompt_bytes, size)
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY or not idempotency_key.isprintable():
            raise InvalidArgument(
                "idempotency_key", f"must be at most {MAX_IDEMPOTENCY_KEY} printable characters"
            )
        machine = await self._machine(principal, machine_id)
        idem = _idem_hash(machine_id, idempotency_key)
        entries = await self._entries(machine)
        if idem:
            for e in entries:
                if e.idempotency == idem:
                    self._count("replayed")
                    return SendResult(e.prompt_id, "queued", None)
        if len(entries) >= self._limits.max_depth:
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
        seq = max(micros, await self._last_seq(machine) + 1)
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
                    _entry_key(machine.account_id, machine_id, seq), body, if_none_match=True
                )
            except PreconditionFailed:
                seq += 1  # another send claimed it: take the next one
                continue
            self._count("queued")
            self._seen.setdefault(machine_id, {})[seq] = record.created_at
            logger.info("prompt %s queued for machine %s (seq %d)", prompt_id, machine_id, seq)
            return SendResult(prompt_id, "queued", dataclasses.replace(record, seq=seq))
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

    async def acknowledged(self, entry: QueuedPrompt, *, refused: bool = False) -> None:
        """The machine stored ``entry`` durably (or refused it for good): delete it."""
        # Deleting a missing key succeeds: a second ack (redelivery) is harmless.
        await self._store.delete(_entry_key(entry.account_id, entry.machine_id, entry.seq))
        self._seen.get(entry.machine_id, {}).pop(entry.seq, None)
        self._count("refused_by_machine" if refused else "acknowledged")

    async def _last_seq(self, machine: Machine) -> int:
        last = 0
        async for info in self._store.list(queue_prefix(machine.account_id, machine.machine_id)):
            last = max(last, _seq_of(info.key) or 0)
        return last

    async def _entries(self, machine: Machine, skip: set[int] | None = None) -> list[QueuedPrompt]:
        prefix = queue_prefix(machine.account_id, machine.machine_id)
        skip = skip or set()
        now = self._clock()
        out: list[QueuedPrompt] = []
        async for info in self._store.list(prefix):
            seq = _seq_of(info.key)
            if seq is None or seq in skip:
                continue
            try:
                data = decode(await self._store.get(info.key), info.key)
                entry = dataclasses.replace(QueuedPrompt.from_dict(data), seq=seq)
            except NotFound:
                continue  # acknowledged meanwhile
            except (IntegrityError, TypeError, ValueError) as e:
                # A forged or damaged entry is never delivered; fsck reports it.
                logger.warning("queue entry %s skipped: %s", info.key, e)
                continue
            if entry.machine_id != machine.machine_id or entry.account_id != machine.account_id:
                logger.warning("queue entry %s names another machine: skipped", info.key)
                continue
            if now - entry.created_at > self._limits.ttl:
                await self._expire(info.key, entry)
                continue
            out.append(entry)
        kept = {s: t for s, t in self._seen.get(machine.machine_id, {}).items() if s in skip}
        kept.update((e.seq, e.created_at) for e in out)
        self._seen[machine.machine_id] = kept
        return out

    async def _expire(self, key: str, entry: QueuedPrompt) -> None:
        try:
            await self._store.delete(key)
        except AgentsError as e:
            logger.warning("expire %s: %s", key, e)
            return
        self._seen.get(entry.machine_id, {}).pop(entry.seq, None)
        await self._audit.record(
            "control-plane", "prompt.expire", entry.prompt_id, entry.account_id
        )
        self._count("expired")
        logger.info("prompt %s for machine %s expired", entry.prompt_id, entry.machine_id)
