"""General fixtures: a moto S3 server subprocess, a fresh bucket, every store."""

from __future__ import annotations

import compileall
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from shared.store import FolderStore, MemoryStore, ObjectStore, S3Config, S3Store
from tests.helpers.moto_server import moto_server

STORE_KINDS = ["folder", "s3", "memory"]
TEST_ACCESS_KEY = "testing"
TEST_SECRET_KEY = "testing-secret"
ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the packages' bytecode once, before any test starts a daemon or CLI.

    With PYTHONDONTWRITEBYTECODE set (as in many containers) Python never caches
    bytecode, so each of the suite's many ``agents-control`` /
    ``agents-machine`` processes would compile every module it imports again
    (about a quarter of a CLI run's CPU). Cached files are still read under that
    setting; compileall writes them regardless of it.
    """
    for package in ("shared", "machine", "controlplane", "tests/helpers"):
        compileall.compile_dir(ROOT / package, quiet=1)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """Endpoint URL of one moto S3 server subprocess shared by the session."""
    with moto_server() as url:
        yield url


def _s3_client(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )


@pytest.fixture
def s3_bucket(moto_endpoint: str) -> Iterator[str]:
    """A fresh, empty bucket on the moto server; emptied and removed afterwards."""
    name = f"test-{secrets.token_hex(6)}"
    client = _s3_client(moto_endpoint)
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        # Free moto's memory: large test objects would otherwise pile up.
        uploads = client.list_multipart_uploads(Bucket=name).get("Uploads", [])
        for upload in uploads:
            client.abort_multipart_upload(
                Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})
        client.delete_bucket(Bucket=name)
        client.close()


@pytest.fixture
def s3_config(moto_endpoint: str, s3_bucket: str) -> S3Config:
    """An S3Config for the fresh bucket, under a prefix so prefix handling is exercised."""
    return S3Config(
        bucket=s3_bucket,
        prefix="deploy/",
        endpoint_url=moto_endpoint,
        access_key=TEST_ACCESS_KEY,
        secret_key=TEST_SECRET_KEY,
    )


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test."""
    return str(request.param)


@pytest.fixture
async def store(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[ObjectStore]:
    """Each backend in turn, open and empty; closed afterwards."""
    backend: ObjectStore
    if store_kind == "folder":
        backend = FolderStore(tmp_path / "store")
    elif store_kind == "s3":
        backend = await S3Store.open(request.getfixturevalue("s3_config"))
    else:
        backend = MemoryStore()
    try:
        yield backend
    finally:
        await backend.close()
