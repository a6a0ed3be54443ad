"""Key rotation without re-pairing, with real processes on moto's S3 server.

``agents-control cert rotate-server`` and ``agents-control ca rollover`` run
against a real control plane; real ``agents-machine`` daemons keep connecting
(no token is used twice, no machine joins again), renew under the new CA, and a
machine that was stopped during the rollover still connects and renews.
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from machine import identity
from shared import tls
from tests.helpers.control_proc import ControlProc, control_plane, start_serve, stop_serve
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
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(
        rf'^agents_cp_key_rotations_total{{kind="{kind}",result="{result}"}} ([0-9.e+]+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


async def _online(cp: ControlProc, machine_id: str) -> bool:
    async with admin(cp) as client:
        return bool((await client.get_machine(machine_id))["online"])


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
        assert [t["uses"] for t in await client.list_tokens(account)] == [1]
        assert [m["machine_id"] for m in await client.list_machines(account)] == [machine_id]
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

    # After a restart (the home holds the new CA only) both come back by themselves.
    stop_serve(cp)
    start_serve(cp)
    await _until(lambda: _online(cp, a_id), 15, "a online under the new CA")
    await _until(lambda: _online(cp, b_id), 15, "b online under the new CA")
    async with admin(cp) as client:
        assert sorted(t["uses"] for t in await client.list_tokens(account)) == [1, 1]
        assert len(await client.list_machines(account)) == 2
    # New join commands pin the new CA.
    assert _printed_join(cp, account)[-1] == new_hash
