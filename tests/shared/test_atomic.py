"""Atomic writes: all or nothing, private modes, no temp files left behind."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.atomic import ensure_private_dir, open_atomic, write_atomic


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
