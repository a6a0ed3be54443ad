"""The machine's identity files: modes, atomic staging, loading and damage."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import stat
from pathlib import Path

import pytest

from machine.link import identity
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, InvalidArgument, InvalidState
from shared.ids import new_id


@pytest.fixture(scope="module")
def ca() -> tls.CertKey:
    return tls.make_ca()


def _record(cert_pem: bytes, **kw: object) -> identity.LinkRecord:
    args: dict[str, object] = {
        "control_address": "127.0.0.1:7444",
        "machine_id": new_id("machine"),
        "account_id": new_id("account"),
        "account_recovery_public_key": BoxKeyPair.generate().public_key,
        "heartbeat_interval": 0.25,
        "cert_not_after": tls.cert_not_after(cert_pem),
        "cert_received_at": dt.datetime.now(dt.UTC),
    }
    args.update(kw)
    return identity.LinkRecord(**args)  # type: ignore[arg-type]


def _material(ca: tls.CertKey) -> tuple[identity.NewKeys, bytes, identity.LinkRecord]:
    keys = identity.NewKeys.generate()
    machine_id, account_id = new_id("machine"), new_id("account")
    cert = tls.sign_client_csr(
        ca,
        keys.csr_pem(),
        account_id=account_id,
        machine_id=machine_id,
        lifetime=dt.timedelta(hours=1),
    )
    link = _record(cert.cert_pem, machine_id=machine_id, account_id=account_id)
    return keys, cert.cert_pem, link


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_staged_join_commits_private_files(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    data_dir = tmp_path / "root" / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
        assert not data_dir.exists()  # nothing visible until the block ends
    assert identity.is_joined(data_dir)
    assert _mode(data_dir) == 0o700
    assert _mode(data_dir / "keys") == 0o700
    for f in (data_dir / "keys").iterdir():
        assert _mode(f) == 0o600, f.name
    assert _mode(data_dir / identity.LINK_FILE) == 0o600
    assert sorted(p.name for p in data_dir.parent.iterdir()) == ["data"]
    assert identity.load_link(data_dir) == link
    loaded = identity.load_keys(data_dir)
    assert loaded.box.public_key == keys.box.public_key
    assert loaded.tls_cert_pem == cert
    assert loaded.ca_cert_pem == ca.cert_pem


def test_failed_stage_leaves_nothing(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    data_dir = tmp_path / "data"
    with pytest.raises(RuntimeError), identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
        raise RuntimeError("join refused")
    assert list(tmp_path.iterdir()) == []


def test_stale_stage_is_swept(ca: tls.CertKey, tmp_path: Path) -> None:
    stale = tmp_path / ".data.join-abcdef"
    stale.mkdir()
    (stale / "junk").write_text("x")
    keys, cert, link = _material(ca)
    with identity.staged_join(tmp_path / "data") as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_empty_existing_data_dir_is_replaced(ca: tls.CertKey, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    keys, cert, link = _material(ca)
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    assert identity.is_joined(data_dir)
    assert _mode(data_dir) == 0o700


@pytest.mark.parametrize("in_use", [False, True], ids=["new folder", "folder in use"])
def test_restore_pending_is_committed_with_the_identity(
    ca: tls.CertKey, tmp_path: Path, in_use: bool
) -> None:
    data_dir = tmp_path / "data"
    if in_use:  # a stand-alone machine's folder: the files move in one by one
        (data_dir / "keys").mkdir(parents=True, mode=0o700)
        (data_dir / "machine.db").write_bytes(b"x")
    keys, cert, link = _material(ca)
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
        identity.mark_restore_pending(stage)
        assert not identity.restore_pending(data_dir)  # not before the commit
    assert identity.is_joined(data_dir) and identity.restore_pending(data_dir)
    identity.clear_restore_pending(data_dir)
    assert not identity.restore_pending(data_dir)
    identity.clear_restore_pending(data_dir)  # twice: nothing to do


def test_a_join_without_restore_drops_an_earlier_identitys_mark(
    ca: tls.CertKey, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "keys").mkdir(parents=True, mode=0o700)
    (data_dir / "keys" / identity.RESTORE_PENDING_FILE).write_text("{}")
    # A join killed before its commit point (link.json) left it: not a pending restore.
    assert not identity.restore_pending(data_dir)
    keys, cert, link = _material(ca)
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    assert identity.is_joined(data_dir) and not identity.restore_pending(data_dir)


@pytest.mark.parametrize("in_use", [False, True], ids=["new folder", "folder in use"])
def test_unconfirmed_mark_is_committed_with_the_identity_and_names_its_machine(
    ca: tls.CertKey, tmp_path: Path, in_use: bool
) -> None:
    data_dir = tmp_path / "data"
    if in_use:  # an earlier identity's mark (of another machine) is not this join's
        (data_dir / "keys").mkdir(parents=True, mode=0o700)
        earlier = identity.UnconfirmedJoin(new_id("machine"), new_id("token"), 1.0)
        (data_dir / "keys" / identity.UNCONFIRMED_FILE).write_bytes(earlier.to_json())
    keys, cert, link = _material(ca)
    join = identity.UnconfirmedJoin(link.machine_id, new_id("token"), 2.5)
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
        identity.mark_unconfirmed(stage, join)
        assert identity.unconfirmed_join(data_dir) is None  # not before the commit
    assert identity.unconfirmed_join(data_dir) == join
    assert _mode(data_dir / "keys" / identity.UNCONFIRMED_FILE) == 0o600
    identity.clear_unconfirmed(data_dir)
    assert identity.unconfirmed_join(data_dir) is None
    identity.clear_unconfirmed(data_dir)  # twice: nothing to do
    # A mark that names another machine than link.json is an earlier identity's.
    other = identity.UnconfirmedJoin(new_id("machine"), join.token_id, 3.0)
    (data_dir / "keys" / identity.UNCONFIRMED_FILE).write_bytes(other.to_json())
    assert identity.unconfirmed_join(data_dir) is None


def test_a_join_as_a_new_machine_swaps_its_mark_in_after_the_commit_point(
    ca: tls.CertKey, tmp_path: Path
) -> None:
    """``--as-new`` stages the new machine's mark with the re-pair's files: killed
    before the commit point the folder is the old machine still, with its mark;
    after it, the new one with its own. A re-pair drops the mark."""
    data_dir = tmp_path / "data"
    keys, cert, link = _material(ca)
    old = identity.UnconfirmedJoin(link.machine_id, new_id("token"), 1.0)
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
        identity.mark_unconfirmed(stage, old)
    new_keys, new_cert, new_link = _material(ca)
    new = identity.UnconfirmedJoin(new_link.machine_id, new_id("token"), 2.0)
    identity.write_repair(
        data_dir,
        new_keys.tls_key,
        cert_pem=new_cert,
        ca_cert_pem=ca.cert_pem,
        link=new_link,
        unconfirmed=new,
    )
    assert identity.load_link(data_dir).machine_id == new_link.machine_id
    assert identity.unconfirmed_join(data_dir) == new
    assert not list(data_dir.rglob("*.new"))
    # Another one, staged and killed before the commit point: still the last machine...
    third_keys, third_cert, third_link = _material(ca)
    third = identity.UnconfirmedJoin(third_link.machine_id, new_id("token"), 3.0)
    for folder, name, data in (
        ("keys", identity.TLS_KEY, tls.private_key_pem(third_keys.tls_key)),
        ("keys", identity.TLS_CERT, third_cert),
        ("keys", identity.CA_CERT, ca.cert_pem),
        ("keys", identity.UNCONFIRMED_FILE, third.to_json()),
        (".", identity.LINK_FILE, third_link.to_json()),
    ):
        (data_dir / folder / f"{name}.new").write_bytes(data)
    assert identity.unconfirmed_join(data_dir) == new
    # ... and killed right after it: the next load finishes the swap, mark included.
    os.replace(data_dir / "keys" / "tls.key.new", data_dir / "keys" / identity.TLS_KEY)
    assert identity.unconfirmed_join(data_dir) == third
    assert not list(data_dir.rglob("*.new"))
    # A re-pair (same machine, a repaired record is never rolled back): no mark.
    identity.write_repair(
        data_dir, tls.new_tls_key(), cert_pem=third_cert, ca_cert_pem=ca.cert_pem, link=third_link
    )
    assert not (data_dir / "keys" / identity.UNCONFIRMED_FILE).exists()
    assert identity.unconfirmed_join(data_dir) is None


def test_already_joined_is_refused(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    data_dir = tmp_path / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    with pytest.raises(InvalidState) as info, identity.staged_join(data_dir):
        pass
    assert info.value.what == "data_dir"
    assert link.machine_id in str(info.value)


def test_link_record_round_trip_and_checks(ca: tls.CertKey) -> None:
    _, cert, link = _material(ca)
    assert identity.LinkRecord.from_json(link.to_json()) == link
    with pytest.raises(InvalidArgument):
        _record(cert, machine_id="mc_bad")
    with pytest.raises(InvalidArgument):
        _record(cert, heartbeat_interval=0)
    with pytest.raises(InvalidArgument):
        _record(cert, account_recovery_public_key=b"short")
    for bad in (b"", b"[]", b'{"format": 2}', b'{"format": 1}', b"\xff"):
        with pytest.raises(IntegrityError):
            identity.LinkRecord.from_json(bad)


def test_not_joined(tmp_path: Path) -> None:
    assert not identity.is_joined(tmp_path)
    with pytest.raises(InvalidState):
        identity.load_link(tmp_path)
    with pytest.raises(InvalidState):
        identity.load_keys(tmp_path)


def test_damaged_key_is_reported_without_its_bytes(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    data_dir = tmp_path / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    box = data_dir / "keys" / identity.BOX_KEY
    secret_text = box.read_text().strip()
    box.write_text(secret_text[:-3] + "AAA\n")
    with pytest.raises(IntegrityError) as info:
        identity.load_keys(data_dir)
    assert secret_text[6:20] not in str(info.value)


def test_repr_hides_keys(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    assert "PRIVATE" not in repr(keys)
    data_dir = tmp_path / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    loaded = identity.load_keys(data_dir)
    assert "PRIVATE" not in repr(loaded)
    assert "agsk1_" not in repr(loaded)


def test_a_record_lists_every_replicas_link_address(ca: tls.CertKey) -> None:
    _, cert, _ = _material(ca)
    link = _record(cert, other_addresses=("10.0.0.2:7444", "[::1]:7444"))
    assert link.control_addresses == ("127.0.0.1:7444", "10.0.0.2:7444", "[::1]:7444")
    doc = json.loads(link.to_json())
    # The first alone too, for a daemon that predates the list.
    assert doc["control_address"] == "127.0.0.1:7444"
    assert doc["control_addresses"] == list(link.control_addresses)
    assert identity.LinkRecord.from_json(link.to_json()) == link
    # Starting at another keeps the round-robin order.
    moved = link.starting_at("[::1]:7444")
    assert moved.control_addresses == ("[::1]:7444", "127.0.0.1:7444", "10.0.0.2:7444")
    assert identity.LinkRecord.from_json(moved.to_json()) == moved


def test_a_record_written_before_replicas_is_read_as_one_address(ca: tls.CertKey) -> None:
    """An existing data folder's link.json (control_address alone) keeps working."""
    _, cert, _ = _material(ca)
    doc = json.loads(_record(cert).to_json())
    del doc["control_addresses"]
    old = identity.LinkRecord.from_json(json.dumps(doc).encode())
    assert old.control_addresses == ("127.0.0.1:7444",)
    assert old.other_addresses == ()


@pytest.mark.parametrize(
    "addresses",
    [
        ["nohost"],
        ["127.0.0.1:0"],
        ["127.0.0.1:99999"],
        ["127.0.0.1:7444", "127.0.0.1:x"],
        ["127.0.0.1:7444", "127.0.0.1:7444"],
        [":7444"],
        [],
        "127.0.0.1:7444",
        [f"10.0.0.{i}:7444" for i in range(identity.MAX_CONTROL_ADDRESSES + 1)],
    ],
)
def test_bad_link_addresses_are_refused(ca: tls.CertKey, addresses: object) -> None:
    _, cert, _ = _material(ca)
    doc = json.loads(_record(cert).to_json())
    doc["control_addresses"] = addresses
    with pytest.raises(IntegrityError, match="link.json"):
        identity.LinkRecord.from_json(json.dumps(doc).encode())
    if isinstance(addresses, list) and addresses:
        with pytest.raises(InvalidArgument) as info:
            _record(cert, control_address=addresses[0], other_addresses=tuple(addresses[1:]))
        assert info.value.field == "control_addresses"


def test_save_certificate_replaces_cert_and_record(ca: tls.CertKey, tmp_path: Path) -> None:
    keys, cert, link = _material(ca)
    data_dir = tmp_path / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    newer = tls.sign_client_csr(
        ca,
        keys.csr_pem(),
        account_id=link.account_id,
        machine_id=link.machine_id,
        lifetime=dt.timedelta(hours=2),
    )
    updated = identity.save_certificate(data_dir, newer.cert_pem, ca.cert_pem, link)
    assert identity.load_keys(data_dir).tls_cert_pem == newer.cert_pem
    assert identity.load_link(data_dir) == updated
    assert updated.cert_not_after == newer.not_after
    assert updated.machine_id == link.machine_id
    assert _mode(data_dir / "keys" / identity.TLS_CERT) == 0o600
    assert [p.name for p in (data_dir / "keys").iterdir() if p.name.startswith(".")] == []
    # A replica learned since the renewal read its record is kept.
    identity.save_link(data_dir, updated.learning(["10.0.0.9:7444"]))
    again = identity.save_certificate(data_dir, newer.cert_pem, ca.cert_pem, link)
    assert again.control_addresses == (link.control_address, "10.0.0.9:7444")
    assert identity.load_link(data_dir) == again


async def test_following_clients_follow_a_renewed_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the backup client was built once at start and kept presenting that
    certificate after a renewal or a CA rollover (backups stopped until a restart)."""
    from machine.link import following

    keys_dir = tmp_path / identity.KEYS_DIR
    keys_dir.mkdir()
    for name in (identity.TLS_KEY, identity.TLS_CERT, identity.CA_CERT):
        (keys_dir / name).write_bytes(b"v1")
    made: list[bytes] = []

    class Keys:
        def __init__(self) -> None:
            self.tls_key_pem = (keys_dir / identity.TLS_KEY).read_bytes()
            self.tls_cert_pem = (keys_dir / identity.TLS_CERT).read_bytes()
            self.ca_cert_pem = (keys_dir / identity.CA_CERT).read_bytes()

    class Client:
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    def mutual(address: str, *, ca_pem: bytes, key_pem: bytes, cert_pem: bytes) -> Client:
        made.append(cert_pem)
        return Client()

    monkeypatch.setattr(following.identity, "load_keys", lambda data_dir: Keys())
    monkeypatch.setattr(following.LinkClient, "mutual", mutual)
    clients = following.FollowingLinkClients(tmp_path, "127.0.0.1:1")
    first = await clients.current()
    assert await clients.current() is first and made == [b"v1"]
    # The live link renews: the certificate is replaced by a rename.
    new = keys_dir / "tls.crt.new"
    new.write_bytes(b"v2")
    new.rename(keys_dir / identity.TLS_CERT)
    second = await clients.current()
    assert second is not first and made == [b"v1", b"v2"]
    assert await clients.current() is second
    await clients.aclose()
    assert first.closed and second.closed  # type: ignore[attr-defined]


async def test_following_clients_follow_the_link_address_that_worked(
    ca: tls.CertKey, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live link saves the replica that answered first in link.json: the backup
    client dials it from its next call (before: the join's address, forever)."""
    from machine.link import following

    keys, cert, link = _material(ca)
    link = dataclasses.replace(link, other_addresses=("127.0.0.1:7446",))
    data_dir = tmp_path / "data"
    with identity.staged_join(data_dir) as stage:
        identity.write_identity(stage, keys, cert_pem=cert, ca_cert_pem=ca.cert_pem, link=link)
    dialled: list[str] = []

    class Client:
        async def aclose(self) -> None:
            pass

    def mutual(address: str, *, ca_pem: bytes, key_pem: bytes, cert_pem: bytes) -> Client:
        dialled.append(address)
        return Client()

    monkeypatch.setattr(following.LinkClient, "mutual", mutual)
    clients = following.FollowingLinkClients(data_dir, link.control_address)
    first = await clients.current()
    assert await clients.current() is first and dialled == ["127.0.0.1:7444"]
    identity.save_link(data_dir, link.starting_at("127.0.0.1:7446"))
    assert await clients.current() is not first
    assert dialled == ["127.0.0.1:7444", "127.0.0.1:7446"]
    await clients.aclose()


def test_a_record_learns_the_replicas_the_control_plane_lists(ca: tls.CertKey) -> None:
    """New addresses go after the record's own (its order and every one of them
    kept: the operator's --link-address among them); bad ones, repeats and any
    past the bound are left out; nothing new gives the record itself back."""
    _, cert, _ = _material(ca)
    link = _record(cert, other_addresses=("10.0.0.2:7444",))
    learned = link.learning(
        [
            "10.0.0.3:7444",
            "127.0.0.1:7444",  # its own
            "::1:7445",  # unbracketed: the last colon is the port's
            "10.0.0.3:7444",  # twice
            "nohost",
            "10.0.0.4:0",
            "10.0.0.5:99999",
            "a b:7444",
            "x" * 300 + ":7444",
            "evil\n:7444",
            "",
        ]
    )
    assert learned.control_addresses == (
        "127.0.0.1:7444",
        "10.0.0.2:7444",
        "10.0.0.3:7444",
        "[::1]:7445",
    )
    assert identity.LinkRecord.from_json(learned.to_json()) == learned
    assert learned.learning(["10.0.0.3:7444", "[::1]:7445"]) is learned
    assert link.learning([]) is link
    # Bounded: a record never holds more than the maximum, its own first.
    flood = [f"10.1.0.{i}:7444" for i in range(100)]
    full = link.learning(flood)
    assert len(full.control_addresses) == identity.MAX_CONTROL_ADDRESSES
    assert full.control_addresses[:2] == link.control_addresses
    assert full.control_addresses[2:] == tuple(flood[: identity.MAX_CONTROL_ADDRESSES - 2])


def test_a_record_forgets_learned_replicas_the_control_plane_stops_listing(
    ca: tls.CertKey,
) -> None:
    """Replicas replaced one at a time for months: each list takes back the learned
    addresses it no longer names, so the record keeps learning new ones past the
    bound; the join's and the operator's addresses are never taken back."""
    _, cert, _ = _material(ca)
    link = _record(cert, other_addresses=("10.0.0.2:7444",))
    given = link.control_addresses
    live = [f"10.2.0.{i}:7444" for i in range(3)]
    record = link.learning(live)
    assert record.control_addresses == (*given, *live)
    assert record.learned_addresses == frozenset(live)
    for day in range(3, 40):  # one replica replaced a day
        live = [*live[1:], f"10.2.0.{day}:7444"]
        record = identity.LinkRecord.from_json(record.learning(live).to_json())
        assert record.control_addresses == (*given, *live), day
    # A list with nothing valid in it takes nothing back.
    assert record.learning(["nohost"]) is record
    # Listed again by the control plane, a given address stays given.
    assert record.learning([given[1], *live]).learned_addresses == frozenset(live)
    # The first address may be a learned one (the link moved to it): taken back, the
    # next one becomes first.
    moved = record.starting_at(live[0])
    after = moved.learning(live[1:])
    assert after.control_address == live[1] and live[0] not in after.control_addresses
    assert set(given) <= set(after.control_addresses)


def test_a_record_written_before_addresses_could_be_forgotten_keeps_them_all(
    ca: tls.CertKey,
) -> None:
    _, cert, _ = _material(ca)
    link = _record(cert, other_addresses=("10.0.0.2:7444", "10.0.0.3:7444"))
    doc = json.loads(link.to_json())
    del doc["learned_addresses"]
    old = identity.LinkRecord.from_json(json.dumps(doc).encode())
    assert old.learned_addresses == frozenset()
    assert old.learning(["10.0.0.9:7444"]).control_addresses == (
        *link.control_addresses,
        "10.0.0.9:7444",
    )
    for bad in ("x", ["10.0.0.7:7444"], [1]):
        doc["learned_addresses"] = bad
        with pytest.raises(IntegrityError, match="malformed"):
            identity.LinkRecord.from_json(json.dumps(doc).encode())
