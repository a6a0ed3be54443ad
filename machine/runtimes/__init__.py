"""The runtimes this machine can drive, by name.

A runtime kind is a pair of functions: ``validate_settings(settings) -> dict``
(raises InvalidArgument naming ``settings_json``) used when an agent is created,
and ``create_runtime(*, agent_id, folder, settings) -> Runtime`` used when the
agent first runs: ``echo`` (built in, the default) and ``acp``. The ``acp``
runtime is the package ``acp/`` (imported on first use); ``claude_files`` finds
the CLIs' session files it deletes.

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
from machine.runtimes.base import Runtime
from shared.errors import InvalidArgument

__all__ = ["RuntimeKind", "RuntimeRegistry", "default_registry"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeKind:
    """How to validate settings for, and create, one kind of runtime."""

    name: str
    validate_settings: Callable[[Mapping[str, Any]], dict[str, Any]]
    create_runtime: Callable[..., Runtime]


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

    def create(
        self, name: str, *, agent_id: str, folder: Path, settings: Mapping[str, Any]
    ) -> Runtime:
        """Make a runtime instance for one agent."""
        return self.kind(name).create_runtime(agent_id=agent_id, folder=folder, settings=settings)


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
        "echo": RuntimeKind("echo", echo.validate_settings, echo.create_runtime),
        "acp": RuntimeKind("acp", _validate_acp, create_acp),
    }


def default_registry(
    *, claude_home: Path | None = None, codex_home: Path | None = None
) -> RuntimeRegistry:
    """A registry of the built-in runtimes, ``echo`` and ``acp``."""
    return RuntimeRegistry(_builtin(claude_home, codex_home))
