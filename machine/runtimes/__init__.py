"""The runtimes this machine can drive, by name.

A runtime kind is three functions: ``validate_settings(settings) -> dict``
(raises InvalidArgument naming ``settings_json``) used when an agent is created
or configured, ``create_runtime(*, agent_id, folder, settings) -> Runtime``
used when the agent first runs, and ``portable_settings(settings) -> (kept,
withheld)`` (:data:`base.PortableSettings`) used when an agent goes into a
backup or an export, so no secret setting travels: ``echo`` (built in, the
default) and ``acp``. The ``acp``
runtime is the package ``acp/`` (imported on first use); ``claude_files`` finds
the CLIs' session files it deletes, and ``session_files`` carries them in
backups and exports and puts them back.

May import: ``machine.models``, ``shared``; the rest of the machine drives a
runtime through ``base.Runtime`` and never the reverse.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine.runtimes import echo
from machine.runtimes.base import PortableSettings, Runtime, withhold_all
from machine.runtimes.claude_files import validate_cli_session_id
from shared.errors import InvalidArgument

__all__ = [
    "MAX_SESSION_ID",
    "RuntimeKind",
    "RuntimeRegistry",
    "check_session_id",
    "default_registry",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeKind:
    """How to validate settings for, and create, one kind of runtime."""

    name: str
    validate_settings: Callable[[Mapping[str, Any]], dict[str, Any]]
    create_runtime: Callable[..., Runtime]
    portable_settings: PortableSettings = withhold_all


class RuntimeRegistry:
    """The runtimes available, by name."""

    def __init__(self, kinds: Mapping[str, RuntimeKind]) -> None:
        self.kinds = dict(kinds)

    def names(self) -> list[str]:
        """Available runtime names, sorted."""
        return sorted(self.kinds)

    def kind(self, name: str) -> RuntimeKind:
        """The named kind; InvalidArgument naming ``runtime`` when unknown."""
        try:
            return self.kinds[name]
        except KeyError:
            raise InvalidArgument(
                "runtime", f"unknown runtime {name!r} (available: {', '.join(self.names())})"
            ) from None

    def validate(self, name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Check a runtime name and its settings; return normalised settings."""
        return self.kind(name).validate_settings(settings)

    def portable(self, name: str, settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``(kept, withheld)`` of an agent's settings for a backup or an export
        (:data:`base.PortableSettings`); an unknown runtime keeps nothing."""
        kind = self.kinds.get(name)
        return (kind.portable_settings if kind else withhold_all)(settings)

    def create(
        self, name: str, *, agent_id: str, folder: Path, settings: Mapping[str, Any]
    ) -> Runtime:
        """Make a runtime instance for one agent."""
        return self.kind(name).create_runtime(agent_id=agent_id, folder=folder, settings=settings)


#: The longest session id kept for a runtime whose ids are not UUIDs.
MAX_SESSION_ID = 200


def check_session_id(settings: Mapping[str, Any], session_id: object) -> str:
    """``session_id`` if it is one an agent with ``settings`` may hold, else
    InvalidArgument naming ``session_id``: the Claude Code and Codex CLIs' ids
    are UUIDs (they go into paths, :mod:`.claude_files`); any other is printable
    text of at most :data:`MAX_SESSION_ID` characters."""
    if settings.get("kind") in ("claude", "codex"):
        return validate_cli_session_id(session_id)  # type: ignore[arg-type]
    if (
        not isinstance(session_id, str)
        or not session_id
        or len(session_id) > MAX_SESSION_ID
        or not session_id.isprintable()
    ):
        raise InvalidArgument(
            "session_id", f"not printable text of 1 to {MAX_SESSION_ID} characters"
        )
    return session_id


def _portable_acp(settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    # Here rather than in acp/ (see _validate_acp): a backup splits every acp
    # agent's settings, and its worker processes should not load the ACP SDK for it.
    # ``command`` travels (so credentials belong in ``env``); every env value stays.
    kept = {k: settings[k] for k in ("command", "kind") if k in settings}
    env = settings.get("env") or {}
    return kept, [f"env.{name}" for name in sorted(env)]


def _validate_acp(settings: Mapping[str, Any]) -> dict[str, Any]:
    # machine.runtimes.acp is imported on first use: the agent-client-protocol
    # package (pydantic models) costs about a second at start-up, which every CLI
    # run and a daemon that never drives an ACP agent should not pay.
    from machine.runtimes import acp

    return acp.validate_settings(settings)


def _create_acp(**kwargs: Any) -> Runtime:
    from machine.runtimes import acp  # on first use, see _validate_acp

    return acp.create_runtime(**kwargs)


def _builtin(claude_home: Path | None, codex_home: Path | None) -> dict[str, RuntimeKind]:
    # The acp runtime removes Claude/Codex session files on delete: bind the
    # folders the config resolved so it never reads the environment itself.
    create_acp = functools.partial(_create_acp, claude_home=claude_home, codex_home=codex_home)
    return {
        "echo": RuntimeKind(
            "echo", echo.validate_settings, echo.create_runtime, echo.portable_settings
        ),
        "acp": RuntimeKind("acp", _validate_acp, create_acp, _portable_acp),
    }


def default_registry(
    *, claude_home: Path | None = None, codex_home: Path | None = None
) -> RuntimeRegistry:
    """A registry of the built-in runtimes, ``echo`` and ``acp``."""
    return RuntimeRegistry(_builtin(claude_home, codex_home))
