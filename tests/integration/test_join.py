"""Joining for real: agents-control and agents-machine processes on moto's S3 server.

Each test runs the real control plane (``tests/helpers/control_proc.py``) on a
fresh bucket of the session's moto server and real ``agents-machine``
processes. The machine joins by running the exact command ``token create``
printed (plus ``--data-dir``). Presence is read through the Admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import grpc
import grpc.aio
import pytest
from botocore.config import Config

from controlplane.cli.admin_types import Machine
from controlplane.cli.client import AdminClient
from machine.link import identity
from shared import tls
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from tests.helpers.control_proc import (
    ControlProc,
    control_plane,
    run_init,
    start_serve,
    stop_serve,
)
from tests.helpers.poll import apoll_until
from tests.helpers.store_records import read_json, sealed

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
PROCESS_DEADLINE = 15.0
ACCESS_KEY, SECRET_KEY = "testing", "testing-secret"
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


def _env(endpoint: str) -> dict[str, str]:
    return {
        "AGENTS_CONTROL_STORE_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    }


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    with control_plane(
        tmp_path / "cp-home",
        f"s3://{s3_bucket}/cp",
        env=_env(moto_endpoint),
        init_args=["--heartbeat-interval", str(HEARTBEAT)],
    ) as running:
        yield running


@contextlib.asynccontextmanager
async def admin(cp: ControlProc) -> AsyncIterator[AdminClient]:
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:
        yield client


def _create_account(cp: ControlProc, login: str = "alice") -> str:
    res = cp.cli("account", "create", "--github-id", "4242", "--github-login", login)
    assert res.code == 0, res.err
    m = re.search(r"account (acct_[0-9a-z]{26})", res.out)
    assert m, res.out
    return m.group(1)


def _printed_join(cp: ControlProc, account_id: str, *extra: str) -> list[str]:
    """``agents-control token create`` and the join command it printed, as argv."""
    res = cp.cli("token", "create", "--account", account_id, *extra)
    assert res.code == 0, res.err
    line = res.out.strip().splitlines()[-1]
    assert line.startswith("agents-machine join "), res.out
    return shlex.split(line)


async def _join_argv(client: AdminClient, account_id: str) -> list[str]:
    """A join command for a fresh token, made through the Admin API (quicker than the CLI)."""
    reply = await client.create_token(account_id)
    return [
        "agents-machine",
        "join",
        reply.join_address,
        "--token",
        reply.token_value,
        "--ca-hash",
        reply.ca_hash,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MachineProc:
    """One ``agents-machine`` process with its log and /metrics port."""

    def __init__(self, data_dir: Path, argv: list[str], log: Path) -> None:
        self.data_dir = data_dir
        self.metrics_port = _free_port()
        self.log = log
        env = {**os.environ, "AGENTS_MACHINE_METRICS": f"127.0.0.1:{self.metrics_port}"}
        env.pop("AGENTS_DATA_DIR", None)
        self.started_at = time.monotonic()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                # The printed command as is, plus --data-dir.
                [str(MACHINE_EXE), *argv[1:], "--data-dir", str(data_dir)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def joined(self) -> bool:
        """True once join succeeded; fails at once (with the output) if the process died."""
        if "joined as machine" in self.output():
            return True
        if self.proc.poll() is not None:
            raise AssertionError(f"agents-machine exited {self.proc.returncode}:\n{self.output()}")
        return False

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2
            ) as r:
                text = r.read().decode()
        except OSError:
            return None
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else None

    def wait_exit(self, timeout: float = PROCESS_DEADLINE) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=PROCESS_DEADLINE)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=PROCESS_DEADLINE)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def machines() -> Iterator[list[MachineProc]]:
    started: list[MachineProc] = []
    try:
        yield started
    finally:
        for m in started:
            m.kill()


def _start(machines: list[MachineProc], data_dir: Path, argv: list[str], log: Path) -> MachineProc:
    proc = MachineProc(data_dir, argv, log)
    machines.append(proc)
    return proc


async def _until(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> float:
    """Poll ``pred`` (sync or async) until truthy; return the seconds it took."""
    start = time.monotonic()
    fail = AssertionError(f"{what}: not within {timeout}s")
    await apoll_until(pred, deadline=timeout, what=what, step=step, fail=lambda: fail)
    return time.monotonic() - start


async def _machine(client: AdminClient, account_id: str) -> Machine | None:
    listed = await client.list_machines(account_id)
    return listed[0] if listed else None


async def _online(client: AdminClient, account_id: str) -> bool:
    m = await _machine(client, account_id)
    return bool(m and m.online)


async def _offline(client: AdminClient, account_id: str) -> bool:
    m = await _machine(client, account_id)
    return bool(m and not m.online)


# --------------------------------------------------------------------- presence


async def test_printed_join_online_offline_and_restart(
    cp: ControlProc, tmp_path: Path, machines: list[MachineProc]
) -> None:
    account_id = _create_account(cp)
    argv = _printed_join(cp, account_id)
    data_dir = tmp_path / "machine"
    log = tmp_path / "machine.log"
    async with admin(cp) as client:
        # Online without a restart or a retry the test would have to make: how long it
        # takes is measured in bench/ (bench.connect: joins and first links), not
        # bounded here, where a loaded machine (CI, a second suite) must still pass.
        proc = _start(machines, data_dir, argv, log)
        await _until(lambda: _online(client, account_id), 30, "online after join")
        assert proc.joined()
        listed = await client.list_machines(account_id)
        assert len(listed) == 1
        machine_id = listed[0].machine_id
        assert identity.load_link(data_dir).machine_id == machine_id

        # SIGKILL: no goodbye; presence must notice the silence.
        proc.kill()
        killed_at = time.monotonic()
        await _until(lambda: _offline(client, account_id), 5, "offline after SIGKILL")
        offline_after = time.monotonic() - killed_at
        assert offline_after <= 3 * HEARTBEAT + 0.25, offline_after

        # Restart with serve: online again under the same id, without a new join.
        restarted = _start(machines, data_dir, ["agents-machine", "serve"], log)
        await _until(lambda: _online(client, account_id), 10, "online after restart")
        listed = await client.list_machines(account_id)
        assert [m.machine_id for m in listed] == [machine_id]
        tokens = await client.list_tokens(account_id)
        assert len(tokens) == 1  # still just the one token, used once

        # A clean stop says goodbye: offline without waiting for missed heartbeats.
        restarted.stop()
        assert restarted.proc.returncode == 0, restarted.output()[-2000:]
        await _until(lambda: _offline(client, account_id), 2, "offline after SIGTERM")


# ---------------------------------------------------------------------- refusals


def _store_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )


def _run_join(argv: list[str], data_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a join that is expected to fail (so it returns instead of serving)."""
    return subprocess.run(
        [str(MACHINE_EXE), *argv[1:], "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "AGENTS_DATA_DIR"},
    )


def _assert_refused(res: subprocess.CompletedProcess[str], data_dir: Path, pattern: str) -> None:
    assert res.returncode != 0, res.stdout
    assert re.search(pattern, res.stderr), res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert not data_dir.exists(), sorted(p.name for p in data_dir.rglob("*"))
    assert [p.name for p in data_dir.parent.iterdir() if p.name.startswith(".")] == []


async def test_join_refusals_write_nothing(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    account_id = _create_account(cp)
    s3 = _store_client(moto_endpoint)
    async with admin(cp) as client:
        # Wrong CA hash: refused before the token is sent (it stays unused).
        argv = await _join_argv(client, account_id)
        bad = list(argv)
        bad[bad.index("--ca-hash") + 1] = tls.ca_hash(tls.make_ca().cert_pem)
        _assert_refused(_run_join(bad, tmp_path / "wrong-ca"), tmp_path / "wrong-ca", "ca_hash")
        tokens = await client.list_tokens(account_id)
        assert [t.uses for t in tokens] == [0]

        # The link port instead of the public one: named, exit 2, before the token
        # is sent (before: "connection lost, run it again", which never helps).
        bad = list(argv)
        bad[2] = cp.link
        res = _run_join(bad, tmp_path / "link-port")
        _assert_refused(res, tmp_path / "link-port", "is the control plane's link port")
        assert res.returncode == 2, res.stderr
        tokens = await client.list_tokens(account_id)
        assert [t.uses for t in tokens] == [0]

        # Expired token: made expired in the store (the shortest TTL is a minute).
        argv = await _join_argv(client, account_id)
        token_id = argv[argv.index("--token") + 1].split(".")[0]
        key = f"accounts/{account_id}/tokens/{token_id}.json"
        doc = read_json(s3.get_object(Bucket=s3_bucket, Key="cp/" + key)["Body"].read())
        past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
        doc["expires_at"] = past.isoformat().replace("+00:00", "Z")
        # Sealed with the home's key: a genuine change, not a forgery.
        body = sealed(cp.home, key, json.dumps(doc).encode())
        s3.put_object(Bucket=s3_bucket, Key="cp/" + key, Body=body)
        _assert_refused(_run_join(argv, tmp_path / "expired"), tmp_path / "expired", "expired")

        # Used token: the first join succeeds (and serves: stop it), the second is refused.
        argv = await _join_argv(client, account_id)
        first = MachineProc(tmp_path / "first", argv, tmp_path / "first.log")
        try:
            await _until(first.joined, 15, "first join")
        finally:
            first.kill()
        _assert_refused(_run_join(argv, tmp_path / "used"), tmp_path / "used", "already used")

        # Revoked token.
        argv = await _join_argv(client, account_id)
        await client.revoke_token(argv[argv.index("--token") + 1].split(".")[0])
        _assert_refused(_run_join(argv, tmp_path / "revoked"), tmp_path / "revoked", "revoked")

        # A token of a deleted account. Account deletion is not implemented yet,
        # so the account is marked deleted the way deletion starts: its tombstone.
        other = (await client.create_account(77, "bob")).account.account_id
        argv = await _join_argv(client, other)
        tombstone = f"accounts/{other}/deleting.json"
        s3.put_object(
            Bucket=s3_bucket,
            Key="cp/" + tombstone,
            Body=sealed(cp.home, tombstone, json.dumps({"account_id": other}).encode()),
        )
        _assert_refused(_run_join(argv, tmp_path / "deleted"), tmp_path / "deleted", "delet")

        # An already joined data folder is refused before any token is spent.
        argv = await _join_argv(client, account_id)
        res = _run_join(argv, tmp_path / "first")
        assert res.returncode != 0 and "already joined" in res.stderr, res.stderr
        token_id = argv[argv.index("--token") + 1].split(".")[0]
        by_id = {t.token_id: t for t in await client.list_tokens(account_id)}
        assert by_id[token_id].uses == 0


# ------------------------------------------------------------------- revocation


async def test_revoked_machine_is_cut_off_and_stays_off(
    cp: ControlProc, tmp_path: Path, machines: list[MachineProc]
) -> None:
    account_id = _create_account(cp)
    async with admin(cp) as client:
        argv = await _join_argv(client, account_id)
        data_dir = tmp_path / "machine"
        proc = _start(machines, data_dir, argv, tmp_path / "machine.log")
        await _until(proc.joined, 15, "joined")
        await _until(lambda: _online(client, account_id), 15, "online")
        await _until(lambda: proc.metric("agents_machine_link_connected") == 1, 5, "link gauge up")
        machine = await _machine(client, account_id)
        assert machine is not None

        await client.revoke_machine(machine.machine_id)
        revoked_at = time.monotonic()
        await _until(lambda: proc.metric("agents_machine_link_connected") == 0, 1.0, "link closed")
        assert time.monotonic() - revoked_at <= 1.0
        await _until(lambda: "stopped for good" in proc.output(), 2, "error logged")
        assert await _offline(client, account_id)
        assert proc.proc.poll() is None  # the daemon keeps serving its local users

        # A restart tries once with its certificate, is refused, and gives up.
        proc.kill()
        again = _start(machines, data_dir, ["agents-machine", "serve"], tmp_path / "again.log")
        await _until(lambda: "stopped for good" in again.output(), 15, "refused again")
        assert "refused this machine" in again.output()
        assert again.metric("agents_machine_link_connected") == 0
        assert await _offline(client, account_id)


# ---------------------------------------------------------------- foreign certs


async def _issued_client_cert(cp: ControlProc) -> tuple[bytes, bytes]:
    """A client certificate from the control plane's own CA, through a real Join."""
    account_id = _create_account(cp, "valid")
    key = tls.new_tls_key()
    async with admin(cp) as client:
        token = (await client.create_token(account_id)).token_value
    creds = grpc.ssl_channel_credentials(root_certificates=cp.ca_pem)
    async with grpc.aio.secure_channel(cp.public, creds) as channel:
        reply = await link_pb2_grpc.MachineLinkStub(channel).Join(
            link_pb2.JoinRequest(
                token=token,
                csr_pem=tls.build_csr(key).decode(),
                machine=link_pb2.MachineInfo(name="valid", version="0.1.0", hostname="h"),
            ),
            timeout=10,
        )
    return reply.certificate_pem.encode(), tls.private_key_pem(key)


def _tls_context(cp: ControlProc, folder: Path, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    folder.mkdir()
    (folder / "c.pem").write_bytes(cert_pem)
    (folder / "k.pem").write_bytes(key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=cp.ca_pem.decode())
    ctx.load_cert_chain(folder / "c.pem", folder / "k.pem")
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _h2_exchange(address: str, ctx: ssl.SSLContext) -> bytes:
    """Open TLS to ``address``, send the HTTP/2 preface, return the server's first frame
    header (9 bytes), or fewer bytes if the server closed the connection."""
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as s,
    ):
        # TLS 1.3 finishes the client side first; the server's verdict on our
        # certificate arrives on the first read: an alert and a close, where an
        # accepted client gets the server's HTTP/2 SETTINGS frame.
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        data = b""
        while len(data) < 9:
            chunk = s.recv(9 - len(data))
            if not chunk:
                break
            data += chunk
        return data


async def test_client_cert_of_another_ca_fails_the_handshake(
    cp: ControlProc, tmp_path: Path
) -> None:
    # Positive control first: the very same exchange with a certificate of this
    # control plane's CA is accepted and answered with HTTP/2 SETTINGS, so the
    # refusal below is about the certificate and nothing else.
    valid = _tls_context(cp, tmp_path / "valid", *await _issued_client_cert(cp))
    frame = await asyncio.to_thread(_h2_exchange, cp.link, valid)
    assert len(frame) == 9 and frame[3] == 0x04, frame  # frame type 4 = SETTINGS

    stranger = tls.make_ca()
    key = tls.new_tls_key()
    cert = tls.sign_client_csr(
        stranger,
        tls.build_csr(key),
        account_id="acct_" + "0" * 26,
        machine_id="mc_" + "0" * 26,
        lifetime=dt.timedelta(hours=1),
    )
    foreign = _tls_context(cp, tmp_path / "foreign", cert.cert_pem, tls.private_key_pem(key))
    try:
        data = await asyncio.to_thread(_h2_exchange, cp.link, foreign)
    except (ssl.SSLError, ConnectionResetError) as e:
        assert "alert" in str(e).lower() or isinstance(e, ConnectionResetError), e
        data = b""
    assert data == b""


# -------------------------------------------------------------------- renewal


async def test_machine_renews_its_certificate_and_stays_online(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str, machines: list[MachineProc]
) -> None:
    home = tmp_path / "cp-home"
    cp = run_init(
        home, f"s3://{s3_bucket}/cp", _env(moto_endpoint), ["--heartbeat-interval", "0.3"]
    )
    # The shortest lifetime the control plane allows (1 hour), and a renewal
    # threshold that makes a fresh certificate already due: the control plane
    # asks for renewal on connect and the machine renews by itself.
    config = home / "config.toml"
    lines = [
        line
        for line in config.read_text().splitlines()
        if not line.startswith(("cert_lifetime_days", "renew_threshold"))
    ]
    config.write_text(
        "\n".join([*lines, "cert_lifetime_days = 0.0417", "renew_threshold = 0.99", ""])
    )
    try:
        start_serve(cp)
        account_id = _create_account(cp)
        async with admin(cp) as client:
            argv = await _join_argv(client, account_id)
            data_dir = tmp_path / "machine"
            proc = _start(machines, data_dir, argv, tmp_path / "machine.log")
            await _until(proc.joined, 15, "joined")
            first_cert = identity.load_keys(data_dir).tls_cert_pem
            first_serial = tls.cert_serial(first_cert)
            await _until(
                lambda: tls.cert_serial(identity.load_keys(data_dir).tls_cert_pem) != first_serial,
                10,
                "renewed certificate on disk",
            )
            renewed = tls.identity_from_cert(identity.load_keys(data_dir).tls_cert_pem)
            link = identity.load_link(data_dir)
            assert (renewed.account_id, renewed.machine_id) == (account_id, link.machine_id)
            # tls.crt is replaced first, link.json right after it.
            await _until(
                lambda: (
                    identity.load_link(data_dir).cert_not_after
                    == tls.cert_not_after(identity.load_keys(data_dir).tls_cert_pem)
                ),
                5,
                "link.json updated",
            )
            await _until(lambda: _online(client, account_id), 5, "online after renewal")
            machine = await _machine(client, account_id)
            assert machine is not None
            assert machine.certificate_serial != first_serial
            assert proc.metric("agents_machine_link_connected") == 1
            # The renewed certificate opens the next connection too.
            proc.kill()
            await _until(lambda: _offline(client, account_id), 5, "offline")
            _start(machines, data_dir, ["agents-machine", "serve"], tmp_path / "again.log")
            await _until(lambda: _online(client, account_id), 15, "online with renewed cert")
    finally:
        for m in machines:  # the control plane's stop waits for open streams
            m.kill()
        stop_serve(cp)


# ------------------------------------------------------------ control-plane restart


async def test_control_plane_restart_drains_fast_and_machine_reconnects(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str, machines: list[MachineProc]
) -> None:
    """A SIGTERM'd control plane does not wait on live Connect streams, and a machine
    reconnects by itself, with the certificate it has, once the daemon is back."""
    ports = ["--listen", f"127.0.0.1:{_free_port()}", "--link-listen", f"127.0.0.1:{_free_port()}"]
    with control_plane(
        tmp_path / "cp-home",
        f"s3://{s3_bucket}/cp",
        env=_env(moto_endpoint),
        init_args=["--heartbeat-interval", str(HEARTBEAT), *ports],
    ) as cp:
        account_id = _create_account(cp)
        proc = _start(
            machines, tmp_path / "machine", _printed_join(cp, account_id), tmp_path / "m.log"
        )
        async with admin(cp) as client:
            await _until(proc.joined, PROCESS_DEADLINE, "join")
            await _until(lambda: _online(client, account_id), 10, "online")

        assert cp.process is not None
        started = time.monotonic()
        stop_serve(cp)
        assert cp.process.returncode == 0
        assert time.monotonic() - started < 4.0, "drain waited on the machine's stream"
        assert proc.proc.poll() is None, "the machine must survive its control plane"

        start_serve(cp)
        async with admin(cp) as client:
            await _until(lambda: _online(client, account_id), 20, "online after restart")
        assert "joined as machine" in proc.output()
        assert proc.output().count("joined as machine") == 1
