"""Outgoing/ and Incoming/: files go once read or imported, or after an hour untouched."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.app import open_machine
from machine.backups.handoff import MAX_AGE_SECONDS, Handoff
from machine.config import MachineConfig
from shared.errors import InvalidArgument


def _config(root: Path) -> MachineConfig:
    return MachineConfig(data_dir=root, background_loops=False, shutdown_grace_seconds=0).validate()


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_sweep_removes_only_files_untouched_for_an_hour(tmp_path: Path) -> None:
    now = [1_000_000.0]
    async with open_machine(_config(tmp_path / "d")) as m:
        handoff = Handoff(
            m.db,
            machine_id=m.machine_id,
            attachments_dir=m.config.attachments_dir,
            outgoing=m.config.outgoing_dir,
            incoming=m.config.incoming_dir,
            clock=lambda: now[0],
        )
        m.config.outgoing_dir.mkdir()
        old = m.config.outgoing_dir / "export-old.tar.gz"
        fresh = m.config.outgoing_dir / "export-new.tar.gz"
        left = handoff.incoming_file()
        for path in (old, fresh, left):
            path.write_bytes(b"x")
        os.utime(old, (now[0] - MAX_AGE_SECONDS - 1,) * 2)
        os.utime(left, (now[0] - MAX_AGE_SECONDS - 5,) * 2)
        os.utime(fresh, (now[0] - 60,) * 2)
        assert await handoff.sweep() == 2
        assert not old.exists() and not left.exists() and fresh.exists()
        now[0] += MAX_AGE_SECONDS
        assert await handoff.sweep() == 1
        assert not fresh.exists()


async def test_a_refused_import_leaves_nothing_in_incoming(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "d")) as m:
        handoff = m.require_handoff()
        with pytest.raises(InvalidArgument, match="archive"):
            await handoff.receive(_chunks(b"not ", b"a tar"))
        with pytest.raises(InvalidArgument, match="empty"):
            await handoff.receive(_chunks())
        assert list(m.config.incoming_dir.iterdir()) == []


async def test_open_machine_sweeps_old_exports_at_start(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "d")
    cfg.outgoing_dir.mkdir(parents=True)
    stale = cfg.outgoing_dir / "export-1.tar.gz"
    stale.write_bytes(b"x")
    os.utime(stale, (1.0, 1.0))
    async with open_machine(cfg):
        assert not stale.exists()
