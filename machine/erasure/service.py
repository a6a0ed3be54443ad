"""Erasing an archived agent: its rows, its bytes, its runtime's copy, its receipt.

:meth:`ErasureService.delete` stops the agent's runtime, then deletes every
row of the agent in one transaction that also puts it on the erased list and
writes its receipt, which queues the runtime erasure (the commit point). Then
the bytes go: the search index is merged (FTS5 keeps deleted terms until
then), the WAL is checkpointed and truncated (``secure_delete`` zeroes the
pages in the database file, but older copies of them sit in the WAL), and the
attachment files no other agent names are removed. A crash after the commit
leaves that second step to :meth:`ErasureService.finish_pending` at the next
start.

The runtime erasure queue (:class:`RuntimeErasures`) holds at most 1,000,
works one at a time, and gives each erasure one try per start, 3 tries at most
within 7 days; then it gives up with an event in the machine log.

The machine issues no per-agent tokens (the local API token is the
machine's): stopping the runtime ends the only credential an agent holds here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from machine.core.attachments import unnamed_attachment_files
from machine.core.runs import RunEngine
from machine.metrics import MachineMetrics
from machine.models import AgentState, MachineIds
from machine.runtimes import RuntimeRegistry
from machine.runtimes.base import SessionEraser
from machine.storage import restored, tables
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures
from machine.storage.tables.erasures import QueuedErasure, Receipt
from shared.atomic import fsync_dir
from shared.errors import AgentsError, InvalidState, QuotaExceeded, RuntimeFailed, StoreError
from shared.ids import validate_id, validate_sha256

__all__ = [
    "ERASED_KEEP_SECONDS",
    "MAX_ATTEMPTS",
    "QUEUE_MAX",
    "RETRY_WINDOW_SECONDS",
    "DeleteResult",
    "ErasureService",
    "ErasureView",
    "RuntimeErasures",
]

logger = logging.getLogger(__name__)

#: The runtime erasure queue holds at most this many; a delete beyond is refused.
QUEUE_MAX: Final = 1000
#: A runtime erasure is tried at most this many times (one try per start)...
MAX_ATTEMPTS: Final = 3
#: ...within this long after the delete, then given up.
RETRY_WINDOW_SECONDS: Final = 7 * 86400.0
#: An erased-list entry is kept this long (backups older than that are gone).
ERASED_KEEP_SECONDS: Final = 400 * 86400.0

#: A checkpoint that finds a reader in the way is tried again this often.
_CHECKPOINT_TRIES = 20

BackupTimes = Callable[[], Awaitable[list[float]]]
"""When each stored backup was made (for the receipts' backups layer)."""


@dataclass(frozen=True)
class DeleteResult:
    """What a delete did."""

    agent_id: str
    runtime_erasure_queued: bool


@dataclass(frozen=True)
class ErasureView:
    """A receipt as shown: each layer done, unsupported, failed or pending.

    ``state`` is the runtime erasure's: queued, done, unsupported or failed;
    "listed" for an erased-list entry brought by a restore (erased elsewhere).
    """

    agent_id: str
    state: str
    erased_at: float
    attempts: int
    machine_data: str
    attachments: str
    runtime_copy: str
    backups: str
    detail: str


class RuntimeErasures:
    """The runtime erasure queue's worker: one erasure at a time, one try per start."""

    def __init__(
        self,
        db: Database,
        registry: RuntimeRegistry,
        *,
        metrics: MachineMetrics | None = None,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._db = db
        self._registry = registry
        self._metrics = metrics
        self._clock = clock
        self._on_change = on_change
        self._wake = asyncio.Event()
        # Erasures tried since this daemon started: the next try waits for the next start.
        self._tried: set[str] = set()

    def notify(self) -> None:
        """A new erasure was queued."""
        self._wake.set()

    async def run(self) -> None:
        """Work the queue until cancelled."""
        while True:
            self._wake.clear()
            try:
                done_one = await self.work_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the runtime erasure queue failed; waiting for the next delete")
                done_one = False
            if not done_one:
                await self._wake.wait()

    async def work_once(self) -> bool:
        """Try the oldest erasure not tried since this start; False when none is left."""
        entries = await self._db.read(store_erasures.queued, what="read the erasure queue")
        todo = [e for e in entries if e.agent_id not in self._tried]
        if not todo:
            return False
        entry = todo[0]
        self._tried.add(entry.agent_id)
        await self._attempt(entry)
        return True

    async def _attempt(self, entry: QueuedErasure) -> None:
        now = self._clock()
        attempts = entry.attempts + 1
        if now - entry.erased_at > RETRY_WINDOW_SECONDS:
            result = "failed"
            detail = f"given up: not erased within 7 days ({entry.attempts} tries)"
            attempts = entry.attempts  # not tried again
        else:
            try:
                result, detail = await self._erase(entry)
            except Exception as e:  # the runtime did not start or answer; or a bug
                if not isinstance(e, AgentsError):
                    logger.exception("runtime erasure of agent %s failed", entry.agent_id)
                if self._metrics is not None:
                    self._metrics.erasure_failures.inc()
                reason = str(e) or type(e).__name__
                if attempts >= MAX_ATTEMPTS:
                    result, detail = "failed", f"given up after {attempts} tries: {reason}"
                else:
                    result = "pending"
                    detail = (
                        f"try {attempts} of {MAX_ATTEMPTS} failed: {reason};"
                        " tried again at the next start"
                    )
        logger.info("runtime erasure of agent %s: %s (%s)", entry.agent_id, result, detail)

        def write(conn: sqlite3.Connection) -> None:
            store_erasures.record_attempt(
                conn,
                entry.agent_id,
                result=result,
                detail=detail,
                now=now,
                tried=attempts > entry.attempts,
            )
            if result == "failed":
                tables.log(conn, now, "erasure.given_up", f"{entry.agent_id}: {detail}")
            elif result != "pending":
                tables.log(conn, now, "erasure.runtime", f"{entry.agent_id}: {result}")

        await self._db.write(write, what=f"record the runtime erasure of {entry.agent_id}")
        if result != "pending" and self._metrics is not None:
            self._metrics.erasures.labels(result).inc()
        if self._on_change is not None:
            await self._on_change()

    async def _erase(self, entry: QueuedErasure) -> tuple[str, str]:
        runtime = self._registry.create(
            entry.runtime,
            agent_id=entry.agent_id,
            folder=Path(entry.folder),
            settings=entry.settings,
        )
        try:
            if not isinstance(runtime, SessionEraser):
                return "unsupported", f"the {entry.runtime} runtime cannot delete its sessions"
            result, detail = await runtime.erase_session(entry.session_id, Path(entry.folder))
            if result not in ("done", "unsupported"):  # the receipt holds nothing else
                raise RuntimeFailed(f"{entry.runtime} erase_session: unknown result {result!r}")
            return result, detail
        finally:
            try:
                await runtime.close()
            except Exception:
                logger.exception("stopping the %s runtime after an erasure failed", entry.runtime)


class ErasureService:
    """Deletes archived agents, keeps their receipts, and answers the erased list."""

    def __init__(
        self,
        db: Database,
        *,
        ids: MachineIds,
        runs: RunEngine,
        registry: RuntimeRegistry,
        attachments_dir: Path,
        metrics: MachineMetrics | None = None,
        backup_times: BackupTimes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._ids = ids
        self._runs = runs
        self._attachments = attachments_dir
        self._metrics = metrics
        self._backup_times = backup_times
        self._clock = clock
        self._oldest: float | None = None
        self.queue = RuntimeErasures(
            db, registry, metrics=metrics, clock=clock, on_change=self.refresh_gauges
        )
        if metrics is not None:
            metrics.erasure_queue_oldest_age.set_function(self._oldest_age)

    def _oldest_age(self) -> float:
        oldest = self._oldest
        return max(0.0, self._clock() - oldest) if oldest is not None else 0.0

    async def refresh_gauges(self) -> None:
        """Read the queue's length and oldest entry for the metrics."""
        entries = await self._db.read(store_erasures.queued, what="read the erasure queue")
        self._oldest = entries[0].erased_at if entries else None
        if self._metrics is not None:
            self._metrics.erasure_queue_length.set(len(entries))

    # ---------------------------------------------------------------- delete

    async def delete(self, agent_id: str) -> DeleteResult:
        """Erase an archived agent; FAILED_PRECONDITION (InvalidState) for an active
        one and RESOURCE_EXHAUSTED (QuotaExceeded) when the queue is full: then
        nothing changes."""
        validate_id("agent", agent_id, "agent_id")
        own = self._ids.own
        what = f"delete agent {agent_id}"
        agent = await self._db.read(lambda c: tables.get_agent(c, agent_id, own), what=what)
        if agent.state is AgentState.ACTIVE:
            raise InvalidState(what, "it is active; archive it first")
        # A restored history still packed is loaded (to be erased with the rest),
        # and its pack, holding the agent's plaintext, removed once all of it is.
        await restored.ensure_loaded(self._db)
        await self._runs.release_runtime(agent_id)
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[list[str], bool]:
            agent = tables.get_agent(conn, agent_id, own)
            if agent.state is AgentState.ACTIVE:  # unarchived meanwhile
                raise InvalidState(what, "it is active; archive it first")
            queued = agent.local
            if queued and store_erasures.queue_length(conn) >= QUEUE_MAX:
                raise QuotaExceeded("runtime erasure queue", QUEUE_MAX)
            orphans = store_erasures.delete_agent_rows(conn, agent_id)
            store_erasures.add_erased(conn, agent_id, now)
            store_erasures.insert_receipt(
                conn,
                agent_id=agent_id,
                erased_at=now,
                runtime=agent.runtime,
                folder=agent.folder,
                settings=agent.settings,
                session_id=agent.session_id,
                attachments="pending" if orphans else "done",
                runtime_copy="pending" if queued else "unsupported",
                detail=""
                if queued
                else f"it ran on machine {agent.origin_machine}: its runtime copy is there",
            )
            tables.log(conn, now, "agent.erased", agent_id)
            return orphans, queued

        # The commit point: the agent is whole, or erased, listed and queued.
        orphans, queued = await self._db.write(write, what=what)
        restored.forget_failed(self._db, agent_id)  # a restored history that did not load
        logger.info("agent %s erased (%d attachment file(s) to remove)", agent_id, len(orphans))
        if queued:
            self.queue.notify()
        await self.refresh_gauges()
        try:
            await self.scrub([agent_id], orphans)
        except AgentsError as e:
            # The rows are gone (committed); the bytes go at the next start.
            logger.error("erasing the bytes of agent %s failed (%s): next start", agent_id, e)
        return DeleteResult(agent_id, queued)

    async def scrub(self, agent_ids: Iterable[str], shas: Iterable[str]) -> None:
        """Make deleted bytes go: merge the search index, checkpoint and truncate
        the WAL, remove the attachment files nobody names; mark the receipts."""
        ids = list(agent_ids)
        await self._db.write(store_erasures.optimize_search, what="optimize the search index")
        await self.checkpoint()
        state = "done"
        try:
            await self.remove_attachment_files(shas)
        except OSError as e:
            logger.error("removing erased attachments failed: %s", e)
            state = "failed"
        if ids:
            await self._db.write(
                lambda c: store_erasures.finish_scrub(c, ids, state),
                what="record erased bytes",
            )

    async def checkpoint(self) -> None:
        """Copy the WAL into machine.db and truncate it to 0 bytes."""
        for _ in range(_CHECKPOINT_TRIES):
            busy, _, _ = await self._db.maintain(
                store_erasures.checkpoint_truncate, what="checkpoint machine.db"
            )
            if not busy:
                return
            await asyncio.sleep(0.05)  # a reader is mid-transaction: let it end
        raise StoreError("checkpoint machine.db: readers kept the WAL busy")

    async def remove_attachment_files(self, shas: Iterable[str]) -> int:
        """Remove the files of ``shas`` that no agent names (checked again here)."""
        wanted = [validate_sha256(s) for s in shas]
        if not wanted:
            return 0
        unnamed = await self._db.read(
            lambda c: store_erasures.unreferenced_attachments(c, wanted), what="read attachments"
        )
        return await asyncio.to_thread(_unlink_all, self._attachments, unnamed)

    async def finish_pending(self) -> None:
        """At start: finish the byte removal of deletes a crash interrupted."""
        pending = await self._db.read(
            store_erasures.unscrubbed_receipts, what="read erasure receipts"
        )
        if pending:
            shas = await unnamed_attachment_files(self._db, self._attachments, min_age=0.0)
            await self.scrub(pending, shas)

    # ---------------------------------------------------------------- lists

    async def erased_ids(self) -> set[str]:
        """Every agent id on the erased list."""
        rows = await self._db.read(store_erasures.erased_rows, what="read the erased list")
        return {str(r["agent_id"]) for r in rows}

    async def receipts(self) -> list[ErasureView]:
        """Receipts (queued first), then erased-list entries brought by a restore."""
        receipts, listed = await self._db.read(
            store_erasures.list_receipts, what="read erasure receipts"
        )
        times = await self._stored_backups()

        def backups(erased_at: float) -> str:
            if times is None:
                return "pending"
            # A backup made before the delete may hold the agent until it ages out.
            return "pending" if any(t < erased_at for t in times) else "done"

        views = [_view(r, backups(r.erased_at)) for r in receipts]
        views += [
            ErasureView(a, "listed", at, 0, "done", "-", "-", backups(at), "erased elsewhere")
            for a, at in listed
        ]
        return views

    async def _stored_backups(self) -> list[float] | None:
        if self._backup_times is None:
            return []
        try:
            return await self._backup_times()
        except AgentsError as e:
            logger.warning("cannot list the stored backups for erasure receipts: %s", e)
            return None


def _view(r: Receipt, backups: str) -> ErasureView:
    state = "queued" if r.runtime_copy == "pending" else r.runtime_copy
    return ErasureView(
        agent_id=r.agent_id,
        state=state,
        erased_at=r.erased_at,
        attempts=r.attempts,
        machine_data=r.machine_data,
        attachments=r.attachments,
        runtime_copy=r.runtime_copy,
        backups=backups,
        detail=r.detail,
    )


def _unlink_all(folder: Path, shas: list[str]) -> int:
    removed = 0
    for sha in shas:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / sha)
            removed += 1
    if removed:
        fsync_dir(folder)
    return removed
