"""The bucket as a writer with its credentials and no file of the home sees it (boto3),
and the control plane's counters of what it refused, read from its /metrics."""

from __future__ import annotations

import re
import secrets
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3  # type: ignore[import-untyped]
from botocore.config import Config

from tests.helpers.control_proc import ControlProc
from tests.helpers.store_records import sealed

#: The deployment prefix the tests' control planes use (``s3://<bucket>/cp``).
PREFIX = "cp/"


class Bucket:
    """Objects under the deployment prefix, written and read straight with boto3."""

    def __init__(self, endpoint: str, bucket: str, home: Path | None = None) -> None:
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            config=Config(s3={"addressing_style": "path"}),
        )
        self.bucket = bucket
        self.home = home

    def put(self, key: str, data: bytes, *, genuine: bool = False) -> None:
        """Write ``data`` at ``key``: as is (a forgery, or an older genuine copy put
        back), or sealed with the home's key (``genuine``: what the MAC would accept)."""
        if genuine:
            assert self.home is not None, "sealing needs the home"
            data = sealed(self.home, key, data)
        self.client.put_object(Bucket=self.bucket, Key=PREFIX + key, Body=data)

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=PREFIX + key)["Body"].read())

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=PREFIX + key)

    def everything(self) -> dict[str, bytes]:
        """Every object in the bucket, key -> bytes."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for obj in page.get("Contents", []):
                body = self.client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"]
                out[obj["Key"]] = bytes(body.read())
        return out

    def close(self) -> None:
        self.client.close()


def counter(cp: ControlProc, name: str, label: str, value: str) -> float | None:
    """``name{label="value"}`` from the control plane's /metrics; None when not exported."""
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=15) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}\{{{label}="{value}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


@contextmanager
def locked_bucket(endpoint: str, *, retention: bool = True) -> Iterator[str]:
    """A bucket made with S3 Object Lock and (``retention``) a default retention in
    governance mode, so that it can be emptied and removed afterwards."""
    name = f"locked-{secrets.token_hex(6)}"
    client = Bucket(endpoint, name).client
    client.create_bucket(Bucket=name, ObjectLockEnabledForBucket=True)
    if retention:
        client.put_object_lock_configuration(
            Bucket=name,
            ObjectLockConfiguration={
                "ObjectLockEnabled": "Enabled",
                "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}},
            },
        )
    try:
        yield name
    finally:
        for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
            for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
                client.delete_object(
                    Bucket=name,
                    Key=v["Key"],
                    VersionId=v["VersionId"],
                    BypassGovernanceRetention=True,
                )
        client.delete_bucket(Bucket=name)
        client.close()
