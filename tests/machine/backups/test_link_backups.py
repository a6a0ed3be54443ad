"""ControlPlaneTarget (backups kept by the control plane) over the fake link client.

The fake runs the control plane's own backup domain on a memory store, so
these check what machine/backups/targets/control_plane.py adds: the batching, the order of the
listing, reading another machine's backups, and gRPC errors as domain errors.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.link.client import MachineInfo
from shared import tls
from shared.errors import NotFound, StoreError, TransientError
from shared.ids import new_id
from tests.helpers.clock import FixedClock
from tests.helpers.fake_link_client import FakeControlPlane, FakeLinkClient, domain_rpc_error


@pytest.fixture(scope="module")
def ca() -> tls.CertKey:
    return tls.make_ca()


@pytest.fixture
def control(ca: tls.CertKey) -> FakeControlPlane:
    fake = FakeControlPlane(ca)
    fake.public_address = "127.0.0.1:7443"
    return fake


async def _machine(control: FakeControlPlane) -> tuple[str, FakeLinkClient]:
    """Join a machine; its id and a mutual-TLS client."""
    key = tls.new_tls_key()
    joining = control.for_join(control.public_address, control.ca.cert_pem)
    info = MachineInfo("m", "1", "h", b"b" * 32, b"s" * 32)
    reply = await joining.join(control.new_token(), tls.build_csr(key).decode(), info, timeout=10)
    client = control.mutual(
        control.link_address,
        ca_pem=control.ca.cert_pem,
        key_pem=tls.private_key_pem(key),
        cert_pem=reply.certificate_pem.encode(),
    )
    return reply.machine_id, client


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def _name() -> str:
    return os.urandom(32).hex()


async def _read(target: ControlPlaneTarget, name: str) -> bytes:
    return b"".join([c async for c in target.get_segment(name)])


async def test_a_backup_round_trips_oldest_first(control: FakeControlPlane) -> None:
    _, client = await _machine(control)
    target = ControlPlaneTarget(client)
    a, b = _name(), _name()
    # Streamed without a size (the engine seals as it goes).
    await target.put_segment(a, _chunks(b"one", b"two"))
    await target.put_segment(b, _chunks(b"three"))
    assert await target.have_segments([a, b, _name()]) == {a: 6, b: 5}
    first, second = new_id("backup", now_ms=1000), new_id("backup", now_ms=2000)
    await target.put_manifest(first, b"m-1", [a, b])
    await target.put_manifest(second, b"m-22", [b])
    # The link lists newest first; the target contract is oldest first.
    assert [(m.backup_id, m.size) for m in await target.list_manifests()] == [
        (first, 3),
        (second, 4),
    ]
    assert await target.get_manifest(first) == b"m-1"
    assert await _read(target, a) == b"onetwo"
    pruned = await target.prune(1)
    assert pruned.manifests == (first,) and pruned.segments == 1
    assert await target.have_segments([a, b]) == {b: 5}


async def test_a_replacement_reads_a_machine_of_its_own_account_only(
    control: FakeControlPlane, ca: tls.CertKey
) -> None:
    lost_id, lost = await _machine(control)
    seg, backup_id = _name(), new_id("backup")
    await ControlPlaneTarget(lost).put_segment(seg, _chunks(b"data"))
    await ControlPlaneTarget(lost).put_manifest(backup_id, b"sealed", [seg])

    _, replacement = await _machine(control)
    source = ControlPlaneTarget(replacement, source=lost_id)
    assert [m.backup_id for m in await source.list_manifests()] == [backup_id]
    assert await source.get_manifest(backup_id) == b"sealed"
    assert await _read(source, seg) == b"data"
    with pytest.raises(ValueError):
        await source.prune(0)  # reads only

    # A machine of another account (same CA, same backup store).
    other = FakeControlPlane(ca)
    other.public_address = control.public_address
    other.backups = control.backups
    _, stranger = await _machine(other)
    missing_id = new_id("machine")
    missing = ControlPlaneTarget(stranger, source=missing_id)
    foreign = ControlPlaneTarget(stranger, source=lost_id)
    with pytest.raises(NotFound) as gone:
        await missing.list_manifests()
    with pytest.raises(NotFound) as hidden:
        await foreign.list_manifests()
    # Another account's machine answers exactly like a missing one.
    assert type(hidden.value) is type(gone.value)
    assert str(hidden.value).replace(lost_id, "M") == str(gone.value).replace(missing_id, "M")


async def test_link_errors_come_back_as_domain_errors(control: FakeControlPlane) -> None:
    _, client = await _machine(control)
    target = ControlPlaneTarget(client)
    with pytest.raises(NotFound):
        await target.get_manifest(new_id("backup"))
    with pytest.raises(NotFound):
        await _read(target, _name())
    control.fail("put_manifest", domain_rpc_error(TransientError("store: slow down")))
    with pytest.raises(TransientError) as info:
        await target.put_manifest(new_id("backup"), b"x", [])
    assert str(info.value) == "store: slow down"  # the control plane's own answer, as is
    assert info.value.__cause__ is not None  # the gRPC error, kept as the cause
    control.down = True
    named = ControlPlaneTarget(client, where="control plane 127.0.0.1:7444")
    # No control plane answered: the error says which one was tried.
    with pytest.raises(
        TransientError, match=r"^control plane 127\.0\.0\.1:7444: unreachable \("
    ) as down:
        await named.have_segments([_name()])
    assert "clock" not in str(down.value)  # a refused connection is no clock problem


async def test_a_failed_tls_date_check_names_this_machines_clock(
    control: FakeControlPlane,
) -> None:
    _, client = await _machine(control)
    control.handshake_failure = "CERTIFICATE_VERIFY_FAILED: certificate is not yet valid"
    behind = FixedClock(dt.datetime(2026, 3, 25, 10, 0, tzinfo=dt.UTC))
    target = ControlPlaneTarget(client, where="control plane 127.0.0.1:7444", clock=behind)
    with pytest.raises(TransientError) as info:
        await target.have_segments([_name()])
    said = str(info.value)
    assert said.startswith("control plane 127.0.0.1:7444: unreachable (")
    assert "this machine's clock, which says 2026-03-25 10:00:00 UTC" in said
    assert "check it / NTP" in said


class _OlderControlPlane:
    """A link client whose control plane predates ``replace``: it keeps a stored
    segment and answers 0 bytes stored, whatever the header asked."""

    async def put_segment(
        self, name: str, size: int, data: AsyncIterator[bytes], *, timeout: float,
        replace: bool = False,
    ) -> int:  # fmt: skip
        async for _ in data:
            pass
        return 0


async def test_a_segment_the_control_plane_did_not_replace_is_not_taken_for_mended() -> None:
    target = ControlPlaneTarget(cast(Any, _OlderControlPlane()), where="control plane X")
    name = os.urandom(32).hex()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"sealed"

    await target.put_segment(name, chunks())  # create-once: 0 is "already there"
    with pytest.raises(StoreError, match=f"kept its damaged copy of segment {name[:16]}"):
        await target.put_segment(name, chunks(), replace=True)
