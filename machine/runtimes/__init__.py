"""The runtimes this machine can drive, by name.

A runtime kind is a pair of functions: ``validate_settings(settings) -> dict``
(raises InvalidArgument naming ``settings_json``) used when an agent is created,
and ``create_runtime(*, agent_id, folder, settings) -> Runtime`` used when the
agent first runs. ``echo`` is always there; ``acp`` comes from
:mod:`machine.runtimes.acp` when that module imports.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine.runtimes import echo
from machine.runtimes.base import Runtime
from shared.errors import InvalidArgument

__all__ = ["RUNTIMES", "RuntimeKind", "RuntimeRegistry", "default_registry"]

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


def _load_acp() -> RuntimeKind | None:
    try:
        mod = importlib.import_module("machine.runtimes.acp")
    except ImportError as e:
        logger.info("acp runtime unavailable: %s", e)
        return None
    kind = getattr(mod, "KIND", None)
    if isinstance(kind, RuntimeKind):
        return kind
    validate = getattr(mod, "validate_settings", None)
    create = getattr(mod, "create_runtime", None)
    if validate is None or create is None:
        logger.warning("machine.runtimes.acp lacks validate_settings/create_runtime; skipped")
        return None
    return RuntimeKind("acp", validate, create)


def _builtin() -> dict[str, RuntimeKind]:
    kinds = {"echo": RuntimeKind("echo", echo.validate_settings, echo.create_runtime)}
    acp = _load_acp()
    if acp is not None:
        kinds["acp"] = acp
    return kinds


def default_registry() -> RuntimeRegistry:
    """A registry of every runtime that imports on this machine."""
    return RuntimeRegistry(RUNTIMES)


#: name -> kind: "echo" always, "acp" when machine.runtimes.acp imports.
RUNTIMES: dict[str, RuntimeKind] = _builtin()
