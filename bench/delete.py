"""Account deletion objects per second against raw S3 DeleteObjects, same server, same run.

Run from the repository root::

    .venv/bin/python -m bench.delete [--objects 10000] [--rounds 1]

It starts one moto S3 server and one real ``agents-control`` process on it, then:

- deletion: writes ``--objects`` sealed objects under an account's prefix
  (straight into the bucket), calls DeleteAccount and polls GetDeletion until
  the account is gone; the rate is objects / (reply of the last poll - call);
- raw: writes the same number of objects under another prefix and deletes
  them with DeleteObjects, 1000 keys a request, one request after the other
  (what a plain script with boto3 would do knowing the keys);
- raw listed: the same, but the keys are found by listing the prefix first,
  as the deletion must (and ``aws s3 rm --recursive`` does).

Prints the rates and the ratios deletion / raw (target at least 0.5) and
deletion / raw listed. On moto, listing costs about three times what deleting
does per key (its XML rendering), so the first ratio is bounded by listing.
Everything is bounded: sizes by flags, each wait by a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
from botocore.config import Config

from controlplane.client import AdminClient
from controlplane.integrity import record_mac_key
from controlplane.keys import load_home_keys
from shared.store.authenticated import seal
from tests.helpers.control_proc import run_init, s3_env, start_serve, stop_serve
from tests.helpers.moto_server import moto_server
from tests.helpers.poll import apoll_until

BUCKET = "bench-delete"
PREFIX = "cp/"
#: Seconds one deletion may take before the bench gives up.
DEADLINE = 600.0


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16),
    )


def _fill(s3: Any, keys: list[str], mac: bytes | None) -> None:
    def put(key: str) -> None:
        body = json.dumps({"k": key}).encode()
        if mac is not None:
            body = seal(mac, key.removeprefix(PREFIX), body)
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))


def bench_raw(s3: Any, objects: int, round_no: int, *, listed: bool) -> float:
    """DeleteObjects of known keys; with ``listed``, keys found by listing the prefix
    page by page first (what ``aws s3 rm --recursive`` does)."""
    prefix = f"raw/{round_no}/{'listed' if listed else 'known'}/"
    keys = [f"{prefix}obj_{i:06d}.json" for i in range(objects)]
    _fill(s3, keys, None)
    start = time.perf_counter()
    if listed:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            batch = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})
    else:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})
    elapsed = time.perf_counter() - start
    left = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0)
    if left:
        raise SystemExit(f"bench: raw delete left {left} objects")
    return objects / elapsed


async def bench_deletion(
    client: AdminClient, s3: Any, mac: bytes, objects: int, round_no: int
) -> float:
    reply = await client.create_account(1000 + round_no, f"bench{round_no}")
    account_id = reply["account"]["account_id"]
    keys = [f"{PREFIX}accounts/{account_id}/backups/seg_{i:06d}.json" for i in range(objects)]
    _fill(s3, keys, mac)
    start = time.perf_counter()
    state = (await client.delete_account(account_id))["state"]

    async def deleted() -> bool:
        return bool((await client.get_deletion(account_id))["state"] == "deleted")

    if state != "deleted":
        # Each poll is a store read on the same server: poll gently (the figure is
        # at most one step low).
        fail = f"bench: deletion not finished within {DEADLINE}s"
        await apoll_until(
            deleted, deadline=DEADLINE, what="deletion", step=0.05, fail=lambda: SystemExit(fail)
        )
    elapsed = time.perf_counter() - start
    left = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}accounts/{account_id}/")
    if left.get("KeyCount", 0):
        raise SystemExit(f"bench: the deletion left {left['KeyCount']} objects")
    return objects / elapsed


async def main_async(args: argparse.Namespace) -> int:
    with moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="bench-delete-") as tmp:
        s3 = _s3(endpoint)
        s3.create_bucket(Bucket=BUCKET)
        cp = run_init(Path(tmp) / "cp-home", f"s3://{BUCKET}/cp", s3_env(endpoint))
        try:
            start_serve(cp)
            mac = record_mac_key(load_home_keys(cp.home))
            deletion: list[float] = []
            raw: list[float] = []
            listed: list[float] = []
            async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
                for r in range(args.rounds):
                    deletion.append(await bench_deletion(client, s3, mac, args.objects, r))
                    raw.append(bench_raw(s3, args.objects, r, listed=False))
                    listed.append(bench_raw(s3, args.objects, r, listed=True))
        finally:
            stop_serve(cp)
    best_raw, best_listed, best_deletion = max(raw), max(listed), max(deletion)
    print(f"objects per account: {args.objects}, rounds: {args.rounds} (best of each)")
    print(f"raw S3 DeleteObjects of known keys (1000 keys/request): {best_raw:.0f} objects/s")
    print(f"raw list + DeleteObjects (aws s3 rm --recursive): {best_listed:.0f} objects/s")
    print(f"account deletion (DeleteAccount -> deleted): {best_deletion:.0f} objects/s")
    print(f"ratio deletion/raw {best_deletion / best_raw:.2f}x (target >= 0.5)")
    print(f"ratio deletion/list+delete {best_deletion / best_listed:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000, help="objects in the account")
    parser.add_argument("--rounds", type=int, default=1, help="repeat and keep the best")
    args = parser.parse_args(argv)
    if not 1 <= args.objects <= 200_000 or not 1 <= args.rounds <= 10:
        parser.error("--objects 1..200000, --rounds 1..10")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
