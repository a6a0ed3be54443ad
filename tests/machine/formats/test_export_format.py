"""machine.formats.export: manifests, JSONL, and staged archives checked whole."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from machine.formats.export import (
    AGENT_FILES,
    AgentEntry,
    ExportManifest,
    accept_path,
    agent_path,
    attachment_path,
    encode_jsonl,
    read_jsonl,
    verify_staged,
)
from shared.archive import ArchiveLimits, extract_staged, write_tar_gz
from shared.errors import InvalidArgument
from shared.ids import new_id

AGENT = new_id("agent")
MACHINE = new_id("machine")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _contents() -> dict[str, bytes]:
    att = b"an attachment \x00\xff"
    return {
        agent_path(AGENT, "record.json"): b'{"name": "n"}',
        agent_path(AGENT, "conversation.jsonl"): encode_jsonl(
            [{"seq": 1, "kind": "RUN_STARTED", "payload": {"prompt": "héllo"}}]
        ),
        agent_path(AGENT, "summaries.jsonl"): b"",
        agent_path(AGENT, "tools.jsonl"): b"",
        attachment_path(_sha(att)): att,
    }


def _manifest(contents: dict[str, bytes], version: int = 1) -> ExportManifest:
    files = {n: _sha(contents[agent_path(AGENT, n)]) for n in AGENT_FILES}
    atts = tuple(p.split("/")[1] for p in contents if p.startswith("attachments/"))
    return ExportManifest(MACHINE, 1.5, (AgentEntry(AGENT, "n", files, atts),), version)


def _archive(tmp_path: Path, contents: dict[str, bytes], manifest: bytes | None) -> Path:
    entries: list[tuple[str, bytes | Path]] = list(contents.items())
    if manifest is not None:
        entries.append(("manifest.json", manifest))
    path = tmp_path / "export.tar.gz"
    write_tar_gz(path, entries)
    return path


def _open(tmp_path: Path, archive: Path) -> ExportManifest:
    stage = tmp_path / "stage"
    paths = extract_staged(archive, stage, accept=accept_path)
    return verify_staged(stage, paths)


def test_round_trip(tmp_path: Path) -> None:
    contents = _contents()
    manifest = _manifest(contents)
    got = _open(tmp_path, _archive(tmp_path, contents, manifest.to_json()))
    assert got == manifest
    rows = list(read_jsonl(tmp_path / "stage" / agent_path(AGENT, "conversation.jsonl"), "c"))
    assert rows == [{"seq": 1, "kind": "RUN_STARTED", "payload": {"prompt": "héllo"}}]


def test_accept_path() -> None:
    assert accept_path("manifest.json")
    assert accept_path(f"agents/{AGENT}/tools.jsonl")
    assert accept_path("attachments/" + "a" * 64)
    assert not accept_path(f"agents/{AGENT}/keys.json")
    assert not accept_path("agents/ag_x/record.json")
    assert not accept_path("attachments/" + "A" * 64)
    assert not accept_path(f"agents/{AGENT}/sub/record.json")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("tamper", "does not match"),
        ("drop", "missing"),
        ("extra", "not named by the manifest"),
    ],
)
def test_archive_must_match_its_manifest(tmp_path: Path, change: str, match: str) -> None:
    contents = _contents()
    manifest = _manifest(contents).to_json()
    conv = agent_path(AGENT, "conversation.jsonl")
    if change == "tamper":
        contents[conv] = contents[conv].replace(b"llo", b"LLO")
    elif change == "drop":
        del contents[conv]
    else:
        other = b"unlisted"
        contents[attachment_path(_sha(other))] = other
    with pytest.raises(InvalidArgument, match=match):
        _open(tmp_path, _archive(tmp_path, contents, manifest))


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="manifest.json: missing"):
        _open(tmp_path, _archive(tmp_path, _contents(), None))


def test_unknown_version_names_the_fix(tmp_path: Path) -> None:
    contents = _contents()
    raw = _manifest(contents, version=2).to_json()
    with pytest.raises(InvalidArgument, match="unknown format version 2.*upgrade"):
        _open(tmp_path, _archive(tmp_path, contents, raw))


def _with(**changes: object) -> bytes:
    data = json.loads(_manifest(_contents()).to_json())
    for key, value in changes.items():
        if key.startswith("agent_"):
            data["agents"][0][key.removeprefix("agent_")] = value
        else:
            data[key] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not an agents-export manifest"),
        (_with(format="tar"), "not an agents-export manifest"),
        (_with(format_version="1"), "format_version"),
        (_with(machine_id="../../etc"), "machine_id"),
        (_with(created_at=None), "created_at"),
        (_with(created_at=1e12), "created_at is not a time"),
        (_with(created_at=12345.5).replace(b"12345.5", b"1e400"), "created_at is not a time"),
        (b"[" * 100_000 + b"]" * 100_000, "manifest.json: nested too deeply"),
        (b'{"format": NaN}', "not valid JSON"),
        (_with(agents={}), "agents missing"),
        (_with(agent_agent_id="ag_../x"), "agent_id"),
        (_with(agent_name=""), "name"),
        (_with(agent_files={"record.json": "0" * 64}), "files must name"),
        (_with(agent_attachments=["zz"]), "attachments"),
    ],
)
def test_malformed_manifest_refused(raw: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        ExportManifest.parse(raw)


def test_duplicate_agent_refused() -> None:
    data = json.loads(_manifest(_contents()).to_json())
    data["agents"].append(data["agents"][0])
    with pytest.raises(InvalidArgument, match="listed twice"):
        ExportManifest.parse(json.dumps(data).encode())


def test_jsonl_bad_lines_named(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n[1]\n')
    with pytest.raises(InvalidArgument, match="x line 2: not a JSON object"):
        list(read_jsonl(path, "x"))
    path.write_bytes(b'{"a": 1}\n\xff\n')
    with pytest.raises(InvalidArgument, match="x line 2: not valid JSON"):
        list(read_jsonl(path, "x"))


def test_a_manifest_past_64_mib_is_refused_before_it_is_read(tmp_path: Path) -> None:
    contents = _contents()
    # Valid JSON, padded with spaces: only its size is wrong.
    raw = _manifest(contents).to_json() + b" " * (64 * 1024 * 1024)
    stage = tmp_path / "stage"
    # (Spaces compress past the import's ratio bound, which would refuse it first.)
    paths = extract_staged(
        _archive(tmp_path, contents, raw), stage, accept=accept_path,
        limits=ArchiveLimits(max_ratio=10**6),
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match="manifest.json: 671.* bytes, over the limit"):
        verify_staged(stage, paths)
