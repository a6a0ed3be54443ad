"""machine.formats.segment_files: a plaintext segment is read in place, only as the format says."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from machine.formats.export import AGENT_FILES, agent_path
from machine.formats.segment_files import open_segment
from shared.archive import write_tar
from shared.errors import IntegrityError
from shared.ids import new_id

AGENT = new_id("agent")


def _segment(path: Path, entries: list[tuple[str, bytes]]) -> Path:
    with open(path, "wb") as f:
        write_tar(f, entries)
    return path


def _read_all(path: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with open_segment(path, AGENT) as files:
        for name in AGENT_FILES:
            with files.open(name) as f:
                out[name] = f.read()
    return out


def test_the_four_files_in_order(tmp_path: Path) -> None:
    entries = [(agent_path(AGENT, n), n.encode() * 3) for n in AGENT_FILES]
    got = _read_all(_segment(tmp_path / "s", entries))
    assert got == {n: n.encode() * 3 for n in AGENT_FILES}


def _with_symlink(path: Path) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for n in AGENT_FILES[:1]:
            data = b"{}"
            info = tarfile.TarInfo(agent_path(AGENT, n))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(agent_path(AGENT, AGENT_FILES[1]))
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    return path


@pytest.mark.parametrize("case", ["order", "other agent", "extra", "missing", "symlink"])
def test_anything_else_is_refused(tmp_path: Path, case: str) -> None:
    files = [(agent_path(AGENT, n), b"x") for n in AGENT_FILES]
    if case == "order":
        files[1], files[2] = files[2], files[1]
    elif case == "other agent":
        files[0] = (agent_path(new_id("agent"), AGENT_FILES[0]), b"x")
    elif case == "extra":
        files.append(("attachments/" + "a" * 64, b"x"))
    elif case == "missing":
        files.pop()
    path = _with_symlink(tmp_path / "s") if case == "symlink" else _segment(tmp_path / "s", files)
    with pytest.raises(IntegrityError, match=f"backup agent {AGENT}"):
        _read_all(path)


def test_an_extended_header_claiming_150_mib_is_refused_before_reading(tmp_path: Path) -> None:
    first = (agent_path(AGENT, AGENT_FILES[0]), b"{}")
    path = _segment(tmp_path / "s", [first])
    info = tarfile.TarInfo("././@LongLink")
    info.type = tarfile.GNUTYPE_LONGNAME
    info.size = 150 * 1024 * 1024
    # After the first file, where the second one's header belongs.
    raw = path.read_bytes()
    path.write_bytes(raw[:1024] + info.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 4096)
    with pytest.raises(IntegrityError, match="extended header of 157286400 bytes"):
        _read_all(path)
