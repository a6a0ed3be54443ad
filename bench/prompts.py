"""Benchmark the prompt queue against raw S3 on the same moto server, same run.

Run from the repository root::

    .venv/bin/python -m bench.prompts [--prompts 200] [--size 1024]

It starts one moto S3 server and, in this process, measures:

(a) raw: ``--prompts`` PUTs, then as many GETs, of ``--size``-byte objects
    straight through the S3 store (no MAC, no sealing);
(b) enqueue: ``PromptQueue.send`` of ``--prompts`` prompts of ``--size`` bytes
    to one machine through the control plane's store stack (MAC'd store,
    retries, metrics): seal + one LIST + one conditional PUT each;
(c) drain: ``pending`` (LIST + one GET each, 8 at once) and the deletes of
    the acknowledged entries through :class:`~controlplane.queue.acks.AckBatcher`
    (acknowledgements arriving one by one; those that arrive while a delete
    is in flight share the next DeleteObjects), as a connect drains it.

It prints prompts per second of each and the ratios enqueue/raw PUT,
drain/raw GET (target: at least 0.5) and drain/raw GET+DELETE (a drained
prompt is both read and deleted, so raw GET alone bounds drain near 0.5).
Everything is bounded by the counts. ``--json PATH`` also writes the three
ratios for ``bench/report.py`` (bench/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import time
from pathlib import Path

import boto3  # type: ignore[import-untyped]

from bench.results import BenchResult, Row
from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.machines.pairing import Pairing
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.queue.acks import AckBatcher
from controlplane.queue.prompts import PromptQueue, QueueLimits
from shared import tls
from shared.crypto import BoxKeyPair
from shared.ids import new_id
from shared.store import ObjectStore, StoreOptions, open_store
from shared.store.authenticated import AuthenticatedStore
from tests.helpers.moto_server import moto_server

ACCESS_KEY, SECRET_KEY = "testing", "testing-secret"


async def _store(endpoint: str, bucket: str, prefix: str) -> ObjectStore:
    options = StoreOptions(
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region="us-east-1",
        endpoint_url=endpoint,
    )
    return await open_store(f"s3://{bucket}/{prefix}", options=options)


async def _raw(store: ObjectStore, count: int, size: int) -> tuple[float, float, float]:
    body = os.urandom(size)
    keys = [f"raw/{i:08d}" for i in range(count)]
    start = time.perf_counter()
    for key in keys:
        await store.put(key, body, if_none_match=True)
    put = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        await store.get(key)
    get = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        await store.delete(key)
    delete = time.perf_counter() - start
    return count / put, count / get, count / delete


async def _queue(store: ObjectStore, count: int, size: int) -> tuple[float, float]:
    audit = Auditor(store)
    accounts = AccountService(store, audit)
    tokens = TokenService(store, accounts, audit)
    machines = MachineRegistry(store, accounts, audit)
    pairing = Pairing(tokens, machines, accounts, tls.make_ca(), dt.timedelta(days=1))
    op = Principal("adm_" + "0" * 26, "operator")
    account = (await accounts.create(1, "bench", None, "bench")).account.account_id
    token = await tokens.create(op, account)
    joined = await pairing.join(
        token.value,
        tls.build_csr(tls.new_tls_key()).decode(),
        MachineInfo("bench", "0", "h", box_public_key=BoxKeyPair.generate().public_key),
    )
    machine_id = joined.machine.machine_id
    queue = PromptQueue(store, machines, audit, limits=QueueLimits(max_depth=count + 1))
    agent = new_id("agent")
    text = "p" * size
    start = time.perf_counter()
    for _ in range(count):
        await queue.send(op, machine_id, agent, text)
    enqueue = time.perf_counter() - start
    start = time.perf_counter()
    entries = await queue.pending(account, machine_id)
    acks = AckBatcher(queue)
    deleted = []
    for entry in entries:
        # Acknowledgements come one by one (a link reads one message at a
        # time); those arriving while a delete is in flight go in the next batch.
        deleted.append(acks.add(entry))
        await asyncio.sleep(0)
    await asyncio.gather(*deleted)
    drain = time.perf_counter() - start
    if len(entries) != count or await queue.pending(account, machine_id):
        raise SystemExit(f"bench: drained {len(entries)} of {count}, or the queue is not empty")
    return count / enqueue, count / drain


async def run(count: int, size: int) -> BenchResult:
    """Measure and print (see the module doc); return the figures printed."""
    with moto_server() as endpoint:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        raw_store = await _store(endpoint, "bench", "raw")
        async with raw_store:
            raw_put, raw_get, raw_delete = await _raw(raw_store, count, size)
        inner = await _store(endpoint, "bench", "cp")
        async with AuthenticatedStore(inner, os.urandom(32)) as store:
            enqueue, drain = await _queue(store, count, size)
    print(f"prompts: {count} of {size} bytes, moto S3 server")
    print(f"raw S3 PUT        : {raw_put:8.1f} objects/s")
    print(f"raw S3 GET        : {raw_get:8.1f} objects/s")
    # A drained prompt is read AND deleted: compare with both raw steps too.
    raw_cycle = 1 / (1 / raw_get + 1 / raw_delete)
    print(f"raw S3 DELETE     : {raw_delete:8.1f} objects/s")
    print(f"raw S3 GET+DELETE : {raw_cycle:8.1f} objects/s")
    ratio_in = enqueue / raw_put
    print(f"enqueue (send)    : {enqueue:8.1f} prompts/s  ratio enqueue/raw PUT {ratio_in:.2f}x")
    print(f"drain (read+ack)  : {drain:8.1f} prompts/s  ratio drain/raw GET {drain / raw_get:.2f}x")
    print(f"                                  ratio drain/raw GET+DELETE {drain / raw_cycle:.2f}x")
    rate = "prompts/s"
    return BenchResult(
        bench="prompts",
        command=f"python -m bench.prompts --prompts {count} --size {size}",
        rows=[
            Row("enqueue (send)", enqueue, raw_put, rate, "raw S3 PUT", "higher"),
            Row("drain (read + ack)", drain, raw_get, rate, "raw S3 GET", "higher", ">= 0.5x"),
            Row("drain (read + ack)", drain, raw_cycle, rate, "raw S3 GET+DELETE", "higher"),
        ],
        notes=[f"{count} prompts of {size} bytes, one moto S3 server"],
    )


def main() -> int:
    """The command line (see the module doc)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts (and raw objects)")
    parser.add_argument("--size", type=int, default=1024, help="bytes per prompt")
    parser.add_argument("--json", type=Path, help="also write the figures here (bench/results.py)")
    args = parser.parse_args()
    if not 1 <= args.prompts <= 10_000 or not 1 <= args.size <= 1024 * 1024:
        parser.error("--prompts must be 1..10000 and --size 1..1048576")
    asyncio.run(run(args.prompts, args.size)).write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
