"""Regression tests for the security review's findings.

Each test starts the real control plane in-process (both TLS listeners, a
folder store) and talks to it over gRPC the way a machine or an operator would.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from controlplane.access import accounts as accounts_mod
from controlplane.api import link as link_servicer_mod
from controlplane.config import ControlConfig
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.server import ControlPlane
from shared import tls
from shared.cli import Column, Output
from shared.errors import InvalidId
from shared.ids import new_id
from shared.pb.control.v1 import admin_pb2, admin_pb2_grpc, link_pb2, link_pb2_grpc
from shared.rpc import domain_error
from tests.helpers.poll import apoll_until

#: Deadline for anything that should happen "at once".
_PROMPT = 5.0
#: What a stream call's read() returns once the server ended the stream.
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

Metadata = tuple[tuple[str, str], ...]


class Env:
    """A running control plane plus what a test needs to reach it."""

    def __init__(self, cp: ControlPlane, cfg: ControlConfig, operator: str, ca: bytes) -> None:
        self.cp = cp
        self.cfg = cfg
        self.operator = operator
        self.ca = ca
        self.public = f"127.0.0.1:{cp.public_port}"
        self.link = f"127.0.0.1:{cp.link_port}"

    def public_channel(self) -> grpc.aio.Channel:
        """Server-TLS channel to the public listener (no client certificate)."""
        return grpc.aio.secure_channel(self.public, grpc.ssl_channel_credentials(self.ca))

    def link_channel(self, cert: bytes, key: bytes) -> grpc.aio.Channel:
        """Mutual-TLS channel to the link listener."""
        creds = grpc.ssl_channel_credentials(self.ca, private_key=key, certificate_chain=cert)
        return grpc.aio.secure_channel(self.link, creds)

    def md(self, credential: str | None = None) -> Metadata:
        """Admin call metadata (the operator credential unless told otherwise)."""
        return (("authorization", f"Bearer {credential or self.operator}"),)

    def disconnects(self, reason: str) -> float:
        """How many Connect streams ended for ``reason``."""
        value = self.cp.registry.get_sample_value("agents_cp_disconnects_total", {"reason": reason})
        return value or 0.0


@contextlib.asynccontextmanager
async def control(tmp: Path, **overrides: Any) -> AsyncIterator[Env]:
    """Init and start a control plane on port-0 loopback listeners; stop it after."""
    settings: dict[str, Any] = {
        "home": tmp / "home",
        "store_url": str(tmp / "store"),
        "listen": "127.0.0.1:0",
        "link_listen": "127.0.0.1:0",
        "metrics_listen": "",
        "heartbeat_interval": 0.5,
        **overrides,
    }
    cfg = ControlConfig(**settings).validate()
    made = await init_control_plane(cfg)
    cp = ControlPlane(cfg)
    try:
        await cp.start()
        yield Env(cp, cfg, made.operator_credential, (cfg.home / "ca.pem").read_bytes())
    finally:
        await cp.stop(0)


class Joined:
    """A machine that joined: its ids, certificate and key."""

    def __init__(self, account_id: str, machine_id: str, cert: bytes, key: bytes) -> None:
        self.account_id = account_id
        self.machine_id = machine_id
        self.cert = cert
        self.key = key


async def new_token(env: Env, github_user_id: int = 1001) -> tuple[str, str]:
    """Create an account and a join token; return (account id, token value)."""
    async with env.public_channel() as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        acct = await admin.CreateAccount(
            admin_pb2.CreateAccountRequest(github_user_id=github_user_id, github_login="alice"),
            metadata=env.md(),
        )
        account_id = acct.account.account_id
        tok = await admin.CreateJoinToken(
            admin_pb2.CreateJoinTokenRequest(account_id=account_id), metadata=env.md()
        )
    return account_id, tok.token_value


async def join(env: Env) -> Joined:
    """Join one machine through the public listener."""
    account_id, token = await new_token(env)
    key = tls.new_tls_key()
    async with env.public_channel() as ch:
        reply = await link_pb2_grpc.MachineLinkStub(ch).Join(
            link_pb2.JoinRequest(
                token=token,
                csr_pem=tls.build_csr(key).decode(),
                machine=link_pb2.MachineInfo(name="m1", version="1", hostname="h"),
            )
        )
    return Joined(
        account_id, reply.machine_id, reply.certificate_pem.encode(), tls.private_key_pem(key)
    )


async def renew(env: Env, cert: bytes, key: bytes) -> tuple[bytes, bytes]:
    """RenewCertificate with (cert, key) and a fresh key; return the new pair."""
    new_key = tls.new_tls_key()
    async with env.link_channel(cert, key) as ch:
        reply = await link_pb2_grpc.MachineLinkStub(ch).RenewCertificate(
            link_pb2.RenewCertificateRequest(csr_pem=tls.build_csr(new_key).decode())
        )
    return reply.certificate_pem.encode(), tls.private_key_pem(new_key)


async def wait_for_value(probe: Any, want: float, deadline: float = _PROMPT) -> float:
    """Poll ``probe()`` until it returns ``want`` or the deadline passes; return the last."""
    try:
        await apoll_until(lambda: probe() == want, deadline=deadline, what=f"{want}", step=0.02)
    except TimeoutError:
        pass  # the caller's assertion shows the value it got instead
    return float(probe())


def connect(channel: grpc.aio.Channel) -> Any:
    """Open a Connect stream (typed loosely: the stubs do not know bidi calls)."""
    stub: Any = link_pb2_grpc.MachineLinkStub(channel)
    return stub.Connect()


def hello(version: str = "1") -> link_pb2.MachineMessage:
    return link_pb2.MachineMessage(hello=link_pb2.Hello(version=version))


# 1 -------------------------------------------------------------------------


async def test_revoke_between_authorisation_and_registration_ends_new_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The revoke finds no session to kick; Connect must notice it once registered."""
    async with control(tmp_path, heartbeat_interval=0.3) as env:
        machine = await join(env)
        entered = asyncio.Event()
        gate = asyncio.Event()
        armed = [True]
        real = accounts_mod.AccountService.is_deleting

        async def held(self: accounts_mod.AccountService, account_id: str) -> bool:
            # is_deleting is the last await of authorize_peer: hold the first call
            # (Connect's) open so the revoke lands after the machine was authorised.
            if armed[0]:
                armed[0] = False
                entered.set()
                await gate.wait()
            return await real(self, account_id)

        monkeypatch.setattr(accounts_mod.AccountService, "is_deleting", held)
        try:
            async with env.link_channel(machine.cert, machine.key) as ch:
                call = connect(ch)
                await call.write(hello())
                await asyncio.wait_for(entered.wait(), _PROMPT)
                async with env.public_channel() as ach:
                    revoked = await admin_pb2_grpc.AdminStub(ach).RevokeMachine(
                        admin_pb2.RevokeMachineRequest(machine_id=machine.machine_id),
                        metadata=env.md(),
                    )
                assert revoked.revoked
                gate.set()
                first = await asyncio.wait_for(call.read(), _PROMPT)
                assert first is not _EOF
                assert first.WhichOneof("kind") == "welcome"
                second = await asyncio.wait_for(call.read(), _PROMPT)
                assert second is not _EOF, "link ended without a revoked notice"
                assert second.WhichOneof("kind") == "revoked"
                await call.done_writing()
                assert await asyncio.wait_for(call.code(), _PROMPT) == grpc.StatusCode.OK
        finally:
            gate.set()
        assert await wait_for_value(lambda: env.disconnects("revoked"), 1.0) == 1.0
        assert env.cp._presence is not None
        assert env.cp._presence.session(machine.machine_id) is None


# 2 -------------------------------------------------------------------------


async def test_link_ends_expired_once_certificate_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live link outliving its certificate is closed with reason expired."""
    async with control(tmp_path) as env:
        machine = await join(env)
        async with env.link_channel(machine.cert, machine.key) as ch:
            call = connect(ch)
            await call.write(hello())
            welcome = await asyncio.wait_for(call.read(), _PROMPT)
            assert welcome is not _EOF
            assert welcome.WhichOneof("kind") == "welcome"
            # The TLS handshake is over: move only the servicer's clock past the
            # certificate's end (30 days) and let the machine keep heartbeating.
            later = dt.datetime.now(dt.UTC) + dt.timedelta(days=31)
            fake_dt = types.SimpleNamespace(
                datetime=types.SimpleNamespace(now=lambda tz=None: later),
                UTC=dt.UTC,
                timedelta=dt.timedelta,
            )
            monkeypatch.setattr(link_servicer_mod, "dt", fake_dt)
            await call.write(link_pb2.MachineMessage(heartbeat=link_pb2.Heartbeat()))
            end = await asyncio.wait_for(call.read(), _PROMPT)
            assert end is _EOF
            await call.done_writing()
            await asyncio.wait_for(call.code(), _PROMPT)
        assert await wait_for_value(lambda: env.disconnects("expired"), 1.0) == 1.0
        assert env.disconnects("timeout") == 0.0


# 3 -------------------------------------------------------------------------


async def test_superseded_certificate_cannot_renew(tmp_path: Path) -> None:
    """Once renewed, the old certificate must never mint another one."""
    # One-hour certificates, renewal due as soon as they are issued.
    async with control(tmp_path, cert_lifetime_days=1 / 24, renew_threshold=0.99) as env:
        machine = await join(env)
        cert1, key1 = await renew(env, machine.cert, machine.key)
        assert tls.identity_from_cert(cert1).machine_id == machine.machine_id
        assert tls.cert_serial(cert1) != tls.cert_serial(machine.cert)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await renew(env, machine.cert, machine.key)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The current certificate is untouched by the refused attempt.
        cert2, _ = await renew(env, cert1, key1)
        assert tls.identity_from_cert(cert2).machine_id == machine.machine_id


async def test_fresh_certificate_not_due_is_refused(tmp_path: Path) -> None:
    """A just-issued 30-day certificate may not renew yet: FAILED_PRECONDITION."""
    async with control(tmp_path) as env:
        machine = await join(env)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await renew(env, machine.cert, machine.key)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "renew" in (caught.value.details() or "")


# 4 -------------------------------------------------------------------------


async def test_anonymous_connect_on_public_listener_refused_at_once(tmp_path: Path) -> None:
    """No client certificate: refused long before one (30 s) heartbeat interval."""
    async with control(tmp_path, heartbeat_interval=30.0) as env:
        async with env.public_channel() as ch:
            call = connect(ch)
            started = time.monotonic()
            try:
                code = await asyncio.wait_for(call.code(), _PROMPT)
            except TimeoutError:
                pytest.fail(f"anonymous Connect still open after {_PROMPT} s")
            finally:
                call.cancel()
            elapsed = time.monotonic() - started
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert elapsed < _PROMPT


# 5 -------------------------------------------------------------------------


async def test_hello_version_with_control_characters_refused(tmp_path: Path) -> None:
    """An escape sequence in hello.version never reaches the presence registry."""
    async with control(tmp_path) as env:
        machine = await join(env)
        async with env.link_channel(machine.cert, machine.key) as ch:
            call = connect(ch)
            await call.write(hello("1.0\x1b[2J\x1b[Hpwned"))
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while await asyncio.wait_for(call.read(), _PROMPT) is not _EOF:
                    pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello.version" in (caught.value.details() or "")
        assert env.cp._presence is not None
        assert env.cp._presence.session(machine.machine_id) is None


def test_machine_table_prints_rich_markup_literally() -> None:
    """A machine name carrying markup or terminal escapes prints as inert text."""
    name = "[link=https://evil]x[/link]"
    escape = "\x1b]8;;https://evil\x1b\\x\x1b]8;;\x1b\\"
    buf = io.StringIO()
    Output(as_json=False, stream=buf).table(
        [Column("machine_id", whole=True), Column("name")],
        [[new_id("machine"), name], [new_id("machine"), escape]],
    )
    out = buf.getvalue()
    assert "\x1b" not in out
    assert name in out


# 6 -------------------------------------------------------------------------


async def test_huge_invalid_id_echoed_shortened(tmp_path: Path) -> None:
    """A 100 KiB id comes back bounded: message, details and rebuilt error."""
    huge = "A" * (100 * 1024)
    async with control(tmp_path) as env:
        async with env.public_channel() as ch:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admin_pb2_grpc.AdminStub(ch).GetAccount(
                    admin_pb2.GetAccountRequest(account_id=huge), metadata=env.md()
                )
    exc = caught.value
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(exc.details() or "") < 200
    trailers: Any = exc.trailing_metadata() or ()
    trailer_bytes = sum(len(k) + len(v) for k, v in trailers)
    assert trailer_bytes < 2000
    err = domain_error(exc)
    assert isinstance(err, InvalidId)
    assert len(err.message) < 200
    assert len(str(err.value)) < 200
    assert len(InvalidId("account", huge).value) < 200


# 7 -------------------------------------------------------------------------


def _wrong(secret: str) -> str:
    return ("A" if secret[0] != "A" else "B") + secret[1:]


async def test_join_unknown_token_and_wrong_secret_answer_alike(tmp_path: Path) -> None:
    """The refusal must not tell an attacker which token ids exist."""
    async with control(tmp_path) as env:
        _, token = await new_token(env)
        token_id, secret = token.split(".")
        answers = []
        async with env.public_channel() as ch:
            stub = link_pb2_grpc.MachineLinkStub(ch)
            for value in (f"{new_id('token')}.{secret}", f"{token_id}.{_wrong(secret)}"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Join(
                        link_pb2.JoinRequest(
                            token=value,
                            csr_pem=tls.build_csr(tls.new_tls_key()).decode(),
                            machine=link_pb2.MachineInfo(name="m", version="1", hostname="h"),
                        )
                    )
                answers.append((caught.value.code(), caught.value.details()))
        assert answers[0][0] == grpc.StatusCode.UNAUTHENTICATED
        assert answers[0] == answers[1]


async def test_admin_unknown_credential_and_wrong_secret_answer_alike(tmp_path: Path) -> None:
    """Same for admin credentials: one message for an unknown id or a wrong secret."""
    async with control(tmp_path) as env:
        cred_id, secret = env.operator.split(".")
        answers = []
        async with env.public_channel() as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            for value in (f"{new_id('credential')}.{secret}", f"{cred_id}.{_wrong(secret)}"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await admin.ListAccounts(
                        admin_pb2.ListAccountsRequest(), metadata=env.md(value)
                    )
                answers.append((caught.value.code(), caught.value.details()))
        assert answers[0][0] == grpc.StatusCode.UNAUTHENTICATED
        assert answers[0] == answers[1]
