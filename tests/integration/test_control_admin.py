"""agents-control as real processes on moto's S3 server: init, admin verbs, isolation,
secrets at rest, and the mutual-TLS link (foreign CA refused, revocation closes Connect)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import grpc
import grpc.aio
import pytest
from botocore.config import Config

from controlplane.cli.client import AdminClient
from shared import tls
from shared.errors import NotFound
from shared.ids import new_id
from shared.pb.control.v1 import admin_pb2, link_pb2, link_pb2_grpc
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from tests.helpers.control_proc import ControlProc, control_plane, run_init
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )


@pytest.fixture(scope="module")
def bucket(moto_endpoint: str) -> Iterator[str]:
    name = f"cp-{secrets.token_hex(6)}"
    client = _s3(moto_endpoint)
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})
        client.delete_bucket(Bucket=name)
        client.close()


def _env(moto_endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
        "AGENTS_CONTROL_STORE_ENDPOINT": moto_endpoint,
    }


@pytest.fixture(scope="module")
def cp(
    moto_endpoint: str, bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlProc]:
    home = tmp_path_factory.mktemp("cp") / "home"
    with control_plane(
        home,
        f"s3://{bucket}/deploy",
        _env(moto_endpoint),
        serve_args=["--heartbeat-interval", "0.5"],
    ) as proc:
        yield proc


def _ok(result: Any) -> str:
    assert result.code == 0, result.err
    return str(result.out)


def _account(cp: ControlProc, github_id: int) -> dict[str, Any]:
    out = _ok(
        cp.cli(
            "account",
            "create",
            "--github-id",
            str(github_id),
            "--github-login",
            f"user{github_id}",
            "--json",
        )
    )
    data: dict[str, Any] = json.loads(out)
    return data


def _token(cp: ControlProc, account_id: str, *extra: str) -> tuple[str, str]:
    """Create a token; return (token value, printed join command)."""
    out = _ok(cp.cli("token", "create", "--account", account_id, *extra))
    command = next(line for line in out.splitlines() if line.startswith("agents-machine join"))
    argv = shlex.split(command)
    assert argv[:3] == ["agents-machine", "join", cp.public]
    assert argv[3] == "--token" and argv[5] == "--ca-hash"
    assert argv[6] == cp.ca_hash == tls.ca_hash(cp.ca_pem)
    return argv[4], command


async def _join(
    cp: ControlProc, token: str, name: str = "box"
) -> tuple[link_pb2.JoinResponse, bytes]:
    key = tls.new_tls_key()
    creds = grpc.ssl_channel_credentials(root_certificates=cp.ca_pem)
    async with grpc.aio.secure_channel(cp.public, creds) as ch:
        reply = await link_pb2_grpc.MachineLinkStub(ch).Join(
            link_pb2.JoinRequest(
                token=token,
                csr_pem=tls.build_csr(key).decode(),
                machine=link_pb2.MachineInfo(name=name, version="0.1.0", hostname="h"),
            ),
            timeout=10,
        )
    return reply, tls.private_key_pem(key)


def _link_channel(cp: ControlProc, key_pem: bytes, cert_pem: bytes) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(cp.ca_pem, key_pem, cert_pem)
    return grpc.aio.secure_channel(cp.link, creds)


def test_init_refuses_non_empty_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "x").write_text("x")
    with pytest.raises(AssertionError, match="not empty"):
        run_init(home, str(tmp_path / "store"), {})


async def test_join_tokens_and_isolation(cp: ControlProc) -> None:
    a, b = _account(cp, 1001), _account(cp, 1002)
    acct_a, acct_b = a["account_id"], b["account_id"]
    token_a, _ = _token(cp, acct_a)
    token_b, _ = _token(cp, acct_b, "--uses", "2", "--ttl", "2h")
    joined_a, _ = await _join(cp, token_a, "a-box")
    joined_b, _ = await _join(cp, token_b, "b-box")
    assert joined_a.account_id == acct_a and joined_b.account_id == acct_b
    assert joined_a.link_port == int(cp.link.rsplit(":", 1)[1])
    # A lone process lists its own link address only (replicas list every one).
    assert list(joined_a.control_addresses) == [cp.link]
    assert tls.identity_from_cert(joined_a.certificate_pem).machine_id == joined_a.machine_id
    mc_a, mc_b = joined_a.machine_id, joined_b.machine_id

    # A single-use token cannot be used twice; a revoked one is refused.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _join(cp, token_a)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "join: token already used" in (info.value.details() or "")
    _ok(cp.cli("token", "revoke", token_b.split(".")[0]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _join(cp, token_b)
    assert "join: token revoked" in (info.value.details() or "")

    # An account-scoped credential sees only its own account.
    cred_a = json.loads(_ok(cp.cli("credential", "create", "--account", acct_a, "--json")))
    cred = cred_a["credential"]
    listed = json.loads(_ok(cp.cli("machine", "list", "--json", credential=cred)))["machines"]
    assert [m["machine_id"] for m in listed] == [mc_a]
    missing = new_id("machine")
    for verb in (["show"], ["revoke"], ["rename"]):
        args = ["machine", verb[0], mc_b] + (["x"] if verb[0] == "rename" else [])
        other = cp.cli(*args, credential=cred)
        args[2] = missing
        absent = cp.cli(*args, credential=cred)
        assert other.code == absent.code == 2
        assert other.err.replace(mc_b, "ID") == absent.err.replace(missing, "ID")
        assert "not found" in other.err
    for args in (["account", "show", acct_b], ["token", "list", "--account", acct_b]):
        res = cp.cli(*args, credential=cred)
        assert res.code == 2 and "not found" in res.err
    # Listing another account's machines answers exactly like a missing account...
    absent_acct = new_id("account")
    other = cp.cli("machine", "list", "--account", acct_b, credential=cred)
    absent = cp.cli("machine", "list", "--account", absent_acct, credential=cred)
    assert other.code == absent.code == 2 and other.out == absent.out == ""
    assert other.err.replace(acct_b, "ID") == absent.err.replace(absent_acct, "ID")
    assert len(other.err.splitlines()) == 1 and "not found" in other.err
    # ...down to the gRPC status, and the client maps it to NotFound.
    async with AdminClient(cp.public, cp.ca_pem, cred, timeout=10) as client:
        stub: Any = client.stub  # typed for the sync API; on an aio channel it awaits
        for acct in (acct_b, absent_acct):
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await stub.ListMachines(
                    admin_pb2.ListMachinesRequest(account_id=acct),
                    metadata=(("authorization", f"Bearer {cred}"),),
                    timeout=10,
                )
            assert raw.value.code() == grpc.StatusCode.NOT_FOUND
            assert raw.value.details() == f"account {acct}: not found"
            with pytest.raises(NotFound) as mapped:
                await client.list_machines(acct)
            assert (mapped.value.kind, mapped.value.ident) == ("account", acct)
    assert (
        cp.cli("account", "create", "--github-id", "9", "--github-login", "x", credential=cred).code
        == 1
    )
    # ...and can rename its own machine; the operator sees every machine.
    _ok(cp.cli("machine", "rename", mc_a, "renamed", credential=cred))
    everything = json.loads(_ok(cp.cli("machine", "list", "--json")))["machines"]
    names = {m["machine_id"]: m["name"] for m in everything}
    assert names[mc_a] == "renamed" and names[mc_b] == "b-box"
    # Bad input: one line, exit 2.
    bad = cp.cli("machine", "show", "nope")
    assert bad.code == 2 and len(bad.err.strip().splitlines()) == 1
    too_long = cp.cli("token", "create", "--account", acct_a, "--ttl", "25h")
    assert too_long.code == 2 and "ttl_seconds" in too_long.err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_no_secret_in_clear(
    cp: ControlProc, moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    acct = _account(cp, 2001)
    token, command = _token(cp, acct["account_id"])
    cred = json.loads(
        _ok(cp.cli("credential", "create", "--account", acct["account_id"], "--json"))
    )["credential"]
    # A real machine joins with that very token (the printed command, plus
    # --data-dir), so its data folder and log have had every chance to keep it.
    data_dir, machine_log = tmp_path / "machine", tmp_path / "machine.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env["AGENTS_MACHINE_METRICS"] = f"127.0.0.1:{_free_port()}"
    with machine_log.open("wb") as log:
        machine = subprocess.Popen(
            [str(MACHINE_EXE), *shlex.split(command)[1:], "--data-dir", str(data_dir)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def joined() -> bool:
        assert machine.poll() is None, machine_log.read_text(errors="replace")
        return "joined as machine" in machine_log.read_text(errors="replace")

    try:
        await apoll_until(
            joined,
            deadline=20,
            what="joined as machine",
            step=0.05,
            fail=lambda: AssertionError(machine_log.read_text(errors="replace")),
        )
        listed = json.loads(
            _ok(cp.cli("machine", "list", "--account", acct["account_id"], "--json"))
        )["machines"]
        assert len(listed) == 1
        used = json.loads(_ok(cp.cli("token", "list", "--account", acct["account_id"], "--json")))[
            "tokens"
        ]
        assert [t["uses"] for t in used] == [1]
    finally:
        machine.kill()
        machine.wait(timeout=15)

    secrets_ = [cp.operator, token, cred, acct["recovery_private_key"]]
    needles = [s.encode() for s in secrets_] + [s.split(".")[-1].encode() for s in secrets_]
    hits = []
    for folder in (cp.home, data_dir):
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                hits += [str(path) for n in needles if n in data]
    assert any(p.is_file() for p in data_dir.rglob("*")), "the machine wrote nothing"
    client = _s3(moto_endpoint)
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert any(k.startswith("deploy/credentials/") for k in keys)
    assert any("/tokens/" in k for k in keys)
    assert any("/machines/" in k for k in keys)
    for key in keys:
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        hits += [key for n in needles if n in data]
    client.close()
    assert cp.log_path is not None
    logs = {"serve log": cp.log_path.read_bytes(), "machine log": machine_log.read_bytes()}
    assert b"joined as machine" in logs["machine log"]
    for name, text in logs.items():
        hits += [name for n in needles if n in text]
    assert hits == []


async def test_link_foreign_ca_refused_and_revocation(cp: ControlProc) -> None:
    acct = _account(cp, 3001)
    token, _ = _token(cp, acct["account_id"])
    joined, key_pem = await _join(cp, token)
    cert = joined.certificate_pem.encode()

    # A certificate from another CA (with a well-formed identity) fails the handshake.
    other = tls.make_ca()
    fkey = tls.new_tls_key()
    forged = tls.sign_client_csr(
        other,
        tls.build_csr(fkey),
        account_id=joined.account_id,
        machine_id=joined.machine_id,
        lifetime=__import__("datetime").timedelta(days=1),
    )
    async with _link_channel(cp, tls.private_key_pem(fkey), forged.cert_pem) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await link_pb2_grpc.MachineLinkStub(ch).RenewCertificate(
                link_pb2.RenewCertificateRequest(csr_pem=tls.build_csr(fkey).decode()), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Without a client certificate (the public listener) link RPCs are refused.
    async with grpc.aio.secure_channel(cp.public, grpc.ssl_channel_credentials(cp.ca_pem)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await link_pb2_grpc.MachineLinkStub(ch).RenewCertificate(
                link_pb2.RenewCertificateRequest(), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async with _link_channel(cp, key_pem, cert) as ch:
        stub = link_pb2_grpc.MachineLinkStub(ch)
        call = stub.Connect()
        await call.write(
            link_pb2.MachineMessage(hello=link_pb2.Hello(version="0.1.0", agent_count=3))
        )
        first = await asyncio.wait_for(call.read(), 5)
        assert first.WhichOneof("kind") == "welcome"
        assert first.welcome.machine_id == joined.machine_id
        assert list(first.welcome.control_addresses) == [cp.link]

        # Heartbeat from the welcome on, as a machine does: the control plane marks a
        # silent session offline after 3 missed beats (1.5 s here), less than a CLI
        # start takes on a loaded host.
        stop_beating = asyncio.Event()

        async def beat() -> None:
            try:
                while not stop_beating.is_set():
                    await call.write(
                        link_pb2.MachineMessage(heartbeat=link_pb2.Heartbeat(agent_count=3))
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop_beating.wait(), 0.2)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the server ended the stream

        beater = asyncio.create_task(beat())
        try:
            # The listing may lag the welcome by a moment: wait for it with a deadline.
            def online() -> dict[str, Any] | None:
                out = _ok(cp.cli("machine", "show", joined.machine_id, "--json"))
                shown: dict[str, Any] = json.loads(out)
                return shown if shown["online"] else None

            shown = await apoll_until(
                lambda: asyncio.to_thread(online),
                deadline=10,
                what="machine shown online",
                step=0.1,
            )
            assert shown["agent_count"] == 3

            # The operator revokes; the stream must end within 1 s.
            revoke = await asyncio.create_subprocess_exec(
                *cp_cli_argv(cp, "machine", "revoke", joined.machine_id),
                env={**cp.env, "AGENTS_CONTROL_CREDENTIAL": cp.operator},
                stdout=asyncio.subprocess.DEVNULL,
            )
            assert await asyncio.wait_for(revoke.wait(), 30) == 0
            revoked_at = time.monotonic()
            kinds = []
            async with asyncio.timeout(5):
                while (msg := await call.read()) is not grpc.aio.EOF:
                    kinds.append(msg.WhichOneof("kind"))
                    if kinds[-1] == "revoked":
                        # What a machine does: finish the write in flight, half-close.
                        stop_beating.set()
                        await beater
                        await call.done_writing()
            assert time.monotonic() - revoked_at < 1.0
            assert kinds[-1:] == ["revoked"]
        finally:
            beater.cancel()
            await asyncio.gather(beater, return_exceptions=True)
        # The revoked certificate is refused from then on.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RenewCertificate(
                link_pb2.RenewCertificateRequest(csr_pem=tls.build_csr(tls.new_tls_key()).decode()),
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in (info.value.details() or "")
        # Connect refuses it too, but only after reading the hello: a refusal sent
        # while the machine's first write is in flight can reach it as INTERNAL,
        # which it would retry. So: no answer while we stay silent (the server
        # waits up to 3 heartbeats, 1.5 s here), then the refusal after hello.
        refused = stub.Connect()
        answer = asyncio.ensure_future(refused.read())
        done, _ = await asyncio.wait({answer}, timeout=0.5)
        assert not done, "refused before the hello was read"
        await refused.write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="0.1.0")))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(answer, 5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in (info.value.details() or "")
    listed = json.loads(_ok(cp.cli("machine", "show", joined.machine_id, "--json")))
    assert listed["revoked"] is True and listed["online"] is False


def cp_cli_argv(cp: ControlProc, *args: str) -> list[str]:
    from tests.helpers.control_proc import agents_control_exe

    return [str(agents_control_exe()), *args, "--home", str(cp.home)]
