"""A stand-alone machine's backups in an S3-compatible bucket: opened on first use, its owner named.

``backup_target = "s3://bucket/prefix"`` keeps the machine's sealed backups
under the prefix in :class:`~shared.backup_target.StoreTarget`'s layout, over
the store :func:`~shared.store.url.open_store` opens (the one place that
chooses a backend), beside ``machine.json`` (:data:`_OWNER_KEY`), which names
the machine whose backups they are, as a backup folder's does: manifests are
sealed with that id, so a restore on another machine (``--from s3://...``)
needs it. The bucket sees only sealed objects; the credentials stay in the
daemon's memory (``machine.config``), never in an object, a log line or a
message (botocore's loggers are capped at WARNING, shared.logs).

:class:`BucketTarget` opens the store when first used: :func:`open_bucket_target`
opens it at start and turns a bucket that refuses us (missing, credentials
refused, no conditional writes, another machine's prefix) into a ConfigError
naming ``backup_target``; one that does not answer is only logged, so that a
machine started offline still serves its agents, and each backup tries again
(failing with a message naming the target). Every store fault of a backup
names the target.

Crash argument: ``machine.json`` is written once, create-only, after the
prefix was found empty (a killed store probe's ``_probe/`` object aside) and
before any backup: a start killed before it leaves the prefix as it was (the
next start writes it), one killed after has written it whole (one PutObject).
Two machines started on one empty prefix at once: the create-only write lets
one win; the other re-reads it and refuses. A prefix naming another machine is
never written to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry

from shared.backup_target import BackupTarget, ManifestInfo, PruneResult, StoreTarget
from shared.errors import (
    ConfigError,
    IntegrityError,
    InvalidArgument,
    InvalidId,
    InvalidState,
    NotFound,
    PreconditionFailed,
    StoreError,
    TransientError,
)
from shared.ids import validate_id
from shared.store.base import ObjectStore
from shared.store.url import StoreOptions, open_store

__all__ = ["BucketTarget", "NotOurs", "open_bucket_from", "open_bucket_target"]

logger = logging.getLogger(__name__)

#: Under the prefix: whose backups it holds (as in a backup folder).
_OWNER_KEY: Final = "machine.json"
#: What the store's probe writes (and deletes) under the prefix: not another's data.
_PROBE: Final = "_probe/"


class NotOurs(InvalidState):
    """The prefix holds something other than this machine's backups (FAILED_PRECONDITION
    when a backup finds it so: the bucket answered only after the start)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(where, reason)


@contextlib.contextmanager
def _named(where: str) -> Iterator[None]:
    """A store fault raised again naming the backup target (same class: its
    status code stands); NotFound and PreconditionFailed pass as they are (the
    target's contract speaks them)."""
    try:
        yield
    except (StoreError, TransientError) as e:
        raise type(e)(f"backup target {where}: {e}") from None


class BucketTarget:
    """A :class:`~shared.backup_target.BackupTarget` in a bucket, opened on first use.

    ``open`` opens the store (``open_store``: the probe runs), checks the owner
    record and writes it on an empty prefix; a failed open is tried again at the
    next use. ``owner``: the machine whose backups are expected (``None``: any
    one's, read from ``machine.json``, as ``--from`` does; nothing is written).
    """

    replaces_segments = True

    def __init__(
        self,
        url: str,
        options: StoreOptions,
        *,
        where: str,
        owner: str | None,
        registry: CollectorRegistry | None = None,
        after_delete: Callable[[], None] | None = None,
    ) -> None:
        self._url = url
        self._options = options
        self.where = where
        self._owner = owner
        self._registry = registry
        self._after_delete = after_delete
        self._lock = asyncio.Lock()
        self._store: ObjectStore | None = None
        self._target: StoreTarget | None = None
        self.machine_id = owner or ""

    async def open(self) -> StoreTarget:
        """The open target (opened now if it is not): ConfigError for another
        machine's prefix or one holding other objects; store faults name the target."""
        async with self._lock:
            if self._target is not None:
                return self._target
            with _named(self.where):
                try:
                    store = await open_store(
                        self._url,
                        options=self._options,
                        namespace="agents_machine",
                        registry=self._registry,
                    )
                except TransientError as e:
                    raise type(e)(f"the server does not answer ({e})") from None
                try:
                    self.machine_id = await self._check_owner(store)
                except BaseException:
                    await store.close()
                    raise
            self._store = store
            self._target = StoreTarget(store, after_delete=self._after_delete)
            return self._target

    async def close(self) -> None:
        """Close the store (opened again on the next use)."""
        async with self._lock:
            store, self._store, self._target = self._store, None, None
            if store is not None:
                await store.close()

    async def _check_owner(self, store: ObjectStore) -> str:
        found = await _read_owner(store, self.where)
        if found is not None:
            if self._owner is not None and found != self._owner:
                raise NotOurs(
                    self.where,
                    f"holds machine {found}'s backups, and this machine is {self._owner};"
                    " give this machine a prefix of its own (or, on a fresh box replacing"
                    " that lost machine, `agents-machine backup take-over --from` it first)",
                )
            return found
        if self._owner is None:
            raise NotOurs(self.where, f"not a backup target (no {_OWNER_KEY})")
        async for info in store.list(""):
            if not info.key.startswith(_PROBE):
                raise NotOurs(
                    self.where,
                    f"holds other objects and no {_OWNER_KEY}; give this machine an empty"
                    " prefix of its own",
                )
        record = json.dumps({"machine_id": self._owner}).encode()
        try:
            await store.put(_OWNER_KEY, record, if_none_match=True)
        except PreconditionFailed:
            # Another machine started on this prefix at the same moment: whose is it?
            return await self._check_owner(store)
        logger.info("backup target %s: named machine %s as its owner", self.where, self._owner)
        return self._owner

    # -- BackupTarget, each call on the open target, its faults naming it ------

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        target = await self.open()
        with _named(self.where):
            return await target.have_segments(names)

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        target = await self.open()
        with _named(self.where):
            await target.put_segment(name, data, replace=replace)

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        target = await self.open()
        with _named(self.where):
            await target.put_manifest(backup_id, blob, names)

    async def list_manifests(self) -> list[ManifestInfo]:
        target = await self.open()
        with _named(self.where):
            return await target.list_manifests()

    async def get_manifest(self, backup_id: str) -> bytes:
        target = await self.open()
        with _named(self.where):
            return await target.get_manifest(backup_id)

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        target = await self.open()
        with _named(self.where):
            async for chunk in target.get_segment(name):
                yield chunk

    async def prune(self, keep: int) -> PruneResult:
        target = await self.open()
        with _named(self.where):
            return await target.prune(keep)


async def _read_owner(store: ObjectStore, where: str) -> str | None:
    """The machine ``machine.json`` names, ``None`` if there is none."""
    try:
        record = json.loads(await store.get(_OWNER_KEY))
        return validate_id("machine", record["machine_id"], "machine_id")
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError, InvalidId, IntegrityError):
        raise NotOurs(where, f"{_OWNER_KEY} is damaged") from None


async def open_bucket_target(
    url: str,
    options: StoreOptions,
    *,
    where: str,
    machine_id: str,
    registry: CollectorRegistry | None = None,
    after_delete: Callable[[], None] | None = None,
) -> BucketTarget:
    """The machine's bucket target, opened now if the bucket answers.

    ConfigError naming ``backup_target`` when the bucket refuses us (it does not
    exist, the credentials are refused, it lacks conditional writes, the prefix
    is another machine's or holds other objects); a bucket that does not answer
    is logged and opened again at the first backup.
    """
    target = BucketTarget(
        url, options, where=where, owner=machine_id, registry=registry, after_delete=after_delete
    )
    try:
        await target.open()
    except TransientError as e:
        logger.warning("%s; the daemon starts, and each backup tries it again", e)
    except NotOurs as e:
        raise ConfigError("backup_target", e.message) from None
    except ConfigError as e:  # the store's own (Object Lock is not asked for here)
        raise ConfigError("backup_target", f"{where}: {e.reason}") from None
    except StoreError as e:
        raise ConfigError("backup_target", str(e)) from None
    return target


@contextlib.asynccontextmanager
async def open_bucket_from(
    url: str, options: StoreOptions, *, where: str, registry: CollectorRegistry | None = None
) -> AsyncIterator[tuple[BackupTarget, str]]:
    """The bucket prefix ``url`` (``--from s3://...``: a lost machine's backups) as
    a target, and the machine whose backups it holds (its ``machine.json`` says
    whose); closed on exit. InvalidArgument for a prefix without backups."""
    target = BucketTarget(url, options, where=where, owner=None, registry=registry)
    try:
        try:
            await target.open()
        except NotOurs as e:
            raise InvalidArgument("--from", e.message) from None
        except InvalidArgument as e:  # the URL (open_store names it "store")
            raise InvalidArgument("--from", e.reason) from None
        yield target, target.machine_id
    finally:
        await target.close()
