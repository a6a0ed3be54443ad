"""The ``acp`` runtime's settings: what an agent may configure, checked and normalised.

:func:`validate_acp_settings` checks the ``command``, ``env`` and ``kind``
settings and :func:`validate_settings` is the runtime registry's hook around
it; :class:`AcpSettings` is the frozen form one agent process is started with
(a process is restarted when it changes). This module does not import the
ACP SDK, so checking settings loads none of its pydantic models.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidArgument

__all__ = ["KINDS", "AcpSettings", "validate_acp_settings", "validate_settings"]

logger = logging.getLogger(__name__)

KINDS = ("claude", "codex", "generic")
"""Allowed values of the ``kind`` setting (which CLI's session files to delete)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MAX_ARGS = 256
_MAX_ARG_CHARS = 8192
_MAX_ENV = 256
_MAX_ENV_VALUE_CHARS = 32768


def validate_acp_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check an agent's ``acp`` settings and return them normalised.

    ``command`` (required): non-empty list of strings, the program and its
    arguments. ``env`` (optional): map of variable name to string value, added
    to the agent process's environment. ``kind`` (optional, default
    ``"generic"``): ``"claude"``, ``"codex"`` or ``"generic"``. Unknown keys
    are refused so a typo does not pass silently. Raises InvalidArgument
    naming the field (``settings.command[1]``...); values of ``env`` never
    appear in messages.
    """
    if not isinstance(settings, Mapping):
        raise InvalidArgument("settings", "must be a map")
    unknown = sorted(str(k) for k in settings if k not in ("command", "env", "kind"))
    if unknown:
        raise InvalidArgument(f"settings.{unknown[0]}", "unknown setting for runtime acp")

    command = settings.get("command")
    if not isinstance(command, list | tuple) or not command:
        raise InvalidArgument("settings.command", "required: a non-empty list of strings")
    if len(command) > _MAX_ARGS:
        raise InvalidArgument("settings.command", f"at most {_MAX_ARGS} items")
    for i, arg in enumerate(command):
        name = f"settings.command[{i}]"
        if not isinstance(arg, str):
            raise InvalidArgument(name, "must be a string")
        if "\x00" in arg or len(arg) > _MAX_ARG_CHARS:
            raise InvalidArgument(name, f"no NUL bytes, at most {_MAX_ARG_CHARS} characters")
    if not command[0].strip():
        raise InvalidArgument("settings.command[0]", "the program must not be empty")

    env_in = settings.get("env") or {}
    if not isinstance(env_in, Mapping):
        raise InvalidArgument("settings.env", "must be a map of names to strings")
    if len(env_in) > _MAX_ENV:
        raise InvalidArgument("settings.env", f"at most {_MAX_ENV} variables")
    env: dict[str, str] = {}
    for key, value in env_in.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            shown = str(key)[:64]
            raise InvalidArgument("settings.env", f"invalid variable name {shown!r}")
        if not isinstance(value, str) or "\x00" in value or len(value) > _MAX_ENV_VALUE_CHARS:
            raise InvalidArgument(
                f"settings.env.{key}",
                f"must be a string without NUL bytes, at most {_MAX_ENV_VALUE_CHARS} characters",
            )
        env[key] = value

    kind = settings.get("kind", "generic")
    if kind not in KINDS:
        raise InvalidArgument("settings.kind", f"must be one of {', '.join(KINDS)}")
    return {"command": list(command), "env": env, "kind": kind}


def validate_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime registry's hook: :func:`validate_acp_settings` with errors on ``settings_json``.

    The registry reports every runtime's settings problem on the request field
    ``settings_json``; the reason still names the setting (``command[1]: ...``).
    """
    try:
        return validate_acp_settings(settings)
    except InvalidArgument as exc:
        inner = exc.field.removeprefix("settings.")
        raise InvalidArgument("settings_json", f"{inner}: {exc.reason}") from None


@dataclass(frozen=True)
class AcpSettings:
    """An agent's checked ``acp`` settings, comparable to tell when they changed."""

    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    kind: str

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> AcpSettings:
        """Check ``settings`` (:func:`validate_acp_settings`) and freeze them."""
        clean = validate_acp_settings(settings)
        return cls(tuple(clean["command"]), tuple(sorted(clean["env"].items())), clean["kind"])

    @property
    def program(self) -> str:
        """The program's base name, the only part of the command put into messages."""
        # Arguments may hold secrets.
        return os.path.basename(self.command[0])
