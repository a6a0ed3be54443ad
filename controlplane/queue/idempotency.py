"""Idempotency keys that outlive the acknowledgement of their prompt.

A queued prompt sent with an idempotency key carries the key's hash
(controlplane.queue.prompts), so a retried send finds it while it is queued. Once the
machine acknowledged it the entry is deleted, yet a client whose reply was
lost retries exactly then. So before a keyed entry is deleted, a small record
of its outcome is written, ONE object::

    accounts/<a>/queue-acked/<m>/<seq>-<tag>.json

(``seq`` the entry's sequence number, the send time in microseconds or just
above; ``tag`` the key hash's first 16 hex digits). It holds the prompt id,
the state (``acknowledged`` or ``refused``), the run id or the refusal reason
and the key's whole hash; never the text. A retried send with the key is
answered from it until the key's time to live (the queue's ``ttl``, counted
from the send) is over; then the record is deleted, aged by its name alone.

The queue writes the record, then deletes the entry: that delete stays the
acknowledgement's commit point. Killed between the two, the store holds both,
which answer a retry with the same prompt id, and the entry is delivered again.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from controlplane.integrity.records import _Record, decode, encode
from shared.errors import IntegrityError, NotFound
from shared.ids import validate_id
from shared.store.base import ObjectStore, delete_keys
from shared.timestamps import Clock

__all__ = ["AckedPrompt", "AcknowledgedKeys", "acked_prefix"]

logger = logging.getLogger(__name__)

_SEQ_DIGITS: Final = 20
_TAG_DIGITS: Final = 16


def acked_prefix(account_id: str, machine_id: str) -> str:
    """Prefix of one machine's acknowledged prompts that carried an idempotency key."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/queue-acked/{validate_id('machine', machine_id, 'machine_id')}/"


def _record_key(account_id: str, machine_id: str, seq: int, tag: str) -> str:
    return f"{acked_prefix(account_id, machine_id)}{seq:0{_SEQ_DIGITS}d}-{tag[:_TAG_DIGITS]}.json"


def _parse(key: str) -> tuple[int, str] | None:
    stem, _, ext = key.rsplit("/", 1)[-1].partition(".")
    seq, _, tag = stem.partition("-")
    if ext != "json" or len(seq) != _SEQ_DIGITS or not seq.isdigit() or len(tag) != _TAG_DIGITS:
        return None
    return int(seq), tag


@dataclass(frozen=True)
class AckedPrompt(_Record):
    """What is kept of an acknowledged prompt that carried an idempotency key:
    enough to answer a retried send (never the text)."""

    prompt_id: str
    account_id: str
    machine_id: str
    agent_id: str
    created_at: dt.datetime
    idempotency: str
    """SHA-256 of machine id and idempotency key."""
    state: str
    """acknowledged or refused"""
    run_id: str = ""
    reason: str = ""
    """The machine's reason, when it refused the prompt."""


class AcknowledgedKeys:
    """The records of every machine's acknowledged keyed prompts (module doc).

    Which records exist is kept in memory per machine, as (seq, tag) pairs (a
    drained queue may give a sequence number again, with another tag): one
    LIST at first use, merged (an ack may add to it meanwhile), then this
    process's own records and sweeps. A send with a new key costs no request.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        ttl: dt.timedelta,
        clock: Clock,
        may_expire: Callable[[], bool] = lambda: True,
    ) -> None:
        self._store = store
        self._ttl = ttl
        self._clock = clock
        # False while our clock is not to be trusted (integrity.clock): a key
        # stays known and its record stays until the clocks agree again.
        self._may_expire = may_expire
        self._known: dict[str, set[tuple[int, str]]] = {}
        self._loaded: set[str] = set()

    async def record(self, done: AckedPrompt, seq: int) -> None:
        """Write ``done`` (the entry ``seq``'s outcome), before its entry is deleted."""
        key = _record_key(done.account_id, done.machine_id, seq, done.idempotency)
        # A plain put: the same ack delivered twice writes the same record.
        await self._store.put(key, encode(done))
        # Known before the entry can be gone: a retry never finds neither.
        self._known.setdefault(done.machine_id, set()).add((seq, done.idempotency[:_TAG_DIGITS]))

    async def find(self, account_id: str, machine_id: str, idem: str) -> AckedPrompt | None:
        """The acknowledged prompt of ``machine_id`` sent with the key hash ``idem``,
        unless its key expired; a record of another machine or account never counts."""
        known = await self._load(account_id, machine_id)
        for seq, tag in sorted(known):
            if tag != idem[:_TAG_DIGITS]:
                continue
            key = _record_key(account_id, machine_id, seq, tag)
            try:
                done = AckedPrompt.from_dict(decode(await self._store.get(key), key))
            except NotFound:
                known.discard((seq, tag))  # swept meanwhile
                continue
            except (IntegrityError, TypeError, ValueError) as e:
                logger.warning("acknowledged prompt record %s skipped: %s", key, e)
                continue
            if (done.idempotency, done.machine_id, done.account_id) != (
                idem,
                machine_id,
                account_id,
            ):
                continue  # another key with the same tag, or a record moved here
            if self._clock() - done.created_at > self._ttl and self._may_expire():
                continue  # the key expired: the sweep deletes its record
            return done
        return None

    async def sweep(self, account_id: str, machine_id: str) -> None:
        """Delete the machine's records whose key expired, aged by the sequence
        number in their name (the send time, or just above): no reads."""
        if not self._may_expire():
            return
        known = await self._load(account_id, machine_id)
        oldest = int((self._clock() - self._ttl).timestamp() * 1_000_000)
        expired = [(seq, tag) for seq, tag in known if seq < oldest]
        if expired:
            await delete_keys(
                self._store, [_record_key(account_id, machine_id, s, t) for s, t in expired]
            )
            known.difference_update(expired)

    async def _load(self, account_id: str, machine_id: str) -> set[tuple[int, str]]:
        known = self._known.setdefault(machine_id, set())
        if machine_id not in self._loaded:
            async for info in self._store.list(acked_prefix(account_id, machine_id)):
                parsed = _parse(info.key)
                if parsed is not None:
                    known.add(parsed)
            self._loaded.add(machine_id)
        return known
