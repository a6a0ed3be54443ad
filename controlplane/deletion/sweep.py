"""Steps 4 and 5 of an account deletion: the store side, batched, and its object count.

:class:`AccountSweep` deletes, for one tombstoned account (the order of the
steps and the commit point are :mod:`controlplane.deletion.service`'s):

- step 4, the index entries pointing to the account (machines, tokens, GitHub
  id, listing) and its account-scoped credentials, found from the account's
  own records (so the caller runs it before step 5 deletes those records);
- step 5, every object under ``accounts/<a>/`` but the tombstone and the
  account record, in batches (each up to ``DELETE_BATCH`` keys, a bounded
  number in flight at once): first the backup segments its machines' backups
  name (their names are in each backup's names list beside its manifest, so
  they are deleted without listing them: most of an account's objects, and
  listing costs a store as much as deleting or more), then whatever a
  paginated listing still finds (names lists, manifests, records, any segment
  no list names).

Crash argument: every step is idempotent (deleting a missing key succeeds), so
a resumed run repeats them all. Names lists are deleted by the listing, after
the segments they name: a run resumed after a crash finds them again. Every
batch is awaited, its error included, before a step returns, so the account
record never goes while a batch may still fail.

The count of deleted objects survives a crash: the tombstone keeps it
(:class:`~controlplane.deletion.tombstone.SweepProgress`), written by one
compare-and-swap put at a time, each put the commit point of what it counts:

- a batch the listing found is counted, and the count saved with the batch's
  key range, BEFORE its delete: killed before that put, the batch is neither
  counted nor deleted (the next run lists and counts it); killed after it, the
  next run has it counted and deletes what is left in the range uncounted;
- the named segments are counted by one run from its start to its end (a
  resumed run finds every name again, deleted or not), saved once at the end
  with ``segments_done``: killed before that put, the next run counts them
  all again from the count before them; killed after it, it skips the step.

So a resumed deletion reports every object deleted, by whichever run. The
cost: one PUT per batch of the listing (the tombstone's etag is kept, so no
read before it) and one at the end of the named segments.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from controlplane.deletion.tombstone import SweepProgress
from controlplane.integrity import jsonstore
from controlplane.integrity.records import (
    account_index_key,
    account_key,
    deleting_key,
    encode,
    github_index_key,
    machine_index_key,
    machines_prefix,
    token_index_key,
    tokens_prefix,
)
from controlplane.machines.backups import backups_prefix
from shared.backup_target import MANIFESTS, NAMES_SUFFIX, is_segment_name, segment_key
from shared.errors import IntegrityError, InvalidState, NotFound, PreconditionFailed
from shared.ids import is_valid_id, validate_id
from shared.retry import retrying
from shared.store.authenticated import unverified_payload
from shared.store.base import DELETE_BATCH, ObjectStore, delete_keys

__all__ = [
    "CONCURRENT_BATCHES",
    "CONCURRENT_READS",
    "CREDENTIALS_PREFIX",
    "AccountSweep",
]

logger = logging.getLogger(__name__)

CREDENTIALS_PREFIX: Final = "credentials/"
#: Delete batches (each up to DELETE_BATCH keys, one S3 request) in flight at once.
CONCURRENT_BATCHES: Final = 4
#: Credential records read at once while looking for the account's own.
CONCURRENT_READS: Final = 8


class AccountSweep:
    """The store side of one account's deletion (steps 4 and 5), and its object count."""

    def __init__(
        self,
        store: ObjectStore,
        account_id: str,
        *,
        tombstone: dict[str, Any] | None = None,
        etag: str | None = None,
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
        self._tomb = tombstone
        """The tombstone as last read or written (None: the progress is not saved)."""
        self._etag = etag
        """Its etag then (None: read it before the next save)."""
        self.progress = SweepProgress.from_tombstone(tombstone or {})
        """The count and what was counted, as saved (and about to be)."""
        self._before_segments = self.progress.deleted
        """The count the named segments add to (a run of that step starts from it)."""
        self._saving = asyncio.Lock()

    @property
    def deleted(self) -> int:
        """Objects deleted under the prefix so far, by this run and the ones before."""
        return self.progress.deleted

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
        resumed after a crash finds them again, and counts them from the count
        before them (see the module doc); once done, the step is skipped.
        """
        if self._backups is None or self.progress.segments_done:
            return
        if machine_ids is None:
            machine_ids = await self.machine_ids()
        # Every name is found again, deleted or not: this run counts them all.
        self.progress.deleted = self._before_segments
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

        await self._delete_pages(pages(), count_first=False)
        self.progress.segments_done = True
        if self.progress.deleted > self._before_segments:
            try:
                await self._save()
            except BaseException:
                self.progress.segments_done = False  # a run again counts them again
                raise

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

        await self._delete_pages(pages(), count_first=True)
        # Every key listed is gone: the ranges an earlier run counted hold nothing more.
        self.progress.counted.clear()

    async def _delete_pages(self, pages: AsyncIterator[list[str]], *, count_first: bool) -> None:
        """Delete each page of keys as one batch, a bounded number at once; with
        ``count_first`` (pages of a listing, in key order), count each batch and
        save the count before its delete (see the module doc)."""
        limit = asyncio.Semaphore(CONCURRENT_BATCHES)
        # Every batch is awaited (its error included) before the account may go.
        started: list[asyncio.Task[None]] = []

        async def batch(keys: list[str]) -> None:
            try:
                fresh = len(keys)
                span: tuple[str, str] | None = None
                if count_first:
                    fresh = sum(1 for k in keys if not self.progress.was_counted(k))
                    if fresh:
                        span = (keys[0], keys[-1])
                        async with self._saving:
                            self.progress.deleted += fresh
                            self.progress.counted.append(span)
                            # THE COMMIT POINT of this batch's count. Failed (or
                            # lost), the count and range stay here and go with the
                            # next save; the keys are deleted only after it.
                            await self._save()
                await self.delete(keys, "objects")
            finally:
                limit.release()
            if span is not None:
                self.progress.counted.remove(span)  # deleted: nothing left to skip
            elif not count_first:
                self.progress.deleted += fresh
            if self._on_objects is not None and fresh:
                self._on_objects(fresh)

        try:
            async for keys in pages:
                await limit.acquire()
                started.append(asyncio.create_task(batch(keys)))
                # Surface a failed batch now rather than after listing everything.
                for t in started:
                    if t.done():
                        t.result()
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

    async def _save(self) -> None:
        """Write :attr:`progress` into the tombstone: one compare-and-swap put
        against the etag of our last write (no read first), read again only when
        someone else wrote it since. Nothing without a tombstone (fsck, tests)."""
        if self._tomb is None:
            return
        key = deleting_key(self._account_id)
        async for attempt in retrying("account.delete.progress"):
            with attempt:
                for _ in range(jsonstore.CAS_ATTEMPTS):
                    if self._etag is None:
                        self._tomb, self._etag = await jsonstore.read_versioned(self._store, key)
                    data = encode(self.progress.to_tombstone(self._tomb))
                    try:
                        self._etag = await self._store.put(key, data, if_match=self._etag)
                        return
                    except PreconditionFailed:
                        self._etag = None
                raise InvalidState(
                    key, f"too much contention ({jsonstore.CAS_ATTEMPTS} lost updates)"
                )
