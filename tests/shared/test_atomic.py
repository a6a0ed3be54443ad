"""Atomic writes: all or nothing, private modes, no temp files left behind."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.atomic import ensure_private_dir, open_atomic, sweep_tagged_temps, write_atomic


def test_write_atomic_creates_private_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    write_atomic(target, b"hello")
    assert target.read_bytes() == b"hello"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_write_atomic_replaces_and_accepts_chunks(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    write_atomic(target, b"old")
    write_atomic(target, iter([b"ne", b"w"]))
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_failure_inside_block_keeps_old_content(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    write_atomic(target, b"old")

    def chunks() -> Iterator[bytes]:
        yield b"partial"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_atomic(target, chunks())
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]

    with pytest.raises(ValueError), open_atomic(tmp_path / "new.bin") as f:
        f.write(b"x")
        raise ValueError("abort")
    assert not (tmp_path / "new.bin").exists()


def test_ensure_private_dir_forces_mode(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    d.parent.mkdir(mode=0o755)
    ensure_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o755)
    ensure_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_create_new_never_replaces_a_file_made_meanwhile(tmp_path: Path) -> None:
    target = tmp_path / "export.tar.gz"
    with open_atomic(target, create_new=True) as f:
        f.write(b"first")
    assert target.read_bytes() == b"first"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    # Made by someone else while our block ran: kept, ours dropped, no temp left.
    with pytest.raises(FileExistsError), open_atomic(target, create_new=True) as f:
        f.write(b"second")
        target.write_bytes(b"theirs")
    assert target.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["export.tar.gz"]


def test_ensure_private_dir_refuses_a_file_and_leaves_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    path.chmod(0o644)
    with pytest.raises(NotADirectoryError):
        ensure_private_dir(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_sweep_removes_only_old_temps_with_its_tag(tmp_path: Path) -> None:
    """What a writer killed inside open_atomic(tag=...) left goes once it is old;
    a fresh one (a write in progress) and other programs' temp files stay."""
    dest = tmp_path / "out.tar.gz"
    with pytest.raises(RuntimeError), open_atomic(dest, tag=".agents-export") as f:
        f.write(b"part of it")
        (left,) = [p for p in tmp_path.iterdir() if p.name.endswith(".agents-export.tmp")]
        os.link(left, tmp_path / "kept")  # as a SIGKILL would leave it
        raise RuntimeError("killed")
    os.rename(tmp_path / "kept", left)
    fresh = tmp_path / f".other.tar.gz.{'b' * 12}.agents-export.tmp"
    fresh.write_bytes(b"being written")
    others = [tmp_path / f".out.tar.gz.{'c' * 12}.tmp", tmp_path / "x.agents-export.tmp"]
    for other in others:
        other.write_bytes(b"not ours")
    old = time.time() - 7200
    for path in (left, *others):
        os.utime(path, (old, old))
    os.symlink(left, tmp_path / f".link.{'d' * 12}.agents-export.tmp")
    assert sweep_tagged_temps(tmp_path, ".agents-export") == [left]
    assert not left.exists() and fresh.exists() and all(o.exists() for o in others)
    assert (tmp_path / f".link.{'d' * 12}.agents-export.tmp").is_symlink()
