"""The export format, version 1: what an export (and a backup segment) holds.

An export is a tar (``.tar.gz`` on disk) of::

    manifest.json                              ExportManifest, written last
    agents/<agent id>/record.json              the agent's record, no secrets
    agents/<agent id>/conversation.jsonl       one stored event per line, in seq order
    agents/<agent id>/summaries.jsonl          one turn summary per line
    agents/<agent id>/tools.jsonl              one tool-log entry per line
    agents/<agent id>/schedules.jsonl          optional: one schedule (with its fires) per line
    agents/<agent id>/sessions.tar             optional: the CLI's session files (a plain tar)
    attachments/<sha256>                       files the conversations name

The manifest names every other file with its SHA-256, so a reader checks the
whole archive against it before it commits anything: an entry missing, extra,
or changed is refused. The full specification is docs/formats/export.md; this
module is its only reader and writer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from shared.errors import InvalidArgument
from shared.ids import is_valid_id
from shared.timestamps import MAX_SECONDS

__all__ = [
    "AGENT_FILES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "OPTIONAL_AGENT_FILES",
    "SESSIONS",
    "AgentEntry",
    "ExportManifest",
    "accept_path",
    "agent_path",
    "attachment_path",
    "encode_jsonl",
    "file_sha256",
    "parse_jsonl_line",
    "read_jsonl",
    "verify_staged",
]

logger = logging.getLogger(__name__)

FORMAT_NAME: Final = "agents-export"
FORMAT_VERSION: Final = 1
MANIFEST: Final = "manifest.json"
AGENT_FILES: Final = ("record.json", "conversation.jsonl", "summaries.jsonl", "tools.jsonl")
#: An agent's CLI session files (Claude Code, Codex): a plain tar of whole files,
#: each ``claude/<path>`` or ``codex/<path>`` under that CLI's home.
SESSIONS: Final = "sessions.tar"
#: Agent files a writer adds only when it has something to put in them (an
#: agent without schedules has no schedules.jsonl, so its archive reads as before).
OPTIONAL_AGENT_FILES: Final = ("schedules.jsonl", SESSIONS)
#: Longest agent name the format carries (the machine's own limit is lower).
MAX_NAME: Final = 500
#: Longest single JSONL line: one event's payload is bounded well below this.
MAX_LINE: Final = 64 * 1024 * 1024
_HASH_CHUNK: Final = 1024 * 1024
#: A SHA-256 as the format writes it: 64 lowercase hex digits (checked once an entry).
_SHA256: Final = re.compile(r"[0-9a-f]{64}")


#: The largest manifest.json an import reads.
MAX_MANIFEST: Final = 64 * 1024 * 1024


def _bad(reason: str) -> InvalidArgument:
    return InvalidArgument("archive", reason)


def agent_path(agent_id: str, name: str) -> str:
    """Path of one of an agent's files inside the archive."""
    if name not in (*AGENT_FILES, *OPTIONAL_AGENT_FILES) or not is_valid_id("agent", agent_id):
        raise ValueError(f"no such export path: {agent_id}/{name}")
    return f"agents/{agent_id}/{name}"


def attachment_path(sha256: str) -> str:
    """Path of an attachment inside the archive."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256: {sha256!r}")
    return f"attachments/{sha256}"


def accept_path(path: str) -> bool:
    """Whether ``path`` is one this format has (for :func:`shared.archive.extract_staged`)."""
    parts = path.split("/")
    if parts == [MANIFEST]:
        return True
    if len(parts) == 3 and parts[0] == "agents":
        return is_valid_id("agent", parts[1]) and parts[2] in (*AGENT_FILES, *OPTIONAL_AGENT_FILES)
    if len(parts) == 2 and parts[0] == "attachments":
        return _SHA256.fullmatch(parts[1]) is not None
    return False


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def encode_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as JSON Lines: compact, keys sorted, UTF-8, one object a line."""
    return b"".join(
        json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        for row in rows
    )


def read_jsonl(source: Path | IO[bytes], what: str) -> Iterator[dict[str, Any]]:
    """The objects of a JSON Lines file (a path, or a binary file open for reading);
    anything else is refused naming the line."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            yield from read_jsonl(f, what)
        return
    for number, line in enumerate(iter(lambda: source.readline(MAX_LINE + 1), b""), 1):
        yield parse_jsonl_line(line, what, number)


def _not_json(token: str) -> Any:
    # Python's json reads NaN and +-Infinity, which JSON has not: a NaN time would
    # otherwise reach the NOT NULL column as a raw database error.
    raise ValueError(f"{token} is not JSON")


def load_json(raw: bytes, what: str) -> Any:
    """An archive's JSON document (a file, a line), refused naming ``what`` when it
    is not UTF-8 JSON: NaN and Infinity are not JSON, and a document nested so
    deep that the parser runs out of stack is refused, not a server fault."""
    try:
        # Decoded first: json.loads of bytes would guess the encoding.
        return json.loads(raw.decode("utf-8"), parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError):
        raise _bad(f"{what}: not valid JSON") from None
    except RecursionError:
        raise _bad(f"{what}: nested too deeply") from None


def parse_jsonl_line(line: bytes, what: str, number: int) -> dict[str, Any]:
    """One line of a JSON Lines file (read with ``readline(MAX_LINE + 1)``) as an
    object; anything else is refused naming the line."""
    if len(line) > MAX_LINE:
        raise _bad(f"{what} line {number}: longer than {MAX_LINE} bytes")
    row = load_json(line, f"{what} line {number}")
    if not isinstance(row, dict):
        raise _bad(f"{what} line {number}: not a JSON object")
    return row


@dataclass(frozen=True)
class AgentEntry:
    """One agent in the manifest: its id, its name, and its files' hashes."""

    agent_id: str
    name: str
    files: dict[str, str]
    """File name (each of :data:`AGENT_FILES`, any of :data:`OPTIONAL_AGENT_FILES`) -> SHA-256."""
    attachments: tuple[str, ...] = ()
    """SHA-256 of each attachment its conversation names."""


@dataclass(frozen=True)
class ExportManifest:
    """manifest.json: the format, where it came from, and every file's hash."""

    machine_id: str
    created_at: float
    agents: tuple[AgentEntry, ...]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """The manifest's bytes (compact, keys sorted)."""
        data = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "machine_id": self.machine_id,
            "created_at": self.created_at,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "name": a.name,
                    "files": dict(sorted(a.files.items())),
                    "attachments": sorted(a.attachments),
                }
                for a in self.agents
            ],
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, raw: bytes) -> ExportManifest:
        """Read a manifest, refusing anything malformed or of an unknown version."""
        data = load_json(raw, "manifest.json")
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise _bad(f"manifest.json: not an {FORMAT_NAME} manifest")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise _bad("manifest.json: format_version missing or not a number")
        if version != FORMAT_VERSION:
            newer = " (newer than this agents-machine reads; upgrade it)" if version > 1 else ""
            raise _bad(f"manifest.json: unknown format version {version}{newer}")
        machine_id = data.get("machine_id")
        if not isinstance(machine_id, str) or not is_valid_id("machine", machine_id):
            raise _bad("manifest.json: machine_id missing or malformed")
        created = data.get("created_at")
        if not isinstance(created, int | float) or isinstance(created, bool):
            raise _bad("manifest.json: created_at missing or not a number")
        if not 0 <= created <= MAX_SECONDS:
            raise _bad("manifest.json: created_at is not a time (Unix seconds up to the year 9999)")
        rows = data.get("agents")
        if not isinstance(rows, list):
            raise _bad("manifest.json: agents missing or not a list")
        agents: list[AgentEntry] = []
        seen: set[str] = set()
        for i, row in enumerate(rows):
            agents.append(_parse_agent(row, f"manifest.json agents[{i}]"))
            if agents[-1].agent_id in seen:
                raise _bad(f"manifest.json: agent {agents[-1].agent_id} listed twice")
            seen.add(agents[-1].agent_id)
        return cls(machine_id, float(created), tuple(agents), version)


def _is_hash(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _parse_agent(row: object, where: str) -> AgentEntry:
    if not isinstance(row, dict):
        raise _bad(f"{where}: not an object")
    agent_id, name, files = row.get("agent_id"), row.get("name"), row.get("files")
    if not isinstance(agent_id, str) or not is_valid_id("agent", agent_id):
        raise _bad(f"{where}: agent_id missing or malformed")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise _bad(f"{where}: name missing or longer than {MAX_NAME} characters")
    if not isinstance(files, dict) or not (
        set(AGENT_FILES) <= set(files) <= {*AGENT_FILES, *OPTIONAL_AGENT_FILES}
    ):
        raise _bad(
            f"{where}: files must name {', '.join(AGENT_FILES)}"
            f" (and may name {', '.join(OPTIONAL_AGENT_FILES)})"
        )
    if not all(_is_hash(h) for h in files.values()):
        raise _bad(f"{where}: a file hash is not a SHA-256")
    attachments = row.get("attachments", [])
    if not isinstance(attachments, list) or not all(_is_hash(h) for h in attachments):
        raise _bad(f"{where}: attachments must be a list of SHA-256 hashes")
    return AgentEntry(agent_id, name, dict(files), tuple(attachments))


def verify_staged(root: Path, paths: Iterable[str]) -> ExportManifest:
    """Check an unpacked archive against its manifest; return the manifest.

    ``paths`` are the files the archive held (as :func:`extract_staged`
    returned them). Every file the manifest names must be there with its
    hash, and nothing else may be: an archive that fails is refused whole.
    """
    present = set(paths)
    if MANIFEST not in present:
        raise _bad("manifest.json: missing")
    # Read and parsed whole: bounded far below an entry's 1 GiB (it names each
    # agent's four files and attachments, a few hundred bytes an agent).
    size = (root / MANIFEST).stat().st_size
    if size > MAX_MANIFEST:
        raise _bad(f"manifest.json: {size} bytes, over the limit of {MAX_MANIFEST}")
    manifest = ExportManifest.parse((root / MANIFEST).read_bytes())
    expected: dict[str, str] = {}
    for agent in manifest.agents:
        for name, digest in agent.files.items():
            expected[agent_path(agent.agent_id, name)] = digest
        for digest in agent.attachments:
            expected[attachment_path(digest)] = digest
    extra = present - set(expected) - {MANIFEST}
    if extra:
        raise _bad(f"entry {sorted(extra)[0]!r}: not named by the manifest")
    for path, digest in sorted(expected.items()):
        if path not in present:
            raise _bad(f"entry {path!r}: named by the manifest but missing")
        if file_sha256(root / path) != digest:
            raise _bad(f"entry {path!r}: content does not match the manifest's hash")
    return manifest
