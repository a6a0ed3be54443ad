"""``store migrate`` between two folder stores: copy, resume, verification, refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.config import ControlConfig, load_config
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.trusted import open_trusted_store, record_mac_key
from controlplane.recovery import migrate
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.recovery.fencing import EPOCH_KEY, Epoch, lock_home, take_epoch
from controlplane.recovery.migrate import PROGRESS_FILE, StoreTarget, migrate_store
from controlplane.recovery.restore import restore_home
from shared.crypto import BoxKeyPair
from shared.errors import ConfigError, IntegrityError, InvalidArgument, InvalidState
from shared.store import FolderStore
from shared.store.authenticated import MAC_HEADER, seal

#: A backup segment (not MAC'd), larger than the test's whole-object limit: streamed.
SEGMENT = "accounts/acct_00000000000000000000000000/backups/mc_x/seg/0001"
#: An object whose MAC does not verify (a forgery fsck would report): copied as is.
FORGED = "junk/forged"


def _cfg(tmp_path: Path, home: str = "home", store: str = "old") -> ControlConfig:
    return ControlConfig(
        home=tmp_path / home,
        store_url=str(tmp_path / store),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()


async def _objects(root: Path) -> dict[str, bytes]:
    store = FolderStore(root)
    try:
        return {info.key: await store.get(info.key) async for info in store.list()}
    finally:
        await store.close()


async def _put(root: Path, key: str, data: bytes) -> None:
    async with FolderStore(root) as store:
        await store.put(key, data)


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ControlConfig, bytes]:
    """A home on the folder store ``old`` that held an epoch (as a serve would),
    plus an un-MAC'd segment and a forged object; and its recovery private key."""
    monkeypatch.setattr(migrate, "_WHOLE_LIMIT", 1024)
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    trusted = await open_trusted_store(cfg, load_home_keys(cfg.home), None)
    try:
        await take_epoch(cfg.home, trusted.authenticated, "test")
    finally:
        await trusted.close()
    await _put(tmp_path / "old", SEGMENT, os.urandom(5000))
    await _put(tmp_path / "old", FORGED, MAC_HEADER + b"0" * 64 + b"\nnot ours")
    return cfg, made.recovery_private_key


async def test_copy_verifies_switches_the_home_and_restore_works_from_the_new_store(
    tmp_path: Path, served: tuple[ControlConfig, bytes]
) -> None:
    cfg, recovery = served
    before = await _objects(tmp_path / "old")
    seen: list[tuple[str, int, int]] = []

    result = await migrate_store(
        cfg, StoreTarget(str(tmp_path / "new")), on_progress=lambda *a: seen.append(a)
    )

    assert await _objects(tmp_path / "new") == before
    assert await _objects(tmp_path / "old") == before  # left as it was
    assert (result.objects, result.copied) == (len(before), len(before))
    assert result.bytes == sum(len(b) for b in before.values())
    assert result.unverified_macs == 1  # FORGED
    assert ("copying", len(before), len(before)) in seen
    assert ("verifying", len(before), len(before)) in seen
    assert not (cfg.home / PROGRESS_FILE).exists()
    switched = load_config({"home": str(cfg.home)}, {})
    assert switched.store_url == str(tmp_path / "new")
    assert switched.listen == cfg.listen  # the rest of config.toml kept

    # DR from the new store: the bundle, the marker and the epoch came along.
    restored = _cfg(tmp_path, "restored", "new")
    out = await restore_home(restored, BoxKeyPair.from_private(recovery))
    assert out.epoch == 2  # the epoch the old home held, plus one


async def test_a_stopped_copy_resumes_without_copying_again(
    tmp_path: Path, served: tuple[ControlConfig, bytes]
) -> None:
    cfg, _ = served
    total = len(await _objects(tmp_path / "old"))
    calls = 0

    def stop() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        await migrate_store(cfg, StoreTarget(str(tmp_path / "new")), after_copy=stop)
    saved = json.loads((cfg.home / PROGRESS_FILE).read_bytes())["objects"]
    assert len(saved) >= 3
    assert load_config({"home": str(cfg.home)}, {}).store_url == cfg.store_url  # not switched

    again = await migrate_store(cfg, StoreTarget(str(tmp_path / "new")))
    assert again.copied == total - len(saved)
    assert again.objects == total
    assert await _objects(tmp_path / "new") == await _objects(tmp_path / "old")


async def test_a_copy_altered_in_the_new_store_is_caught_and_copied_again(
    tmp_path: Path, served: tuple[ControlConfig, bytes]
) -> None:
    cfg, _ = served
    new = tmp_path / "new"

    async def alter() -> None:
        # Between the copy and the read-back: another valid object at one key (a
        # hash mismatch), and a damaged file at another (the folder store's check).
        await _put(new, "cp/deployment.json", b"not the marker")
        path = new / "cp" / "keys.sealed"
        path.write_bytes(path.read_bytes()[:-1] + b"!")

    real_verify = migrate._Migration.verify

    async def verify_after_alter(self: migrate._Migration) -> None:
        await alter()
        await real_verify(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(migrate._Migration, "verify", verify_after_alter)
        with pytest.raises(IntegrityError, match=r"2 object\(s\) read back .*first: cp/deployment"):
            await migrate_store(cfg, StoreTarget(str(new)))
    assert load_config({"home": str(cfg.home)}, {}).store_url == cfg.store_url
    saved = json.loads((cfg.home / PROGRESS_FILE).read_bytes())["objects"]
    assert "cp/deployment.json" not in saved and "cp/keys.sealed" not in saved

    again = await migrate_store(cfg, StoreTarget(str(new)))
    assert again.copied == 2
    assert await _objects(new) == await _objects(tmp_path / "old")


async def test_refusals_write_nothing(tmp_path: Path, served: tuple[ControlConfig, bytes]) -> None:
    cfg, _ = served
    new = tmp_path / "new"

    async def refused(
        error: type[Exception], match: str, c: ControlConfig = cfg, to: str = str(new)
    ) -> None:
        with pytest.raises(error, match=match):
            await migrate_store(c, StoreTarget(to))
        assert not (cfg.home / PROGRESS_FILE).exists()
        assert load_config({"home": str(cfg.home)}, {}).store_url == cfg.store_url

    # serve runs on this home.
    fd = lock_home(cfg.home, "serve")
    try:
        await refused(InvalidState, "another agents-control serve is running on this home")
    finally:
        os.close(fd)
    # The store comes from the environment, which would outlive the switch.
    overridden = dataclasses.replace(cfg, store_overrides=("AGENTS_CONTROL_STORE",))
    await refused(InvalidState, "set by AGENTS_CONTROL_STORE", c=overridden)
    # The same store, one inside the other, a credential in the URL.
    await refused(InvalidState, "already uses", to=cfg.store_url)
    await refused(InvalidState, "overlap", to=str(tmp_path / "old" / "inside"))
    await refused(InvalidArgument, "credential", to="s3://b/p?access_key=AK&secret_key=SK")
    # A new store holding something else (another deployment's objects).
    await _put(new, "cp/deployment.json", b"someone else's")
    await refused(InvalidState, "is not empty")
    assert await _objects(new) == {"cp/deployment.json": b"someone else's"}


async def test_refused_while_another_control_plane_holds_the_old_store(
    tmp_path: Path, served: tuple[ControlConfig, bytes]
) -> None:
    cfg, _ = served
    mac = record_mac_key(load_home_keys(cfg.home))
    other = Epoch(9, "f" * 32, "2026-01-01T00:00:00Z", "elsewhere", 1).to_json()
    await _put(tmp_path / "old", EPOCH_KEY, seal(mac, EPOCH_KEY, other))
    with pytest.raises(InvalidState, match="another control plane holds the old store"):
        await migrate_store(cfg, StoreTarget(str(tmp_path / "new")))
    assert not (tmp_path / "new").exists() or not await _objects(tmp_path / "new")


async def test_a_run_killed_after_its_commit_point_is_done_on_the_next(
    tmp_path: Path, served: tuple[ControlConfig, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, _ = served
    real_switch = migrate._switch_config

    def switch_then_die(c: ControlConfig, record: dict[str, object]) -> None:
        real_switch(c, record)
        raise SystemExit("killed after the commit point")

    monkeypatch.setattr(migrate, "_switch_config", switch_then_die)
    with pytest.raises(SystemExit):
        await migrate_store(cfg, StoreTarget(str(tmp_path / "new")))
    monkeypatch.undo()
    assert (cfg.home / PROGRESS_FILE).exists()
    now = load_config({"home": str(cfg.home)}, {})
    assert now.store_url == str(tmp_path / "new")

    again = await migrate_store(now, StoreTarget(str(tmp_path / "new")))
    assert again.already
    assert not (cfg.home / PROGRESS_FILE).exists()
    # Another target now starts a new migration only from the new store.
    with pytest.raises(InvalidState, match="already uses"):
        await migrate_store(now, StoreTarget(str(tmp_path / "new")))


async def test_cli_summary_and_a_refusal_in_one_line(
    tmp_path: Path, served: tuple[ControlConfig, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, _ = served
    home = str(cfg.home)
    await _put(tmp_path / "busy", "x", b"y")
    argv = ["store", "migrate", "--home", home, "--to"]
    # main() runs its own event loop: in a thread, as the CLI would.
    assert await asyncio.to_thread(main, [*argv, str(tmp_path / "busy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty" in err

    assert await asyncio.to_thread(main, [*argv, str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "migrated" in out and "objects" in out and "bytes" in out and " s " in out
    assert load_config({"home": home}, {}).store_url == str(tmp_path / "new")


def test_the_config_names_what_overrides_the_store_and_reads_the_crash_hook(
    tmp_path: Path,
) -> None:
    env = {"AGENTS_CONTROL_STORE_REGION": "eu-west-1"}
    cfg = load_config({"home": str(tmp_path), "store_url": str(tmp_path / "s")}, env)
    assert cfg.store_overrides == ("--store", "AGENTS_CONTROL_STORE_REGION")
    assert load_config({"home": str(tmp_path)}, {}).store_overrides == ()
    hooked = load_config(
        {"home": str(tmp_path)}, {"AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER": "3"}
    )
    assert hooked.crash_in_migrate_after == 3
    with pytest.raises(ConfigError, match="must be a whole number"):
        load_config({"home": str(tmp_path)}, {"AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER": "x"})


async def test_an_s3_probe_left_in_the_old_store_is_not_copied(
    tmp_path: Path, served: tuple[ControlConfig, bytes]
) -> None:
    cfg, _ = served
    await _put(tmp_path / "old", "_probe/0123456789abcdef", b"a probe killed midway")
    result = await migrate_store(cfg, StoreTarget(str(tmp_path / "new")))
    copied = await _objects(tmp_path / "new")
    assert "_probe/0123456789abcdef" not in copied and result.objects == len(copied)
