"""An object store in an S3-compatible bucket, through aiobotocore.

Keys live under an optional prefix in one bucket. Small objects go up in one
PutObject; streamed objects larger than one part go up as a multipart upload
holding one part in memory at a time. Conditional writes use S3's
``If-None-Match: *`` (create-only) and ``If-Match: <etag>`` (compare-and-swap)
on PutObject and on CompleteMultipartUpload.

S3-compatible servers differ, so :meth:`S3Store.open` probes the bucket:
create-only and compare-and-swap on PutObject must be honoured, or the store is
refused with :class:`~shared.errors.StoreIncompatible`. Conditions on
CompleteMultipartUpload are probed too; where the server ignores them (moto
5.2.5 ignores ``If-Match`` there), a large conditional write is spooled to a
temp file and sent as one conditional PutObject instead, which is still atomic
on the server and keeps memory bounded.

botocore's own retries are off: :class:`~shared.store.wrappers.RetryingStore`
owns the retry policy. Every botocore error is translated through one table,
:data:`_ERROR_KINDS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import email.utils
import enum
import logging
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from types import TracebackType
from typing import IO, Any, Final, Self

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from shared.errors import (
    AgentsError,
    ConfigError,
    NotFound,
    PreconditionFailed,
    StoreError,
    StoreIncompatible,
    StoreMisconfigured,
    StoreUnavailable,
    TooLarge,
)
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    DELETE_BATCH,
    ObjectInfo,
    PutData,
    StoreBase,
    check_conditions,
    check_sizes,
    iter_chunks,
    validate_key,
    validate_prefix,
)
from shared.store.clock import StoreTime
from shared.store.s3_config import MAX_PARTS, MAX_PUT_SIZE, S3Config

__all__ = ["S3Config", "S3Store"]

logger = logging.getLogger(__name__)


class _Kind(enum.Enum):
    NOT_FOUND = "not_found"
    PRECONDITION = "precondition"
    UNAVAILABLE = "unavailable"
    MISCONFIGURED = "misconfigured"
    PERMANENT = "permanent"


#: The one table from S3 error codes (and HTTP statuses) to our error kinds.
_ERROR_KINDS: Final[dict[str, _Kind]] = {
    "NoSuchKey": _Kind.NOT_FOUND,
    "NotFound": _Kind.NOT_FOUND,
    "404": _Kind.NOT_FOUND,
    "PreconditionFailed": _Kind.PRECONDITION,
    "412": _Kind.PRECONDITION,
    "ConditionalRequestConflict": _Kind.PRECONDITION,
    "409": _Kind.PRECONDITION,
    "SlowDown": _Kind.UNAVAILABLE,
    "Throttling": _Kind.UNAVAILABLE,
    "ThrottlingException": _Kind.UNAVAILABLE,
    "RequestTimeout": _Kind.UNAVAILABLE,
    "RequestTimeTooSkewed": _Kind.UNAVAILABLE,
    "InternalError": _Kind.UNAVAILABLE,
    "ServiceUnavailable": _Kind.UNAVAILABLE,
    "503": _Kind.UNAVAILABLE,
    "500": _Kind.UNAVAILABLE,
    "502": _Kind.UNAVAILABLE,
    "504": _Kind.UNAVAILABLE,
    "429": _Kind.UNAVAILABLE,
    "NoSuchBucket": _Kind.MISCONFIGURED,
    "AccessDenied": _Kind.MISCONFIGURED,
    "403": _Kind.MISCONFIGURED,
    "InvalidAccessKeyId": _Kind.MISCONFIGURED,
    "SignatureDoesNotMatch": _Kind.MISCONFIGURED,
}

#: What an operator reads for each misconfiguration (the S3 code follows in brackets).
_CAUSES: Final[dict[str, str]] = {
    "NoSuchBucket": "the bucket does not exist",
    "AccessDenied": "access denied (check the credentials' permissions)",
    "403": "access denied (check the credentials' permissions)",
    "InvalidAccessKeyId": "the access key is not known to the server",
    "SignatureDoesNotMatch": "the secret key is wrong",
}

#: Faults below HTTP: the server may be back in a moment.
_TRANSIENT_EXCEPTIONS: Final = (
    BotoConnectionError,
    HTTPClientError,
    ReadTimeoutError,
    aiohttp.ClientError,
    TimeoutError,
    ConnectionError,
)


def _translate(exc: BaseException, op: str, key: str, *, cas: bool = False) -> AgentsError:
    """Map one botocore/aiohttp exception to our error tree (no secrets in messages)."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        kind = _ERROR_KINDS.get(code) or _ERROR_KINDS.get(str(status))
        if kind is None:
            kind = _Kind.UNAVAILABLE if status >= 500 else _Kind.PERMANENT
        if kind is _Kind.NOT_FOUND and cas:
            # S3 answers If-Match on a missing key with 404: the CAS lost.
            kind = _Kind.PRECONDITION
        if kind is _Kind.NOT_FOUND:
            return NotFound("object", key)
        if kind is _Kind.PRECONDITION:
            return PreconditionFailed(key, f"{code or status}")
        if kind is _Kind.UNAVAILABLE:
            return StoreUnavailable(f"{op} {key}: server answered {code or status}")
        if kind is _Kind.MISCONFIGURED:
            cause = _CAUSES.get(code) or _CAUSES.get(str(status)) or "refused"
            return StoreMisconfigured(f"{op} {key}: {cause} ({code or status})")
        return StoreError(f"{op} {key}: server answered {code or status}")
    if isinstance(exc, NoCredentialsError):
        return StoreMisconfigured(f"{op} {key}: no credentials configured")
    if isinstance(exc, _TRANSIENT_EXCEPTIONS):
        return StoreUnavailable(f"{op} {key}: {type(exc).__name__}")
    if isinstance(exc, BotoCoreError):
        return StoreError(f"{op} {key}: {type(exc).__name__}")
    return StoreError(f"{op} {key}: {type(exc).__name__}")


@contextlib.contextmanager
def _mapped(op: str, key: str, *, cas: bool = False) -> Iterator[None]:
    try:
        yield
    except AgentsError:
        raise
    except (TimeoutError, BotoCoreError, ClientError, aiohttp.ClientError, OSError) as exc:
        raise _translate(exc, op, key, cas=cas) from exc


def _etag(raw: str) -> str:
    return raw.strip('"')


class S3Store(StoreBase):
    """An :class:`~shared.store.base.ObjectStore` in an S3-compatible bucket.

    Use ``store = await S3Store.open(config)`` or ``async with S3Store(config)``:
    either connects and runs the conditional-write probe.
    """

    def __init__(self, config: S3Config) -> None:
        config.validate()
        self.config = config
        self._client: Any = None
        self._exit = contextlib.AsyncExitStack()
        self._multipart_if_match = False
        self._multipart_if_none_match = False

    @classmethod
    async def open(cls, config: S3Config) -> S3Store:
        """Connect, probe the bucket's conditional writes, and return the open store."""
        store = cls(config)
        await store.start()
        return store

    async def __aenter__(self) -> Self:
        if self._client is None:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the client and run :meth:`probe`; closes again if either fails."""
        cfg = self.config
        session = get_session()
        # No store method returns a time from S3 (ObjectInfo has none): keep them
        # as the text S3 sent. Parsing every listed key's LastModified (dateutil)
        # was half the client's CPU for a listing (an account deletion lists all).
        session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
        client_config = AioConfig(
            s3={"addressing_style": "path" if cfg.path_style else "auto"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            # Third-party servers often reject the newer default checksum headers; a
            # bucket with Object Lock refuses an upload without one.
            request_checksum_calculation="when_supported" if cfg.object_lock else "when_required",
            response_checksum_validation="when_required",
        )
        try:
            self._client = await self._exit.enter_async_context(
                session.create_client(
                    "s3",
                    region_name=cfg.region,
                    endpoint_url=cfg.endpoint_url,
                    aws_access_key_id=cfg.access_key,
                    aws_secret_access_key=cfg.secret_key,
                    config=client_config,
                )
            )
            if cfg.object_lock:
                await self.check_object_lock()
            await self.probe()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the HTTP client. Idempotent."""
        self._client = None
        await self._exit.aclose()

    # -- helpers -------------------------------------------------------------

    @property
    def _s3(self) -> Any:
        if self._client is None:
            raise StoreError("s3 store: not open (use S3Store.open or async with)")
        return self._client

    def _full(self, key: str) -> str:
        return self.config.prefix + key

    def _where(self) -> str:
        return f"s3://{self.config.bucket}/{self.config.prefix}"

    @staticmethod
    def _conditions(if_none_match: bool, if_match: str | None) -> dict[str, str]:
        if if_none_match:
            return {"IfNoneMatch": "*"}
        if if_match is not None:
            return {"IfMatch": f'"{_etag(if_match)}"'}
        return {}

    # -- probe -----------------------------------------------------------------

    async def check_object_lock(self) -> None:
        """With ``object_lock`` configured: the bucket has Object Lock enabled with a
        default retention, else ConfigError naming the bucket and what is missing."""
        bucket = self.config.bucket
        with _mapped("get object lock configuration", ""):
            try:
                reply = await self._s3.get_object_lock_configuration(Bucket=bucket)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code != "ObjectLockConfigurationNotFoundError":
                    raise
                reply = {}  # the bucket was made without Object Lock
        lock = reply.get("ObjectLockConfiguration") or {}
        retention = (lock.get("Rule") or {}).get("DefaultRetention") or {}
        if lock.get("ObjectLockEnabled") != "Enabled":
            missing = "Object Lock is not enabled on it (ObjectLockEnabled)"
        elif retention.get("Mode") not in ("COMPLIANCE", "GOVERNANCE") or not (
            retention.get("Days") or retention.get("Years")
        ):
            missing = "it has no default retention (Rule.DefaultRetention: mode and days)"
        else:
            period = retention.get("Days") or retention.get("Years")
            unit = "days" if retention.get("Days") else "years"
            logger.info(
                "store %s: Object Lock enabled, default retention %s %s %s",
                self._where(),
                retention["Mode"],
                period,
                unit,
            )
            return
        raise ConfigError(
            "store_object_lock",
            f"bucket {bucket}: {missing}; enable it on the bucket or unset store_object_lock",
        )

    async def probe(self) -> None:
        """Check that the bucket honours conditional writes; raise StoreIncompatible if not.

        Writes ``_probe/<random>`` under the prefix, then: a second create-only
        write must fail, a compare-and-swap with a wrong etag must fail, one with
        the right etag must succeed. The same conditions on a one-part multipart
        upload are tried too, only to choose how large conditional writes go up.
        The probe object is deleted at the end.
        """
        key = f"_probe/{secrets.token_hex(8)}"
        full = self._full(key)
        bucket = self.config.bucket
        wrong = '"' + "0" * 32 + '"'
        try:
            with _mapped("probe", key):
                try:
                    first = await self._s3.put_object(
                        Bucket=bucket, Key=full, Body=b"probe-1", IfNoneMatch="*"
                    )
                except ClientError as exc:
                    self._refuse_5xx(exc, "If-None-Match")
                    raise
            if not await self._put_lost(full, b"probe-2", IfNoneMatch="*"):
                raise StoreIncompatible(
                    f"store {self._where()}: the server ignores If-None-Match on "
                    "PutObject, so create-only writes are unsafe"
                )
            if not await self._put_lost(full, b"probe-3", IfMatch=wrong):
                raise StoreIncompatible(
                    f"store {self._where()}: the server ignores If-Match on PutObject, "
                    "so compare-and-swap writes are unsafe"
                )
            with _mapped("probe", key):
                try:
                    await self._s3.put_object(
                        Bucket=bucket, Key=full, Body=b"probe-4", IfMatch=first["ETag"]
                    )
                except ClientError as exc:
                    raise StoreIncompatible(
                        f"store {self._where()}: compare-and-swap with the current etag "
                        f"was refused ({exc.response.get('Error', {}).get('Code', '?')})"
                    ) from None
            self._multipart_if_none_match = await self._multipart_lost(full, IfNoneMatch="*")
            self._multipart_if_match = await self._multipart_lost(full, IfMatch=wrong)
            if not (self._multipart_if_match and self._multipart_if_none_match):
                logger.info(
                    "store %s: conditions on CompleteMultipartUpload not honoured "
                    "(If-None-Match %s, If-Match %s); large conditional writes will be "
                    "spooled to a temp file and sent as one PutObject",
                    self._where(),
                    "ok" if self._multipart_if_none_match else "ignored",
                    "ok" if self._multipart_if_match else "ignored",
                )
        finally:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._s3.delete_object(Bucket=bucket, Key=full)

    async def _put_lost(self, full: str, body: bytes, **conditions: str) -> bool:
        """True if a conditional PutObject that must fail did fail with 412/409."""
        try:
            await self._s3.put_object(Bucket=self.config.bucket, Key=full, Body=body, **conditions)
        except ClientError as exc:
            mapped = _translate(exc, "probe", full, cas="IfMatch" in conditions)
            if isinstance(mapped, PreconditionFailed):
                return True
            self._refuse_5xx(exc, "If-Match" if "IfMatch" in conditions else "If-None-Match")
            raise mapped from exc
        except (TimeoutError, BotoCoreError, aiohttp.ClientError, OSError) as exc:
            raise _translate(exc, "probe", full) from exc
        return False

    def _refuse_5xx(self, exc: ClientError, header: str) -> None:
        """StoreIncompatible naming ``header`` when a conditional PutObject got a 5xx.

        Some S3-compatible servers fail a header they do not implement with a 500
        rather than ignoring it: name the feature, not just the status.
        """
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status >= 500:
            raise StoreIncompatible(
                f"store {self._where()}: the server answered {status} to a PutObject with "
                f"{header}; it probably does not support conditional writes ({header}), "
                "which this store needs (if the server is only having a bad moment, "
                "try again)"
            ) from exc

    async def _multipart_lost(self, full: str, **conditions: str) -> bool:
        """True if a conditional one-part multipart upload that must fail did fail."""
        bucket = self.config.bucket
        with _mapped("probe", full):
            upload = await self._s3.create_multipart_upload(Bucket=bucket, Key=full)
            upload_id = upload["UploadId"]
        try:
            with _mapped("probe", full):
                part = await self._s3.upload_part(
                    Bucket=bucket, Key=full, UploadId=upload_id, PartNumber=1, Body=b"mp"
                )
            try:
                await self._s3.complete_multipart_upload(
                    Bucket=bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
                    **conditions,
                )
            except ClientError as exc:
                mapped = _translate(exc, "probe", full, cas="IfMatch" in conditions)
                if isinstance(mapped, StoreUnavailable):
                    raise mapped from exc
                # Refused as a lost condition: honoured. Refused otherwise
                # (e.g. 501 NotImplemented): treat as not supported.
                return isinstance(mapped, PreconditionFailed)
            return False
        finally:
            with contextlib.suppress(Exception):
                await self._s3.abort_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id)

    # -- reads -------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        validate_key(key)
        with _mapped("get", key):
            response = await self._s3.get_object(Bucket=self.config.bucket, Key=self._full(key))
            async with response["Body"] as body:
                data: bytes = await body.read()
        return data

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`."""
        validate_key(key)
        check_sizes(chunk_size)
        with _mapped("get", key):
            response = await self._s3.get_object(Bucket=self.config.bucket, Key=self._full(key))
        async with response["Body"] as body:
            while True:
                with _mapped("get", key):
                    chunk: bytes = await body.read(chunk_size)
                if not chunk:
                    return
                yield chunk

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        validate_key(key)
        with _mapped("head", key):
            response = await self._s3.head_object(Bucket=self.config.bucket, Key=self._full(key))
        return ObjectInfo(key, int(response["ContentLength"]), _etag(response["ETag"]))

    # -- writes --------------------------------------------------------------------

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        validate_key(key)
        check_conditions(if_none_match, if_match)
        part_size = self.config.part_size
        if isinstance(data, bytes | bytearray | memoryview) and len(data) <= part_size:
            return await self._put_single(key, bytes(data), if_none_match, if_match)
        parts = _PartReader(iter_chunks(data, part_size), part_size)
        first = await parts.next_part()
        if parts.exhausted:
            return await self._put_single(key, first, if_none_match, if_match)
        conditional = if_none_match or if_match is not None
        if conditional:
            await self._precheck(key, if_none_match, if_match)
        honoured = (
            self._multipart_if_match if if_match is not None else (self._multipart_if_none_match)
        )
        if conditional and not honoured:
            return await self._put_spooled(key, first, parts, if_none_match, if_match)
        return await self._put_multipart(key, first, parts, if_none_match, if_match)

    async def _put_single(
        self, key: str, body: bytes | IO[bytes], if_none_match: bool, if_match: str | None
    ) -> str:
        with _mapped("put", key, cas=if_match is not None):
            response = await self._s3.put_object(
                Bucket=self.config.bucket,
                Key=self._full(key),
                Body=body,
                **self._conditions(if_none_match, if_match),
            )
        return _etag(response["ETag"])

    async def _precheck(self, key: str, if_none_match: bool, if_match: str | None) -> None:
        """Fail a doomed large conditional write before uploading it (the server still decides)."""
        try:
            info = await self.head(key)
        except NotFound:
            if if_match is not None:
                raise PreconditionFailed(key, "object does not exist") from None
            return
        if if_none_match:
            raise PreconditionFailed(key, "object already exists")
        if if_match is not None and info.etag != _etag(if_match):
            raise PreconditionFailed(key, "etag does not match")

    async def _put_multipart(
        self,
        key: str,
        first: bytes,
        parts: _PartReader,
        if_none_match: bool,
        if_match: str | None,
    ) -> str:
        bucket, full = self.config.bucket, self._full(key)
        with _mapped("put", key):
            upload = await self._s3.create_multipart_upload(Bucket=bucket, Key=full)
        upload_id = upload["UploadId"]
        done: list[dict[str, Any]] = []
        try:
            body: bytes | None = first
            while body:
                number = len(done) + 1
                if number > MAX_PARTS:
                    raise TooLarge("data", MAX_PARTS * self.config.part_size)
                with _mapped("put", key):
                    result = await self._s3.upload_part(
                        Bucket=bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body
                    )
                done.append({"PartNumber": number, "ETag": result["ETag"]})
                body = None  # drop the part before reading the next one
                body = await parts.next_part()
            with _mapped("put", key, cas=if_match is not None):
                response = await self._s3.complete_multipart_upload(
                    Bucket=bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                    **self._conditions(if_none_match, if_match),
                )
        except BaseException:
            # Shielded: a cancelled put must not leave parts billed forever.
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._s3.abort_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id)
                )
            raise
        return _etag(response["ETag"])

    async def _put_spooled(
        self,
        key: str,
        first: bytes,
        parts: _PartReader,
        if_none_match: bool,
        if_match: str | None,
    ) -> str:
        spool: IO[bytes] = await asyncio.to_thread(
            tempfile.TemporaryFile, "w+b", dir=self.config.spool_dir
        )
        try:
            size = 0
            body: bytes | None = first
            while body:
                size += len(body)
                if size > MAX_PUT_SIZE:
                    raise TooLarge("data", MAX_PUT_SIZE)
                await asyncio.to_thread(spool.write, body)
                body = None
                body = await parts.next_part()
            await asyncio.to_thread(spool.seek, 0)
            return await self._put_single(key, spool, if_none_match, if_match)
        finally:
            await asyncio.to_thread(spool.close)

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        validate_key(key)
        try:
            with _mapped("delete", key):
                await self._s3.delete_object(Bucket=self.config.bucket, Key=self._full(key))
        except NotFound:
            pass

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` with DeleteObjects, ``DELETE_BATCH`` keys a request."""
        for key in keys:
            validate_key(key)
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            request = {"Objects": [{"Key": self._full(k)} for k in batch], "Quiet": True}
            with _mapped("delete", batch[0]):
                response = await self._s3.delete_objects(Bucket=self.config.bucket, Delete=request)
            errors = response.get("Errors") or []
            if errors:
                # A per-key failure is answered inside a 200: map the first one
                # as if the single DeleteObject had answered it.
                first = errors[0]
                fake = ClientError({"Error": {"Code": str(first.get("Code", ""))}}, "DeleteObjects")
                raise _translate(fake, "delete", str(first.get("Key", batch[0])))

    # -- the store's clock -----------------------------------------------------------

    async def server_time(self) -> StoreTime:
        """The server's clock (its ``Date`` header on a one-key listing) and ours
        at the middle of the request: what a skew check compares."""
        before = dt.datetime.now(dt.UTC)
        with _mapped("list", "_probe/"):
            response = await self._s3.list_objects_v2(
                Bucket=self.config.bucket, Prefix=self._full("_probe/"), MaxKeys=1
            )
        after = dt.datetime.now(dt.UTC)
        header = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date", "")
        try:
            server = email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError):
            raise StoreUnavailable(
                f"store {self._where()}: no usable Date header ({header[:40]!r})"
            ) from None
        if server.tzinfo is None:
            server = server.replace(tzinfo=dt.UTC)
        return StoreTime(server=server, local=before + (after - before) / 2)

    # -- listing ---------------------------------------------------------------------

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`."""
        validate_prefix(prefix)
        check_sizes(page_size, "page_size")
        strip = len(self.config.prefix)
        request: dict[str, Any] = {
            "Bucket": self.config.bucket,
            "Prefix": self._full(prefix),
            "MaxKeys": min(page_size, 1000),
        }
        if start_after:
            request["StartAfter"] = self._full(start_after)
        pending: list[ObjectInfo] = []
        while True:
            with _mapped("list", prefix):
                response = await self._s3.list_objects_v2(**request)
            for item in response.get("Contents", []):
                key = item["Key"][strip:]
                pending.append(ObjectInfo(key, int(item["Size"]), _etag(item["ETag"])))
            truncated = bool(response.get("IsTruncated"))
            while len(pending) >= page_size or (pending and not truncated):
                yield pending[:page_size]
                pending = pending[page_size:]
            if not truncated:
                return
            request["ContinuationToken"] = response["NextContinuationToken"]


class _PartReader:
    """Regroups a stream of chunks into parts of exactly ``part_size`` (the last shorter)."""

    def __init__(self, chunks: AsyncIterator[bytes], part_size: int) -> None:
        self._chunks = chunks
        self._part_size = part_size
        self._carry = b""
        self.exhausted = False

    async def next_part(self) -> bytes:
        """Return the next part, or b"" at the end; ``exhausted`` tells if this was the last."""
        buffer = bytearray(self._carry)
        self._carry = b""
        while len(buffer) < self._part_size and not self.exhausted:
            try:
                buffer += await anext(self._chunks)
            except StopAsyncIteration:
                self.exhausted = True
        if len(buffer) > self._part_size:
            self._carry = bytes(buffer[self._part_size :])
            del buffer[self._part_size :]
        if not self._carry and not self.exhausted:
            # Peek so that a stream ending exactly at a part boundary is known to end.
            try:
                self._carry = await anext(self._chunks)
            except StopAsyncIteration:
                self.exhausted = True
        return bytes(buffer)
