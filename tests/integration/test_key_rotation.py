"""Key rotation without re-pairing, and adopting a store whose keys are lost, with real
processes on moto's S3 server.

``agents-control cert rotate-server`` and ``agents-control ca rollover`` run
against a real control plane; real ``agents-machine`` daemons keep connecting
(no token is used twice, no machine joins again), renew under the new CA, and a
machine that was stopped during the rollover still connects and renews.

When the control plane's home is destroyed, ``init --adopt`` starts new keys
over the same store and ``machine repair`` tokens re-pair the machines: each
keeps its id, agents and backups, and its queued prompt is still delivered.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.integrity.trusted import DEPLOYMENT_KEY
from machine.link import identity
from shared import tls
from tests.helpers.control_proc import (
    ControlProc,
    control_plane,
    init_argv,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.fault_proxy import crash_proxy
from tests.helpers.machine_proc import run_cli
from tests.integration.test_join import (
    HEARTBEAT,
    MachineProc,
    _create_account,
    _env,
    _free_port,
    _printed_join,
    _start,
    _until,
    admin,
    machines,  # noqa: F401 (a fixture)
)
from tests.integration.test_prompt_queue import _runs

pytestmark = pytest.mark.integration


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    # Fixed ports: the tests restart the control plane and machines keep its address.
    ports = ["--listen", f"127.0.0.1:{_free_port()}", "--link-listen", f"127.0.0.1:{_free_port()}"]
    with control_plane(
        tmp_path / "cp-home",
        f"s3://{s3_bucket}/cp",
        env=_env(moto_endpoint),
        init_args=["--heartbeat-interval", str(HEARTBEAT), *ports],
    ) as running:
        yield running


def _server_cert(address: str) -> bytes:
    host, _, port = address.rpartition(":")
    return ssl.get_server_certificate((host, int(port))).encode()


def _json(cp: ControlProc, *args: str) -> dict[str, object]:
    res = cp.cli(*args, "--json")
    assert res.code == 0, res.err
    data: dict[str, object] = json.loads(res.out)
    return data


def _issuer_hash(data_dir: Path) -> str:
    """The pin of the trusted CA that signed the machine's current certificate."""
    keys = identity.load_keys(data_dir)
    for ca in tls.split_certs(keys.ca_cert_pem):
        try:
            tls.verify_issued_by(keys.tls_cert_pem, ca)
        except Exception:
            continue
        return tls.ca_hash(ca)
    raise AssertionError("the machine's certificate chains to none of its CAs")


def _trusted(data_dir: Path) -> set[str]:
    pem = identity.load_keys(data_dir).ca_cert_pem
    return {tls.ca_hash(c) for c in tls.split_certs(pem)}


def _metric(cp: ControlProc, kind: str, result: str) -> float:
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=15) as r:
        text = r.read().decode()
    m = re.search(
        rf'^agents_cp_key_rotations_total{{kind="{kind}",result="{result}"}} ([0-9.e+]+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


async def _online(cp: ControlProc, machine_id: str) -> bool:
    async with admin(cp) as client:
        return (await client.get_machine(machine_id)).online


async def _offline(cp: ControlProc, machine_id: str) -> bool:
    return not await _online(cp, machine_id)


def _join(
    cp: ControlProc, procs: list[MachineProc], tmp_path: Path, account: str, name: str
) -> MachineProc:
    argv = _printed_join(cp, account)
    return _start(procs, tmp_path / name, argv, tmp_path / f"{name}.log")


async def test_rotate_server_certificate_machine_reconnects_without_join(
    cp: ControlProc,
    tmp_path: Path,
    machines: list[MachineProc],  # noqa: F811
) -> None:
    account = _create_account(cp)
    proc = _join(cp, machines, tmp_path, account, "m1")
    await _until(proc.joined, 10, "joined")
    machine_id = identity.load_link(proc.data_dir).machine_id
    await _until(lambda: _online(cp, machine_id), 10, "online")
    before = _server_cert(cp.public)

    out = _json(cp, "cert", "rotate-server")
    after = _server_cert(cp.public)
    # The live server presents the new certificate to new connections, same CA.
    assert tls.cert_serial(after) == out["serial"] != tls.cert_serial(before)
    tls.verify_issued_by(after, cp.ca_pem)
    assert _metric(cp, "server", "ok") == 1

    # A restarted control plane serves the rotated certificate from its home, and
    # the machine comes back by itself: no join, its one token used once.
    stop_serve(cp)
    start_serve(cp)
    assert tls.cert_serial(_server_cert(cp.public)) == out["serial"]
    await _until(lambda: _online(cp, machine_id), 15, "online again")
    async with admin(cp) as client:
        assert [t.uses for t in await client.list_tokens(account)] == [1]
        assert [m.machine_id for m in await client.list_machines(account)] == [machine_id]
    assert proc.proc.poll() is None


async def test_ca_rollover_renews_online_and_offline_machines_then_retires(
    cp: ControlProc,
    tmp_path: Path,
    machines: list[MachineProc],  # noqa: F811
) -> None:
    account = _create_account(cp)
    a = _join(cp, machines, tmp_path, account, "a")
    b = _join(cp, machines, tmp_path, account, "b")
    await _until(lambda: a.joined() and b.joined(), 15, "both joined")
    a_id = identity.load_link(a.data_dir).machine_id
    b_id = identity.load_link(b.data_dir).machine_id
    await _until(lambda: _online(cp, a_id), 10, "a online")
    await _until(lambda: _online(cp, b_id), 10, "b online")
    old_hash = cp.ca_hash
    b.stop()  # offline during the rollover
    await _until(lambda: _offline(cp, b_id), 5, "b offline")

    started = _json(cp, "ca", "rollover")
    new_hash = str(started["ca_hash"])
    assert started["state"] == "rolling" and started["old_ca_hash"] == old_hash != new_hash
    assert started["machines_pending"] == 2 and started["machines_notified"] == 1

    # The online machine renews at once under the new CA and trusts both.
    await _until(lambda: _issuer_hash(a.data_dir) == new_hash, 10, "a renewed")
    assert _trusted(a.data_dir) == {old_hash, new_hash}
    # Run again (as its advice says): a, renewed, is not asked again (it would ask
    # with the certificate its link opened with, be refused, and keep asking).
    await _until(lambda: _json(cp, "ca", "rollover")["machines_pending"] == 1, 10, "a counted")
    again = _json(cp, "ca", "rollover")
    assert (again["machines_pending"], again["machines_notified"]) == (1, 0)
    # b still holds an old-CA certificate: retiring is refused, nothing changes.
    refused = cp.cli("ca", "rollover", "--retire-old")
    assert refused.code == 2 and "1 machine(s) still hold" in refused.err, refused
    assert len(refused.err.strip().splitlines()) == 1
    assert _metric(cp, "ca_retire", "refused") == 1

    # b, offline all along, connects with its old certificate and renews.
    b2 = _start(machines, b.data_dir, ["agents-machine", "serve"], tmp_path / "b.log")
    await _until(lambda: _online(cp, b_id), 10, "b online with its old certificate")
    await _until(lambda: _issuer_hash(b2.data_dir) == new_hash, 10, "b renewed")

    retired = _json(cp, "ca", "rollover", "--retire-old")
    assert retired["state"] == "retired" and retired["machines_pending"] == 0
    # The live server now presents a chain under the new CA.
    tls.verify_issued_by(_server_cert(cp.public), cp.ca_pem)
    assert tls.ca_hash(cp.ca_pem) == new_hash
    assert json.loads((cp.home / "serve.json").read_text())["ca_hash"] == new_hash
    # a's daemon never restarted: its backups follow the renewal and the rollover
    # (before: "certificate not issued by this control plane" until a restart).
    made = _machine_json(a.data_dir, "backup", "now")
    assert str(made["backup_id"]).startswith("bk_"), made

    # After a restart (the home holds the new CA only) both come back by themselves.
    stop_serve(cp)
    start_serve(cp)
    await _until(lambda: _online(cp, a_id), 15, "a online under the new CA")
    await _until(lambda: _online(cp, b_id), 15, "b online under the new CA")
    async with admin(cp) as client:
        assert sorted(t.uses for t in await client.list_tokens(account)) == [1, 1]
        assert len(await client.list_machines(account)) == 2
    # New join commands pin the new CA.
    assert _printed_join(cp, account)[-1] == new_hash


def _machine_json(data_dir: Path, *args: str) -> dict[str, object]:
    res = run_cli(data_dir, *args, "--json")
    assert res.returncode == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


async def test_keys_lost_adopt_and_re_pair_keep_id_agents_backups_and_queue(
    cp: ControlProc,
    tmp_path: Path,
    s3_bucket: str,
    machines: list[MachineProc],  # noqa: F811
) -> None:
    account = _create_account(cp)
    m = _join(cp, machines, tmp_path, account, "m")
    await _until(m.joined, 15, "joined")
    machine_id = identity.load_link(m.data_dir).machine_id
    await _until(lambda: _online(cp, machine_id), 10, "online")
    made = _machine_json(m.data_dir, "agent", "create", "a", "--folder", str(tmp_path))
    agent = str(made["agent_id"])
    first_backup = _machine_json(m.data_dir, "backup", "now")["backup_id"]
    m.stop()
    await _until(lambda: _offline(cp, machine_id), 5, "offline")
    sent = cp.cli("prompt", "send", "--machine", machine_id, "--agent", agent, "--text", "hi")
    assert sent.code == 0 and " queued" in sent.out, sent

    # The keys are lost: the daemon dies, its home with it.
    assert cp.process is not None
    cp.process.kill()
    cp.process.wait(timeout=10)
    shutil.rmtree(cp.home)
    ports = [
        "--listen",
        cp.public,
        "--link-listen",
        cp.link,
        "--heartbeat-interval",
        str(HEARTBEAT),
    ]
    adopted = run_init(cp.home, f"s3://{s3_bucket}/cp", cp.env, [*ports, "--adopt"])
    assert adopted.ca_hash != cp.ca_hash
    start_serve(adopted)
    try:
        repair = json.loads(adopted.cli("machine", "repair", machine_id, "--json").out)
        argv = shlex.split(str(repair["join_command"]))
        argv = argv[: argv.index("--recovery-key")]  # its data is still there
        assert argv[argv.index("--ca-hash") + 1] == adopted.ca_hash
        again = _start(machines, m.data_dir, argv, tmp_path / "m.log")
        await _until(lambda: _online(adopted, machine_id), 20, "online after re-pair")
        assert f"re-paired as machine {machine_id}" in again.output()
        assert identity.load_link(m.data_dir).machine_id == machine_id
        # The queued prompt, sealed to the box key the machine kept, is delivered.
        await _until(lambda: any(r[1] == "hi" for r in _runs(m.data_dir)), 20, "prompt ran")
        agents = _machine_json(m.data_dir, "agent", "list")["agents"]
        assert isinstance(agents, list) and [a["agent_id"] for a in agents] == [agent]
        after = _machine_json(m.data_dir, "backup", "list")["backups"]
        assert isinstance(after, list) and len(after) == 2  # the old one and a fresh one
        assert first_backup in {b["backup_id"] for b in after}
        async with admin(adopted) as client:
            listed = await client.list_machines(account)
        assert [x.machine_id for x in listed] == [machine_id]
    finally:
        stop_serve(adopted)


async def test_adopt_killed_before_or_at_its_commit_point_is_run_again(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    with crash_proxy(moto_endpoint) as proxy:
        store = f"s3://{s3_bucket}/cp"
        cp = run_init(tmp_path / "home", store, s3_env(proxy.url))
        start_serve(cp)
        try:
            account = _create_account(cp)
        finally:
            stop_serve(cp)
        shutil.rmtree(cp.home)
        argv = init_argv(cp.home, store, ["--adopt"])

        def killed_adopt(arm: Callable[[int], None]) -> None:
            # Not /dev/null: init prints a new credential once, and refuses that.
            with subprocess.Popen(argv, env=cp.env, stdout=subprocess.PIPE) as proc:
                arm(proc.pid)
                proc.wait(timeout=60)
            assert proc.returncode == -signal.SIGKILL and proxy.crashed.is_set()
            assert not cp.home.exists()  # the home appears only after the commit point

        # Killed half-way through re-authenticating the records ...
        killed_adopt(lambda pid: proxy.arm(pid, after=2))
        # ... just before the marker (the commit point) ...
        killed_adopt(lambda pid: proxy.arm_before(pid, "PUT", DEPLOYMENT_KEY))
        # ... and right after it, before the home was moved into place.
        killed_adopt(lambda pid: proxy.arm_after(pid, "PUT", DEPLOYMENT_KEY))
        proxy.disarm()
        adopted = run_init(cp.home, store, cp.env, ["--adopt"])
        start_serve(adopted)
        try:
            async with admin(adopted) as client:
                assert [a.account_id for a in await client.list_accounts()] == [account]
        finally:
            stop_serve(adopted)
