"""The object store: one contract, a folder, an S3 bucket and an in-memory fake.

Open a store with :func:`open_store`; depend on :class:`ObjectStore` only.
See ``docs/store.md``.
"""

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
from shared.store.s3 import S3Config, S3Store
from shared.store.url import StoreOptions, describe_store, open_store, parse_store_url
from shared.store.wrappers import METRIC_NAMESPACES, DeadlineStore, MeteredStore, RetryingStore

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
