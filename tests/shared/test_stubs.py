"""The committed stubs under shared/pb match a fresh generation from proto/."""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.gen_proto import PROTO, ROOT, generate


def _tree(base: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _diff(proto_root: Path, tmp: Path) -> list[str]:
    generate(tmp, proto_root)
    fresh = _tree(tmp / "shared" / "pb")
    committed = _tree(ROOT / "shared" / "pb")
    names = sorted(set(fresh) | set(committed))
    return [n for n in names if fresh.get(n) != committed.get(n)]


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    stale = _diff(PROTO, tmp_path)
    assert not stale, (
        f"shared/pb is out of date with proto/ for {stale}; "
        "run: .venv/bin/python scripts/gen_proto.py"
    )


def test_changed_proto_without_regeneration_is_caught(tmp_path: Path) -> None:
    protos = tmp_path / "proto"
    shutil.copytree(PROTO, protos)
    victim = sorted(protos.rglob("*.proto"))[0]
    victim.write_text(victim.read_text() + "\nmessage StubsTestExtra { string x = 1; }\n")
    assert _diff(protos, tmp_path / "out"), "a changed proto must make the stubs differ"


def test_stubs_import_without_path_tricks() -> None:
    import importlib

    for path in (ROOT / "shared" / "pb").rglob("*_pb2*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        importlib.import_module(module)
