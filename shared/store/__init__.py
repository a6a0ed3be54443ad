"""The object store: one contract, a folder, an S3 bucket and an in-memory fake.

Open a store with :func:`open_store`; depend on :class:`ObjectStore` only.
See ``docs/store.md``.
"""

from typing import TYPE_CHECKING, Any

from shared.store.authenticated import AuthenticatedStore
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    MAX_KEY_BYTES,
    ObjectInfo,
    ObjectStore,
    PutData,
    validate_key,
    validate_prefix,
)
from shared.store.folder import FolderStore
from shared.store.memory import MemoryStore
from shared.store.s3_config import S3Config
from shared.store.url import StoreOptions, describe_store, open_store, parse_store_url
from shared.store.wrappers import METRIC_NAMESPACES, DeadlineStore, MeteredStore, RetryingStore

if TYPE_CHECKING:
    from shared.store.s3 import S3Store

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PAGE_SIZE",
    "MAX_KEY_BYTES",
    "METRIC_NAMESPACES",
    "AuthenticatedStore",
    "DeadlineStore",
    "FolderStore",
    "MemoryStore",
    "MeteredStore",
    "ObjectInfo",
    "ObjectStore",
    "PutData",
    "RetryingStore",
    "S3Config",
    "S3Store",
    "StoreOptions",
    "describe_store",
    "open_store",
    "parse_store_url",
    "validate_key",
    "validate_prefix",
]


def __getattr__(name: str) -> Any:
    """``S3Store`` on first use: importing aiobotocore costs most of a second, which
    a folder store and a CLI run that only parses a store URL should not pay."""
    if name == "S3Store":
        from shared.store.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
