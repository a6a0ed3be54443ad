"""Session files that the Claude Code and Codex CLIs keep on disk.

Deleting an agent's session must also remove what its CLI stored for it:

- Claude Code (``$CLAUDE_CONFIG_DIR``, default ``~/.claude``):
  ``projects/<project>/<id>.jsonl`` (the transcript), ``projects/<project>/<id>/``
  (sub-agent transcripts, large tool results), ``todos/<id>-agent-*.json``,
  ``file-history/<id>/``, ``session-env/<id>/`` and ``debug/<id>.txt``.
- Codex (``$CODEX_HOME``, default ``~/.codex``): ``sessions/YYYY/MM/DD/rollout-*-<id>.jsonl``
  and ``archived_sessions/rollout-*-<id>.jsonl``.

Both CLIs name sessions with UUIDs; a session id must match that strict pattern
before it is put into any path or glob, so a crafted id can neither climb out of
the base folder nor match other sessions' files. The base folders are passed in
(see :func:`default_claude_home`); this module reads no environment.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from shared.errors import InvalidArgument

__all__ = [
    "SESSION_ID_PATTERN",
    "claude_session_paths",
    "codex_session_paths",
    "default_claude_home",
    "default_codex_home",
    "remove_session_paths",
    "validate_cli_session_id",
]

logger = logging.getLogger(__name__)

SESSION_ID_PATTERN = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)


def validate_cli_session_id(session_id: str, field: str = "session_id") -> str:
    """Return ``session_id`` if it is a UUID, else raise InvalidArgument naming ``field``."""
    if not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
        shown = session_id[:64] if isinstance(session_id, str) else type(session_id).__name__
        raise InvalidArgument(field, f"not a CLI session id (a UUID): {shown!r}")
    return session_id


def default_claude_home(env: Mapping[str, str], home: Path) -> Path:
    """Claude Code's config folder: ``CLAUDE_CONFIG_DIR`` if set, else ``home/.claude``.

    For the daemon's config module, which is the one place that reads the
    environment; pass the result to :class:`machine.runtimes.acp.runtime.AcpRuntime`.
    """
    value = env.get("CLAUDE_CONFIG_DIR", "")
    return Path(value) if value else home / ".claude"


def default_codex_home(env: Mapping[str, str], home: Path) -> Path:
    """Codex's home folder: ``CODEX_HOME`` if set, else ``home/.codex``."""
    value = env.get("CODEX_HOME", "")
    return Path(value) if value else home / ".codex"


def claude_session_paths(claude_home: Path, session_id: str) -> list[Path]:
    """Every file or folder Claude Code keeps for ``session_id`` (which must be valid)."""
    sid = validate_cli_session_id(session_id)
    found: list[Path] = []
    found += claude_home.glob(f"projects/*/{sid}.jsonl")
    found += claude_home.glob(f"projects/*/{sid}")
    found += claude_home.glob(f"todos/{sid}-agent-*.json")
    found += [
        claude_home / "file-history" / sid,
        claude_home / "session-env" / sid,
        claude_home / "debug" / f"{sid}.txt",
    ]
    return _existing(found)


def codex_session_paths(codex_home: Path, session_id: str) -> list[Path]:
    """Every rollout file Codex keeps for ``session_id`` (which must be valid)."""
    sid = validate_cli_session_id(session_id)
    found: list[Path] = []
    found += codex_home.glob(f"sessions/**/*{sid}*.jsonl")
    found += codex_home.glob(f"archived_sessions/*{sid}*.jsonl")
    return _existing(found)


def _existing(paths: Iterable[Path]) -> list[Path]:
    seen: set[Path] = set()
    out: list[Path] = []
    for path in paths:
        if path in seen or not (path.exists() or path.is_symlink()):
            continue
        seen.add(path)
        out.append(path)
    return out


def remove_session_paths(base: Path, paths: Iterable[Path]) -> int:
    """Remove ``paths`` (files, folders, links) that lie inside ``base``; return the count.

    A link is removed itself, never followed. A path whose parent folder
    resolves outside ``base`` (a linked project folder) is skipped and logged,
    so nothing outside the CLI's own folder is ever deleted.
    """
    root = base.resolve()
    removed = 0
    for path in paths:
        parent = path.parent.resolve()
        if parent != root and root not in parent.parents:
            logger.warning("skipping session file outside %s", root)
            continue
        try:
            if path.is_symlink() or not path.is_dir():
                path.unlink()
            else:
                shutil.rmtree(path)
        except FileNotFoundError:
            continue
        removed += 1
    return removed
