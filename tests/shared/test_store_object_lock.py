"""``object_lock``: an S3 store that must have Object Lock with a default retention
(moto's S3 server, which implements Object Lock and, like S3, refuses an upload to
such a bucket without a checksum)."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from shared.errors import ConfigError, StoreError
from shared.store import S3Store, StoreOptions, open_store
from shared.store.s3_config import S3Config
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, _s3_client
from tests.helpers.bucket import locked_bucket


@pytest.fixture
def locked(moto_endpoint: str) -> Iterator[str]:
    """A bucket with Object Lock and a default retention."""
    with locked_bucket(moto_endpoint) as name:
        yield name


def _config(endpoint: str, bucket: str, *, lock: bool) -> S3Config:
    return S3Config(
        bucket=bucket,
        prefix="deploy/",
        endpoint_url=endpoint,
        access_key=TEST_ACCESS_KEY,
        secret_key=TEST_SECRET_KEY,
        object_lock=lock,
    )


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1000):
        yield data[i : i + 1000]


async def test_a_bucket_without_object_lock_is_refused_naming_it(
    moto_endpoint: str, s3_bucket: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        await S3Store.open(_config(moto_endpoint, s3_bucket, lock=True))
    assert refused.value.field == "store_object_lock"
    message = str(refused.value)
    assert s3_bucket in message and "ObjectLockEnabled" in message
    assert "\n" not in message
    # Unset, nothing changes: the same bucket opens.
    store = await S3Store.open(_config(moto_endpoint, s3_bucket, lock=False))
    await store.close()


async def test_object_lock_without_a_default_retention_is_refused(moto_endpoint: str) -> None:
    with locked_bucket(moto_endpoint, retention=False) as name:
        with pytest.raises(ConfigError) as refused:
            await S3Store.open(_config(moto_endpoint, name, lock=True))
        assert name in str(refused.value) and "DefaultRetention" in str(refused.value)


async def test_a_locked_bucket_opens_and_keeps_what_is_deleted(
    moto_endpoint: str, locked: str
) -> None:
    config = _config(moto_endpoint, locked, lock=True)
    store = await open_store(
        f"s3://{locked}/deploy",
        options=StoreOptions(
            access_key=TEST_ACCESS_KEY,
            secret_key=TEST_SECRET_KEY,
            endpoint_url=moto_endpoint,
            object_lock=True,
        ),
    )
    try:
        await store.put("marker", b"create-only", if_none_match=True)
        await store.put("segment", _chunks(secrets.token_bytes(5000)), if_none_match=True)
        etag = (await store.head("marker")).etag
        await store.put("marker", b"swapped", if_match=etag)
        assert await store.get("marker") == b"swapped"
        await store.delete("marker")
        assert [i.key async for i in store.list("")] == ["segment"]
    finally:
        await store.close()
    # What retention keeps: every version of the deleted marker is still in the bucket.
    client = _s3_client(moto_endpoint)
    try:
        versions: dict[str, Any] = client.list_object_versions(Bucket=locked)
        kept = [v for v in versions.get("Versions", []) if v["Key"] == "deploy/marker"]
        assert len(kept) == 2
        with pytest.raises(client.exceptions.ClientError):
            client.delete_object(Bucket=locked, Key="deploy/marker", VersionId=kept[0]["VersionId"])
    finally:
        client.close()
    # Without the setting the store cannot write there at all: such a bucket refuses
    # an upload without a checksum, which the store sends only with object_lock.
    with pytest.raises(StoreError, match="MissingUploadObjectWithObjectLockHeaders"):
        await S3Store.open(dataclasses.replace(config, object_lock=False))


async def test_object_lock_on_a_folder_store_is_a_config_error(tmp_path: Any) -> None:
    with pytest.raises(ConfigError):
        await open_store(str(tmp_path / "store"), options=StoreOptions(object_lock=True))
