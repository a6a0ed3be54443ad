"""Crash consistency of the control plane's multi-object changes, with real processes.

A fault-injecting proxy (``tests/helpers/fault_proxy.py``) sits between a real
``agents-control serve`` and moto's S3 server and SIGKILLs the daemon right
after the server accepted its n-th write, for n = 1, 2, ... until the change
completes without a crash: so every gap between two store writes of account
create, token create and join (with its token use) is a crash point. After
each crash the daemon is started again and must show no orphan, no GitHub id
stuck, no token lost, and ``agents-control fsck`` must be clean.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from controlplane.cli.admin_types import JoinToken
from controlplane.cli.client import AdminClient
from controlplane.config import load_config
from controlplane.integrity.keys import HomeKeys, load_home_keys
from controlplane.integrity.trusted import marker_deployment_id
from controlplane.recovery.fencing import EPOCH_KEY, HOME_ID_FILE, read_home_id
from controlplane.recovery.fsck import FsckReport, fsck_deployment
from controlplane.recovery.keybundle import StoredBundle, open_bundle
from shared import tls
from shared.recovery_key import read_recovery_key
from shared.store.authenticated import unverified_payload
from tests.conftest import _s3_client
from tests.helpers.control_proc import (
    CliResult,
    ControlProc,
    agents_control_exe,
    init_argv,
    recovery_key_path,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.fault_proxy import CrashProxy, crash_proxy
from tests.helpers.link_client import connect_once, join
from tests.helpers.poll import apoll_until
from tests.helpers.store_records import read_json

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
#: Seconds a joined machine has to connect before its join is rolled back.
CONFIRM_GRACE = 3.0
#: Seconds before the self-check asks again about a held join (config
#: intent_recheck_seconds, 30 by default): a trial waits for the roll-back, which
#: comes within this of CONFIRM_GRACE.
INTENT_RECHECK = 0.5
MAX_WRITES = 12
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
#: Where the control plane keeps its intents in the bucket (store URL s3://bucket/cp).
INTENTS = "cp/cp/intents/"


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[CrashProxy]:
    with crash_proxy(moto_endpoint) as p:
        yield p


@pytest.fixture
def cp(tmp_path: Path, proxy: CrashProxy, s3_bucket: str) -> Iterator[ControlProc]:
    env = {**s3_env(proxy.url), "AGENTS_CONTROL_JOIN_CONFIRM_GRACE": str(CONFIRM_GRACE)}
    running = run_init(
        tmp_path / "home", f"s3://{s3_bucket}/cp", env, ["--heartbeat-interval", str(HEARTBEAT)]
    )
    with (running.home / "config.toml").open("a") as f:
        f.write(f"intent_recheck_seconds = {INTENT_RECHECK}\n")
    try:
        start_serve(running)
        yield running
    finally:
        proxy.disarm()
        stop_serve(running)


def _ok(res: CliResult) -> str:
    assert res.code == 0, res.err
    return res.out


def _json(cp: ControlProc, *args: str) -> Any:
    return json.loads(_ok(cp.cli(*args, "--json")))


def _crashed(cp: ControlProc, proxy: CrashProxy) -> bool:
    """Whether the armed write killed the daemon; if so, wait for it and start it again."""
    if not proxy.crashed.is_set():
        proxy.disarm()
        return False
    assert cp.process is not None
    cp.process.wait(timeout=10)
    start_serve(cp)
    return True


def _accounts_of(cp: ControlProc, gid: int) -> list[Any]:
    # str(): the JSON form of a 64-bit id may be a string.
    return [
        a for a in _json(cp, "account", "list")["accounts"] if str(a["github_user_id"]) == str(gid)
    ]


async def _fsck(cp: ControlProc) -> FsckReport:
    """A read-only fsck of the deployment, in this process: the trials run one at
    every kill point, and a CLI process each time cost about a second of
    interpreter start (the CLI's output has tests of its own)."""
    return await fsck_deployment(load_config({"home": str(cp.home)}, cp.env), repair=False)


def _assert_fsck_clean(cp: ControlProc) -> None:
    report = asyncio.run(_fsck(cp))
    assert report.clean, report.to_dict()


async def _aassert_fsck_clean(cp: ControlProc) -> None:
    report = await _fsck(cp)
    assert report.clean, report.to_dict()


async def _settled(cp: ControlProc, s3: Any, bucket: str) -> bool:
    """Whether fsck is clean. While an intent object is left in the bucket fsck reports
    it as unfinished, so that is checked first (cheaper than a whole fsck), and the
    roll-back waits CONFIRM_GRACE."""
    if s3.list_objects_v2(Bucket=bucket, Prefix=INTENTS).get("KeyCount", 0):
        return False
    return (await _fsck(cp)).clean


def _committed(proxy: CrashProxy) -> bool:
    """Whether the change's commit point (deleting its intent) was among the writes."""
    return any(w.startswith(f"DELETE {INTENTS}") for w in proxy.writes)


# Many daemon starts and kill points: minutes on a loaded machine.
@pytest.mark.timeout(600)
def test_account_create_crash_at_every_write(cp: ControlProc, proxy: CrashProxy) -> None:
    points = 0
    for n in range(1, MAX_WRITES):
        gid = 5000 + n
        assert cp.process is not None
        proxy.arm(cp.process.pid, after=n)
        res = cp.cli("account", "create", "--github-id", str(gid), "--github-login", f"u{gid}")
        if not _crashed(cp, proxy):
            assert res.code == 0, res.err
            break
        points += 1
        committed = _committed(proxy)
        listed = _accounts_of(cp, gid)
        assert len(listed) == (1 if committed else 0), (proxy.writes, listed)
        # No GitHub id stuck: either its account is visible, or it can be created again.
        again = cp.cli("account", "create", "--github-id", str(gid), "--github-login", f"u{gid}")
        if committed:
            assert again.code == 2 and "already exists" in again.err, again.err
        else:
            assert again.code == 0, (proxy.writes, again.err)
        assert len(_accounts_of(cp, gid)) == 1
        _assert_fsck_clean(cp)
    # intent, GitHub claim, record, listing, commit (the audit record follows it).
    assert points >= 5, points


# Many daemon starts and kill points: minutes on a loaded machine.
@pytest.mark.timeout(600)
def test_token_create_crash_at_every_write(cp: ControlProc, proxy: CrashProxy) -> None:
    acct = _json(cp, "account", "create", "--github-id", "77", "--github-login", "t")
    account_id = acct["account_id"]
    points, expected = 0, 0
    for n in range(1, MAX_WRITES):
        assert cp.process is not None
        proxy.arm(cp.process.pid, after=n)
        res = cp.cli("token", "create", "--account", account_id)
        if not _crashed(cp, proxy):
            assert res.code == 0, res.err
            break
        points += 1
        # A token whose value nobody saw is rolled back unless it had committed.
        expected += 1 if _committed(proxy) else 0
        tokens = _json(cp, "token", "list", "--account", account_id)["tokens"]
        assert len(tokens) == expected, (proxy.writes, tokens)
        for token in tokens:  # each listed token is reachable through its index
            assert _json(cp, "machine", "list", "--account", account_id)["machines"] == []
            _ok(cp.cli("token", "revoke", token["token_id"]))
        _assert_fsck_clean(cp)
    assert points >= 4, points


async def _join(cp: ControlProc, token: str) -> tuple[str, bytes, bytes]:
    return await join(cp.public, cp.ca_pem, token)


async def _connect_once(cp: ControlProc, cert: bytes, key: bytes) -> None:
    await connect_once(cp.link, cp.ca_pem, cert, key)


def _admin(cp: ControlProc) -> AdminClient:
    """A typed admin client of the running daemon (open one after each restart).

    The trials below call the Admin API in-process rather than through the CLI:
    a CLI process costs about a second of interpreter start per call, and the
    CLI's own output is tested elsewhere (test_cli_admin_output).
    """
    return AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30)


async def _live_machines(cp: ControlProc, account_id: str) -> list[str]:
    # Earlier trials' machines are revoked at the end of their trial.
    async with _admin(cp) as admin:
        return [m.machine_id for m in await admin.list_machines(account_id) if not m.revoked]


async def _token(cp: ControlProc, account_id: str, token_id: str) -> JoinToken:
    async with _admin(cp) as admin:
        return next(t for t in await admin.list_tokens(account_id) if t.token_id == token_id)


async def _until(check: Any, deadline: float, what: str) -> None:
    await apoll_until(
        check, deadline=deadline, what=what, step=0.2, fail=lambda: AssertionError(what)
    )


# A kill at each write, each followed by a restart: minutes on a loaded machine.
@pytest.mark.timeout(600)
async def test_join_crash_at_every_write(
    cp: ControlProc, proxy: CrashProxy, moto_endpoint: str, s3_bucket: str
) -> None:
    s3 = _s3_client(moto_endpoint)
    acct = _json(cp, "account", "create", "--github-id", "88", "--github-login", "j")
    account_id = acct["account_id"]
    points = 0
    for n in range(1, MAX_WRITES):
        async with _admin(cp) as admin:
            made = await admin.create_token(account_id)
        token_id, value = made.token.token_id, made.token_value
        assert cp.process is not None
        proxy.arm(cp.process.pid, after=n)
        try:
            joined: tuple[str, bytes, bytes] | None = await _join(cp, value)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            joined = None
        if not _crashed(cp, proxy):
            assert joined is not None
            await _connect_once(cp, joined[1], joined[2])
            await _aassert_fsck_clean(cp)
            break
        points += 1
        assert joined is None

        async def settled() -> bool:
            # Rolled back: at once when no machine record was written, else after the
            # machine had its chance to connect (CONFIRM_GRACE); the self-check
            # tick (one heartbeat) runs the roll-back.
            return await _settled(cp, s3, s3_bucket)

        await _until(settled, CONFIRM_GRACE + 60, f"join rolled back after {proxy.writes}")
        # No orphan visible, and the token's use was given back.
        assert await _live_machines(cp, account_id) == []
        token = await _token(cp, account_id, token_id)
        assert token.uses == 0 and token.state == "active"
        # The same token joins for real, and that machine stays once it connected.
        machine_id, cert, key = await _join(cp, value)
        await _connect_once(cp, cert, key)
        assert await _live_machines(cp, account_id) == [machine_id]
        async with _admin(cp) as admin:
            await admin.revoke_machine(machine_id)
        await _aassert_fsck_clean(cp)
    # intent, token use (+ its audit record), machine index, machine record.
    assert points >= 4, points


# A kill at each write, each followed by a restart: minutes on a loaded machine.
@pytest.mark.timeout(600)
async def test_repair_join_crash_at_every_write(
    cp: ControlProc, proxy: CrashProxy, moto_endpoint: str, s3_bucket: str
) -> None:
    """A repair join killed at each store write: the old certificate is refused only
    once the repair's record write happened; the token's use always comes back
    unless the new box connected; the same token then repairs for real."""
    s3 = _s3_client(moto_endpoint)
    acct = _json(cp, "account", "create", "--github-id", "66", "--github-login", "r")
    account_id = acct["account_id"]
    tok = _json(cp, "token", "create", "--account", account_id)
    machine_id, old_cert, old_key = await _join(cp, tok["token_value"])
    await _connect_once(cp, old_cert, old_key)
    points = 0
    for n in range(1, MAX_WRITES):
        async with _admin(cp) as admin:
            made = await admin.create_repair_token(machine_id)
        token_id, value = made.token.token_id, made.token_value
        assert cp.process is not None
        proxy.arm(cp.process.pid, after=n)
        try:
            joined: tuple[str, bytes, bytes] | None = await _join(cp, value)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            joined = None
        if not _crashed(cp, proxy):
            assert joined is not None and joined[0] == machine_id
            await _connect_once(cp, joined[1], joined[2])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _connect_once(cp, old_cert, old_key)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await _aassert_fsck_clean(cp)
            break
        points += 1
        assert joined is None

        async def settled() -> bool:
            return await _settled(cp, s3, s3_bucket)

        await _until(settled, CONFIRM_GRACE + 60, f"repair settled after {proxy.writes}")
        token = await _token(cp, account_id, token_id)
        assert token.uses == 0 and token.state == "active"
        # The same token repairs for real; the box that joins with it is the machine.
        again, cert, key = await _join(cp, value)
        assert again == machine_id
        await _connect_once(cp, cert, key)
        old_cert, old_key = cert, key
        assert await _live_machines(cp, account_id) == [machine_id]
        await _aassert_fsck_clean(cp)
    # intent, token use (+ its audit record), machine record.
    assert points >= 3, points


def test_machine_join_says_it_lost_the_control_plane(
    cp: ControlProc, proxy: CrashProxy, tmp_path: Path
) -> None:
    """The real ``agents-machine join`` whose control plane dies mid-join says so."""
    acct = _json(cp, "account", "create", "--github-id", "99", "--github-login", "k")
    made = _json(cp, "token", "create", "--account", acct["account_id"])
    argv = shlex.split(made["join_command"])
    assert cp.process is not None
    proxy.arm(cp.process.pid, after=2)  # after the intent and the token use
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    res = subprocess.run(
        [str(MACHINE_EXE), *argv[1:], "--data-dir", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proxy.crashed.is_set()
    assert res.returncode != 0
    assert "cannot reach the control plane" in res.stderr, res.stderr
    assert "refused" not in res.stderr, res.stderr


def test_init_killed_before_its_marker_leaves_no_deployment(
    proxy: CrashProxy, s3_bucket: str, tmp_path: Path
) -> None:
    """init writes its marker last: killed after the credential, the store holds no
    deployment (serve refuses it) and a fresh init on the same store succeeds."""
    env = {**os.environ, **s3_env(proxy.url)}
    env.pop("AGENTS_CONTROL_CREDENTIAL", None)
    home = tmp_path / "first"
    argv = init_argv(home, f"s3://{s3_bucket}/cp")
    init = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proxy.arm(init.pid, after=1)  # right after the operator credential
    out, _ = init.communicate(timeout=60)
    assert proxy.crashed.is_set() and init.returncode == -9
    assert b"adm_" not in out
    assert proxy.writes == [w for w in proxy.writes if "/credentials/" in w]
    serve = subprocess.run(
        [str(agents_control_exe()), "serve", "--home", str(home)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serve.returncode == 1 and "deployment.json is missing" in serve.stderr, serve.stderr
    again = run_init(tmp_path / "second", f"s3://{s3_bucket}/cp", env)
    assert again.operator.startswith("adm_")


def _cas_home_and_bundle(cp: ControlProc, s3: Any, bucket: str) -> tuple[set[str], set[str]]:
    """The CA hashes the home holds, and those the sealed key bundle in the bucket
    holds (opened with the deployment's recovery key, as a restore would)."""

    def hashes(keys: HomeKeys) -> set[str]:
        return {tls.ca_hash(p.cert_pem) for p in (keys.ca, keys.next_ca) if p is not None}

    def payload(key: str) -> bytes:
        return unverified_payload(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    deployment = marker_deployment_id(payload("cp/cp/deployment.json"))
    envelope = StoredBundle.parse(payload("cp/cp/keys.sealed"))
    recovery = read_recovery_key(recovery_key_path(cp.home))
    bundle = open_bundle(envelope.sealed, recovery, deployment)
    return hashes(load_home_keys(cp.home)), hashes(bundle.keys)


def test_ca_rollover_killed_at_each_write_keeps_the_home_and_the_key_bundle_alike(
    cp: ControlProc, proxy: CrashProxy, moto_endpoint: str, s3_bucket: str
) -> None:
    """A CA rollover writes the ``*-next`` files, then the sealed key bundle, then
    swaps the key ring; retiring moves the deployment marker, renames the files,
    then reseals. Killed around each store write, the restarted daemon serves, the
    bundle holds exactly the CAs of the home (a restore from it would trust every
    machine certificate the home signed), and fsck is clean."""
    s3 = _s3_client(moto_endpoint)
    old = cp.ca_hash

    def restarted_alike() -> set[str]:
        assert _crashed(cp, proxy), proxy.writes
        home, bundle = _cas_home_and_bundle(cp, s3, s3_bucket)
        assert home == bundle, proxy.writes
        _assert_fsck_clean(cp)
        return home

    # Killed just before the bundle is written (the *-next files are in the home):
    # serve's start reseals, and the rollover stands.
    assert cp.process is not None
    proxy.arm_before(cp.process.pid, "PUT", "cp/keys.sealed")
    cp.cli("ca", "rollover")
    started = restarted_alike()
    assert old in started and len(started) == 2
    state = _json(cp, "ca", "rollover")
    assert state["state"] == "rolling" and state["old_ca_hash"] == old
    new = str(state["ca_hash"])

    # Retiring, killed after each of its writes in turn, run again each time.
    points = 0
    for n in range(1, MAX_WRITES):
        assert cp.process is not None
        proxy.arm(cp.process.pid, after=n)
        res = cp.cli("ca", "rollover", "--retire-old", "--json")
        if not proxy.crashed.is_set():
            proxy.disarm()
            assert res.code == 0, res.err
            break
        points += 1
        after = restarted_alike()
        assert after in ({old, new}, {new}), proxy.writes
        if after == {new}:
            break  # killed past its commit point (the home's renames): it is retired
    assert points >= 2, points  # the marker, then the bundle
    home, bundle = _cas_home_and_bundle(cp, s3, s3_bucket)
    assert home == bundle == {new}

    # A second rollover, killed right after its bundle was written (before the
    # key ring swap): the restarted daemon is mid-rollover, bundle and home alike.
    assert cp.process is not None
    proxy.arm_after(cp.process.pid, "PUT", "cp/keys.sealed")
    cp.cli("ca", "rollover")
    again = restarted_alike()
    assert new in again and len(again) == 2
    assert _json(cp, "ca", "rollover")["state"] == "rolling"


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_home_from_before_fencing_killed_around_its_epoch_write_starts_next_time(
    cp: ControlProc, proxy: CrashProxy, moto_endpoint: str, s3_bucket: str, when: str
) -> None:
    """A home made before fencing has no id and the store no epoch record: its first
    ``serve`` writes the id, then the epoch record naming it. Killed just before or
    just after that record's write, the next ``serve`` starts (it used to find an
    epoch of a home without an id, and refuse itself as stale)."""
    s3 = _s3_client(moto_endpoint)
    stop_serve(cp)
    (cp.home / HOME_ID_FILE).unlink()
    s3.delete_object(Bucket=s3_bucket, Key=f"cp/{EPOCH_KEY}")
    log = (cp.home.parent / "pre-fencing-serve.log").open("wb")
    with log:
        first = subprocess.Popen(
            [str(agents_control_exe()), "serve", "--home", str(cp.home)],
            env=cp.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    # Armed before the new process can reach the store (it imports and reads its
    # config first); the kill is on the epoch record's write.
    (proxy.arm_before if when == "before" else proxy.arm_after)(first.pid, "PUT", EPOCH_KEY)
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert proxy.crashed.is_set()
    home_id = read_home_id(cp.home)
    assert home_id is not None  # the id came first
    start_serve(cp)
    assert read_home_id(cp.home) == home_id
    epoch = read_json(s3.get_object(Bucket=s3_bucket, Key=f"cp/{EPOCH_KEY}")["Body"].read())
    assert epoch["home_id"] == home_id, epoch
    _ok(cp.cli("account", "list"))
    _assert_fsck_clean(cp)
