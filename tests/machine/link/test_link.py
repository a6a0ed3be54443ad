"""Unit tests of join (input checks, the CA pin, staging) and of ControlLink.

Both talk to :class:`~tests.helpers.fake_link_client.FakeControlPlane`, an
in-process control plane behind a fake of the machine's link client (no gRPC):
it records every call so tests can prove what the machine did (and did not)
send, and scripts refusals, broken streams and notices. The pin check before a
join is a real TLS handshake with a bare TLS listener. The link client itself
is tested against a real TLS gRPC server in test_link_client.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from machine.link import identity
from machine.link.client import (
    AccountDeleted,
    AgentRoster,
    DeliveryAck,
    RenewNow,
    Revoked,
    Welcome,
)
from machine.link.connection import ControlLink, Delivery, LinkState
from machine.link.join import (
    join_control_plane,
    parse_address,
    parse_link_addresses,
    validate_ca_hash,
    validate_token,
)
from shared import tls
from shared.errors import (
    AgentsError,
    DatabaseDamaged,
    DiskFull,
    IntegrityError,
    InvalidArgument,
    InvalidState,
    MachineRevoked,
    TransientError,
    Unauthenticated,
)
from shared.ids import new_id
from tests.helpers.clock import FixedClock
from tests.helpers.fake_link_client import (
    GOOD_SECRET,
    FakeControlPlane,
    FakeStream,
    domain_rpc_error,
    rpc_error,
    serve_pin_check,
)
from tests.helpers.poll import apoll_until


def _token() -> str:
    return f"{new_id('token')}.{GOOD_SECRET}"


@pytest.fixture(scope="module")
def ca() -> tls.CertKey:
    return tls.make_ca()


@pytest.fixture
async def control(ca: tls.CertKey) -> AsyncIterator[FakeControlPlane]:
    fake = FakeControlPlane(ca)
    async with serve_pin_check(ca) as address:
        fake.public_address = address
        yield fake


def _pin(control: FakeControlPlane) -> str:
    return tls.ca_hash(control.ca.cert_pem)


async def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    fail = AssertionError("condition not met before the deadline")
    await apoll_until(pred, deadline=timeout, what="condition", fail=lambda: fail)


async def _join(control: FakeControlPlane, data_dir: Path, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "data_dir": data_dir,
        "address": control.public_address,
        "token": control.new_token(),
        "ca_hash": _pin(control),
        "name": "test-machine",
        "dial": control.for_join,
    }
    args.update(kw)
    return await join_control_plane(**args)


async def _joined(control: FakeControlPlane, data_dir: Path) -> None:
    await _join(control, data_dir)


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


# ------------------------------------------------------------------ join input


@pytest.mark.parametrize(
    "token",
    [
        "",
        "abc",
        "tok_123.secret",
        # Fixed ids: test ids must be the same in every collecting process (xdist).
        "tok_" + "0" * 26,
        f"ag_{'1' * 26}.{GOOD_SECRET}",
        f"tok_{'2' * 26}.short",
        f"tok_{'3' * 26}.{GOOD_SECRET}.x",
    ],
)
def test_token_shape_is_checked(token: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_token(token)
    assert info.value.field == "token"
    if "." in token and len(token.split(".")[-1]) > 8:
        assert token.split(".")[1] not in str(info.value)  # the secret is never echoed


@pytest.mark.parametrize(
    "value",
    ["", "sha256:", "sha256:" + "g" * 64, "md5:" + "0" * 64, "0" * 64, "sha256:" + "0" * 63],
)
def test_ca_hash_shape_is_checked(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_ca_hash(value)
    assert info.value.field == "ca_hash"


def test_ca_hash_is_normalised() -> None:
    assert validate_ca_hash("SHA256:" + "AB" * 32) == "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "value", ["", "host", "host:", ":80", "host:0", "host:70000", "ho st:80", "[::zz]:80", "a/b:1"]
)
def test_address_shape_is_checked(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_address(value)
    assert info.value.field == "address"


def test_address_forms() -> None:
    assert parse_address("127.0.0.1:7443") == ("127.0.0.1", 7443)
    assert parse_address("cp.example.com:443") == ("cp.example.com", 443)
    assert parse_address("[::1]:7443") == ("::1", 7443)


@pytest.mark.parametrize(
    ("field_name", "kwargs"),
    [
        ("token", {"token": "nope"}),
        ("ca_hash", {"ca_hash": "sha256:xyz"}),
        ("address", {"address": "nowhere"}),
        ("name", {"name": "bad\nname"}),
        ("name", {"name": "x" * 65}),
    ],
)
async def test_join_validates_before_contacting_anyone(
    control: FakeControlPlane, tmp_path: Path, field_name: str, kwargs: dict[str, str]
) -> None:
    args: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "address": control.public_address,
        "token": control.new_token(),
        "ca_hash": _pin(control),
        "name": "m",
        "dial": control.for_join,
    }
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as info:
        await join_control_plane(**args)
    assert info.value.field == field_name
    assert control.join_calls == 0
    assert _listing(tmp_path) == []


# ------------------------------------------------------------------ join flow


async def test_join_writes_private_identity(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    token = control.new_token()
    result = await _join(control, data_dir, name="laptop", token=token)
    assert result.account_id == control.account_id
    # The reply names the link port only: the link is on the join's host.
    assert result.control_address == control.link_address
    assert [m.name for m in control.joined] == ["laptop"]
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    keys = data_dir / identity.KEYS_DIR
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert _listing(keys) == sorted(
        [
            identity.SIGNING_KEY,
            identity.BOX_KEY,
            identity.TLS_KEY,
            identity.TLS_CERT,
            identity.CA_CERT,
            identity.UNCONFIRMED_FILE,
        ]
    )
    # Not confirmed until the machine first connects; the mark names the token's id only.
    unconfirmed = identity.unconfirmed_join(data_dir)
    assert unconfirmed is not None
    assert (unconfirmed.machine_id, unconfirmed.token_id) == (
        result.machine_id,
        validate_token(token),
    )
    assert token.split(".")[1] not in (keys / identity.UNCONFIRMED_FILE).read_text()
    for f in [*keys.iterdir(), data_dir / identity.LINK_FILE]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    doc = json.loads((data_dir / identity.LINK_FILE).read_text())
    assert doc["machine_id"] == result.machine_id
    assert doc["control_address"] == control.link_address
    assert doc["heartbeat_interval_ms"] == control.heartbeat_ms
    link = identity.load_link(data_dir)
    assert link.account_recovery_public_key == control.recovery.public_key
    loaded = identity.load_keys(data_dir)
    assert tls.identity_from_cert(loaded.tls_cert_pem).machine_id == result.machine_id
    assert tls.ca_hash(loaded.ca_cert_pem) == _pin(control)
    assert control.joined[0].box_public_key == loaded.box.public_key
    # No staging folder is left beside the data folder.
    assert _listing(tmp_path) == ["data"]
    # Nothing private in the link record.
    assert "PRIVATE" not in (data_dir / identity.LINK_FILE).read_text()


async def test_a_server_that_waits_for_the_client_to_speak_is_not_taken_for_the_link_port(
    control: FakeControlPlane, ca: tls.CertKey, tmp_path: Path
) -> None:
    """A proxy in front of the public port may stay silent after the handshake
    (the control plane itself sends its HTTP/2 settings at once): the pin check
    waits a moment for a hang-up, and a silence is no hang-up."""
    async with serve_pin_check(ca, speaks_first=False) as silent:
        control.public_address = silent
        result = await _join(control, tmp_path / "data")
    assert result.account_id == control.account_id and len(control.joined) == 1


async def test_wrong_pin_is_refused_before_join(control: FakeControlPlane, tmp_path: Path) -> None:
    other = tls.ca_hash(tls.make_ca().cert_pem)
    with pytest.raises(IntegrityError) as info:
        await _join(control, tmp_path / "data", ca_hash=other, name=None)
    assert info.value.what == "ca_hash"
    assert "does not present the pinned CA" in str(info.value)
    assert control.join_calls == 0  # the token never left the machine
    assert _listing(tmp_path) == []


async def test_join_reads_the_injected_clock(control: FakeControlPlane, tmp_path: Path) -> None:
    # Ten years on, the server certificate has expired: refused before the token is sent.
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=3650)
    with pytest.raises(IntegrityError) as info:
        await _join(control, tmp_path / "data", name=None, clock=lambda: later)
    assert "is not valid now" in str(info.value)
    assert control.join_calls == 0


async def test_join_records_the_certificate_arrival_by_the_injected_clock(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    clock = FixedClock(dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(days=1))
    data_dir = tmp_path / "data"
    await _join(control, data_dir, clock=clock)
    # Renewal is timed from this moment (the link's renew_in).
    assert identity.load_link(data_dir).cert_received_at == clock.now


async def test_server_without_ca_in_chain_is_refused(ca: tls.CertKey, tmp_path: Path) -> None:
    fake = FakeControlPlane(ca)
    async with serve_pin_check(ca, with_ca=False) as address:
        fake.public_address = address
        with pytest.raises(IntegrityError):
            await _join(fake, tmp_path / "data", name=None)
    assert fake.join_calls == 0
    assert _listing(tmp_path) == []


async def test_refused_token_writes_nothing(control: FakeControlPlane, tmp_path: Path) -> None:
    with pytest.raises(Unauthenticated):
        await _join(control, tmp_path / "data", token=_token(), name=None)  # unknown to it
    assert control.join_calls == 1
    assert _listing(tmp_path) == []


async def test_join_whose_connection_is_lost_is_transient_and_writes_nothing(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    token = control.new_token()
    control.fail("join", rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    with pytest.raises(TransientError) as info:
        await _join(control, tmp_path / "data", token=token, name=None)
    assert "run the same command again" in str(info.value)
    assert token not in str(info.value)
    assert _listing(tmp_path) == []
    # The same command again succeeds with the same token.
    await _join(control, tmp_path / "data", token=token)
    assert identity.is_joined(tmp_path / "data")


async def test_join_refusal_with_a_status_detail_is_the_domain_error(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    # UNAVAILABLE with our detail is the control plane's answer, not a lost connection.
    control.fail("join", domain_rpc_error(TransientError("join: the store is busy")))
    with pytest.raises(TransientError) as info:
        await _join(control, tmp_path / "data")
    assert "store is busy" in str(info.value)
    assert "run the same command again" not in str(info.value)


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        (lambda r: dataclasses.replace(r, account_recovery_public_key=b"short"), "32 bytes"),
        (lambda r: dataclasses.replace(r, machine_id=new_id("machine")), "bad certificate"),
        (lambda r: dataclasses.replace(r, link_host="bad host"), "bad link address"),
        (lambda r: dataclasses.replace(r, ca_certificate_pem=""), "bad certificate"),
    ],
)
async def test_a_bad_join_reply_is_refused_and_writes_nothing(
    ca: tls.CertKey,
    tmp_path: Path,
    tamper: Callable[[Any], Any],
    words: str,
) -> None:
    fake = FakeControlPlane(ca)
    fake.next_ca = tls.make_ca()  # signed by the new CA: without the bundle it does not verify
    async with serve_pin_check(ca) as address:
        fake.public_address = address
        fake.tamper_join = tamper
        with pytest.raises(IntegrityError) as info:
            await _join(fake, tmp_path / "data")
    assert words in str(info.value)
    assert _listing(tmp_path) == []


async def test_unreachable_control_plane(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransientError):
        await join_control_plane(
            data_dir=tmp_path / "data",
            address=f"127.0.0.1:{port}",
            token=_token(),
            ca_hash="sha256:" + "0" * 64,
            name=None,
        )
    assert _listing(tmp_path) == []


async def test_joined_data_dir_is_refused_without_spending_a_token(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    before = (data_dir / identity.LINK_FILE).read_bytes()
    token = control.new_token()
    with pytest.raises(InvalidState) as info:
        await _join(control, data_dir, token=token, name=None)
    assert "already joined" in str(info.value)
    assert token in control.tokens  # not spent
    assert (data_dir / identity.LINK_FILE).read_bytes() == before


async def test_repair_token_re_pairs_a_joined_box_keeping_its_id_and_keys(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    link = identity.load_link(data_dir)
    held = identity.load_keys(data_dir)
    token = control.new_token()
    control.repairs[token] = link.machine_id
    result = await _join(control, data_dir, token=token, name=None)
    assert result.repaired and result.machine_id == link.machine_id
    now = identity.load_keys(data_dir)
    assert now.box.public_key == held.box.public_key  # queued prompts still open
    assert now.tls_key_pem != held.tls_key_pem and now.tls_cert_pem != held.tls_cert_pem
    assert tls.identity_from_cert(now.tls_cert_pem).machine_id == link.machine_id
    assert not list(data_dir.rglob("*.new"))
    # A repaired record is never rolled back: the first join's mark goes.
    assert identity.unconfirmed_join(data_dir) is None
    assert not (data_dir / identity.KEYS_DIR / identity.UNCONFIRMED_FILE).exists()


async def test_as_new_joins_a_joined_box_as_a_new_machine_and_never_takes_one_over(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    """``--as-new`` (even with ``--no-restore``, which asks for take_over) must not
    let a repair token for another machine hand that machine to this box: the
    control plane is never told take_over by a joined box. A plain token makes
    it a new machine with the same box key."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    before = identity.load_link(data_dir)
    held = identity.load_keys(data_dir)
    identity.mark_stopped(data_dir, "machine revoked: by the test", 1.0)
    other = new_id("machine")
    token = control.new_token()
    control.repairs[token] = other
    with pytest.raises(InvalidState, match="would take over machine"):
        await _join(control, data_dir, token=token, as_new=True, take_over=True)
    assert token in control.tokens, "refused before it was used"
    assert identity.load_link(data_dir) == before
    plain = control.new_token()
    result = await _join(control, data_dir, token=plain, as_new=True, take_over=True)
    assert not result.repaired and result.machine_id not in (before.machine_id, other)
    # A new machine: not confirmed until it connects (the control plane may roll it back).
    unconfirmed = identity.unconfirmed_join(data_dir)
    assert unconfirmed is not None
    assert (unconfirmed.machine_id, unconfirmed.token_id) == (
        result.machine_id,
        validate_token(plain),
    )
    assert identity.load_link(data_dir).machine_id == result.machine_id
    assert identity.load_keys(data_dir).box.public_key == held.box.public_key
    assert not list(data_dir.rglob("*.new"))
    assert identity.stopped_reason(data_dir) is None, "a new machine: not stopped"


async def test_join_during_a_ca_rollover_trusts_both_cas(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    control.next_ca = tls.make_ca()
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    keys = identity.load_keys(data_dir)
    assert tls.split_certs(keys.ca_cert_pem) == [control.ca.cert_pem, control.next_ca.cert_pem]
    tls.verify_issued_by(keys.tls_cert_pem, control.next_ca.cert_pem)


def test_re_pair_interrupted_after_its_commit_point_is_finished_at_load(tmp_path: Path) -> None:
    ca = tls.make_ca()
    data_dir = tmp_path / "data"
    keys = identity.NewKeys.generate()
    first = tls.sign_client_csr(
        ca,
        keys.csr_pem(),
        account_id=new_id("account"),
        machine_id=new_id("machine"),
        lifetime=dt.timedelta(hours=1),
    )
    ident = tls.identity_from_cert(first.cert_pem)
    link = identity.LinkRecord(
        control_address="127.0.0.1:1",
        machine_id=ident.machine_id,
        account_id=ident.account_id,
        account_recovery_public_key=bytes(32),
        heartbeat_interval=1.0,
        cert_not_after=first.not_after,
        cert_received_at=first.not_after,
    )
    identity.write_identity(
        data_dir, keys, cert_pem=first.cert_pem, ca_cert_pem=ca.cert_pem, link=link
    )
    new_key = tls.new_tls_key()
    second = tls.sign_client_csr(
        ca,
        tls.build_csr(new_key),
        account_id=ident.account_id,
        machine_id=ident.machine_id,
        lifetime=dt.timedelta(hours=2),
    )
    moved = dataclasses.replace(link, control_address="127.0.0.1:2")
    # Staged, then killed right after the first rename (the commit point).
    for folder, name, data in (
        ("keys", "tls.key", tls.private_key_pem(new_key)),
        ("keys", "tls.crt", second.cert_pem),
        ("keys", "ca.crt", ca.cert_pem),
        (".", "link.json", moved.to_json()),
    ):
        (data_dir / folder / f"{name}.new").write_bytes(data)
    os.replace(data_dir / "keys" / "tls.key.new", data_dir / "keys" / "tls.key")

    assert identity.load_link(data_dir).control_address == "127.0.0.1:2"
    now = identity.load_keys(data_dir)
    assert now.tls_cert_pem == second.cert_pem
    tls.check_client_cert(
        now.tls_cert_pem,
        now.ca_cert_pem,
        public_key=new_key.public_key(),
        account_id=ident.account_id,
    )


async def test_join_into_a_used_data_dir_keeps_its_files(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "keys").mkdir(parents=True)
    (data_dir / "machine.db").write_bytes(b"db")
    (data_dir / "keys" / "backup.key").write_bytes(b"other key")
    await _joined(control, data_dir)
    assert (data_dir / "machine.db").read_bytes() == b"db"
    assert (data_dir / "keys" / "backup.key").read_bytes() == b"other key"
    assert identity.is_joined(data_dir)
    assert identity.load_keys(data_dir).tls_cert_pem
    assert _listing(tmp_path) == ["data"]


# ------------------------------------------------------------------ the link


def _sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    return 0.0 if value is None else value


def _sample_ok(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("agents_machine_link_renewals_total", {"outcome": "ok"})
    return 0.0 if value is None else value


def _link(
    control: FakeControlPlane, data_dir: Path, registry: CollectorRegistry, **kw: Any
) -> ControlLink:
    async def count() -> int:
        return 7

    args: dict[str, Any] = {
        "backoff_initial": 0.05,
        "backoff_max": 0.2,
        "stable_after": 0.5,
        "dial": control.mutual,
    }
    args.update(kw)
    return ControlLink(
        data_dir=data_dir, agent_count=count, version="9.9.9", registry=registry, **args
    )


async def test_link_says_hello_and_beats(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    assert ControlLink.is_joined(data_dir)
    fire_at = time.time() + 3600
    async with _link(control, data_dir, registry, next_fire=lambda: fire_at) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert _sample(registry, "agents_machine_link_connected") == 1
        stream = control.streams[0]
        assert (stream.hello.version, stream.hello.agent_count) == ("9.9.9", 7)
        assert stream.hello.next_fire_at == fire_at
        assert stream.cert_pem == identity.load_keys(data_dir).tls_cert_pem
        await _until(lambda: stream.heartbeats >= 3)
        assert _sample(registry, "agents_machine_link_heartbeats_total") >= 3
    # Leaving the block half-closes the stream: the control plane sees a clean end.
    assert stream.ended_by_client
    assert link.state is LinkState.STOPPED
    assert _sample(registry, "agents_machine_link_connected") == 0


async def test_link_sends_the_roster_at_connect_on_change_and_before_goodbye(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    a, b = new_id("agent"), new_id("agent")
    current = AgentRoster(active=(a,))

    async def roster() -> AgentRoster:
        return current

    async with _link(control, data_dir, CollectorRegistry(), roster=roster) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        await _until(lambda: stream.rosters == [([a], [])])
        await _until(lambda: stream.heartbeats >= 3)
        assert len(stream.rosters) == 1  # unchanged: not sent again with each beat
        current = AgentRoster(active=(b,), archived=(a,))
        await _until(lambda: stream.rosters[-1] == ([b], [a]))
        current = AgentRoster(active=(a, b))  # changed just before the goodbye
    assert stream.ended_by_client
    assert stream.rosters[-1] == ([a, b], [])


class _SpyLock(asyncio.Lock):
    """A lock that says when someone waits for it while it is held."""

    def __init__(self) -> None:
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self) -> bool:
        if self.locked():
            self.contended.set()
        return await super().acquire()


async def test_a_stopping_link_lets_the_write_in_flight_end_before_its_goodbye(
    control: FakeControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC cancels the whole call when a task is cancelled inside a write: a stop
    # that cancelled the beat mid-write lost the last roster and the goodbye
    # (found under stress-ng: an agent made just before a stop stayed unknown).
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    a, b = new_id("agent"), new_id("agent")
    current = AgentRoster(active=(a,))

    async def roster() -> AgentRoster:
        return current

    gate, blocked, armed, cut = asyncio.Event(), asyncio.Event(), [False], [False]
    original = FakeStream.heartbeat

    async def heartbeat(
        self: FakeStream, agent_count: int, next_fire_at: float | None = None
    ) -> None:
        if armed[0]:
            armed[0] = False
            blocked.set()
            try:
                await gate.wait()
            except asyncio.CancelledError:
                cut[0] = True
                self.cancel()
                raise
        await original(self, agent_count, next_fire_at)

    monkeypatch.setattr(FakeStream, "heartbeat", heartbeat)
    link = _link(control, data_dir, CollectorRegistry(), roster=roster)
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        await _until(lambda: stream.rosters == [([a], [])])
        spy = link._heartbeats.writing = _SpyLock()
        armed[0] = True
        await asyncio.wait_for(blocked.wait(), 5)  # a heartbeat is being written
        current = AgentRoster(active=(a, b))  # an agent made just before the stop
        closing = asyncio.create_task(link.close(timeout=10))
        await asyncio.wait_for(spy.contended.wait(), 5)  # the stop waits for the write
        gate.set()
        await closing
    assert not cut[0]
    assert stream.ended_by_client
    assert stream.rosters[-1] == ([a, b], [])


async def test_link_not_joined(ca: tls.CertKey, tmp_path: Path) -> None:
    assert not ControlLink.is_joined(tmp_path)
    with pytest.raises(InvalidState):
        async with _link(FakeControlPlane(ca), tmp_path, CollectorRegistry()):
            pass


async def test_link_reconnects_after_a_drop(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.drop(control.streams[0])
        await _until(lambda: len(control.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert _sample(registry, "agents_machine_link_reconnects_total") >= 1


async def test_link_survives_a_control_plane_restart(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.down = True
    # The control plane is down: the link backs off and keeps trying.
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry) as link:
        await link.wait_for_state(LinkState.BACKING_OFF, timeout=5)
        await _until(lambda: _sample(registry, "agents_machine_link_reconnects_total") >= 2)
        assert control.connects == 0
        control.down = False  # back on the same address
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert control.streams


async def test_revoked_notice_stops_the_link(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        control.revoked.add(stream.machine_id)
        control.send(stream, Revoked(reason="test says so"))
        await link.wait_for_state(LinkState.REVOKED, timeout=1)
        assert "test says so" in link.final_reason
        # Recorded in the data folder: what lets `join --as-new` go on.
        assert "test says so" in (identity.stopped_reason(data_dir) or "")
        # The background task is over: nothing will dial again.
        assert link._task is not None
        await asyncio.wait_for(asyncio.shield(link._task), 1)
    assert control.connects == 1


async def test_a_superseded_box_is_told_so_not_revoked(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    # A repair: a new box took this machine over. It lives on; this box stops.
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    why = "certificate superseded: a new box took this machine over (machine repair)"
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        control.revoked.add(stream.machine_id)
        control.send(stream, Revoked(reason=why))
        await link.wait_for_state(LinkState.REVOKED, timeout=1)
        assert link.final_reason.startswith(why)
        assert "machine revoked" not in link.final_reason


async def test_refused_handshake_stops_the_link(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.revoked.add(identity.load_link(data_dir).machine_id)
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.REVOKED, timeout=5)
        assert "refused" in link.final_reason
    assert control.connects == 1


async def test_machine_revoked_detail_stops_the_link(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    # The current control plane names the class in the status detail, not in words.
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.fail("connect", domain_rpc_error(MachineRevoked("link: certificate withdrawn")))
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.REVOKED, timeout=5)
        assert "certificate withdrawn" in link.final_reason
    assert control.connects == 1


async def test_unknown_machine_keeps_identity_and_retries_slowly(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A control plane whose store is being restored may not know us yet: not final.
    A machine that never connected since its join says how to join again (the
    control plane rolled the join back); its first welcome confirms the join."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    machine_id = identity.load_link(data_dir).machine_id
    assert identity.unconfirmed_join(data_dir) is not None
    control.unknown.add(machine_id)
    with caplog.at_level(logging.WARNING, logger="machine.link.connection"):
        async with _link(control, data_dir, CollectorRegistry(), refused_retry=0.3) as link:
            await _until(lambda: control.connects >= 2)
            assert link.state not in (LinkState.REVOKED, LinkState.STOPPED), link.final_reason
            assert link.final_reason == ""
            assert identity.stopped_reason(data_dir) is None
            rolled_back = [r for r in caplog.records if "never confirmed" in r.getMessage()]
            assert rolled_back and rolled_back[0].levelno == logging.ERROR
            assert "--as-new" in rolled_back[0].getMessage()
            control.unknown.discard(machine_id)
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
            assert identity.unconfirmed_join(data_dir) is None
            # Confirmed: an unknown machine from now on is a control plane's trouble.
            caplog.clear()
            control.unknown.add(machine_id)
            control.drop(control.streams[-1])
            await _until(lambda: "unknown machine" in caplog.text)
            assert "never confirmed" not in caplog.text
    assert ControlLink.is_joined(data_dir)


async def test_dropped_stream_is_retried_at_once(
    control: FakeControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a control-plane restart the first retry is immediate, not a random pause."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    monkeypatch.setattr("machine.link.connection.random.random", lambda: 1.0)
    link = _link(
        control,
        data_dir,
        CollectorRegistry(),
        backoff_initial=5.0,
        backoff_max=5.0,
        stable_after=0.0,
    )
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.drop(control.streams[0])
        started = time.monotonic()
        await _until(lambda: len(control.streams) == 2)
        assert time.monotonic() - started < 2.0


async def test_a_stream_dying_young_backs_off(
    control: FakeControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that breaks before ``stable_after`` is retried like a failed dial."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    monkeypatch.setattr("machine.link.connection.random.random", lambda: 1.0)
    registry = CollectorRegistry()
    link = _link(
        control, data_dir, registry, backoff_initial=5.0, backoff_max=5.0, stable_after=60.0
    )
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.drop(control.streams[0])
        await link.wait_for_state(LinkState.BACKING_OFF, timeout=5)
        assert len(control.streams) == 1


async def test_join_records_the_other_replicas_link_addresses(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    given = parse_link_addresses(f"127.0.0.1:7446, {control.link_address},[::1]:7447")
    assert given == ("127.0.0.1:7446", control.link_address, "[::1]:7447")
    await _join(control, data_dir, link_addresses=given)
    link = identity.load_link(data_dir)
    # The replica that answered first, the others in the order given.
    assert link.control_addresses == (control.link_address, "127.0.0.1:7446", "[::1]:7447")
    # A caller's bad address is refused before the token is sent.
    calls = control.join_calls
    with pytest.raises(InvalidArgument):
        await _join(control, tmp_path / "other", link_addresses=("nohost",))
    assert control.join_calls == calls and not (tmp_path / "other").exists()


async def test_a_machine_joined_through_one_replica_learns_the_others(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The join reply's list goes into link.json after the operator's addresses;
    a welcome's list adds a replica started since (saved at once), a bad entry
    from the control plane is never recorded, and an unchanged list writes nothing."""
    data_dir = tmp_path / "data"
    second, third, later = "127.0.0.1:7446", "127.0.0.1:7447", "127.0.0.1:7448"
    control.control_addresses = (control.link_address, third, "not an address")
    await _join(control, data_dir, link_addresses=(second,))
    path = data_dir / identity.LINK_FILE
    assert identity.load_link(data_dir).control_addresses == (control.link_address, second, third)

    control.control_addresses = (control.link_address, "bad:0", later, third)
    caplog.set_level(logging.INFO, logger="machine.link.connection")
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        await _until(lambda: later in identity.load_link(data_dir).control_addresses)
        assert identity.load_link(data_dir).control_addresses == (
            control.link_address,
            second,
            third,
            later,
        )
        assert any(later in r.getMessage() and "learned" in r.getMessage() for r in caplog.records)
        # A welcome mid-stream (a replica joined the control plane) adds it too.
        newest = "127.0.0.1:7449"
        control.control_addresses = (control.link_address, later, third, newest)
        control.streams[0].inbox.put_nowait(
            Welcome(
                control.streams[0].machine_id,
                control.heartbeat_ms / 1000,
                None,
                control.control_addresses,
            )
        )
        await _until(lambda: newest in identity.load_link(data_dir).control_addresses)
        assert link.state == LinkState.CONNECTED
        # The next welcome lists nothing new: link.json is not written again.
        written = path.stat().st_mtime_ns
        control.drop(control.streams[0])
        await _until(lambda: len(control.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert path.stat().st_mtime_ns == written
        # A replica gone for good: the next list no longer names it, and a learned
        # address goes; the join's and the operator's stay though neither is listed.
        control.streams[1].inbox.put_nowait(
            Welcome(control.streams[1].machine_id, control.heartbeat_ms / 1000, None, (newest,))
        )
        await _until(lambda: later not in identity.load_link(data_dir).control_addresses)
        assert identity.load_link(data_dir).control_addresses == (
            control.link_address,
            second,
            newest,
        )
        assert any(
            "forgot" in r.getMessage() and later in r.getMessage() and third in r.getMessage()
            for r in caplog.records
        )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "127.0.0.1",
        "127.0.0.1:7446,",
        "h:0",
        "a:1,b:70000",
        # One place is the join reply's.
        ",".join(f"10.0.0.{i}:7444" for i in range(identity.MAX_CONTROL_ADDRESSES)),
    ],
)
def test_bad_link_addresses_are_refused_before_a_join(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_link_addresses(text)
    assert info.value.field == "link_address"


async def test_a_link_moves_round_robin_to_the_replica_that_answers(
    control: FakeControlPlane,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its replica gone, the link tries the next address, then the next, with the
    backoff between attempts (a fake sleep records it), one WARNING for the outage,
    and saves the one that welcomed it first (renewals and backups follow it)."""
    data_dir = tmp_path / "data"
    first, second, third = control.link_address, "127.0.0.1:7446", "127.0.0.1:7447"
    await _join(control, data_dir, link_addresses=(second, third))
    dialled: list[str] = []

    def dial(target: str, **kw: bytes) -> Any:
        dialled.append(target)
        return control.mutual(target, **kw)

    registry = CollectorRegistry()
    link = _link(control, data_dir, registry, dial=dial, backoff_initial=1.0, backoff_max=4.0)
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(link, "_interruptible_sleep", fake_sleep)
    caplog.set_level(logging.DEBUG, logger="machine.link.connection")
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert dialled == [first]
        control.link_address = third  # the first replica dies; the third serves
        control.drop(control.streams[0])
        await _until(lambda: len(control.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        # The young stream's end and the second's refusal each waited the
        # backoff (full jitter); the third answered.
        assert dialled == [first, second, third]
        assert len(waits) == 2 and all(0 <= w <= 4.0 for w in waits)
        assert identity.load_link(data_dir).control_addresses == (third, first, second)
        # The third goes too, the first is back: third -> first, no more attempts.
        control.link_address = first
        control.drop(control.streams[1])
        await _until(lambda: len(control.streams) == 3)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert dialled == [first, second, third, first]
        assert identity.load_link(data_dir).control_addresses == (first, second, third)
        assert _sample(registry, "agents_machine_link_address_moves_total") == 2
        # All down: every address in turn, the backoff under its cap.
        control.down = True
        control.drop(control.streams[2])
        await _until(lambda: len(dialled) >= 11)
        assert dialled[4:10] == [second, third, first, second, third, first]
        assert all(0 <= w <= 4.0 for w in waits)
        control.down = False
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
    failed = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage().startswith("control link to")
    ]
    # One WARNING per outage (three here), not one per address tried (16 attempts).
    assert len(failed) == 3, [r.getMessage() for r in failed]


async def test_account_deleted_stops_the_link(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.send(control.streams[0], AccountDeleted())
        await link.wait_for_state(LinkState.ACCOUNT_DELETED, timeout=2)
    assert control.connects == 1


async def test_refused_account_stops_the_link(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.account_deleting = True
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.ACCOUNT_DELETED, timeout=5)
        assert "being deleted" in link.final_reason
    assert control.connects == 1


async def test_client_cert_of_another_ca_is_refused(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    # Swap in a certificate for the same key, signed by a stranger CA.
    stranger = tls.make_ca()
    keys = identity.load_keys(data_dir)
    link = identity.load_link(data_dir)
    csr = tls.build_csr(tls.load_private_key(keys.tls_key_pem))
    forged = tls.sign_client_csr(
        stranger,
        csr,
        account_id=link.account_id,
        machine_id=link.machine_id,
        lifetime=dt.timedelta(hours=1),
    )
    (data_dir / "keys" / identity.TLS_CERT).write_bytes(forged.cert_pem)
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry) as running:
        await _until(lambda: _sample(registry, "agents_machine_link_reconnects_total") >= 2)
        assert running.state is not LinkState.CONNECTED
        assert running.final_reason == ""  # a handshake failure is not a refusal: retried
    assert control.connects == 0  # the handshake failed before any handler ran


async def test_delivery_is_acked_after_the_callback(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    got: list[Delivery] = []
    stored = asyncio.Event()
    run_id = new_id("run")

    async def store(delivery: Delivery) -> DeliveryAck:
        got.append(delivery)
        await stored.wait()
        return DeliveryAck(run_id=run_id)

    async with _link(control, data_dir, CollectorRegistry(), on_delivery=store) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        prompt_id, agent_id = new_id("prompt"), new_id("agent")
        sent = dt.datetime(2026, 5, 1, tzinfo=dt.UTC)
        control.send(stream, Delivery(prompt_id, agent_id, b"x", sent))
        await _until(lambda: len(got) == 1)
        assert stream.acks == []  # not before the callback returned
        stored.set()
        await _until(lambda: stream.ack_ids == [prompt_id])
    assert stream.acks == [(prompt_id, DeliveryAck(run_id=run_id))]
    assert [(d.id, d.agent_id, d.sealed_prompt, d.created_at) for d in got] == [
        (prompt_id, agent_id, b"x", sent)
    ]


@pytest.mark.parametrize(
    "failure",
    [
        TransientError("database is locked"),
        DiskFull("delivery", "/data"),
        # Not a reason to stop the link for good, unlike an IntegrityError of the link.
        DatabaseDamaged("delivery", "/data/machine.db", "malformed"),
    ],
    ids=["transient", "disk-full", "damaged"],
)
async def test_a_delivery_not_stored_ends_the_stream_so_no_later_one_goes_first(
    control: FakeControlPlane, tmp_path: Path, failure: AgentsError
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    calls: list[str] = []

    async def store(delivery: Delivery) -> DeliveryAck:
        calls.append(delivery.id)
        if len(calls) == 1:
            raise failure
        return DeliveryAck(run_id="run_" + delivery.id[3:])

    registry = CollectorRegistry()
    async with _link(control, data_dir, registry, on_delivery=store) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.streams[0]
        first, second = new_id("prompt"), new_id("prompt")
        control.send(stream, Delivery(first, new_id("agent"), b"x", None))
        control.send(stream, Delivery(second, new_id("agent"), b"y", None))
        # The machine ends the stream at the failure and reconnects after its
        # backoff; the second was never stored (it would have run first).
        await _until(lambda: len(control.streams) == 2)
        assert (calls, stream.acks) == ([first], [])
        assert _sample(registry, "agents_machine_link_reconnects_total") == 1
        # The control plane delivers again from the first, in order.
        again = control.streams[1]
        control.send(again, Delivery(first, new_id("agent"), b"x", None))
        control.send(again, Delivery(second, new_id("agent"), b"y", None))
        await _until(lambda: again.ack_ids == [first, second])
        assert link.connected
    assert calls == [first, first, second]


async def test_link_renews_a_short_lived_certificate(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    control.cert_lifetime = dt.timedelta(seconds=2)
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    first = identity.load_keys(data_dir).tls_cert_pem
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry, renew_fraction=0.5) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        await _until(lambda: _sample_ok(registry) >= 2, timeout=10)
        assert link.state is LinkState.CONNECTED
    renewed = identity.load_keys(data_dir)
    assert renewed.tls_cert_pem != first
    assert renewed.tls_cert_pem in control.renewed
    assert tls.cert_not_after(renewed.tls_cert_pem) > tls.cert_not_after(first)
    assert identity.load_link(data_dir).cert_not_after == tls.cert_not_after(renewed.tls_cert_pem)
    assert stat.S_IMODE((data_dir / "keys" / identity.TLS_CERT).stat().st_mode) == 0o600
    assert control.renew_calls >= 2


async def test_renewal_is_timed_by_the_injected_clock(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    # A one-hour certificate, renewed once a third of it is left: 50 minutes on, at once.
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    clock = FixedClock(identity.load_link(data_dir).cert_received_at + dt.timedelta(minutes=50))
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry, clock=clock) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        await _until(lambda: _sample_ok(registry) >= 1)
        # Received "at" the injected now: the next renewal is ~40 minutes of it away.
        assert identity.load_link(data_dir).cert_received_at == clock.now
    assert control.renew_calls == 1


async def test_a_failed_renewal_is_retried_after_a_backoff(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    # Renewal is due at once by the injected clock; the first call fails.
    clock = FixedClock(identity.load_link(data_dir).cert_received_at + dt.timedelta(minutes=50))
    control.fail("renew", rpc_error(grpc.StatusCode.UNAVAILABLE, "the store is down"))
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry, clock=clock) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        await _until(lambda: _sample_ok(registry) == 1)
        errors = registry.get_sample_value(
            "agents_machine_link_renewals_total", {"outcome": "error"}
        )
        assert errors == 1
        assert link.connected  # the stream lives on meanwhile
    assert control.renew_calls == 1  # the failed call never reached the handler


async def test_expired_certificate_is_logged_while_retrying(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.down = True
    clock = FixedClock(identity.load_link(data_dir).cert_not_after + dt.timedelta(seconds=1))
    registry = CollectorRegistry()
    with caplog.at_level(logging.ERROR, logger="machine.link.connection"):
        async with _link(control, data_dir, registry, clock=clock) as link:
            await _until(lambda: "certificate expired" in caplog.text)
            assert link.state is not LinkState.STOPPED  # it keeps trying
    assert "agents-control machine repair" in caplog.text


async def test_renew_now_renews_at_once(control: FakeControlPlane, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(control, data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert control.renew_calls == 0
        control.send(control.streams[0], RenewNow(reason="rollover"))
        await _until(lambda: control.renew_calls == 1)
        await _until(lambda: identity.load_keys(data_dir).tls_cert_pem == control.renewed[0])
        # After a renewal the next connection presents the new certificate.
        control.drop(control.streams[0])
        await _until(lambda: len(control.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert control.streams[1].cert_pem == control.renewed[0]


async def test_renew_now_after_a_renewal_on_the_same_stream_is_not_refused(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    """A stream keeps presenting the certificate it opened with; the control plane
    lets only the current one renew. A renew-now (a CA rollover) after a renewal
    made on this stream goes over a channel with the current certificate (before:
    refused "only the current certificate may renew" until the stream ended)."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.send(control.streams[0], RenewNow(reason="routine"))
        await _until(lambda: _sample_ok(registry) == 1)
        control.send(control.streams[0], RenewNow(reason="ca rollover"))
        await _until(lambda: _sample_ok(registry) == 2)
        assert len(control.streams) == 1  # the same stream all along
        errors = registry.get_sample_value(
            "agents_machine_link_renewals_total", {"outcome": "error"}
        )
        assert not errors
    assert identity.load_keys(data_dir).tls_cert_pem == control.renewed[1]


async def test_a_failed_renew_now_is_retried_after_a_backoff_not_when_due(
    control: FakeControlPlane, tmp_path: Path
) -> None:
    # The certificate is far from due: only the RenewNow asks for this renewal
    # (a CA rollover waits on it), so a failure must not wait until the due time.
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.fail("renew", rpc_error(grpc.StatusCode.UNAVAILABLE, "the store is down"))
    registry = CollectorRegistry()
    async with _link(control, data_dir, registry) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.send(control.streams[0], RenewNow(reason="rollover"))
        await _until(lambda: _sample_ok(registry) == 1)
        errors = registry.get_sample_value(
            "agents_machine_link_renewals_total", {"outcome": "error"}
        )
        assert errors == 1
    assert control.renew_calls == 1  # the failed call never reached the handler
    assert identity.load_keys(data_dir).tls_cert_pem == control.renewed[0]


def test_link_options_are_checked(ca: tls.CertKey, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        _link(FakeControlPlane(ca), tmp_path, CollectorRegistry(), renew_fraction=1.5)


def test_no_os_environ_here() -> None:
    # The house rule: only config modules read the environment.
    for mod in (
        "link/connection",
        "link/heartbeats",
        "link/renewal",
        "link/clock",
        "link/states",
        "link/join",
        "link/identity",
        "cli/service_unit",
    ):
        text = (Path(__file__).parents[3] / "machine" / f"{mod}.py").read_text()
        assert "os.environ" not in text, mod
        assert "print(" not in text, mod
    assert os.sep  # keep the import used on every platform


async def test_an_outage_is_one_warning_the_repeats_debug_and_one_line_back(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every failed attempt is logged in the same format (bench/connect.py counts
    them), but only an outage's first at WARNING; its end is one INFO line."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    machine_id = identity.load_link(data_dir).machine_id
    control.down = True
    registry = CollectorRegistry()
    with caplog.at_level(logging.DEBUG, logger="machine.link.connection"):
        async with _link(control, data_dir, registry) as link:
            await _until(lambda: _sample(registry, "agents_machine_link_reconnects_total") >= 4)
            control.down = False
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
    records = [r for r in caplog.records if r.name == "machine.link.connection"]
    failed = [r for r in records if "failed (attempt" in str(r.msg)]
    assert len(failed) >= 4
    assert [r.levelno for r in failed] == [logging.WARNING] + [logging.DEBUG] * (len(failed) - 1)
    assert all(isinstance(r.args, tuple) and r.args[3] == "TransientError" for r in failed), [
        r.args for r in failed
    ]
    assert all(getattr(r, "machine_id", None) == machine_id for r in failed)
    back = [r for r in records if "works again" in r.getMessage()]
    assert len(back) == 1 and back[0].levelno == logging.INFO
    assert f"after {len(failed)} failed tries" in back[0].getMessage()
