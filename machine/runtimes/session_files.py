"""An agent's CLI session files as they travel in backups and exports.

The Claude Code and Codex CLIs keep what they need to resume a session in
their own home folders (:mod:`.claude_files` lists them). A backup or an
export carries them, so a restored agent resumes its session: as one plain
tar (the agent file ``sessions.tar``, docs/formats/export.md) of whole files,
each named ``claude/<path>`` or ``codex/<path>`` relative to that CLI's home.

What is carried, and what never is:

- only the files of the agent's own session (its id, a UUID, in the name),
  only regular files: a link is never followed nor carried;
- never ``session-env/`` (it may hold environment values: secrets) nor
  ``debug/`` (logs, of no use to resume);
- at most :data:`MAX_SESSION_BYTES` per agent: past it none are carried, and
  a warning says so (the backup still succeeds);
- a ``.jsonl`` file is cut after its last complete line (a run may be writing it).

Putting them back (:func:`restore_session_tar`) checks every path before it
writes any: a path that is absolute, holds ``..``, or is not one of the
places the CLI keeps *that* session's files (so an archive can never write a
CLI's settings, hooks or another session) is refused (InvalidArgument naming
it); a folder on the way that is a link is refused too, so nothing is written
outside the CLI's home. Each file is
written atomically (temp, fsync, rename, fsync of its folder). An existing
file with the same bytes is left alone; one changed after the carried copy
(a newer mtime) is kept, and the result says so; an older one is replaced.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from machine.runtimes.claude_files import (
    SESSION_ID_PATTERN,
    claude_session_paths,
    codex_session_paths,
)
from shared.archive import BoundedTarInfo
from shared.atomic import DIR_MODE, FILE_MODE, write_atomic
from shared.errors import InvalidArgument

__all__ = [
    "MAX_SESSION_BYTES",
    "SessionCapture",
    "SessionHomes",
    "SessionRestore",
    "capture_session_files",
    "read_session_tar",
    "restore_session_tar",
    "session_tar_files",
]

logger = logging.getLogger(__name__)

#: The session files carried for one agent, at most (a long Claude session's
#: transcript and its sub-agents' are a few MiB; past this, none are carried).
MAX_SESSION_BYTES: Final = 64 * 1024 * 1024
#: Top folders of a CLI's home never carried (environment values; logs).
_NEVER: Final = frozenset({"session-env", "debug"})
#: A path component as carried: what the CLIs name their folders and files.
_COMPONENT: Final = re.compile(r"^[A-Za-z0-9._@+=-]{1,255}$")
_KINDS: Final = ("claude", "codex")
#: Files a session tar may hold (sub-agent transcripts, file history, todos).
_MAX_FILES: Final = 10_000


@dataclass(frozen=True)
class SessionHomes:
    """The CLIs' home folders this machine's acp runtime uses (MachineConfig's)."""

    claude: Path | None = None
    codex: Path | None = None

    def of(self, kind: str) -> Path | None:
        """The home of CLI ``kind`` ("claude" or "codex"), or None."""
        return self.claude if kind == "claude" else self.codex if kind == "codex" else None


@dataclass(frozen=True)
class SessionCapture:
    """What :func:`capture_session_files` wrote."""

    files: int = 0
    bytes: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    """SHA-256 of every session file now (carried or unchanged), by tar path."""
    skipped: str = ""
    """Why none were carried (over the size cap), or ''."""


@dataclass(frozen=True)
class SessionRestore:
    """What :func:`restore_session_tar` did."""

    written: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    kept_newer: tuple[str, ...] = ()
    """Files left as they are here: changed after the carried copy was made."""


def session_tar_files(
    homes: SessionHomes, settings: Mapping[str, Any], session_id: str | None
) -> list[tuple[str, Path]]:
    """(tar path, file) of each session file an agent with ``settings`` and
    ``session_id`` has in its CLI's home, sorted; none for other runtimes."""
    kind = settings.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS or not session_id:
        return []
    home = homes.of(kind)
    if home is None or not SESSION_ID_PATTERN.fullmatch(session_id) or not home.is_dir():
        return []
    found = (
        claude_session_paths(home, session_id)
        if kind == "claude"
        else codex_session_paths(home, session_id)
    )
    root = home.resolve()
    out: dict[str, Path] = {}
    for path in found:
        for file in _regular_files(path):
            rel = file.relative_to(home).parts
            if rel[0] in _NEVER or not all(_COMPONENT.match(p) for p in rel):
                continue
            parent = file.parent.resolve()
            if parent != root and root not in parent.parents:
                logger.warning("skipping a session file outside %s", root)
                continue
            out[f"{kind}/{'/'.join(rel)}"] = file
    return sorted(out.items())


def _regular_files(path: Path) -> Iterator[Path]:
    """``path`` if a regular file, or the regular files under it; links never followed."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        yield path
    elif stat.S_ISDIR(mode):
        for folder, dirs, files in os.walk(path, followlinks=False):
            dirs.sort()
            for name in sorted(files):
                child = Path(folder, name)
                if stat.S_ISREG(child.lstat().st_mode):
                    yield child


def _size(file: Path) -> int:
    try:
        return file.lstat().st_size
    except FileNotFoundError:  # the CLI removed it meanwhile
        return 0


def _content(tar_path: str, file: Path) -> tuple[bytes, float] | None:
    """The bytes to carry of ``file`` and its mtime (None: gone, or unreadable)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        data = f.read(MAX_SESSION_BYTES + 1)
    if tar_path.endswith(".jsonl"):
        # A run may be writing it: the last line may be half written.
        data = data[: data.rfind(b"\n") + 1]
    return data, st.st_mtime


def capture_session_files(
    homes: SessionHomes,
    settings: Mapping[str, Any],
    session_id: str | None,
    out: IO[bytes],
    *,
    known: Mapping[str, str] | None = None,
    label: str = "",
) -> SessionCapture:
    """Write the agent's session files as a tar to ``out``; return what it holds.

    With ``known`` (tar path -> SHA-256 of the copy the backup chain holds) a
    file whose bytes did not change is left out (an increment's delta). Writes
    nothing at all (not even an empty tar) when there is nothing to carry: the
    caller then adds no ``sessions.tar``. Over :data:`MAX_SESSION_BYTES` in all,
    nothing is carried and ``skipped`` says why (logged once, here).
    """
    files = session_tar_files(homes, settings, session_id)
    total = sum(_size(f) for _, f in files)
    if total > MAX_SESSION_BYTES:
        reason = (
            f"its session files are {total} bytes, over the {MAX_SESSION_BYTES}-byte limit:"
            " not carried"
        )
        logger.warning("agent %s: %s", label or "?", reason)
        return SessionCapture(skipped=reason)
    hashes: dict[str, str] = {}
    carried: list[tuple[str, bytes, float]] = []
    for name, file in files:
        got = _content(name, file)
        if got is None:
            continue
        data, mtime = got
        digest = hashlib.sha256(data).hexdigest()
        hashes[name] = digest
        if known is not None and known.get(name) == digest:
            continue
        carried.append((name, data, mtime))
    if carried:
        # Deterministic: the same files make the same bytes (a segment is named
        # by a keyed hash of its plaintext); the mtime travels, for restore.
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, data, mtime in carried:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = int(mtime)
                info.mode = FILE_MODE
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    return SessionCapture(len(carried), sum(len(d) for _, d, _ in carried), hashes)


def _checked_path(name: str, where: str) -> tuple[str, tuple[str, ...]]:
    """(kind, parts under its home) of a tar path; InvalidArgument naming it otherwise."""
    shown = name[:200]
    parts = tuple(name.split("/"))
    if (
        name.startswith("/")
        or len(parts) < 2
        or parts[0] not in _KINDS
        or any(p in ("", ".", "..") or not _COMPONENT.match(p) for p in parts[1:])
    ):
        raise InvalidArgument("archive", f"{where}: refused session file path {shown!r}")
    if parts[1] in _NEVER:
        raise InvalidArgument("archive", f"{where}: {shown!r} is never carried")
    return parts[0], parts[1:]


def _is_session_file(kind: str, parts: tuple[str, ...], sid: str) -> bool:
    """Whether ``parts`` (under the home of CLI ``kind``) is where that CLI keeps a
    file of session ``sid`` (:mod:`.claude_files`)."""
    top, name = parts[0], parts[-1]
    if kind == "claude":
        return (
            (top == "projects" and len(parts) == 3 and name == f"{sid}.jsonl")
            or (top == "projects" and len(parts) >= 4 and parts[2] == sid)
            or (
                top == "todos"
                and len(parts) == 2
                and name.startswith(f"{sid}-agent-")
                and name.endswith(".json")
            )
            or (top == "file-history" and len(parts) >= 3 and parts[1] == sid)
        )
    in_name = sid in name and name.endswith(".jsonl")
    return (top == "sessions" and len(parts) == 5 and in_name) or (
        top == "archived_sessions" and len(parts) == 2 and in_name
    )


def read_session_tar(data: bytes, where: str) -> list[tuple[str, bytes, float]]:
    """(tar path, bytes, mtime) of each file of a ``sessions.tar``, every path
    checked (InvalidArgument naming the first refused) before any is returned."""
    out: list[tuple[str, bytes, float]] = []
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=BoundedTarInfo) as tar:
            for member in tar:
                _checked_path(member.name, where)
                if not member.isreg():
                    raise InvalidArgument(
                        "archive", f"{where}: {member.name[:200]!r} is not a regular file"
                    )
                total += member.size
                if total > MAX_SESSION_BYTES or len(out) >= _MAX_FILES:
                    raise InvalidArgument("archive", f"{where}: more session files than carried")
                f = tar.extractfile(member)
                body = f.read() if f is not None else b""
                out.append((member.name, body, float(member.mtime)))
    except (tarfile.TarError, EOFError) as e:
        raise InvalidArgument("archive", f"{where}: not a tar ({e})") from None
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise InvalidArgument("archive", f"{where}: a session file appears twice")
    return out


def _folder_inside(home: Path, parts: tuple[str, ...]) -> Path | None:
    """The folder ``home/parts`` made (private) where missing; None when a part of
    it is a link or not a folder (nothing is written through a link)."""
    cur = home
    for part in parts:
        cur = cur / part
        try:
            mode = cur.lstat().st_mode
        except FileNotFoundError:
            os.mkdir(cur, DIR_MODE)
            continue
        if not stat.S_ISDIR(mode):
            return None
    return cur


def restore_session_tar(
    homes: SessionHomes, data: bytes, session_id: str | None, where: str
) -> SessionRestore:
    """Put the files of a ``sessions.tar`` of session ``session_id`` back under
    the CLIs' homes (see the module doc). InvalidArgument naming a refused
    path, before anything is written; a CLI whose home this machine does not
    know is skipped (logged)."""
    files = read_session_tar(data, where)
    sid = session_id if session_id and SESSION_ID_PATTERN.fullmatch(session_id) else ""
    for name, _, _ in files:
        kind, parts = _checked_path(name, where)
        if not sid or not _is_session_file(kind, parts, sid):
            raise InvalidArgument(
                "archive", f"{where}: {name[:200]!r} is not a file of the agent's session"
            )
    written: list[str] = []
    unchanged: list[str] = []
    newer: list[str] = []
    for name, body, mtime in files:
        kind, parts = _checked_path(name, where)
        home = homes.of(kind)
        if home is None:
            logger.warning("%s: no %s home on this machine: %s not restored", where, kind, name)
            continue
        home.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        folder = _folder_inside(home, parts[:-1])
        if folder is None:
            raise InvalidArgument("archive", f"{where}: {name[:200]!r} would go through a link")
        dest = folder / parts[-1]
        try:
            st = dest.lstat()
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(
                    "archive", f"{where}: {name[:200]!r} is a link or a folder here"
                )
            if dest.read_bytes() == body:
                unchanged.append(name)
                continue
            if st.st_mtime > mtime:
                logger.warning("%s: %s changed here since it was carried: kept", where, name)
                newer.append(name)
                continue
        write_atomic(dest, body, FILE_MODE)
        os.utime(dest, (mtime, mtime))
        written.append(name)
    return SessionRestore(tuple(written), tuple(unchanged), tuple(newer))
