"""``agents-control store migrate``: move a control plane to another store.

A folder store to S3, S3 to a folder (or bucket to bucket): every object of the
old store is copied to the new one, read back and checked, and only then does
the home switch to the new store. The old store is left as it was.

Steps, in order:

1. **Refusals, before anything is written.** The home is locked for the whole
   run (:func:`controlplane.recovery.fencing.lock_home`, the lock ``serve``
   holds: no ``serve`` of this home runs during a migration, nor starts). The old
   store must be this deployment's (``cp/deployment.json`` verifies under the
   home's key) and held by this home: ``cp/epoch.json`` naming another home (a
   restore elsewhere took it over) or a home marked superseded is refused, as
   ``serve`` would refuse to start. The new store must be empty, or hold only
   keys of the old store left by an earlier run of this same migration (the
   progress file below names it); one holding anything else (another
   deployment, another copy of this one) is refused. A store setting given by a
   flag or the environment (``AGENTS_CONTROL_STORE*``) is refused: config.toml
   is what switches, and the override would keep naming the old store.
2. **The intent.** ``<home>/store-migrate.json`` (:data:`PROGRESS_FILE`, written
   atomically by :func:`shared.atomic.write_atomic`) names the old and new store
   and, per key, what was copied: the source's etag, size and SHA-256, whether
   its MAC verified, the new store's etag, and whether it was read back. It is
   written before the first object is copied, then every
   :data:`SAVE_EVERY_OBJECTS` objects (a tenth of the copied ones, if more) or
   :data:`SAVE_EVERY_SECONDS`, and when a run stops with an error.
3. **Copy.** Every key of the old store (bar the S3 probe's ``_probe/``), bytes
   as they are (MAC header included; the stores record nothing else about an
   object). A rerun skips a key whose source etag and new-store etag are the
   ones recorded; anything else is copied again (an unconditional put is
   idempotent). Keys the new store holds that an earlier run copied and the old
   store no longer has are deleted.
4. **Verify.** Every object not yet read back is read from the new store: its
   size and SHA-256 must be the source's, and an object whose MAC verified in
   the old store must verify at its key in the new one. A mismatch drops the
   key from the progress file and fails the run (a rerun copies it again).
   An object whose MAC did not verify in the old store (``fsck`` reports those)
   is copied as it is and counted, not fixed.
5. **Nothing moved meanwhile.** Both stores are listed again: the old store's
   keys and etags must be the ones copied and the new store's the ones
   written. Otherwise someone wrote to one of them; the run fails, and a rerun
   copies what changed.
6. **COMMIT POINT: config.toml** names the new store (``store_url``,
   ``store_endpoint``, ``store_region``, ``store_object_lock``), in one atomic
   write. Then the progress file is removed; a crash between the two leaves a
   progress file naming the store the home already uses, which the next run
   removes (it reports the migration as done).

A crash anywhere before 6 leaves the home on the old store, intact; the new
store holds a partial copy that a rerun completes. Nothing in the deployment
names its store, so the fencing epoch, the key bundle and ``restore`` work
from the new store as they did from the old (``serve`` takes the next epoch
there and re-seals the bundle's copy of config.toml).

S3 credentials come from the configuration (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``), for both stores; a ``--to`` URL carrying
``access_key``/``secret_key`` is refused (it would be written to config.toml).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.opening import store_options
from controlplane.integrity.trusted import DeploymentGuard, record_mac_key
from controlplane.recovery.bootstrap import toml_dumps
from controlplane.recovery.fencing import EPOCH_KEY, Fence, lock_home, read_home_id
from controlplane.recovery.keyshapes import shape_of
from shared.atomic import write_atomic
from shared.config import load_toml
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    InvalidState,
    NotFound,
    StoreFenced,
    StoreUntrusted,
)
from shared.store import S3Config, StoreOptions, describe_store, open_store, parse_store_url
from shared.store.authenticated import (
    MAC_HEADER,
    MAX_AUTHENTICATED_BYTES,
    AuthenticatedStore,
    unseal,
)
from shared.store.base import ObjectInfo, ObjectStore, delete_keys

__all__ = [
    "PROGRESS_FILE",
    "MigrateResult",
    "StoreTarget",
    "crash_after",
    "migrate_store",
]

logger = logging.getLogger(__name__)

#: The migration's intent and progress, in the home.
PROGRESS_FILE: Final = "store-migrate.json"
_VERSION: Final = 1
#: The progress file is rewritten once this many objects were copied since the
#: last write, or a tenth of those it holds if more (so the bytes written stay
#: a small multiple of its final size, and a crash costs at most that many
#: copies again), or after this long.
SAVE_EVERY_OBJECTS: Final = 8
SAVE_EVERY_SECONDS: Final = 30.0
#: Objects copied or read back at once.
CONCURRENCY: Final = 8
#: Objects up to this size are read whole (a MAC'd record is at most
#: MAX_AUTHENTICATED_BYTES plus its header line); larger ones are streamed.
_WHOLE_LIMIT: Final = MAX_AUTHENTICATED_BYTES + 256

Progress = Callable[[str, int, int], None]
"""``(stage, done, total)``: ``copying`` or ``verifying``."""


@dataclass(frozen=True)
class StoreTarget:
    """The store to move to, as ``--to`` and its flags name it."""

    url: str
    """``s3://bucket/prefix`` (``?endpoint=…&region=…`` allowed) or a folder path."""
    endpoint: str | None = None
    """S3 endpoint (``--store-endpoint``); wins over the URL's ``endpoint``."""
    region: str | None = None
    """S3 region (``--store-region``); wins over the URL's ``region``."""
    object_lock: bool = False
    """The bucket has S3 Object Lock with a default retention (``--store-object-lock``)."""


@dataclass(frozen=True)
class MigrateResult:
    """What a migration did."""

    source: str
    """The old store (never a credential)."""
    target: str
    """The new store, which the home now uses."""
    objects: int
    bytes: int
    copied: int
    """Objects copied by this run (the rest were copied and checked by an earlier one)."""
    seconds: float
    unverified_macs: int = 0
    """Objects whose MAC did not verify in the old store, copied as they were."""
    already: bool = False
    """The home was already on the target (a run killed after its commit point)."""


@dataclass
class _Entry:
    """One key's copy (see the module doc, step 2)."""

    etag: str
    size: int
    sha256: str
    mac: bool
    """Its MAC verified in the old store (so it must in the new one)."""
    copied: str
    verified: bool = False
    bad_mac: bool = False
    """It carries a MAC header that did not verify in the old store (copied as is)."""


@dataclass
class _Progress:
    source: str
    target: dict[str, Any]
    started_at: float
    objects: dict[str, _Entry] = field(default_factory=dict)

    def to_json(self) -> bytes:
        data = {
            "version": _VERSION,
            "source": self.source,
            "target": self.target,
            "started_at": self.started_at,
            "objects": {k: dataclasses.asdict(v) for k, v in sorted(self.objects.items())},
        }
        return json.dumps(data, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def load(cls, path: Path) -> _Progress | None:
        try:
            data = json.loads(path.read_bytes())
            if data.get("version") != _VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            return cls(
                str(data["source"]),
                dict(data["target"]),
                float(data["started_at"]),
                {str(k): _Entry(**v) for k, v in data["objects"].items()},
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise InvalidState(
                f"store migrate {path}",
                f"unreadable ({e}); remove it to start the migration over "
                "(and empty the new store)",
            ) from None


def _stores_own(key: str) -> bool:
    """An S3 probe's object (shared.store.s3, keyshapes' ``probe``): never copied."""
    # Most keys start with a letter: no need to try every shape on them.
    shape = shape_of(key) if key.startswith("_") else None
    return shape is not None and shape.name == "probe"


def _keys(infos: Iterable[ObjectInfo]) -> dict[str, ObjectInfo]:
    return {i.key: i for i in infos if not _stores_own(i.key)}


async def _listing(store: ObjectStore) -> dict[str, ObjectInfo]:
    return _keys([info async for info in store.list()])


def _target_options(cfg: ControlConfig, target: StoreTarget) -> StoreOptions:
    # The same credentials as the old store: they come from the configuration
    # (the environment), never from a file.
    return StoreOptions(
        access_key=cfg.store_access_key,
        secret_key=cfg.store_secret_key,
        region=target.region,
        endpoint_url=target.endpoint,
        retry_initial=cfg.store_retry_seconds,
        object_lock=target.object_lock,
    )


def _check_target_url(url: str) -> None:
    if "://" in url and urlsplit(url).scheme.lower() == "s3":
        query = parse_qs(urlsplit(url).query, keep_blank_values=True)
        if "access_key" in query or "secret_key" in query:
            raise InvalidArgument(
                "store migrate --to",
                "the URL carries a credential, which would be written to config.toml: "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead",
            )


def _overlaps(a: Path | S3Config, b: Path | S3Config) -> bool:
    """Whether one store holds the other's keys (the same store, or one inside the other)."""
    if isinstance(a, Path) and isinstance(b, Path):
        ra, rb = a.resolve(), b.resolve()
        return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)
    if isinstance(a, S3Config) and isinstance(b, S3Config):
        same_bucket = a.bucket == b.bucket and a.endpoint_url == b.endpoint_url
        return same_bucket and (a.prefix.startswith(b.prefix) or b.prefix.startswith(a.prefix))
    return False


def _target_record(url: str, parsed: Path | S3Config) -> dict[str, Any]:
    """What config.toml (and the progress file) say of the new store: no secret."""
    if isinstance(parsed, Path):
        return {"store_url": str(parsed)}
    record: dict[str, Any] = {"store_url": url, "store_region": parsed.region}
    if parsed.endpoint_url:
        record["store_endpoint"] = parsed.endpoint_url
    if parsed.object_lock:
        record["store_object_lock"] = True
    return record


def _switch_config(cfg: ControlConfig, record: dict[str, Any]) -> None:
    """COMMIT POINT of the migration: config.toml names the new store (one atomic write)."""
    values = load_toml(cfg.config_path)
    for name in ("store_url", "store_endpoint", "store_object_lock"):
        values.pop(name, None)
    values.update(record)
    write_atomic(cfg.config_path, toml_dumps(values).encode(), mode=0o600)


async def _check_source(cfg: ControlConfig, authed: ObjectStore, where: str) -> None:
    """InvalidState unless the old store is this deployment's, held by this home."""
    keys = load_home_keys(cfg.home)
    guard = DeploymentGuard(authed, keys.ca_hash, where)
    await guard.verify()
    if guard.problem is not None:
        raise InvalidState("store migrate", guard.problem.message)
    home_id = read_home_id(cfg.home)
    if home_id is None:
        try:
            await authed.head(EPOCH_KEY)
        except NotFound:
            return
        raise InvalidState(
            "store migrate",
            f"another control plane holds the old store ({EPOCH_KEY} names another home, "
            "and this home has no id: it is stale)",
        )
    try:
        await Fence(authed, home_id, where, home=cfg.home).hold_current()
    except StoreFenced as e:
        raise InvalidState(
            "store migrate", f"another control plane holds the old store: {e.message}"
        ) from None
    except StoreUntrusted as e:
        raise InvalidState("store migrate", e.message) from None


async def _each(
    keys: list[str], work: Callable[[str], Awaitable[None]], concurrency: int = CONCURRENCY
) -> None:
    """``work(key)`` for every key, ``concurrency`` at once; the first error stops the rest."""
    it = iter(keys)

    async def worker() -> None:
        for key in it:
            await work(key)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(keys))):
                group.create_task(worker())
    except BaseExceptionGroup as eg:
        # One line for the CLI: the first failure, as it was raised.
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


class _Migration:
    """One run over open stores (see the module doc for the steps)."""

    def __init__(
        self,
        cfg: ControlConfig,
        source: ObjectStore,
        target: ObjectStore,
        progress: _Progress,
        mac_key: bytes,
        on_progress: Progress | None,
        after_copy: Callable[[], None] | None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.target = target
        self.progress = progress
        self.mac_key = mac_key
        self.on_progress = on_progress or (lambda stage, done, total: None)
        self.after_copy = after_copy
        self.path = cfg.home / PROGRESS_FILE
        self._saved_at = time.monotonic()
        self._unsaved = 0
        self.copied = 0

    def save(self) -> None:
        write_atomic(self.path, self.progress.to_json(), mode=0o600)
        self._saved_at = time.monotonic()
        self._unsaved = 0

    def _maybe_save(self) -> None:
        self._unsaved += 1
        due = time.monotonic() - self._saved_at >= SAVE_EVERY_SECONDS
        batch = max(SAVE_EVERY_OBJECTS, len(self.progress.objects) // 10)
        if self._unsaved >= batch or due:
            self.save()

    def _mac(self, key: str, data: bytes) -> tuple[bool, bool]:
        """(its MAC verifies, it carries one that does not)."""
        if not data.startswith(MAC_HEADER):
            return False, False
        try:
            unseal(self.mac_key, key, data)
        except IntegrityError:
            return False, True
        return True, False

    async def _copy_one(self, info: ObjectInfo) -> None:
        key = info.key
        if info.size <= _WHOLE_LIMIT:
            data = await self.source.get(key)
            etag = await self.target.put(key, data)
            mac, bad_mac = self._mac(key, data)
            entry = _Entry(
                info.etag, len(data), hashlib.sha256(data).hexdigest(), mac, etag, bad_mac=bad_mac
            )
        else:
            digest = hashlib.sha256()
            size = 0

            async def chunks() -> AsyncIterator[bytes]:
                nonlocal size
                async for chunk in self.source.get_stream(key):
                    digest.update(chunk)
                    size += len(chunk)
                    yield chunk

            etag = await self.target.put(key, chunks())
            entry = _Entry(info.etag, size, digest.hexdigest(), False, etag)
        self.progress.objects[key] = entry
        self.copied += 1
        self._maybe_save()
        if self.after_copy is not None:
            self.after_copy()

    async def copy(self, source: dict[str, ObjectInfo], target: dict[str, ObjectInfo]) -> None:
        objects = self.progress.objects
        # What the new store holds must still be what was recorded, else copy again.
        for key in list(objects):
            entry, there = objects[key], target.get(key)
            src = source.get(key)
            if src is None or src.etag != entry.etag or there is None or there.etag != entry.copied:
                del objects[key]
        # Our own copies of keys the old store no longer has.
        gone = sorted(k for k in target if k not in source)
        await delete_keys(self.target, gone)
        todo = [k for k in sorted(source) if k not in objects]
        total, done = len(source), len(source) - len(todo)
        self.on_progress("copying", done, total)

        async def one(key: str) -> None:
            nonlocal done
            await self._copy_one(source[key])
            done += 1
            self.on_progress("copying", done, total)

        try:
            await _each(todo, one)
        finally:
            # Also when stopped by an error or Ctrl-C: what was copied stays copied.
            self.save()

    async def _read_back(self, key: str, entry: _Entry) -> str | None:
        """Why the new store's copy of ``key`` is not the old one's (None: it is)."""
        try:
            if entry.size <= _WHOLE_LIMIT:
                data = await self.target.get(key)
                size, sha = len(data), hashlib.sha256(data).hexdigest()
            else:
                digest, size = hashlib.sha256(), 0
                async for chunk in self.target.get_stream(key):
                    digest.update(chunk)
                    size += len(chunk)
                sha, data = digest.hexdigest(), b""
        except NotFound:
            return "missing"
        except IntegrityError as e:
            return e.reason
        if size != entry.size or sha != entry.sha256:
            return "its bytes differ from the old store's"
        if entry.mac:
            try:
                unseal(self.mac_key, key, data)
            except IntegrityError as e:
                return e.reason
        return None

    async def verify(self) -> None:
        objects = self.progress.objects
        todo = sorted(k for k, e in objects.items() if not e.verified)
        total, done = len(objects), len(objects) - len(todo)
        failed: dict[str, str] = {}
        self.on_progress("verifying", done, total)

        async def one(key: str) -> None:
            nonlocal done
            problem = await self._read_back(key, objects[key])
            if problem is None:
                objects[key].verified = True
            else:
                failed[key] = problem
            done += 1
            self.on_progress("verifying", done, total)

        try:
            await _each(todo, one)
        finally:
            for key in failed:
                objects.pop(key, None)  # copied again by the next run
            self.save()
        if failed:
            first = min(failed)
            raise IntegrityError(
                "store migrate",
                f"{len(failed)} object(s) read back from the new store do not match the old "
                f"store's (first: {first}: {failed[first]}); the home still uses the old "
                "store; run the migration again to copy them again",
            )

    async def check_unchanged(self) -> None:
        """InvalidState when either store changed since its objects were copied."""
        objects = self.progress.objects
        source = await _listing(self.source)
        for key in sorted(set(source) | set(objects)):
            entry, info = objects.get(key), source.get(key)
            if entry is None or info is None or info.etag != entry.etag:
                raise InvalidState(
                    "store migrate",
                    f"the old store changed during the migration ({key}): is another "
                    "control plane writing to it? Run the migration again once it is stopped",
                )
        target = await _listing(self.target)
        for key in sorted(set(target) | set(objects)):
            entry, info = objects.get(key), target.get(key)
            if entry is None or info is None or info.etag != entry.copied:
                raise InvalidState(
                    "store migrate",
                    f"the new store changed during the migration ({key}): is something else "
                    "writing to it? Run the migration again",
                )


async def migrate_store(
    cfg: ControlConfig,
    target: StoreTarget,
    *,
    on_progress: Progress | None = None,
    after_copy: Callable[[], None] | None = None,
) -> MigrateResult:
    """Move the home's deployment to ``target`` and switch the home to it (module doc).

    InvalidArgument for a bad ``--to``; InvalidState for a refusal (the home is
    served, another control plane holds the old store, the new store is not
    empty, …), having written nothing; IntegrityError when an object read back
    does not match (the home stays on the old store). ``after_copy`` is called
    after each object copied (a test's crash hook).
    """
    if cfg.store_overrides:
        raise InvalidState(
            "store migrate",
            f"the store is set by {', '.join(cfg.store_overrides)}, which would keep "
            "overriding config.toml after the switch: unset it and run again (the home's "
            "config.toml names the store to move from)",
        )
    if not cfg.config_path.is_file():
        raise InvalidState(
            "store migrate", f"{cfg.home} is not a control plane's home (no config.toml)"
        )
    if not cfg.store_url:
        raise InvalidState("store migrate", f"{cfg.config_path} names no store")
    fd = lock_home(cfg.home, "store migrate")
    try:
        return await _migrate(cfg, target, on_progress, after_copy)
    finally:
        os.close(fd)


async def _migrate(
    cfg: ControlConfig,
    target: StoreTarget,
    on_progress: Progress | None,
    after_copy: Callable[[], None] | None,
) -> MigrateResult:
    started = time.monotonic()
    _check_target_url(target.url)
    options = _target_options(cfg, target)
    to = parse_store_url(target.url, options)
    if isinstance(to, Path) and target.object_lock:
        raise InvalidArgument("store_object_lock", f"{to} is a folder: Object Lock is S3's")
    source_options = store_options(cfg)
    source_where = describe_store(cfg.store_url, source_options)
    target_where = describe_store(target.url, options)
    record = _target_record(target.url, to)
    path = cfg.home / PROGRESS_FILE
    progress = _Progress.load(path)
    from_store = parse_store_url(cfg.store_url, source_options)
    if _same_store(from_store, to):
        if progress is not None and progress.target == record:
            # Killed after its commit point: only the progress file was left.
            path.unlink()
            return MigrateResult(source_where, target_where, 0, 0, 0, 0.0, already=True)
        raise InvalidState("store migrate", f"the home already uses {target_where}")
    if _overlaps(from_store, to):
        raise InvalidState(
            "store migrate", f"{target_where} and {source_where} overlap (one holds the other)"
        )
    if progress is not None and (progress.target != record or progress.source != source_where):
        raise InvalidState(
            "store migrate",
            f"a migration from {progress.source} to "
            f"{describe_store(str(progress.target.get('store_url', '?')))} is in progress "
            f"({path}): finish it with that --to, or remove the file (and empty that store) "
            "to start another",
        )
    mac_key = record_mac_key(load_home_keys(cfg.home))
    source = await open_store(cfg.store_url, options=source_options)
    try:
        await _check_source(cfg, AuthenticatedStore(source, mac_key), source_where)
        new = await open_store(target.url, options=options)
        try:
            return await _run(
                cfg, source, new, progress, record, mac_key, on_progress, after_copy, started
            )
        finally:
            await new.close()
    finally:
        await source.close()


def _same_store(a: Path | S3Config, b: Path | S3Config) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    if isinstance(a, S3Config) and isinstance(b, S3Config):
        return (a.bucket, a.prefix, a.endpoint_url) == (b.bucket, b.prefix, b.endpoint_url)
    return False


async def _run(
    cfg: ControlConfig,
    source: ObjectStore,
    new: ObjectStore,
    progress: _Progress | None,
    record: dict[str, Any],
    mac_key: bytes,
    on_progress: Progress | None,
    after_copy: Callable[[], None] | None,
    started: float,
) -> MigrateResult:
    source_where = describe_store(cfg.store_url, store_options(cfg))
    target_where = describe_store(str(record["store_url"]))
    there = await _listing(new)
    here = await _listing(source)
    if progress is None:
        if there:
            raise InvalidState(
                "store migrate",
                f"{target_where} is not empty ({len(there)} objects, e.g. {min(there)}): "
                "give an empty store (one this deployment used before holds an older copy: "
                "empty it first)",
            )
        progress = _Progress(source_where, record, time.time())
    else:
        ours = set(progress.objects)
        foreign = sorted(k for k in there if k not in here and k not in ours)
        if foreign:
            raise InvalidState(
                "store migrate",
                f"{target_where} holds {len(foreign)} object(s) that are not this "
                f"migration's copy (e.g. {foreign[0]}): give an empty store",
            )
    run = _Migration(cfg, source, new, progress, mac_key, on_progress, after_copy)
    # The intent, before the first object is copied: a rerun then knows the new
    # store's objects for its own partial copy.
    run.save()
    await run.copy(here, there)
    await run.verify()
    await run.check_unchanged()
    _switch_config(cfg, record)  # COMMIT POINT
    run.path.unlink()
    objects = progress.objects.values()
    result = MigrateResult(
        source=source_where,
        target=target_where,
        objects=len(progress.objects),
        bytes=sum(e.size for e in objects),
        copied=run.copied,
        seconds=time.monotonic() - started,
        unverified_macs=sum(1 for e in objects if e.bad_mac),
    )
    logger.info(
        "store migrated from %s to %s: %d objects, %d bytes",
        source_where,
        target_where,
        result.objects,
        result.bytes,
    )
    return result


def crash_after(count: int) -> Callable[[], None] | None:
    """A test's fault hook (``ControlConfig.crash_in_migrate_after``): SIGKILL this
    process at the ``count``-th call; None when ``count`` is 0."""
    if count <= 0:
        return None
    done = 0

    def hook() -> None:
        nonlocal done
        done += 1
        if done >= count:
            logger.error("test fault: killing store migrate after %d objects", done)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
