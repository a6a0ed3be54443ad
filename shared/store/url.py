"""Open a store from a URL: the only place that chooses a backend.

Forms:

- ``/var/lib/agents/store``, ``./store`` or ``file:///var/lib/agents/store``:
  a :class:`~shared.store.folder.FolderStore`.
- ``s3://bucket/optional/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1``:
  an :class:`~shared.store.s3.S3Store`. Query keys: ``endpoint``, ``region``,
  ``path_style`` (``true``/``false``), ``part_size`` (bytes), and, only as a
  fallback to :class:`StoreOptions`, ``access_key``/``secret_key``.

The store comes back open (the S3 probe has run) and wrapped as
``MeteredStore(RetryingStore(backend))``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CollectorRegistry

from shared.errors import ConfigError, InvalidArgument
from shared.store.base import ObjectStore, validate_prefix
from shared.store.folder import FolderStore
from shared.store.s3_config import S3Config
from shared.store.wrappers import DeadlineStore, MeteredStore, RetryingStore

__all__ = ["StoreOptions", "describe_store", "open_store", "parse_store_url"]

logger = logging.getLogger(__name__)

_QUERY_KEYS: Final = frozenset(
    {"endpoint", "region", "path_style", "part_size", "access_key", "secret_key"}
)


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """Settings from the daemon's config that override the URL. Secrets hidden in repr."""

    access_key: str | None = field(default=None, repr=False)
    """S3 access key id (wins over the URL's ``access_key``)."""
    secret_key: str | None = field(default=None, repr=False)
    """S3 secret key (wins over the URL's ``secret_key``)."""
    region: str | None = None
    """S3 region (wins over the URL's ``region``)."""
    endpoint_url: str | None = None
    """S3 endpoint (wins over the URL's ``endpoint``)."""
    spool_dir: Path | None = None
    """Temp folder for large conditional S3 writes on servers that need it."""
    call_deadline: float | None = None
    """Seconds one operation may take, retries included (``DeadlineStore``); None: unbounded."""
    retry_initial: float | None = None
    """Seconds before a failed call is tried again (doubling, with jitter); None:
    the default of :mod:`shared.retry`."""
    object_lock: bool = False
    """The bucket must have S3 Object Lock with a default retention (checked at open;
    refused for a folder store)."""


def _bad(reason: str) -> InvalidArgument:
    # Never echo the URL: its query may hold a secret key.
    return InvalidArgument("store", reason)


def parse_store_url(url: str, options: StoreOptions | None = None) -> Path | S3Config:
    """Turn a store URL into a folder path or an S3 config, refusing bad ones."""
    options = options or StoreOptions()
    if not isinstance(url, str) or not url.strip():
        raise _bad("the store URL is empty")
    if any(ord(c) < 0x20 for c in url):
        raise _bad("the store URL contains a control character")
    if "://" not in url:
        return Path(url).absolute()
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise _bad("a file URL is file:///absolute/path")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise _bad("a file URL needs an absolute path")
        return Path(path)
    if scheme != "s3":
        raise _bad(f"unsupported scheme {scheme!r} (use a path, file:// or s3://)")
    if parts.fragment or parts.username or parts.password or parts.port:
        raise _bad("an s3 URL is s3://bucket/prefix?query")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = set(query) - _QUERY_KEYS
    if unknown:
        raise _bad(f"unknown s3 URL parameter {sorted(unknown)[0]!r}")
    if any(len(values) != 1 for values in query.values()):
        raise _bad("each s3 URL parameter may appear once")
    q = {k: v[0] for k, v in query.items()}
    prefix = parts.path.lstrip("/")
    if prefix:
        validate_prefix(prefix, "store")
        if not prefix.endswith("/"):
            prefix += "/"
    endpoint = options.endpoint_url or q.get("endpoint") or None
    if endpoint is not None:
        ep = urlsplit(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname or ep.username or ep.password:
            raise _bad("endpoint must be an http(s) URL without credentials")
    path_style = q.get("path_style", "true").lower()
    if path_style not in ("true", "false"):
        raise _bad("path_style must be true or false")
    try:
        part_size = int(q.get("part_size", str(8 * 1024 * 1024)))
    except ValueError:
        raise _bad("part_size must be a number of bytes") from None
    config = S3Config(
        bucket=parts.hostname or "",
        prefix=prefix,
        endpoint_url=endpoint,
        region=options.region or q.get("region") or "us-east-1",
        access_key=options.access_key or q.get("access_key") or None,
        secret_key=options.secret_key or q.get("secret_key") or None,
        path_style=path_style == "true",
        part_size=part_size,
        spool_dir=options.spool_dir,
        object_lock=options.object_lock,
    )
    try:
        config.validate()
    except InvalidArgument as exc:
        raise _bad(exc.reason if exc.field != "store" else exc.message) from None
    return config


def describe_store(url: str, options: StoreOptions | None = None) -> str:
    """The store ``url`` names, for messages: never a credential or query parameter."""
    return _where(parse_store_url(url, options))


def _where(target: Path | S3Config) -> str:
    if isinstance(target, Path):
        return str(target)
    return f"s3://{target.bucket}/{target.prefix}"


async def open_store(
    url: str,
    *,
    options: StoreOptions | None = None,
    namespace: str = "agents_cp",
    registry: CollectorRegistry | None = None,
    causes: Collection[str] = (),
) -> ObjectStore:
    """Open the store ``url`` names, wrapped in ``MeteredStore(RetryingStore(...))``.

    With ``options.call_deadline``, ``MeteredStore(DeadlineStore(RetryingStore(...)))``:
    a call that runs out of time is then measured as an ``unavailable`` fault.
    ``causes``: the daemon's store causes, counted by MeteredStore (none: not counted).

    The result is open: close it with ``await store.close()`` or ``async with``.
    Raises InvalidArgument("store", ...) for a bad URL and StoreIncompatible for
    an S3 server that does not honour conditional writes. Credentials come from
    ``options`` (the daemon's config), then the URL; if neither has them,
    botocore's default chain (e.g. an instance role) applies.
    """
    target = parse_store_url(url, options)
    backend: ObjectStore
    if isinstance(target, Path):
        if options is not None and options.object_lock:
            raise ConfigError("store_object_lock", f"{target} is a folder: Object Lock is S3's")
        backend = await FolderStore.open(target)
    else:
        # Imported here: aiobotocore costs most of a second, which a folder store and
        # every CLI run that only parses a URL should not pay.
        from shared.store.s3 import S3Store

        backend = await S3Store.open(target)
    retry = options.retry_initial if options is not None else None
    inner: ObjectStore = (
        RetryingStore(backend) if retry is None else RetryingStore(backend, initial=retry)
    )
    deadline = options.call_deadline if options is not None else None
    if deadline is not None:
        inner = DeadlineStore(inner, seconds=deadline, where=_where(target))
    return MeteredStore(inner, namespace, registry, causes=causes)
