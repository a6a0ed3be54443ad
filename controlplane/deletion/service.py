"""Account deletion: tombstone, close the account's links, delete everything under it, then it.

One deletion is one ``account.delete`` intent (:mod:`controlplane.integrity.intents`)
that only ever rolls FORWARD once its tombstone is written::

    1. begin the intent (cp/intents/<int>.json names the account)
    2. create accounts/<a>/deleting.json        <- THE COMMIT POINT
    3. close the account's live Connect streams (``account_deleted``)
    4. delete the index entries pointing to the account (machines, tokens,
       GitHub id, listing) and its account-scoped credentials
    5. delete every object under accounts/<a>/ but the tombstone and the
       account record, in batches: first the backup segments its machines'
       backups name, then whatever a paginated listing still finds
       (:mod:`controlplane.deletion.sweep`). Step 4 and the named segments
       run at once: segments are not the records step 4 finds its entries from.
       The tombstone keeps the count of objects deleted as the sweep goes
       (each save one compare-and-swap put: the commit point of what it
       counts), so a resumed run reports every object, not only its own.
    6. create deleted/<a>.json (who, when, how many objects) and an audit record
    7. delete accounts/<a>/account.json, then the tombstone, then the intent

Before step 2 nobody was told anything, so an abandoned intent without a
tombstone is rolled back (the intent is dropped; the account lives on). From
step 2 on, every step is idempotent and a resumed deletion repeats them all:
index entries are found by listing the account's own records, which are
deleted only after the entries that point to them (step 4 before step 5), so
a crash never leaves an entry nobody can find. A restarted control plane
resumes every unfinished deletion by itself (the intent's resolver starts it
in the background), as does ``fsck --repair`` (in the foreground).

:class:`AccountDeletion` starts, resumes and reports deletions and runs the
steps in this order; :class:`~controlplane.deletion.sweep.AccountSweep` does
steps 4 and 5 against the store and counts objects; the tombstone and
``deleted/<a>.json`` hold a :class:`~controlplane.deletion.tombstone.Deletion`.

While the tombstone exists the account's RPCs, joins and links are refused
(:meth:`AccountService.require_active`, :meth:`MachineRegistry.authorize_peer`);
afterwards its ids are simply unknown, and ``deleted/<a>.json`` tells "deleted
at T by X" apart from "never existed". A backup upload authorized before the
tombstone can outlast the last sweep: the backups domain looks for the
tombstone or ``deleted/<a>.json`` after each segment or manifest it writes and
deletes what it wrote (:class:`controlplane.machines.backups.MachineBackups`). Machines
themselves are not touched: they are told ``account_deleted``, stop
reconnecting and keep their data.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.deletion.sweep import AccountSweep
from controlplane.deletion.tombstone import Deletion
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intent, Intents
from controlplane.integrity.records import account_key, deleted_key, deleting_key
from shared.errors import IntegrityError, InvalidState, NotFound
from shared.ids import is_valid_id, validate_id
from shared.store.base import DELETE_BATCH, ObjectStore
from shared.store.causes import set_cause
from shared.timestamps import Clock, utc_now

__all__ = [
    "DELETED_PREFIX",
    "AccountDeletion",
    "DeletionHooks",
    "deleted_key",
]

logger = logging.getLogger(__name__)

_KIND: Final = "account.delete"
DELETED_PREFIX: Final = "deleted/"


@dataclass
class DeletionHooks:
    """What the daemon plugs in once it runs (all optional for unit tests and fsck)."""

    close_links: Callable[[str], int] | None = None
    """Tell the account's live links ``account_deleted``; returns how many."""
    finished: Callable[[str], None] | None = None
    """Count one deletion run by result ("ok" or "failed")."""
    objects: Callable[[int], None] | None = None
    """Count objects deleted."""


class AccountDeletion:
    """Starts, runs, resumes and reports account deletions; one instance per process."""

    def __init__(
        self,
        store: ObjectStore,
        accounts: AccountService,
        auditor: Auditor,
        intents: Intents,
        *,
        clock: Clock = utc_now,
        page_size: int = DELETE_BATCH,
        backups: ObjectStore | None = None,
    ) -> None:
        self._store = store
        self._backups = backups
        self._accounts = accounts
        self._audit = auditor
        self._intents = intents
        self._clock = clock
        self._page_size = page_size
        self.hooks = DeletionHooks()
        self._background = False
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sweeps: dict[str, AccountSweep] = {}
        """Deletions in progress here (their live object counts)."""
        self._running: dict[str, Deletion] = {}
        """Deletions running here now, as their tombstones say."""
        intents.register(_KIND, self._resolve)

    def run_in_background(self, hooks: DeletionHooks) -> None:
        """Serve mode: deletions run as tasks and resumed ones start from recovery."""
        self.hooks = hooks
        self._background = True

    # -- the RPCs -------------------------------------------------------------------

    async def delete(self, principal: Principal, account_id: str) -> Deletion:
        """Start deleting ``account_id`` (operator only) and return its state. Idempotent.

        NotFound for an account that never existed (or, for an account-scoped
        credential, any other account).
        """
        validate_id("account", account_id, "account_id")
        principal.visible_account(account_id, "account", account_id)
        principal.require_operator("account delete")
        current = await self._find(account_id)
        if current is not None:
            if current.state == "deleting":
                await self._ensure_running(account_id)
            return current
        account = await self._accounts.get(account_id)
        now = self._clock()
        started = Deletion(account_id, "deleting", now, principal.credential_id)
        intent = await self._intents.begin(
            _KIND,
            account_id=account_id,
            deleted_by=principal.credential_id,
            github_user_id=str(account.github_user_id),
        )
        tomb = {**started.to_dict(), "github_user_id": account.github_user_id}
        tomb["intent_id"] = intent.intent_id
        try:
            created = await jsonstore.create(self._store, deleting_key(account_id), tomb)
        except BaseException:
            # Nothing was told to anyone yet: roll back (drop the intent) or leave
            # it for recovery, which drops it too while no tombstone exists.
            self._intents.release(intent)
            raise
        if not created:
            # A concurrent delete won the tombstone: ours was never needed.
            await self._intents.commit(intent)
            return await self.get(principal, account_id)
        # Tombstone written: the COMMIT POINT. From here the deletion only rolls
        # forward, here or in whichever control plane runs next.
        self._intents.release(intent)
        await self._audit.record(principal.credential_id, "account.delete.start", account_id)
        logger.info("account %s: deletion started by %s", account_id, principal.credential_id)
        await self._ensure_running(account_id)
        return (await self._find(account_id)) or started

    async def get(self, principal: Principal, account_id: str) -> Deletion:
        """The deletion's state; NotFound if the account never existed (or is not
        visible), InvalidState if it exists and is not being deleted."""
        validate_id("account", account_id, "account_id")
        principal.visible_account(account_id, "account", account_id)
        found = await self._find(account_id)
        if found is not None:
            return found
        await self._accounts.get(account_id)  # NotFound when it never existed
        raise InvalidState(f"deletion {account_id}", "the account is not being deleted")

    async def _find(self, account_id: str) -> Deletion | None:
        running = self._running.get(account_id)
        sweep = self._sweeps.get(account_id)
        if running is not None and sweep is not None:
            # Running here: its tombstone is there until it ends, and the live
            # count is here. Answered without the store, so an operator's polls
            # do not compete with the deletion for it.
            return Deletion(
                running.account_id,
                "deleting",
                running.started_at,
                running.deleted_by,
                None,
                max(sweep.deleted, running.deleted_objects),
            )
        # One after the other: the tombstone goes only after deleted/<a>.json is
        # written, so reading them in this order never misses both.
        deleting = await self._read(deleting_key(account_id))
        deleted = await self._read(deleted_key(account_id)) if deleting is None else None
        if deleting is not None:
            d = Deletion.from_dict(deleting, "deleting")
            sweep = self._sweeps.get(account_id)
            done = sweep.deleted if sweep is not None else None
            if done is not None and done > d.deleted_objects:
                d = Deletion(d.account_id, d.state, d.started_at, d.deleted_by, None, done)
            return d
        if deleted is None:
            return None
        return Deletion.from_dict(deleted, "deleted")

    async def _read(self, key: str) -> dict[str, Any] | None:
        try:
            return await jsonstore.read(self._store, key)
        except (NotFound, IntegrityError):
            return None

    # -- running --------------------------------------------------------------------

    async def _ensure_running(self, account_id: str) -> None:
        """Start the deletion's task unless it runs; in the foreground, run it now."""
        if not self._background:
            await self.finish(account_id)
            return
        task = self._tasks.get(account_id)
        if task is None or task.done():
            self._tasks[account_id] = asyncio.create_task(
                self._run_counted(account_id), name=f"delete-{account_id}"
            )

    async def _run_counted(self, account_id: str) -> None:
        set_cause("deletion")  # a task of its own (_ensure_running)
        try:
            await self.finish(account_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # retried by the next recovery tick
            if self.hooks.finished is not None:
                self.hooks.finished("failed")
            logger.warning("account %s: deletion interrupted, will resume: %s", account_id, e)
            return
        if self.hooks.finished is not None:
            self.hooks.finished("ok")

    async def _resolve(self, intent: Intent, age: float) -> bool:
        """Recovery of an ``account.delete`` intent: roll back before the tombstone,
        roll forward after it (see the module doc)."""
        account_id = validate_id("account", intent.fields.get("account_id", ""), "account_id")
        try:
            tomb = await jsonstore.read(self._store, deleting_key(account_id))
        except NotFound:
            return True  # never committed, or finished: the intent alone is left
        if tomb.get("intent_id") != intent.intent_id:
            return True  # another deletion's intent (a lost race): not ours to run
        if self._background:
            await self._ensure_running(account_id)
            return False  # the task commits the intent when it is done
        await self.finish(account_id)
        return True

    async def finish(self, account_id: str) -> None:
        """Run (or resume) the deletion of a tombstoned account to its end. Idempotent."""
        try:
            tomb, etag = await jsonstore.read_versioned(self._store, deleting_key(account_id))
        except NotFound:
            return  # finished already
        started = Deletion.from_dict(tomb, "deleting")
        self._running[account_id] = started
        try:
            await self._finish(account_id, tomb, etag, started)
        finally:
            self._running.pop(account_id, None)

    async def _finish(
        self, account_id: str, tomb: dict[str, Any], etag: str, started: Deletion
    ) -> None:
        close = self.hooks.close_links
        if close is not None:
            closed = close(account_id)
            if closed:
                logger.info("account %s: closed %d live link(s)", account_id, closed)
        # A run again in this process goes on from its sweep's count (it may be
        # ahead of the tombstone: a save that failed); another starts from the
        # tombstone's (controlplane.deletion.sweep: what a crash leaves).
        sweep = self._sweeps.get(account_id)
        if sweep is None:
            sweep = AccountSweep(
                self._store,
                account_id,
                tombstone=tomb,
                etag=etag,
                page_size=self._page_size,
                on_objects=self.hooks.objects,
                backups=self._backups,
            )
            self._sweeps[account_id] = sweep
        # In the log's order (the first two run at once).
        steps = dict.fromkeys(("index", "named segments", "listed objects", "records"), 0.0)

        async def timed(step: str, work: Awaitable[None]) -> None:
            start = time.monotonic()
            await work
            steps[step] = time.monotonic() - start

        machine_ids = await sweep.machine_ids()
        github_user_id = int(tomb.get("github_user_id", 0) or 0)
        # Steps 4 and 5's named segments at once: the segments are no record
        # the index entries are found from (those go with the listing, after).
        await _together(
            timed("index", sweep.index_entries(github_user_id, machine_ids)),
            timed("named segments", sweep.named_segments(machine_ids)),
        )
        await timed("listed objects", sweep.prefix())
        listed = time.monotonic()
        if await sweep.left_over():
            # Written behind the sweep (a last presence write of a closing link):
            # sweep again; a run that still finds some fails and is resumed later.
            await sweep.prefix()
            if await sweep.left_over():
                raise InvalidState(f"delete account {account_id}", "objects keep appearing")
        done = Deletion(
            account_id,
            "deleted",
            started.started_at,
            started.deleted_by,
            self._clock(),
            sweep.deleted,
        )
        await jsonstore.create(self._store, deleted_key(account_id), done.to_dict())
        await self._audit.record(started.deleted_by, "account.delete", account_id)
        await sweep.delete([account_key(account_id)])
        await sweep.delete([deleting_key(account_id)])
        intent_id = str(tomb.get("intent_id", ""))
        if is_valid_id("intent", intent_id):
            await self._intents.commit_id(intent_id)
        self._sweeps.pop(account_id, None)
        steps["records"] = time.monotonic() - listed
        logger.info(
            "account %s: deleted (%d objects; %s)",
            account_id,
            done.deleted_objects,
            ", ".join(f"{step} {seconds:.2f} s" for step, seconds in steps.items()),
        )

    async def wait(self) -> None:
        """Wait for every running deletion task (tests, and a draining daemon)."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel running deletions (they resume at the next start)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


async def _together(*steps: Awaitable[None]) -> None:
    """Run ``steps`` at once; the first to fail cancels the others and is raised."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        for done in asyncio.as_completed(tasks):
            await done
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
