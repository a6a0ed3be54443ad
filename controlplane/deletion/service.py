"""Account deletion: tombstone, close, delete everything under the account, then the account.

One deletion is one ``account.delete`` intent (:mod:`controlplane.integrity.intents`)
that only ever rolls FORWARD once its tombstone is written::

    1. begin the intent (cp/intents/<int>.json names the account)
    2. create accounts/<a>/deleting.json        <- THE COMMIT POINT
    3. close the account's live Connect streams (``account_deleted``)
    4. delete the index entries pointing to the account (machines, tokens,
       GitHub id, listing) and its account-scoped credentials
    5. delete every object under accounts/<a>/ but the tombstone and the
       account record (batched, a bounded number of batches at once): first
       the backup segments its machines' backups name (their names are in
       each backup's names list beside its manifest, so they are deleted
       without listing them: most of an account's objects, and listing costs
       a store as much as deleting or more), then whatever a paginated
       listing still finds (names lists, manifests, records, any segment no
       list names). Step 4 and the named segments run at once: segments are
       not the records step 4 finds its entries from.
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

:class:`AccountDeletion` starts, resumes and reports deletions;
:class:`AccountSweep` does steps 4 and 5 against the store and counts objects.

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
import datetime as dt
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intent, Intents
from controlplane.integrity.records import (
    account_index_key,
    account_key,
    deleted_key,
    deleting_key,
    github_index_key,
    machine_index_key,
    machines_prefix,
    parse_time,
    token_index_key,
    tokens_prefix,
    utc_iso,
)
from controlplane.machines.backups import backups_prefix
from shared.backup_target import MANIFESTS, NAMES_SUFFIX, is_segment_name, segment_key
from shared.errors import AgentsError, IntegrityError, InvalidState, NotFound
from shared.ids import is_valid_id, validate_id
from shared.retry import retrying
from shared.store.authenticated import unverified_payload
from shared.store.base import DELETE_BATCH, ObjectStore, delete_keys
from shared.timestamps import Clock, utc_now

__all__ = [
    "DELETED_PREFIX",
    "AccountDeletion",
    "AccountSweep",
    "Deletion",
    "DeletionHooks",
    "deleted_key",
]

logger = logging.getLogger(__name__)

_KIND: Final = "account.delete"
DELETED_PREFIX: Final = "deleted/"
CREDENTIALS_PREFIX: Final = "credentials/"
#: Delete batches (each up to DELETE_BATCH keys, one S3 request) in flight at once.
CONCURRENT_BATCHES: Final = 4
#: Credential records read at once while looking for the account's own.
CONCURRENT_READS: Final = 8
#: Deleted batches between two saves of the count in the tombstone. A save is
#: three requests (head, get, compare-and-swap put) that compete with the listing
#: on the server; the count only matters to a resumed run, which recounts what
#: it deletes itself (so a crash forgets at most this many batches of it).
PROGRESS_EVERY: Final = 5


@dataclass(frozen=True)
class Deletion:
    """One account deletion, running or finished."""

    account_id: str
    state: str
    """"deleting" or "deleted"."""
    started_at: dt.datetime
    deleted_by: str
    """The credential id that asked for it."""
    finished_at: dt.datetime | None = None
    deleted_objects: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The stored form (tombstone and ``deleted/`` record)."""
        out: dict[str, Any] = {
            "account_id": self.account_id,
            "state": self.state,
            "started_at": utc_iso(self.started_at),
            "deleted_by": self.deleted_by,
            "deleted_objects": self.deleted_objects,
        }
        if self.finished_at is not None:
            out["finished_at"] = utc_iso(self.finished_at)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], state: str) -> Deletion:
        """Inverse of :meth:`to_dict`."""
        finished = data.get("finished_at")
        return cls(
            account_id=validate_id("account", str(data.get("account_id", "")), "account_id"),
            state=state,
            started_at=parse_time(str(data["started_at"])),
            deleted_by=str(data.get("deleted_by", "")),
            finished_at=parse_time(str(finished)) if finished else None,
            deleted_objects=int(data.get("deleted_objects", 0) or 0),
        )


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
            tomb = await jsonstore.read(self._store, deleting_key(account_id))
        except NotFound:
            return  # finished already
        started = Deletion.from_dict(tomb, "deleting")
        self._running[account_id] = started
        try:
            await self._finish(account_id, tomb, started)
        finally:
            self._running.pop(account_id, None)

    async def _finish(self, account_id: str, tomb: dict[str, Any], started: Deletion) -> None:
        close = self.hooks.close_links
        if close is not None:
            closed = close(account_id)
            if closed:
                logger.info("account %s: closed %d live link(s)", account_id, closed)
        sweep = self._sweeps.get(account_id)
        if sweep is None:
            sweep = AccountSweep(
                self._store,
                account_id,
                deleted=started.deleted_objects,
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


class AccountSweep:
    """The store side of one account's deletion (steps 4 and 5), and its object count."""

    def __init__(
        self,
        store: ObjectStore,
        account_id: str,
        *,
        deleted: int = 0,
        page_size: int = DELETE_BATCH,
        on_objects: Callable[[int], None] | None = None,
        backups: ObjectStore | None = None,
    ) -> None:
        self._store = store
        self._backups = backups
        """Where the names lists are read (raw: MAC'd, read without the record wrapper)."""
        self._account_id = validate_id("account", account_id, "account_id")
        self._page_size = page_size
        self._on_objects = on_objects
        self.deleted = deleted
        """Objects deleted under the prefix so far (this run and the saved count)."""

    async def delete(self, keys: list[str], op: str = "delete") -> None:
        """Delete ``keys``, retried with the shared policy on top of the store's own."""
        async for attempt in retrying(f"account.delete.{op}"):
            with attempt:
                await delete_keys(self._store, keys)

    async def _keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        async for attempt in retrying("account.delete.list"):
            with attempt:
                keys = [info.key async for info in self._store.list(prefix)]
        return keys

    async def machine_ids(self) -> list[str]:
        """The account's machines, from their records under its prefix."""
        return [
            name
            for key in await self._keys(machines_prefix(self._account_id))
            if is_valid_id("machine", name := key.rsplit("/", 1)[-1].removesuffix(".json"))
        ]

    async def index_entries(
        self, github_user_id: int, machine_ids: list[str] | None = None
    ) -> None:
        """Step 4: every entry pointing to the account, found from its own records
        (``machine_ids``: the :meth:`machine_ids` the caller listed already)."""
        account_id = self._account_id
        if machine_ids is None:
            machine_ids = await self.machine_ids()
        keys = [machine_index_key(m) for m in machine_ids]
        for key in await self._keys(tokens_prefix(account_id)):
            name = key.rsplit("/", 1)[-1].removesuffix(".json")
            if is_valid_id("token", name):
                keys.append(token_index_key(name))
        keys.extend(await self._credentials_of())
        if github_user_id > 0 and await self._points_to(
            github_index_key(github_user_id), account_id
        ):
            keys.append(github_index_key(github_user_id))
        keys.append(account_index_key(account_id))
        for start in range(0, len(keys), self._page_size):
            await self.delete(keys[start : start + self._page_size], "index")

    async def _points_to(self, key: str, account_id: str) -> bool:
        try:
            return (await jsonstore.read(self._store, key)).get("account_id") == account_id
        except (NotFound, IntegrityError):
            return False

    async def _credentials_of(self) -> list[str]:
        """Admin credentials scoped to the account (they live outside its prefix)."""
        account_id = self._account_id
        keys = await self._keys(CREDENTIALS_PREFIX)
        # One read per credential (they carry the account, no index does): a
        # bounded number at once rather than one round trip after the other.
        limit = asyncio.Semaphore(CONCURRENT_READS)

        async def scoped(key: str) -> bool:
            async with limit:
                return await self._points_to(key, account_id)

        found = await asyncio.gather(*(scoped(k) for k in keys))
        return [k for k, mine in zip(keys, found, strict=True) if mine]

    async def named_segments(self, machine_ids: list[str] | None = None) -> None:
        """Step 5, first: the segments the account's backups name, without listing them.

        A names list is read as the store holds it: a name that is not one is
        skipped, and the listing after this deletes whatever is left anyway.
        Names lists are deleted by that listing, after their segments: a run
        resumed after a crash finds them again (and counts those segments again).
        """
        if self._backups is None:
            return
        if machine_ids is None:
            machine_ids = await self.machine_ids()
        roots = [backups_prefix(self._account_id, m) for m in machine_ids]
        listed = await asyncio.gather(*(self._keys(root + MANIFESTS) for root in roots))
        lists = [
            (root, key)
            for root, keys in zip(roots, listed, strict=True)
            for key in keys
            if key.endswith(NAMES_SUFFIX)
        ]
        limit = asyncio.Semaphore(CONCURRENT_READS)

        async def named_by(root: str, key: str) -> list[str]:
            async with limit:
                return [root + segment_key(n) for n in await self._names_in(key)]

        async def pages() -> AsyncIterator[list[str]]:
            # Deleting starts with the first list read, while the others are read.
            reads = [asyncio.ensure_future(named_by(*rk)) for rk in lists]
            try:
                seen: set[str] = set()
                page: list[str] = []
                for read in asyncio.as_completed(reads):
                    for key in await read:
                        if key not in seen:  # backups share most segments
                            seen.add(key)
                            page.append(key)
                            if len(page) == self._page_size:
                                yield page
                                page = []
                if page:
                    yield page
            finally:
                for read in reads:
                    read.cancel()
                await asyncio.gather(*reads, return_exceptions=True)

        await self._delete_pages(pages())

    async def _names_in(self, key: str) -> list[str]:
        assert self._backups is not None
        data: Any = None
        async for attempt in retrying("account.delete.names"):
            with attempt:
                try:
                    # MAC'd (controlplane.machines.backups); not verified: the names only
                    # pick keys under this account's own prefix, all deleted anyway.
                    data = json.loads(unverified_payload(await self._backups.get(key)))
                except (NotFound, ValueError):
                    return []
        if not isinstance(data, list):
            return []
        return [n for n in data if isinstance(n, str) and is_segment_name(n)]

    async def prefix(self) -> None:
        """Step 5: every object under the account's prefix but the tombstone and record."""
        account_id = self._account_id
        keep = {deleting_key(account_id), account_key(account_id)}

        async def pages() -> AsyncIterator[list[str]]:
            # The store resumes a failed page after its last key (RetryingStore);
            # deleting keys behind the cursor does not disturb the listing.
            async for page in self._store.list_pages(
                f"accounts/{account_id}/", page_size=self._page_size
            ):
                keys = [i.key for i in page if i.key not in keep]
                if keys:
                    yield keys

        await self._delete_pages(pages())

    async def _delete_pages(self, pages: AsyncIterator[list[str]]) -> None:
        """Delete each page of keys as one batch, a bounded number at once."""
        limit = asyncio.Semaphore(CONCURRENT_BATCHES)
        # Every batch is awaited (its error included) before the account may go.
        started: list[asyncio.Task[None]] = []
        done = 0
        listed = False

        async def batch(keys: list[str]) -> None:
            nonlocal done
            try:
                await self.delete(keys, "objects")
            finally:
                limit.release()
            self.deleted += len(keys)
            done += 1
            if self._on_objects is not None:
                self._on_objects(len(keys))
            last = listed and done == len(started)
            if done % PROGRESS_EVERY == 0 and not last:
                # Progress survives a restart (give or take the batches since).
                # Not after the step's last batch: the step ends there, and the
                # save would only delay the next one.
                await self._save_progress()

        try:
            async for keys in pages:
                await limit.acquire()
                started.append(asyncio.create_task(batch(keys)))
                # Surface a failed batch now rather than after listing everything.
                for t in started:
                    if t.done():
                        t.result()
            listed = True
            await asyncio.gather(*started)
        except BaseException:
            for t in started:
                t.cancel()
            await asyncio.gather(*started, return_exceptions=True)
            raise

    async def left_over(self) -> bool:
        """Whether anything but the tombstone and the record is still under the prefix."""
        account_id = self._account_id
        keep = {deleting_key(account_id), account_key(account_id)}
        async for page in self._store.list_pages(f"accounts/{account_id}/", page_size=3):
            if any(i.key not in keep for i in page):
                return True
        return False

    async def _save_progress(self) -> None:
        account_id, count = self._account_id, self.deleted

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if int(d.get("deleted_objects", 0) or 0) >= count:
                return None
            return {**d, "deleted_objects": count}

        try:
            await jsonstore.update(self._store, deleting_key(account_id), change)
        except AgentsError as e:
            logger.debug("account %s: progress not saved: %s", account_id, e)
