"""Replay of older genuine objects by a bucket writer, against a real control plane on moto.

The attacker has the bucket's credentials and no file of the home: with boto3
they save objects the control plane wrote and put them back later, or delete
them. The MAC cannot tell an older genuine object from the current one, so
each record whose older version grants more needs its own answer
(docs/security.md). Here: the fencing epoch, join tokens and machine revocations.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from controlplane.recovery.fencing import EPOCH_KEY
from tests.helpers.bucket import Bucket, counter
from tests.helpers.control_proc import (
    ControlProc,
    agents_control_exe,
    control_plane,
    recovery_key_path,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.link_client import connect_once, join

pytestmark = pytest.mark.integration

DEADLINE = 60.0


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    with control_plane(
        tmp_path / "home", f"s3://{s3_bucket}/cp", env=s3_env(moto_endpoint)
    ) as running:
        yield running


@pytest.fixture
def bucket(moto_endpoint: str, s3_bucket: str) -> Iterator[Bucket]:
    b = Bucket(moto_endpoint, s3_bucket)
    try:
        yield b
    finally:
        b.close()


def _replays(cp: ControlProc, record: str) -> float:
    """agents_cp_store_replays_refused_total{record} from the daemon's /metrics."""
    found = counter(cp, "agents_cp_store_replays_refused_total", "record", record)
    assert found is not None, "the counter is exported from the start"
    return found


def _fsck_kinds(cp: ControlProc) -> dict[str, str]:
    """``fsck --json`` (read-only, beside the running daemon): key -> finding kind."""
    res = cp.cli("fsck", "--json", timeout=DEADLINE)
    assert res.code in (0, 1), res.err
    return {f["key"]: f["kind"] for f in json.loads(res.out)["findings"]}


def _serve_refused(cp: ControlProc, home: Path, says: str) -> None:
    """``serve --home`` refuses at start in one line, having written nothing."""
    res = subprocess.run(
        [str(agents_control_exe()), "serve", "--home", str(home)],
        env=cp.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("agents-control: ") and says in last, res.stderr


def test_a_deleted_or_older_epoch_record_is_refused_not_a_fresh_start(
    cp: ControlProc, bucket: Bucket
) -> None:
    first = bucket.get(EPOCH_KEY)  # the epoch the fixture's serve took
    stop_serve(cp)
    start_serve(cp)
    stop_serve(cp)
    # Before: the older copy was taken up (epoch 2 again, a second owner's epoch)
    # and a deleted record started a fresh deployment at epoch 1.
    bucket.put(EPOCH_KEY, first)
    frozen = bucket.everything()
    _serve_refused(cp, cp.home, "went back to epoch 1, but this home held epoch 2")
    assert bucket.everything() == frozen
    bucket.delete(EPOCH_KEY)
    frozen = bucket.everything()
    _serve_refused(cp, cp.home, "is missing, but this home held epoch 2")
    assert bucket.everything() == frozen


def test_a_home_down_during_a_restore_refuses_its_own_record_put_back(
    cp: ControlProc, bucket: Bucket, tmp_path: Path, s3_bucket: str
) -> None:
    old_record = bucket.get(EPOCH_KEY)
    stop_serve(cp)  # the old home's VM is down
    restored = tmp_path / "restored"
    done = subprocess.run(
        [str(agents_control_exe()), "restore", "--home", str(restored),
         "--store", f"s3://{s3_bucket}/cp", "--recovery-key", str(recovery_key_path(cp.home))],
        env=cp.env, capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The old home comes back, and a bucket writer has put its own last record back.
    bucket.put(EPOCH_KEY, old_record)
    frozen = bucket.everything()
    _serve_refused(cp, cp.home, "this home was superseded")
    assert bucket.everything() == frozen


async def test_a_used_token_put_back_joins_nothing(cp: ControlProc, bucket: Bucket) -> None:
    made = cp.cli("account", "create", "--github-id", "9101", "--github-login", "rp", "--json")
    assert made.code == 0, made.err
    account = json.loads(made.out)["account_id"]
    value = json.loads(cp.cli("token", "create", "--account", account, "--json").out)["token_value"]
    record_key = f"accounts/{account}/tokens/{value.split('.')[0]}.json"
    unused = bucket.get(record_key)
    machine, cert, key = await join(cp.public, cp.ca_pem, value)
    await connect_once(cp.link, cp.ca_pem, cert, key)  # the join is confirmed
    # Before: the record put back at 0 uses let a second box join with the token.
    bucket.put(record_key, unused)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await join(cp.public, cp.ca_pem, value)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token already used" in (refused.value.details() or "")
    assert _replays(cp, "token") >= 1
    assert _fsck_kinds(cp).get(record_key) == "replay"
    listed = json.loads(cp.cli("machine", "list", "--account", account, "--json").out)
    assert [m["machine_id"] for m in listed["machines"]] == [machine]


async def test_a_revoked_machine_put_back_stays_revoked(cp: ControlProc, bucket: Bucket) -> None:
    made = cp.cli("account", "create", "--github-id", "9102", "--github-login", "rv", "--json")
    assert made.code == 0, made.err
    account = json.loads(made.out)["account_id"]
    value = json.loads(cp.cli("token", "create", "--account", account, "--json").out)["token_value"]
    machine, cert, key = await join(cp.public, cp.ca_pem, value)
    await connect_once(cp.link, cp.ca_pem, cert, key)
    record_key = f"accounts/{account}/machines/{machine}.json"
    before = bucket.get(record_key)
    revoked = cp.cli("machine", "revoke", machine)
    assert revoked.code == 0, revoked.err
    assert _replays(cp, "machine") == 0
    # Before: the record put back said "revoked: False" at once, and after a
    # restart (the in-memory set gone) the machine connected and was online.
    bucket.put(record_key, before)
    shown = json.loads(cp.cli("machine", "show", machine, "--json").out)
    assert shown["revoked"] is True, shown
    assert _replays(cp, "machine") >= 1
    assert _fsck_kinds(cp).get(record_key) == "replay"
    stop_serve(cp)
    start_serve(cp)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await connect_once(cp.link, cp.ca_pem, cert, key)
    assert "revoked" in (refused.value.details() or ""), refused.value


async def test_a_replaced_box_stays_out_when_the_old_record_is_put_back(
    cp: ControlProc, bucket: Bucket
) -> None:
    made = cp.cli("account", "create", "--github-id", "9103", "--github-login", "rb", "--json")
    assert made.code == 0, made.err
    account = json.loads(made.out)["account_id"]
    value = json.loads(cp.cli("token", "create", "--account", account, "--json").out)["token_value"]
    machine, old_cert, old_key = await join(cp.public, cp.ca_pem, value)
    await connect_once(cp.link, cp.ca_pem, old_cert, old_key)
    record_key = f"accounts/{account}/machines/{machine}.json"
    before = bucket.get(record_key)
    repair = json.loads(cp.cli("machine", "repair", machine, "--json").out)
    repaired, new_cert, new_key = await join(cp.public, cp.ca_pem, repair["token_value"])
    assert repaired == machine
    await connect_once(cp.link, cp.ca_pem, new_cert, new_key)
    # Before: the record put back named the old box's certificate again, and the
    # replaced box connected as the machine.
    bucket.put(record_key, before)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await connect_once(cp.link, cp.ca_pem, old_cert, old_key)
    assert "certificate superseded" in (refused.value.details() or ""), refused.value
    assert _replays(cp, "machine") >= 1


async def test_a_deleted_account_put_back_stays_deleted(
    cp: ControlProc, moto_endpoint: str, s3_bucket: str
) -> None:
    """After a deletion finished, the account's records and its tombstone put back
    (genuine copies saved before) grant nothing: ``deleted/<a>`` outlives them. The
    account answers like a missing one, its token and machine are refused, and
    fsck names what was put back (its tombstone too) and repair removes it."""
    bucket = Bucket(moto_endpoint, s3_bucket, home=cp.home)
    try:
        made = cp.cli("account", "create", "--github-id", "9104", "--github-login", "dl", "--json")
        assert made.code == 0, made.err
        account = json.loads(made.out)["account_id"]
        value = json.loads(cp.cli("token", "create", "--account", account, "--json").out)[
            "token_value"
        ]
        spare = json.loads(cp.cli("token", "create", "--account", account, "--json").out)[
            "token_value"
        ]
        machine, cert, key = await join(cp.public, cp.ca_pem, value)
        await connect_once(cp.link, cp.ca_pem, cert, key)
        saved = {
            k: bucket.get(k)
            for k in (
                f"accounts/{account}/account.json",
                f"accounts/{account}/machines/{machine}.json",
                f"accounts/{account}/tokens/{spare.split('.')[0]}.json",
            )
        }
        deleted = cp.cli("account", "delete", account, "--wait", "--json")
        assert deleted.code == 0, deleted.err
        assert f"deleted/{account}.json" in {k.removeprefix("cp/") for k in bucket.everything()}
        for k, data in saved.items():
            bucket.put(k, data)
        # The tombstone as the deletion wrote it (sealed: what a saved copy would be).
        tombstone = {
            "account_id": account,
            "state": "deleting",
            "started_at": "2026-12-01T00:00:00Z",
            "deleted_by": "adm_" + "0" * 26,
            "deleted_objects": 0,
        }
        bucket.put(
            f"accounts/{account}/deleting.json", json.dumps(tombstone).encode(), genuine=True
        )

        shown = cp.cli("account", "show", account)
        assert shown.code == 2 and "not found" in shown.err, shown
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await join(cp.public, cp.ca_pem, spare)
        assert refused.value.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        ), refused.value
        with pytest.raises(grpc.aio.AioRpcError):
            await connect_once(cp.link, cp.ca_pem, cert, key)
        listed = json.loads(cp.cli("account", "list", "--json").out)
        assert account not in json.dumps(listed)
        assert _replays(cp, "account") >= 1
        # fsck names every object put back (a leftover of a deleted account).
        stop_serve(cp)
        res = cp.cli("fsck", "--json", timeout=DEADLINE)
        assert res.code in (0, 1), res.err
        named = {f["key"] for f in json.loads(res.out)["findings"]}
        left = {k.removeprefix("cp/") for k in bucket.everything()}
        assert {k for k in left if k.startswith(f"accounts/{account}/")} <= named, (named, left)
        # Repair removes them (a serving control plane ignores them meanwhile:
        # deleted/<a> wins over every record under the account).
        res = cp.cli("fsck", "--repair", "--json", timeout=DEADLINE)
        assert res.code in (0, 1), res.err
        keys = {k.removeprefix("cp/") for k in bucket.everything()}
        assert f"deleted/{account}.json" in keys
        assert not any(k.startswith(f"accounts/{account}/") for k in keys), keys
        start_serve(cp)
        shown = cp.cli("account", "show", account)
        assert shown.code == 2 and "not found" in shown.err, shown
    finally:
        bucket.close()
