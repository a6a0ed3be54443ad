"""Disaster recovery on a folder store: the bundle in the store, restore, fencing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from controlplane.cli.client import AdminClient
from controlplane.cli.main import main
from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_ca_cert, load_home_keys
from controlplane.integrity.trusted import DEPLOYMENT_KEY, marker_deployment_id, open_trusted_store
from controlplane.recovery import fencing, rotation
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.recovery.fencing import EPOCH_KEY, Fence, read_home_id, take_epoch
from controlplane.recovery.fsck import fsck_deployment
from controlplane.recovery.keybundle import (
    BUNDLE_KEY,
    StoredBundle,
    read_recovery_public_key,
    reseal_key_bundle,
)
from controlplane.recovery.restore import restore_home
from controlplane.server import ControlPlane, run_daemon
from shared.crypto import BoxKeyPair, encode_private_key
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    StoreError,
    StoreFenced,
    StoreUntrusted,
)
from shared.recovery_key import write_recovery_key
from shared.store import FolderStore
from shared.store.authenticated import seal
from tests.helpers.poll import apoll_until


def _cfg(tmp_path: Path, home: str = "home") -> ControlConfig:
    return ControlConfig(
        home=tmp_path / home,
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()


async def _objects(tmp_path: Path) -> dict[str, bytes]:
    store = FolderStore(tmp_path / "store")
    try:
        out = {}
        async for page in store.list_pages(""):
            for info in page:
                out[info.key] = await store.get(info.key)
        return out
    finally:
        await store.close()


async def test_init_seals_every_key_and_reseal_writes_only_changes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    keys = load_home_keys(cfg.home)
    objects = await _objects(tmp_path)
    assert BUNDLE_KEY in objects
    secrets = [keys.ca.key_pem, keys.server.key_pem, keys.control_key_pem, keys.secrets_key]
    for body in objects.values():
        assert b"PRIVATE KEY" not in body and made.operator_credential.encode() not in body
        for secret in secrets:
            assert secret not in body
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        dep = marker_deployment_id(await trusted.store.get(DEPLOYMENT_KEY))
        assert dep == made.deployment_id
        assert not await reseal_key_bundle(cfg.home, trusted.store, deployment_id=dep)
        with (cfg.home / "config.toml").open("a") as f:
            f.write("prompt_queue_depth = 7\n")
        assert await reseal_key_bundle(cfg.home, trusted.store, deployment_id=dep)
        assert not await reseal_key_bundle(cfg.home, trusted.store, deployment_id=dep)

        # Someone with write access to the bucket only swaps in their own public key:
        # without the home's MAC key the envelope is refused, nothing is sealed to it.
        thief = BoxKeyPair.generate()
        env = StoredBundle.parse(await trusted.store.get(BUNDLE_KEY))
        forged = StoredBundle(thief.public_key, "x", env.sealed).to_json()
        await trusted.authenticated.inner.put(  # type: ignore[attr-defined]
            BUNDLE_KEY, seal(b"k" * 32, BUNDLE_KEY, forged)
        )
        # A home from before recovery.pub trusts only a verified envelope: refused.
        pub_file = cfg.home / "recovery.pub"
        saved = pub_file.read_bytes()
        pub_file.unlink()
        with pytest.raises(IntegrityError):
            await reseal_key_bundle(cfg.home, trusted.store)
        # With the home's public key (serve's reseal), the damaged bundle is replaced.
        pub_file.write_bytes(saved)
        public = read_recovery_public_key(cfg.home)
        assert public is not None and public != thief.public_key
        assert await reseal_key_bundle(cfg.home, trusted.store)
        assert not await reseal_key_bundle(cfg.home, trusted.store)
        env = StoredBundle.parse(await trusted.store.get(BUNDLE_KEY))
        assert env.recovery_public_key == public
    finally:
        await trusted.close()


async def test_restore_rebuilds_the_home_and_refuses_a_wrong_key(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    recovery = BoxKeyPair.from_private(made.recovery_private_key)
    target = _cfg(tmp_path, "restored")

    with pytest.raises(InvalidArgument, match="does not open with this recovery key"):
        await restore_home(target, BoxKeyPair.generate())
    assert not target.home.exists()
    assert not list(tmp_path.glob(".restore-*"))

    result = await restore_home(target, recovery)
    assert load_home_keys(target.home) == load_home_keys(cfg.home)
    assert result.ca_hash == made.ca_hash and result.epoch == 1
    assert read_home_id(target.home) not in (None, read_home_id(cfg.home))
    assert (target.home / "config.toml").stat().st_mode & 0o777 == 0o600


async def test_restore_from_a_folder_that_is_not_there_makes_nothing(tmp_path: Path) -> None:
    """Before, opening the folder store made it (a typo left an empty folder behind)."""
    target = _cfg(tmp_path, "restored")
    with pytest.raises(InvalidArgument, match="store: .*/store: no such folder"):
        await restore_home(target, BoxKeyPair.generate())
    assert sorted(p.name for p in tmp_path.iterdir()) == []


async def test_restore_cli_damaged_bundle_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    key_file = tmp_path / "recovery.key"
    write_recovery_key(key_file, BoxKeyPair.from_private(made.recovery_private_key), "test")
    path = tmp_path / "store" / BUNDLE_KEY
    store = FolderStore(tmp_path / "store")
    try:
        stored = await store.get(BUNDLE_KEY)
        body = json.loads(stored.split(b"\n", 1)[1])
        body["sealed"] = body["sealed"][:-12] + "AAAAAAAAAAAA"
        header = stored.split(b"\n", 1)[0]
        await store.put(BUNDLE_KEY, header + b"\n" + json.dumps(body).encode())
    finally:
        await store.close()
    assert path.exists()
    home = tmp_path / "restored"
    argv = ["restore", "--home", str(home), "--store", str(tmp_path / "store")]
    code = await asyncio.to_thread(main, [*argv, "--recovery-key", str(key_file)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not open with this recovery key" in err and "Traceback" not in err
    assert not home.exists()
    assert encode_private_key(made.recovery_private_key) not in err


async def test_a_newer_epoch_fences_a_running_and_a_restarted_old_home(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    fenced: list[StoreFenced] = []
    try:
        old = await take_epoch(cfg.home, trusted.authenticated, "test", fenced.append)
        assert old.epoch == 1
        trusted.set_fence(old)
        await trusted.store.put("audit/before", b"ok")  # still ours: allowed

        # A restore elsewhere takes the next epoch for its own home.
        target = _cfg(tmp_path, "restored")
        result = await restore_home(target, BoxKeyPair.from_private(made.recovery_private_key))
        assert result.epoch == 2
        before = await _objects(tmp_path)
        for _ in range(2):
            with pytest.raises(StoreFenced, match="fenced out: epoch 2"):
                await trusted.store.put("audit/after", b"stale")
        with pytest.raises(StoreFenced):
            await trusted.store.delete("audit/before")
        assert len(fenced) == 1, "the daemon is told once"
        assert await _objects(tmp_path) == before, "the stale process wrote nothing"

        # The old home started again: refused at start, the epoch record untouched;
        # its fsck --repair too (a read-only fsck still reports).
        with pytest.raises(StoreFenced, match="fenced out"):
            await take_epoch(cfg.home, trusted.authenticated, "test")
        with pytest.raises(StoreFenced, match="fenced out"):
            await fsck_deployment(cfg, repair=True)
        assert (await fsck_deployment(cfg, repair=False)).objects > 0
        assert await _objects(tmp_path) == before
        # The restored home restarts normally: previous + 1.
        again = await take_epoch(target.home, trusted.authenticated, "test")
        assert again.epoch == 3
    finally:
        await trusted.close()


async def _raw(tmp_path: Path, key: str, data: bytes | None = None) -> bytes:
    """A bucket writer without the home: read an object as stored, or put ``data``
    back (a genuine older copy) or delete it (``data`` empty)."""
    store = FolderStore(tmp_path / "store")
    try:
        if data is None:
            return await store.get(key)
        if data:
            await store.put(key, data)
        else:
            await store.delete(key)
        return data
    finally:
        await store.close()


async def test_a_missing_or_older_epoch_record_is_an_alarm_not_a_fresh_start(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        assert (await take_epoch(cfg.home, trusted.authenticated, "test")).epoch == 1
        first = await _raw(tmp_path, EPOCH_KEY)
        assert (await take_epoch(cfg.home, trusted.authenticated, "test")).epoch == 2
        assert fencing.read_home_state(cfg.home) == fencing.HomeState(
            read_home_id(cfg.home) or "", epoch=2
        )

        # Before: an older copy of its own record put back was taken as epoch 2 again,
        # and a deleted record as a fresh deployment (epoch 1).
        await _raw(tmp_path, EPOCH_KEY, first)
        with pytest.raises(StoreUntrusted, match="epoch 1, but this home held epoch 2"):
            await take_epoch(cfg.home, trusted.authenticated, "test")
        assert await _raw(tmp_path, EPOCH_KEY) == first, "nothing written"
        await _raw(tmp_path, EPOCH_KEY, b"")
        with pytest.raises(StoreUntrusted, match="missing, but this home held epoch 2"):
            await take_epoch(cfg.home, trusted.authenticated, "test")
        with pytest.raises(StoreUntrusted, match="missing"):
            await fsck_deployment(cfg, repair=True)
        report = await fsck_deployment(cfg, repair=False)
        assert report.findings[0].kind == "epoch" and not report.clean, report
        assert "missing, but this home held epoch 2" in report.findings[0].detail
        assert EPOCH_KEY not in await _objects(tmp_path), "no fresh start"
    finally:
        await trusted.close()


async def test_a_home_down_during_a_restore_never_starts_again(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        await take_epoch(cfg.home, trusted.authenticated, "test")
        old_record = await _raw(tmp_path, EPOCH_KEY)
        # The old home is down while a restore elsewhere takes the deployment over.
        target = _cfg(tmp_path, "restored")
        result = await restore_home(target, BoxKeyPair.from_private(made.recovery_private_key))
        assert result.epoch == 2
        new_record = await _raw(tmp_path, EPOCH_KEY)

        # A bucket writer puts the old home's own record back: it still refuses.
        await _raw(tmp_path, EPOCH_KEY, old_record)
        with pytest.raises(StoreFenced, match="this home was superseded"):
            await take_epoch(cfg.home, trusted.authenticated, "test")
        assert await _raw(tmp_path, EPOCH_KEY) == old_record, "nothing written"
        state = fencing.read_home_state(cfg.home)
        assert state is not None and state.superseded
        # Remembered in the home: also once the marker is gone (a deleting writer).
        marker = fencing.superseded_key(state.home_id)
        await _raw(tmp_path, marker, b"")
        with pytest.raises(StoreFenced, match="this home was superseded"):
            await take_epoch(cfg.home, trusted.authenticated, "test")

        # The restored home goes on; a forged marker for it stops nothing.
        await _raw(tmp_path, EPOCH_KEY, new_record)
        new_id = read_home_id(target.home) or ""
        await _raw(tmp_path, fencing.superseded_key(new_id), b"forged")
        assert (await take_epoch(target.home, trusted.authenticated, "test")).epoch == 3
        state = fencing.read_home_state(target.home)
        assert state is not None and not state.superseded and state.epoch == 3
    finally:
        await trusted.close()


async def test_concurrent_writes_share_one_epoch_check(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        fence = Fence(trusted.authenticated, "h" * 32, "test")
        await fence.acquire()
        heads = 0
        inner = trusted.authenticated
        real_head = inner.head

        async def counting_head(key: str):  # type: ignore[no-untyped-def]
            nonlocal heads
            heads += key == EPOCH_KEY
            return await real_head(key)

        inner.head = counting_head  # type: ignore[method-assign]
        # All 20 start before the first HEAD can answer: they wait for that one.
        await asyncio.gather(*(fence.check() for _ in range(20)))
        assert heads == 1
    finally:
        await trusted.close()


async def test_recovery_key_new_and_init_needs_a_key_for_s3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rk.key"
    assert await asyncio.to_thread(main, ["recovery-key", "new", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["public_key"].startswith("agpk1_") and out.stat().st_mode & 0o777 == 0o600
    before = out.read_bytes()
    assert await asyncio.to_thread(main, ["recovery-key", "new", "--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err and out.read_bytes() == before

    argv = ["init", "--home", str(tmp_path / "h"), "--store", "s3://bucket/cp"]
    assert await asyncio.to_thread(main, argv) == 2
    err = capsys.readouterr().err
    assert "recovery_public_key: required with an S3 store" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "h").exists()


async def test_a_running_idle_daemon_is_fenced_out_by_a_restore_and_stops(
    tmp_path: Path,
) -> None:
    cfg = dataclasses.replace(_cfg(tmp_path), heartbeat_interval=0.1)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    recovery = BoxKeyPair.from_private(made.recovery_private_key)

    async def restore_once_serving() -> None:
        await apoll_until(cfg.serve_path.exists, deadline=20, what="serving")
        await restore_home(_cfg(tmp_path, "restored"), recovery)

    restoring = asyncio.create_task(restore_once_serving())
    with pytest.raises(StoreFenced, match="fenced out: epoch 2"):
        await asyncio.wait_for(run_daemon(cfg, grace=1), 20)
    await restoring
    assert not cfg.serve_path.exists()


async def test_every_rotation_reseals_the_bundle_and_a_restore_brings_the_next_ca(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    recovery = BoxKeyPair.from_private(made.recovery_private_key)
    async with ControlPlane(cfg) as cp:
        address = f"127.0.0.1:{cp.public_port}"
        async with AdminClient(address, load_ca_cert(cfg.home), made.operator_credential) as c:
            await c.rotate_server_certificate()
            rotated = load_home_keys(cfg.home).server.cert_pem
            await c.rollover_ca()
        rolling = load_home_keys(cfg.home)
        assert rolling.next_ca is not None
        assert cp.registry.get_sample_value("agents_cp_key_bundle_sealed") == 1
    restored = await restore_home(_cfg(tmp_path, "restored"), recovery)
    keys = load_home_keys(restored.home)
    assert keys.server.cert_pem == rotated  # the rotated certificate, not init's
    assert keys.next_ca is not None and keys.next_ca.cert_pem == rolling.next_ca.cert_pem
    assert keys.next_server is not None


@pytest.mark.parametrize("killed_at", ["the home id", "the epoch record"])
async def test_a_pre_fencing_home_killed_between_its_first_two_writes_starts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed_at: str
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        # A home made before fencing: no id in it, no epoch record in the store.
        (cfg.home / fencing.HOME_ID_FILE).unlink(missing_ok=True)
        await trusted.authenticated.delete(EPOCH_KEY)
        real = {"write_home_id": fencing.write_home_id, "acquire": Fence.acquire}

        def killed(*args: object, **kw: object) -> None:
            raise SystemExit("killed")

        # The process dies as it makes the named write, the other one done or not.
        if killed_at == "the home id":
            monkeypatch.setattr(fencing, "write_home_id", killed)
        else:
            monkeypatch.setattr(Fence, "acquire", killed)
        with pytest.raises(SystemExit):
            await take_epoch(cfg.home, trusted.authenticated, "test")
        monkeypatch.setattr(fencing, "write_home_id", real["write_home_id"])
        monkeypatch.setattr(Fence, "acquire", real["acquire"])
        fence = await take_epoch(cfg.home, trusted.authenticated, "test")
        assert read_home_id(cfg.home) == fence.home_id
    finally:
        await trusted.close()


async def test_a_rollover_whose_bundle_cannot_be_sealed_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    real = rotation.reseal_key_bundle
    failing = True

    async def reseal(home: Path, store: object) -> None:
        if failing:
            raise StoreError("store: slow down")
        await real(home, store)  # type: ignore[arg-type]

    monkeypatch.setattr(rotation, "reseal_key_bundle", reseal)
    async with ControlPlane(cfg) as cp:
        address = f"127.0.0.1:{cp.public_port}"
        async with AdminClient(address, load_ca_cert(cfg.home), made.operator_credential) as c:
            # The new CA would sign renewals and joins a restore from the stale
            # bundle does not trust: nothing of the rollover is kept.
            with pytest.raises(AgentsError, match="no rollover was started"):
                await c.rollover_ca()
            assert cp.registry.get_sample_value("agents_cp_key_bundle_sealed") == 0
            assert load_home_keys(cfg.home).next_ca is None
            assert cp._keyring is not None and cp._keyring.keys.next_ca is None
            failing = False
            await c.rollover_ca()  # again: the bundle holds the new CA before it signs
            assert cp.registry.get_sample_value("agents_cp_key_bundle_sealed") == 1
            assert cp._keyring.keys.next_ca is not None


async def test_a_take_over_killed_between_its_marker_and_the_epoch(tmp_path: Path) -> None:
    """The marker retires the old home first (a restore is never undone); the epoch
    write that did not happen is taken by the restore run again."""
    from shared.store import MemoryStore

    class Crash(Exception):
        pass

    class DiesAtTheEpoch(MemoryStore):
        armed = False

        async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
            if self.armed and key == EPOCH_KEY:
                raise Crash(key)
            return await super().put(key, data, if_none_match=if_none_match, if_match=if_match)

    store = DiesAtTheEpoch()
    old_home = tmp_path / "old"
    old_home.mkdir()
    assert (await take_epoch(old_home, store, "test")).epoch == 1
    new_id_ = fencing.new_home_id()
    store.armed = True
    with pytest.raises(Crash):
        await Fence(store, new_id_, "test").acquire(take_over=True)
    store.armed = False
    # The old home is retired already, its record untouched.
    with pytest.raises(StoreFenced, match="superseded"):
        await take_epoch(old_home, store, "test")
    # The restore again: the next epoch, and the old home still out.
    assert await Fence(store, new_id_, "test").acquire(take_over=True) == 2
    with pytest.raises(StoreFenced):
        await take_epoch(old_home, store, "test")
