"""Replicas of one home join its epoch and never fence each other (recovery.fencing)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.trusted import open_trusted_store
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.recovery.fencing import read_home_state, take_epoch
from controlplane.recovery.restore import restore_home
from shared.crypto import BoxKeyPair
from shared.errors import StoreFenced


def _cfg(tmp_path: Path, home: str = "home") -> ControlConfig:
    return ControlConfig(
        home=tmp_path / home,
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()


async def test_replicas_of_one_home_share_its_epoch_and_a_restore_fences_them_all(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.recovery_private_key is not None
    shutil.copytree(cfg.home, tmp_path / "copy")  # a second replica's home
    trusted = await open_trusted_store(cfg, load_home_keys(cfg.home), None)
    fenced: list[StoreFenced] = []
    try:
        first = await take_epoch(cfg.home, trusted.authenticated, "a", fenced.append, replica=True)
        assert first.epoch == 1, "no record yet: the first replica takes one"
        second = await take_epoch(
            tmp_path / "copy", trusted.authenticated, "b", fenced.append, replica=True
        )
        third = await take_epoch(cfg.home, trusted.authenticated, "c", fenced.append, replica=True)
        assert second.epoch == third.epoch == 1, "later replicas join it"
        for fence in (first, second, third):
            await fence.check()  # every replica may still write
        assert read_home_state(tmp_path / "copy").epoch == 1  # type: ignore[union-attr]

        # Before: a copied home's start took epoch 2 and fenced the live one; a
        # plain serve of the home still does (the replicas stop).
        plain = await take_epoch(tmp_path / "copy", trusted.authenticated, "d")
        assert plain.epoch == 2
        with pytest.raises(StoreFenced, match="epoch 2"):
            await first.check()
        # A replica started now joins epoch 2; a restore elsewhere fences it.
        joined = await take_epoch(cfg.home, trusted.authenticated, "e", fenced.append, replica=True)
        assert joined.epoch == 2
        target = _cfg(tmp_path, "restored")
        await restore_home(target, BoxKeyPair.from_private(made.recovery_private_key))
        with pytest.raises(StoreFenced, match="epoch 3"):
            await joined.check()
        with pytest.raises(StoreFenced, match="superseded"):
            await take_epoch(cfg.home, trusted.authenticated, "f", replica=True)
    finally:
        await trusted.close()


def test_a_lone_control_plane_never_imports_nats() -> None:
    code = (
        "import sys, controlplane.server, controlplane.cli.main\n"
        "assert not [m for m in sys.modules if m == 'nats' or m.startswith('nats.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_replicas_starting_together_on_a_fresh_store_share_the_first_epoch(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    homes = [cfg.home]
    for i in (1, 2):
        shutil.copytree(cfg.home, tmp_path / f"copy{i}")
        homes.append(tmp_path / f"copy{i}")
    trusted = await open_trusted_store(cfg, load_home_keys(cfg.home), None)
    try:
        fences = await asyncio.gather(
            *(take_epoch(h, trusted.authenticated, "t", replica=True) for h in homes)
        )
        assert [f.epoch for f in fences] == [1, 1, 1]
        for fence in fences:
            await fence.check()
    finally:
        await trusted.close()
