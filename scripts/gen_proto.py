"""Regenerate the protobuf and gRPC stubs under shared/pb from proto/.

Usage: ``python scripts/gen_proto.py [--out DIR]``. With ``--out`` the stubs
are written under DIR instead of the repository root (the stubs test uses
this to compare a fresh generation with the committed one). Needs the pinned
grpcio-tools and mypy-protobuf from the ``dev`` extra.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"


def generate(out: Path, proto_root: Path = PROTO) -> list[Path]:
    """Generate every .proto under ``proto_root`` into ``out``; return the files written."""
    from grpc_tools import protoc  # imported late: a dev-only dependency

    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"gen_proto: no .proto files under {proto_root}")
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    # The mypy plugins live beside the interpreter; PATH may not include the venv.
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("gen_proto: protoc failed")
    # Packages need __init__.py files so the stubs import as shared.pb.<area>.v1.
    written = []
    for folder in sorted({p.parent for p in (out / "shared" / "pb").rglob("*.py")}):
        cur = folder
        while cur != out / "shared":
            init = cur / "__init__.py"
            if not init.exists():
                init.write_text("")
            cur = cur.parent
    for p in sorted((out / "shared" / "pb").rglob("*")):
        if p.is_file():
            written.append(p)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    if args.out != ROOT:
        files = generate(args.out)
        print(f"gen_proto: wrote {len(files)} files", file=sys.stderr)
        return 0
    # Generate aside, then sync into shared/pb: readers never see a missing
    # package halfway through, and stubs of deleted protos are removed.
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        new_pb, old_pb = fresh / "shared" / "pb", ROOT / "shared" / "pb"
        wanted = {p.relative_to(new_pb) for p in new_pb.rglob("*") if p.is_file()}
        changed = 0
        for rel in sorted(wanted):
            dest = old_pb / rel
            data = (new_pb / rel).read_bytes()
            if not dest.exists() or dest.read_bytes() != data:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                changed += 1
        for p in sorted(old_pb.rglob("*"), reverse=True):
            rel = p.relative_to(old_pb)
            if "__pycache__" in rel.parts:
                continue
            if p.is_file() and rel not in wanted:
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    print(f"gen_proto: {len(wanted)} files, {changed} changed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
