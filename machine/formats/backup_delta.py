"""An agent's delta segment (a continuous backup's increment) merged onto its earlier files.

A *delta* is an agent's export-format tar (the same files as a whole segment,
docs/formats/export.md) dumped with ``since_seq``: its conversation holds only
the events after ``base_seq``, its summaries and tool log the rows of the runs
those events belong to (whole, as they are now), its record and schedules are
whole. Merging it onto the agent's files as the chain restored them so far:

* conversation: the earlier lines as they are, then the delta's lines whose seq
  is past the earlier last one, byte for byte (events are append-only, so a
  line of a seq already there is the same line: a delta dumped a little after
  its base was listed may repeat a few). A delta whose ``base_seq`` is past the
  earlier last seq would leave a gap: the chain is broken (IntegrityError).
* summaries (by run) and tool log (by run and call): the delta's row replaces
  the earlier one of the same key, new ones follow; summaries stay in run order
  as a whole dump writes them.
* record and schedules: the delta's (its schedules file absent: none now).
* sessions.tar (the CLI's session files): a delta carries only the files that
  changed since the chain's copy, so its files replace the earlier ones of the
  same path and the others stay (its file absent: none changed). Paths are
  checked when the files are put back, not here.

A delta of ``base_seq`` 0 is the agent whole (one new since the base): it
replaces whatever came before. So a point's whole segment and its increments'
deltas merged in order give what a whole dump at the last increment's time
gives, line for line.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Iterable
from typing import Any, Final

from machine.formats.export import AGENT_FILES, OPTIONAL_AGENT_FILES, SESSIONS, agent_path
from machine.formats.segment_files import open_segment
from shared.archive import BoundedTarInfo
from shared.errors import IntegrityError

__all__ = ["AgentSegment", "merge_delta", "read_agent_segment", "segment_entries"]

logger = logging.getLogger(__name__)

AgentSegment = dict[str, bytes]
"""An agent's export files by name (``record.json`` ... ``schedules.jsonl``)."""

_SCHEDULES: Final = "schedules.jsonl"


def read_agent_segment(plaintext: bytes, agent_id: str) -> AgentSegment:
    """An agent's plaintext segment (whole or delta) read into its files, checked
    as a restore checks it (:func:`machine.formats.segment_files.open_segment`)."""
    files: AgentSegment = {}
    with open_segment(plaintext, agent_id) as segment:
        for name in AGENT_FILES:
            with segment.open(name) as f:
                files[name] = f.read()
        for name in OPTIONAL_AGENT_FILES:
            with segment.open_optional(name) as found:
                if found is not None:
                    files[name] = found.read()
    return files


def segment_entries(agent_id: str, files: AgentSegment) -> list[tuple[str, bytes]]:
    """``files`` as tar entries in the format's order (write them with
    :func:`shared.archive.write_tar`: a whole segment of the agent)."""
    names = [*AGENT_FILES, *(n for n in OPTIONAL_AGENT_FILES if n in files)]
    return [(agent_path(agent_id, n), files[n]) for n in names]


def _lines(data: bytes) -> list[bytes]:
    return [line + b"\n" for line in data.split(b"\n") if line]


def _row(line: bytes, what: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise IntegrityError(what, "a line is not JSON") from None
    if not isinstance(row, dict):
        raise IntegrityError(what, "a line is not a JSON object")
    return row


def _seq(line: bytes, what: str) -> int:
    seq = _row(line, what).get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise IntegrityError(what, "an event's seq is malformed")
    return seq


def _last_seq(conversation: bytes, what: str) -> int:
    lines = _lines(conversation)
    return _seq(lines[-1], what) if lines else 0


def _keyed(
    earlier: bytes, delta: bytes, key: tuple[str, ...], what: str
) -> list[tuple[tuple[Any, ...], bytes]]:
    """Rows of ``earlier`` then ``delta``, a delta row replacing the earlier one
    of the same ``key`` in its place."""
    rows: dict[tuple[Any, ...], bytes] = {}
    for line in (*_lines(earlier), *_lines(delta)):
        row = _row(line, what)
        rows[tuple(str(row.get(k)) for k in key)] = line
    return list(rows.items())


def merge_delta(
    earlier: AgentSegment | None,
    delta: AgentSegment,
    *,
    base_seq: int,
    agent_id: str,
    increment: str,
) -> AgentSegment:
    """The agent's files once ``delta`` (of increment ``increment``, dumped after
    ``base_seq``) is merged onto ``earlier`` (None: not in the chain so far).

    IntegrityError naming the increment when the chain is broken: the delta
    continues from events the earlier files do not reach.
    """
    what = f"backup increment {increment}: agent {agent_id}"
    if base_seq == 0:
        return dict(delta)  # the agent whole
    if earlier is None:
        raise IntegrityError(
            what, f"continues from event {base_seq}, but no earlier backup holds the agent"
        )
    have = _last_seq(earlier["conversation.jsonl"], what)
    if base_seq > have:
        raise IntegrityError(
            what, f"continues from event {base_seq}, but the backups before it end at {have}"
        )
    conversation = bytearray(earlier["conversation.jsonl"])
    if conversation and not conversation.endswith(b"\n"):
        conversation += b"\n"
    for line in _lines(delta["conversation.jsonl"]):
        seq = _seq(line, what)
        if seq > have:
            conversation += line
            have = seq
    summaries = _keyed(earlier["summaries.jsonl"], delta["summaries.jsonl"], ("run_id",), what)
    tools = _keyed(earlier["tools.jsonl"], delta["tools.jsonl"], ("run_id", "call_id"), what)
    merged: AgentSegment = {
        "record.json": delta["record.json"],
        "conversation.jsonl": bytes(conversation),
        "summaries.jsonl": _join(line for _, line in sorted(summaries)),
        "tools.jsonl": _join(line for _, line in tools),
    }
    if _SCHEDULES in delta:
        merged[_SCHEDULES] = delta[_SCHEDULES]
    sessions = _merge_sessions(earlier.get(SESSIONS), delta.get(SESSIONS), what)
    if sessions is not None:
        merged[SESSIONS] = sessions
    return merged


def _session_files(data: bytes, what: str) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
    files: dict[str, tuple[tarfile.TarInfo, bytes]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=BoundedTarInfo) as tar:
            for member in tar:
                f = tar.extractfile(member) if member.isreg() else None
                if f is None:
                    raise IntegrityError(what, f"{SESSIONS} holds {member.name[:80]!r}, not a file")
                files[member.name] = (member, f.read())
    except (tarfile.TarError, EOFError) as e:
        raise IntegrityError(what, f"{SESSIONS} is not a tar ({e})") from None
    return files


def _merge_sessions(earlier: bytes | None, delta: bytes | None, what: str) -> bytes | None:
    """The session files of ``earlier`` with those of ``delta`` in their place, as
    one tar in path order (None: neither has any)."""
    if delta is None or earlier is None:
        return delta if delta is not None else earlier
    files = _session_files(earlier, what)
    files.update(_session_files(delta, what))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info, body = files[name]
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def _join(lines: Iterable[bytes]) -> bytes:
    return b"".join(lines)
