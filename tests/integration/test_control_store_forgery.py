"""Write access to the bucket alone grants nothing: forged and altered objects are refused.

Each test writes a record straight into the bucket with boto3, the way someone
with the bucket's credentials but no file from the control plane's home could,
and shows the real control plane refuses it. Then it writes the very same
record sealed with the home's key (``tests/helpers/store_records.sealed``) and
shows it is accepted: the MAC, and nothing else, is what refused the forgery.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from controlplane.access.hashing import hash_secret, new_secret
from controlplane.integrity.records import Credential, JoinToken, Machine, encode
from shared.ids import new_id
from tests.helpers.bucket import Bucket, counter
from tests.helpers.control_proc import CliResult, ControlProc, control_plane, s3_env
from tests.helpers.link_client import join
from tests.helpers.store_records import payload

pytestmark = pytest.mark.integration


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    with control_plane(
        tmp_path / "home", f"s3://{s3_bucket}/cp", env=s3_env(moto_endpoint)
    ) as running:
        yield running


@pytest.fixture
def bucket(cp: ControlProc, moto_endpoint: str, s3_bucket: str) -> Iterator[Bucket]:
    b = Bucket(moto_endpoint, s3_bucket, cp.home)
    try:
        yield b
    finally:
        b.close()


def _refused(cp: ControlProc, kind: str) -> float:
    """agents_cp_store_records_refused_total{kind} from the daemon's /metrics."""
    return counter(cp, "agents_cp_store_records_refused_total", "kind", kind) or 0.0


def _account(cp: ControlProc, gid: int) -> str:
    res = cp.cli("account", "create", "--github-id", str(gid), "--github-login", f"u{gid}")
    assert res.code == 0, res.err
    m = re.search(r"account (acct_[0-9a-z]{26})", res.out)
    assert m, res.out
    return m.group(1)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _listed_ids(res: CliResult, field: str) -> list[str]:
    assert res.code == 0, res.err
    data = json.loads(res.out)
    # Listings print {"<things>": [...]}: one key, one list.
    (items,) = data.values()
    return [str(item[field]) for item in items]


def test_forged_and_altered_credentials_grant_nothing(cp: ControlProc, bucket: Bucket) -> None:
    # A forged operator credential: a record and a hash for a secret the forger chose.
    cred_id, secret = new_id("credential"), new_secret()
    forged = Credential(
        cred_id, "operator", "", hash_secret("credential", cred_id, secret), _now()
    ).to_dict()
    bucket.put(f"credentials/{cred_id}.json", encode(forged))
    res = cp.cli("account", "list", credential=f"{cred_id}.{secret}")
    assert res.code == 1 and "unknown credential or wrong secret" in res.err, res.err
    assert _refused(cp, "credential") >= 1
    bucket.put(f"credentials/{cred_id}.json", encode(forged), genuine=True)
    assert cp.cli("account", "list", credential=f"{cred_id}.{secret}").code == 0

    # An altered one: a genuine account credential whose scope is raised to operator,
    # its original MAC kept.
    acct = _account(cp, 11)
    made = json.loads(cp.cli("credential", "create", "--account", acct, "--json").out)
    value = made["credential"]
    key = f"credentials/{value.split('.')[0]}.json"
    stored = bucket.get(key)
    header = stored.split(b"\n", 1)[0]
    record = json.loads(payload(stored))
    raised = encode({**record, "scope": "operator", "account_id": ""})
    bucket.put(key, header + b"\n" + raised)
    other = _account(cp, 12)
    res = cp.cli("account", "show", other, credential=value)
    assert res.code == 1 and "unknown credential" in res.err, res.err
    bucket.put(key, raised, genuine=True)
    assert cp.cli("account", "show", other, credential=value).code == 0


async def test_forged_token_cannot_join(cp: ControlProc, bucket: Bucket) -> None:
    acct = _account(cp, 21)
    token_id, secret = new_id("token"), new_secret()
    now = _now()
    token = JoinToken(
        token_id, acct, hash_secret("token", token_id, secret), now, now + dt.timedelta(hours=1)
    ).to_dict()
    index = {"account_id": acct}
    bucket.put(f"index/tokens/{token_id}.json", encode(index))
    bucket.put(f"accounts/{acct}/tokens/{token_id}.json", encode(token))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await join(cp.public, cp.ca_pem, f"{token_id}.{secret}")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown token or wrong secret" in (info.value.details() or "")
    assert _refused(cp, "index") >= 1
    # The index entry alone, sealed: the forged record is still refused.
    bucket.put(f"index/tokens/{token_id}.json", encode(index), genuine=True)
    with pytest.raises(grpc.aio.AioRpcError):
        await join(cp.public, cp.ca_pem, f"{token_id}.{secret}")
    assert _refused(cp, "token") >= 1
    bucket.put(f"accounts/{acct}/tokens/{token_id}.json", encode(token), genuine=True)
    machine_id, _, _ = await join(cp.public, cp.ca_pem, f"{token_id}.{secret}")
    assert machine_id.startswith("mc_")


def test_forged_machine_and_account_are_invisible(cp: ControlProc, bucket: Bucket) -> None:
    acct = _account(cp, 31)
    machine_id = new_id("machine")
    now = _now()
    machine = Machine(
        machine_id, acct, "ghost", "h", "1", now, "ab" * 20, now + dt.timedelta(days=1)
    ).to_dict()
    bucket.put(f"index/machines/{machine_id}.json", encode({"account_id": acct}))
    bucket.put(f"accounts/{acct}/machines/{machine_id}.json", encode(machine))
    res = cp.cli("machine", "show", machine_id)
    assert res.code == 2 and "not found" in res.err, res.err
    assert machine_id not in _listed_ids(cp.cli("machine", "list", "--json"), "machine_id")
    bucket.put(f"index/machines/{machine_id}.json", encode({"account_id": acct}), genuine=True)
    bucket.put(f"accounts/{acct}/machines/{machine_id}.json", encode(machine), genuine=True)
    assert cp.cli("machine", "show", machine_id).code == 0
    assert machine_id in _listed_ids(cp.cli("machine", "list", "--json"), "machine_id")

    # An account: its record and its listing entry.
    ghost = new_id("account")
    account: dict[str, Any] = {
        "account_id": ghost,
        "github_user_id": 32,
        "github_login": "ghost",
        "signed_up_at": now.isoformat().replace("+00:00", "Z"),
        "recovery_public_key": "00" * 32,
    }
    bucket.put(f"index/accounts/{ghost}.json", b"{}")
    bucket.put(f"accounts/{ghost}/account.json", encode(account))
    assert ghost not in _listed_ids(cp.cli("account", "list", "--json"), "account_id")
    assert cp.cli("account", "show", ghost).code == 2
    bucket.put(f"index/accounts/{ghost}.json", b"{}", genuine=True)
    bucket.put(f"accounts/{ghost}/account.json", encode(account), genuine=True)
    assert ghost in _listed_ids(cp.cli("account", "list", "--json"), "account_id")


def test_forged_github_claim_does_not_block_sign_up(cp: ControlProc, bucket: Bucket) -> None:
    claim = encode({"account_id": new_id("account")})
    bucket.put("index/github/41.json", claim)
    _account(cp, 41)  # the forged claim is replaced
    bucket.put("index/github/42.json", claim, genuine=True)
    res = cp.cli("account", "create", "--github-id", "42", "--github-login", "u42")
    assert res.code == 2 and "already exists" in res.err, res.err
