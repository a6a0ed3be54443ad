"""shared.archive: hostile archives are refused whole, good ones round-trip."""

from __future__ import annotations

import errno
import gzip
import io
import os
import tarfile
import threading
import zlib
from pathlib import Path

import pytest

from shared import archive
from shared.archive import FIXED_MTIME, ArchiveLimits, extract_staged, write_tar, write_tar_gz
from shared.atomic import FILE_MODE
from shared.errors import InvalidArgument

EXPECTED = {"manifest.json", "agents/ag_1/record.json", "agents/ag_1/conversation.jsonl"}


def accept(path: str) -> bool:
    return path in EXPECTED


def _tar_gz(path: Path, build: object) -> Path:
    """A .tar.gz made by ``build(tar)`` with tarfile, no checks of ours."""
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:  # type: ignore[call-overload]
        build(tar)  # type: ignore[operator]
    return path


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"x", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if info.isreg() else None)


def _refused(tmp_path: Path, archive: Path, match: str, **limits: int) -> None:
    dest = tmp_path / "stage"
    with pytest.raises(InvalidArgument, match=match) as err:
        extract_staged(archive, dest, accept=accept, limits=ArchiveLimits(**limits))
    assert err.value.field == "archive"
    assert not dest.exists(), "a refused archive must leave nothing behind"


def test_round_trip_is_byte_equal_and_deterministic(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    entries: list[tuple[str, bytes | Path]] = [
        ("manifest.json", b'{"format": 1}'),
        ("agents/ag_1/record.json", b"{}"),
        ("agents/ag_1/conversation.jsonl", big),
    ]
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    size = write_tar_gz(a, entries)
    write_tar_gz(b, entries)
    assert size == a.stat().st_size
    assert a.read_bytes() == b.read_bytes(), "the same content must make the same archive"
    assert oct(a.stat().st_mode & 0o777) == "0o600"
    names = extract_staged(a, tmp_path / "out", accept=accept)
    assert names == [n for n, _ in entries]
    assert (tmp_path / "out/agents/ag_1/conversation.jsonl").read_bytes() == big.read_bytes()
    assert (tmp_path / "out/manifest.json").read_bytes() == b'{"format": 1}'


def _tarfile_reference(entries: list[tuple[str, bytes]]) -> bytes:
    """What tarfile's own stream writer makes of ``entries`` (the format before
    write_tar had its own writer: segments stay byte-equal, so keep their names)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.uid, info.gid = FIXED_MTIME, FILE_MODE, 0, 0
            info.uname = info.gname = ""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    "sizes",
    [[], [0], [1], [511], [512], [513], [9216], [10240], [3 * 1024 * 1024 + 5], [5, 0, 700, 1]],
)
def test_writer_makes_the_bytes_tarfile_makes(tmp_path: Path, sizes: list[int]) -> None:
    # Later names pass ustar's 100 bytes: tarfile writes a PAX header for those.
    entries = [
        (f"agents/ag_{i}/f{'x' * 40 * i}-{n}.jsonl", os.urandom(n)) for i, n in enumerate(sizes)
    ]
    expected = _tarfile_reference(entries)
    as_bytes = io.BytesIO()
    write_tar(as_bytes, entries)
    assert as_bytes.getvalue() == expected
    # The same from files and from open files.
    files: list[tuple[str, bytes | Path | io.BytesIO]] = []
    for i, (name, data) in enumerate(entries):
        path = tmp_path / f"e{i}"
        path.write_bytes(data)
        files.append((name, path if i % 2 else io.BytesIO(data)))
    from_files = io.BytesIO()
    write_tar(from_files, files)  # type: ignore[arg-type]
    assert from_files.getvalue() == expected


def test_writer_refuses_a_file_that_ends_early() -> None:
    class Short(io.BytesIO):
        def seek(self, pos: int, whence: int = 0) -> int:
            super().seek(pos, whence)
            return 100 if whence == os.SEEK_END else pos

    with pytest.raises(OSError, match="ended 90 bytes early"):
        write_tar(io.BytesIO(), [("agents/ag_1/record.json", Short(b"x" * 10))])  # type: ignore[list-item]


def test_plain_tar_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        _add(tar, "manifest.json", b"{}")
    assert extract_staged(path, tmp_path / "out", accept=accept) == ["manifest.json"]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("../manifest.json", "escapes"),
        ("agents/../../etc/passwd", "escapes"),
        ("/etc/passwd", "absolute"),
        ("agents\\ag_1\\record.json", "plain relative"),
        ("other.json", "not a path this format has"),
    ],
)
def test_bad_paths_refused(tmp_path: Path, name: str, match: str) -> None:
    archive = _tar_gz(tmp_path / "a.tar.gz", lambda tar: _add(tar, name))
    _refused(tmp_path, archive, match)


@pytest.mark.parametrize(
    ("kind", "attrs", "match"),
    [
        ("symlink", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "symbolic link"),
        ("hardlink", {"type": tarfile.LNKTYPE, "linkname": "/etc/passwd"}, "hard link"),
        ("chardev", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "device"),
        ("blockdev", {"type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}, "device"),
        ("fifo", {"type": tarfile.FIFOTYPE}, "FIFO"),
    ],
)
def test_links_devices_and_fifos_refused(
    tmp_path: Path, kind: str, attrs: dict[str, object], match: str
) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")
        info = tarfile.TarInfo("agents/ag_1/record.json")
        for key, value in attrs.items():
            setattr(info, key, value)
        tar.addfile(info)

    _refused(tmp_path, _tar_gz(tmp_path / f"{kind}.tar.gz", build), match)


def test_good_entries_before_a_bad_one_are_removed(tmp_path: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")
        _add(tar, "agents/ag_1/record.json", b"{}")
        _add(tar, "../evil")

    _refused(tmp_path, _tar_gz(tmp_path / "a.tar.gz", build), "escapes")


def test_duplicate_entry_refused(tmp_path: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")
        _add(tar, "manifest.json", b"{}")

    _refused(tmp_path, _tar_gz(tmp_path / "a.tar.gz", build), "twice")


def test_entry_claiming_10_gb_refused_before_reading(tmp_path: Path) -> None:
    info = tarfile.TarInfo("agents/ag_1/conversation.jsonl")
    info.size = 10 * 1000**3
    header = info.tobuf(format=tarfile.PAX_FORMAT)
    path = tmp_path / "claim.tar.gz"
    with gzip.open(path, "wb") as gz:
        gz.write(header + b"\0" * 4096)
    _refused(tmp_path, path, "claims 10000000000 bytes")


def test_200000_entries_refused(tmp_path: Path) -> None:
    # Raw headers are much faster to make than tarfile.addfile, and the same bytes;
    # folder entries are otherwise passed over, so only the count can refuse them.
    info = tarfile.TarInfo("agents")
    info.type = tarfile.DIRTYPE
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    path = tmp_path / "many.tar.gz"
    with gzip.open(path, "wb", compresslevel=1) as gz:
        gz.write(header * 200_000)
    _refused(tmp_path, path, "more than 100000 entries")


def test_gzip_bomb_refused_at_the_ratio(tmp_path: Path) -> None:
    # One entry of 600 MiB of zeros: about 600 KiB compressed, far over 200:1.
    size = 600 * 1024 * 1024
    info = tarfile.TarInfo("agents/ag_1/conversation.jsonl")
    info.size = size
    path = tmp_path / "bomb.tar.gz"
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (1024 * 1024)
    with open(path, "wb") as f:
        f.write(comp.compress(tarfile.TarInfo("manifest.json").tobuf() + b"\0" * 0))
        f.write(comp.compress(info.tobuf()))
        for _ in range(size // len(zeros)):
            f.write(comp.compress(zeros))
        f.write(comp.flush())
    assert path.stat().st_size < 2 * 1024 * 1024
    _refused(tmp_path, path, "compression ratio")


def test_total_size_bound(tmp_path: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", os.urandom(600))
        _add(tar, "agents/ag_1/record.json", os.urandom(600))

    _refused(tmp_path, _tar_gz(tmp_path / "a.tar.gz", build), "add up", max_total_bytes=1000)


@pytest.mark.parametrize("cut", [10, 300, 700, -20])
def test_truncated_archive_refused(tmp_path: Path, cut: int) -> None:
    good = tmp_path / "good.tar.gz"
    write_tar_gz(
        good,
        [("manifest.json", os.urandom(2000)), ("agents/ag_1/record.json", os.urandom(500))],
    )
    data = good.read_bytes()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(data[:cut] if cut > 0 else data[:cut])
    _refused(tmp_path, bad, "damaged|truncated|not a tar")


def test_not_an_archive_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.tar.gz"
    path.write_bytes(b"this is not a tar archive at all" * 100)
    _refused(tmp_path, path, "not a tar|damaged")


def test_existing_destination_is_never_reused(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    write_tar_gz(archive, [("manifest.json", b"{}")])
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        extract_staged(archive, tmp_path / "stage", accept=accept)
    assert (tmp_path / "stage" / "keep").read_text() == "mine"


def test_writer_refuses_bad_paths_and_leaves_no_file(tmp_path: Path) -> None:
    dest = tmp_path / "out.tar.gz"
    with pytest.raises(InvalidArgument, match="escapes"):
        write_tar_gz(dest, [("manifest.json", b"{}"), ("../x", b"")])
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE])
def test_an_extended_header_claiming_150_mib_is_refused_before_reading(
    tmp_path: Path, kind: bytes
) -> None:
    # tarfile reads such a header's payload whole into memory before any entry
    # exists to bound; the claim alone must be refused.
    info = tarfile.TarInfo("././@LongLink")
    info.type = kind
    info.size = 150 * 1024 * 1024
    path = tmp_path / "header.tar.gz"
    with gzip.open(path, "wb") as gz:
        gz.write(info.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 4096)
    _refused(tmp_path, path, "an extended header of 157286400 bytes")


def test_a_small_extended_header_still_reads(tmp_path: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("manifest.json")
        info.size = 2
        info.pax_headers = {"comment": "c" * 10_000}
        tar.format = tarfile.PAX_FORMAT
        tar.addfile(info, io.BytesIO(b"{}"))

    paths = extract_staged(_tar_gz(tmp_path / "pax.tar.gz", build), tmp_path / "s", accept=accept)
    assert paths == ["manifest.json"]


def test_nothing_is_written_before_the_whole_archive_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")
        _add(tar, "agents/ag_1/record.json", b"{}")
        _add(tar, "agents/ag_1/record.json", b"{}")  # the refusal comes last

    def written(*args: object) -> None:
        raise AssertionError("a file was written before the archive was checked whole")

    monkeypatch.setattr(archive, "_write_entry", written)
    _refused(tmp_path, _tar_gz(tmp_path / "a.tar.gz", build), "twice")


def test_a_failed_write_is_the_disks_error_not_a_damaged_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive, "_write_entry", full)
    dest = tmp_path / "stage"
    with pytest.raises(OSError) as err:
        extract_staged(_tar_gz(tmp_path / "a.tar.gz", build), dest, accept=accept)
    assert err.value.errno == errno.ENOSPC and not isinstance(err.value, InvalidArgument)
    assert not dest.exists()


def test_a_stop_ends_it_and_leaves_nothing(tmp_path: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _add(tar, "manifest.json", b"{}")

    stop = threading.Event()
    stop.set()
    dest = tmp_path / "stage"
    with pytest.raises(InvalidArgument, match="stopped"):
        extract_staged(_tar_gz(tmp_path / "a.tar.gz", build), dest, accept=accept, stop=stop)
    assert not dest.exists()
