"""The control plane's trusted store: MAC'd records, a per-call deadline, a deployment check.

:func:`open_trusted_store` stacks the wrappers every daemon, ``init`` and
``fsck`` use, outermost first::

    GuardedStore          refuses everything while the store is not this deployment's
    AuthenticatedStore    MAC on every object (shared.store.authenticated)
    MeteredStore(DeadlineStore(RetryingStore(backend)))   from shared.store.open_store:
                          each call bounded by STORE_CALL_DEADLINE, faults name the store

The MAC key's only source is :func:`record_mac_key`: today it is derived from
the home's ``secrets.key`` (never in the store); the DR issue moves it into the
sealed key bundle by changing that one function.

**Deployment self-check** (:class:`DeploymentGuard`): ``cp/deployment.json``
(MAC'd like every object) names the deployment's CA. ``serve`` refuses a store
whose marker is missing, forged or names another CA; while serving, a check
every tick (and before any "not found" is believed) notices a store that was
emptied or swapped, and from then on every call answers UNAVAILABLE naming the
problem (:class:`~shared.errors.StoreUntrusted`) until the right store is back.
So a machine is never told "unknown machine", nor an admin "unknown
credential", by a control plane that cannot trust its store.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter

from controlplane.config import ControlConfig
from controlplane.integrity import jsonstore
from controlplane.integrity.keys import HomeKeys
from controlplane.integrity.opening import store_options
from controlplane.integrity.records import utc_iso
from controlplane.metrics import STORE_CAUSES
from shared.errors import (
    AgentsError,
    IntegrityError,
    NotFound,
    StoreError,
    StoreUnavailable,
    StoreUntrusted,
)
from shared.store import describe_store, open_store
from shared.store.authenticated import AuthenticatedStore
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ObjectInfo,
    ObjectStore,
    PutData,
    delete_keys,
)
from shared.store.wrappers import StoreWrapper

__all__ = [
    "DEPLOYMENT_KEY",
    "STORE_CALL_DEADLINE",
    "DeploymentGuard",
    "GuardedStore",
    "TrustedStore",
    "WriteFence",
    "deployment_marker",
    "marker_ca_hashes",
    "marker_deployment_id",
    "move_deployment_ca",
    "open_trusted_store",
    "record_kind",
    "record_mac_key",
]

logger = logging.getLogger(__name__)

#: Marks a store as holding this control plane (MAC'd, names the CA).
DEPLOYMENT_KEY: Final = "cp/deployment.json"
#: Seconds one store call may take, retries included. The admin CLI waits 30 s
#: (controlplane.cli.client.AdminClient) and one admin call makes a few store calls
#: in a row, so a frozen store must answer well within that.
STORE_CALL_DEADLINE: Final = 5.0
_MAC_INFO: Final = b"agents.control.record-mac.v1"


def record_mac_key(keys: HomeKeys) -> bytes:
    """The key that authenticates every stored object (the one seam for its source)."""
    return hmac.new(keys.secrets_key, _MAC_INFO, hashlib.sha256).digest()


_KINDS: Final = (
    ("cp/deployment", "deployment"),
    ("cp/intents/", "intent"),
    ("credentials/", "credential"),
    ("index/", "index"),
    ("audit/", "audit"),
)


def record_kind(key: str) -> str:
    """A bounded label for the kind of object at ``key`` (metrics never carry ids)."""
    for prefix, kind in _KINDS:
        if key.startswith(prefix):
            return kind
    if key.startswith("accounts/"):
        parts = key.split("/")
        if len(parts) == 3:
            return "account" if parts[2] == "account.json" else "other"
        if len(parts) >= 4:
            return {
                "machines": "machine",
                "tokens": "token",
                "presence": "presence",
                "backups": "backup",  # a machine's manifest (segments are not MAC'd)
            }.get(parts[2], "other")
    return "other"


def deployment_marker(keys: HomeKeys, now: dt.datetime, deployment_id: str = "") -> bytes:
    """The content ``init`` writes at :data:`DEPLOYMENT_KEY`."""
    fields = {"ca_hash": keys.ca_hash, "created_at": utc_iso(now)}
    if deployment_id:
        fields["deployment_id"] = deployment_id
    return json.dumps(fields).encode()


def marker_deployment_id(marker: bytes) -> str:
    """The deployment id a marker names (the key bundle is bound to it).

    Markers written before ids existed name only their CA: its hash stands in.
    IntegrityError for a marker that is not one.
    """
    try:
        data = json.loads(marker)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(DEPLOYMENT_KEY, "not valid JSON") from None
    if not isinstance(data, dict):
        raise IntegrityError(DEPLOYMENT_KEY, "not a JSON object")
    ident = data.get("deployment_id") or data.get("ca_hash")
    if not isinstance(ident, str) or not ident:
        raise IntegrityError(DEPLOYMENT_KEY, "names no deployment")
    return ident


def marker_ca_hashes(marker: dict[str, Any]) -> set[str]:
    """The CA pins a deployment marker accepts: its CA and any CA a rollover retired
    (a home whose swap to the new CA was interrupted still opens its store)."""
    previous = marker.get("previous_ca_hashes")
    named = [marker.get("ca_hash"), *(previous if isinstance(previous, list) else [])]
    return {h for h in named if isinstance(h, str)}


async def move_deployment_ca(store: ObjectStore, new_ca_hash: str) -> None:
    """Name ``new_ca_hash`` in the marker, the former CA kept as previous (one CAS write).

    ``store`` is the MAC'd store below the guard (:attr:`TrustedStore.authenticated`).
    """

    def change(marker: dict[str, Any]) -> dict[str, Any] | None:
        if marker.get("ca_hash") == new_ca_hash:
            return None
        previous = sorted(marker_ca_hashes(marker) - {new_ca_hash})
        return {**marker, "ca_hash": new_ca_hash, "previous_ca_hashes": previous}

    await jsonstore.update(store, DEPLOYMENT_KEY, change)


class DeploymentGuard:
    """Whether the store is this deployment's (see the module doc)."""

    def __init__(self, store: ObjectStore, ca_hash: str, where: str) -> None:
        self._store = store
        self._ca_hash = ca_hash
        self._where = where
        self.problem: StoreUntrusted | None = None
        self._checked_at = -1e18
        self._verified = False
        self._lock = asyncio.Lock()

    def _untrusted(self, reason: str) -> StoreUntrusted:
        return StoreUntrusted(
            f"store {self._where}: {reason}; refusing to use it. Restore the store's "
            "contents (or point --store at this deployment's store) and it is used again"
        )

    async def verify(self) -> None:
        """Read the marker now; set or clear :attr:`problem`. Store faults propagate."""
        async with self._lock:
            await self._verify_locked()

    async def _verify_locked(self) -> None:
        self._checked_at = time.monotonic()
        problem: StoreUntrusted | None = None
        try:
            data = json.loads(await self._store.get(DEPLOYMENT_KEY))
        except NotFound:
            problem = self._untrusted(
                f"{DEPLOYMENT_KEY} is missing (the store was emptied or replaced)"
            )
        except IntegrityError:
            problem = self._untrusted(
                f"{DEPLOYMENT_KEY} is not authentic under this home's key "
                "(another deployment's store, or a forged marker)"
            )
        except ValueError:
            problem = self._untrusted(f"{DEPLOYMENT_KEY} is not valid JSON")
        else:
            if not isinstance(data, dict) or self._ca_hash not in marker_ca_hashes(data):
                problem = self._untrusted(f"{DEPLOYMENT_KEY} names another deployment")
        if problem is None and self.problem is not None:
            logger.warning("store %s: this deployment's store is back", self._where)
        elif problem is not None and self.problem is None and self._verified:
            # The first check's problem is the caller's to report (serve's one line).
            logger.error("%s", problem)
        self.problem = problem
        self._verified = True

    def check(self) -> None:
        """Raise the current problem, if any."""
        if self.problem is not None:
            raise self.problem

    async def confirm_missing(self) -> None:
        """Before a "not found" is believed: re-read the marker.

        Only a check that began after the store said "not found" can vouch for
        it: a store emptied a moment after the last tick would otherwise have its
        "not found" passed on (a machine told "unknown machine" waits minutes
        before it tries again). Callers that miss at the same moment share one
        check. A store that cannot be asked now answers UNAVAILABLE, not the miss.
        """
        missed_at = time.monotonic()
        async with self._lock:
            if self._checked_at < missed_at:
                await self._verify_locked()
        self.check()


class WriteFence(Protocol):
    """What :class:`GuardedStore` asks before each write (controlplane.recovery.fencing.Fence)."""

    async def check(self) -> None:
        """Raise unless this process may still write."""


class GuardedStore(StoreWrapper):
    """Refuses every call while ``guard`` has a problem; re-checks before a NotFound.

    With a ``fence`` set, every write first asks it whether this process still
    holds the deployment's epoch (controlplane.recovery.fencing).
    """

    def __init__(self, inner: ObjectStore, guard: DeploymentGuard) -> None:
        super().__init__(inner)
        self.guard = guard
        self.fence: WriteFence | None = None

    async def _may_write(self) -> None:
        self.guard.check()
        if self.fence is not None:
            await self.fence.check()

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        self.guard.check()
        try:
            return await self.inner.get(key)
        except NotFound:
            await self.guard.confirm_missing()
            raise

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`."""
        self.guard.check()
        async for chunk in self.inner.get_stream(key, chunk_size):
            yield chunk

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        self.guard.check()
        try:
            return await self.inner.head(key)
        except NotFound:
            await self.guard.confirm_missing()
            raise

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        await self._may_write()
        return await self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        await self._may_write()
        await self.inner.delete(key)

    async def delete_many(self, keys: Sequence[str]) -> None:
        """See :meth:`StoreBase.delete_many`."""
        await self._may_write()
        await delete_keys(self.inner, keys)

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`."""
        self.guard.check()
        async for page in self.inner.list_pages(
            prefix, start_after=start_after, page_size=page_size
        ):
            yield page


class TrustedStore:
    """The opened stack: ``store`` for domain services, ``guard`` for the self-check,
    ``authenticated`` (below the guard) for ``init`` and ``fsck``."""

    def __init__(
        self,
        store: GuardedStore,
        authenticated: ObjectStore,
        where: str,
        backups: ObjectStore | None = None,
    ) -> None:
        self.store = store
        self.guard = store.guard
        self.authenticated = authenticated
        self.where = where
        self.backups = backups
        """Machines' sealed backups: guarded but not MAC'd (see controlplane.machines.backups);
        shares the stack's bottom store, closed with ``store``."""

    def set_fence(self, fence: WriteFence) -> None:
        """Check ``fence`` before every write through ``store`` and ``backups``."""
        self.store.fence = fence
        if isinstance(self.backups, GuardedStore):
            self.backups.fence = fence

    async def close(self) -> None:
        """Close the whole stack."""
        await self.store.close()


_REFUSED: dict[int, Counter] = {}


def refused_counter(registry: CollectorRegistry) -> Counter:
    """``agents_cp_store_records_refused_total{kind}`` (one per registry)."""
    key = id(registry)
    if key not in _REFUSED:
        _REFUSED[key] = Counter(
            "agents_cp_store_records_refused",
            "Store objects refused because their MAC did not verify, by record kind.",
            ["kind"],
            registry=registry,
        )
    return _REFUSED[key]


async def open_trusted_store(
    cfg: ControlConfig,
    keys: HomeKeys,
    registry: CollectorRegistry | None,
    *,
    deadline: float = STORE_CALL_DEADLINE,
) -> TrustedStore:
    """Open the configured store with every wrapper (see the module doc).

    The deployment is NOT checked here: the caller runs ``guard.verify()``
    (``serve``) or writes the marker (``init``). Opening faults name the store.
    """
    options = store_options(cfg, deadline)
    where = describe_store(cfg.store_url, options)
    try:
        raw = await open_store(
            cfg.store_url,
            options=options,
            namespace="agents_cp",
            registry=registry,
            causes=STORE_CAUSES,
        )
    except (StoreError, StoreUnavailable) as exc:
        raise _named(exc, where) from exc
    counter = refused_counter(registry) if registry is not None else None

    def refused(key: str) -> None:
        if counter is not None:
            counter.labels(record_kind(key)).inc()

    authed = AuthenticatedStore(raw, record_mac_key(keys), on_refused=refused)
    guard = DeploymentGuard(authed, keys.ca_hash, where)
    # Sealed backups carry their own authentication and may be gigabytes: they
    # stream past the record MAC (which reads objects whole), under the same guard.
    return TrustedStore(GuardedStore(authed, guard), authed, where, GuardedStore(raw, guard))


def _named(exc: AgentsError, where: str) -> AgentsError:
    named: Any = type(exc).__new__(type(exc))
    AgentsError.__init__(named, f"store {where}: {exc.message}")
    named.__dict__.update({k: v for k, v in exc.__dict__.items() if k != "message"})
    return named  # type: ignore[no-any-return]
