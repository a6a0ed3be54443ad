"""JSON records in the object store: read, create-once, compare-and-swap update."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from controlplane.integrity.records import decode, encode
from shared.errors import (
    IntegrityError,
    InvalidState,
    NotFound,
    PreconditionFailed,
    StoreUnavailable,
)
from shared.ids import is_valid_id
from shared.store.base import ObjectStore

__all__ = ["create", "read", "read_all", "read_versioned", "update"]

logger = logging.getLogger(__name__)

#: How many times a compare-and-swap update is retried when it loses a race.
CAS_ATTEMPTS = 20
#: Reads of a listed key that answered NotFound while a HEAD still found it.
_LISTED_READS = 3


async def read(store: ObjectStore, key: str) -> dict[str, Any]:
    """The JSON object at ``key``; NotFound if missing."""
    return decode(await store.get(key), key)


async def read_all(store: ObjectStore, prefix: str, kind: str) -> list[dict[str, Any]]:
    """Every ``<prefix><id>.json`` object whose name is a valid ``kind`` id, in key order.

    Complete, or an error naming what could not be read: other keys under
    ``prefix`` are skipped, and so is an object that fails its integrity check
    (a forgery: refused and counted by the store, never a record); an object
    listed but then not found is skipped only once a HEAD confirms it is gone
    (deleted since the listing), and one that fails its check is read once
    more first (a body cut short passes the second time). One that a HEAD
    still finds is read again; a key that stays listed but unreadable fails
    the listing (StoreUnavailable) instead of leaving a record out of it.
    """
    out: list[dict[str, Any]] = []
    async for info in store.list(prefix):
        name = info.key[len(prefix) :]
        if not name.endswith(".json") or not is_valid_id(kind, name.removesuffix(".json")):
            continue
        try:
            found = await _read_listed(store, info.key)
        except IntegrityError:
            continue
        if found is not None:
            out.append(found)
    return out


async def _read_listed(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The record at a key a listing just named; None when it was deleted since."""
    torn = False
    for _ in range(_LISTED_READS):
        try:
            return await read(store, key)
        except NotFound:
            pass
        except IntegrityError:
            # A forgery fails every read; a body cut short fails once. Read it
            # once more before the caller leaves it out as a forgery.
            if torn:
                raise
            torn = True
            continue
        # Some servers answer a GET racing an overwrite with 404 for a moment
        # (moto does under load): the HEAD says whether it is really gone.
        try:
            await store.head(key)
        except NotFound:
            return None
    raise StoreUnavailable(
        f"list: {key} is listed and exists but could not be read ({_LISTED_READS} tries); try again"
    )


async def read_versioned(store: ObjectStore, key: str) -> tuple[dict[str, Any], str]:
    """The JSON object at ``key`` and an etag no newer than it (for :func:`update`).

    The etag is read first: if the object changes between the two reads, a
    later ``put(if_match=etag)`` fails, so no update is ever lost.
    """
    info = await store.head(key)
    return decode(await store.get(key), key), info.etag


async def create(store: ObjectStore, key: str, data: dict[str, Any]) -> bool:
    """Write ``data`` only if ``key`` does not exist; False when it already did.

    An object at ``key`` that fails its integrity check (forged: written
    without the deployment's key) does not count: it is replaced, with
    compare-and-swap, so a forgery cannot block a create (a GitHub id claim).
    """
    try:
        await store.put(key, encode(data), if_none_match=True)
    except PreconditionFailed:
        pass
    else:
        return True
    try:
        await store.get(key)
    except IntegrityError:
        info = await store.head(key)
        try:
            await store.put(key, encode(data), if_match=info.etag)
        except PreconditionFailed:
            return False
        logger.warning("create %s: replaced an object that failed its integrity check", key)
        return True
    except NotFound:
        return False  # deleted meanwhile: it existed when we tried
    return False


async def update(
    store: ObjectStore,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any] | None],
) -> dict[str, Any]:
    """Apply ``change`` to the object at ``key`` with compare-and-swap, retrying races.

    ``change`` gets the current object and returns the new one, or None to
    leave it as it is; it may raise a domain error to refuse. Returns the
    object as finally stored. NotFound if the key is missing.
    """
    for _ in range(CAS_ATTEMPTS):
        current, etag = await read_versioned(store, key)
        new = change(dict(current))
        if new is None:
            return current
        try:
            await store.put(key, encode(new), if_match=etag)
        except PreconditionFailed:
            logger.debug("update %s: lost a race, retrying", key)
            continue
        return new
    raise InvalidState(key, f"too much contention ({CAS_ATTEMPTS} lost updates in a row)")
