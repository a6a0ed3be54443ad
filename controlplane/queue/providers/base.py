"""The provider interface, provider settings, and the one place that picks a provider.

Settings arrive as JSON from an admin (``machine provider set``) and are
checked field by field here before anything is stored. Secret fields (the
EC2 secret key) are kept only in the sealed provider record; ``public()``
gives what a listing or a log may show.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from shared.errors import InvalidArgument

__all__ = [
    "PROVIDER_NAMES",
    "Ec2Settings",
    "LocalSettings",
    "MachineProvider",
    "ProviderSettings",
    "ProviderState",
    "ProviderStatus",
    "parse_settings",
]

logger = logging.getLogger(__name__)

PROVIDER_NAMES: Final = ("local", "ec2")
_MAX_ARGS: Final = 64
_MAX_ARG: Final = 4096
_ENV_NAME: Final = re.compile(r"\A[A-Z_][A-Z0-9_]{0,63}\Z")
_INSTANCE_ID: Final = re.compile(r"\Ai-[0-9a-f]{8,17}\Z")
_REGION: Final = re.compile(r"\A[a-z]{2}(-[a-z]+)+-\d{1,2}\Z")
_ACCESS_KEY: Final = re.compile(r"\A[A-Z0-9]{16,128}\Z")


class ProviderState(enum.StrEnum):
    """What a provider says of its machine."""

    RUNNING = "running"
    STARTING = "starting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProviderStatus:
    """A provider's answer: the machine's state and a short reason for people."""

    state: ProviderState
    detail: str = ""


class MachineProvider(Protocol):
    """Starts one stopped machine and says what state it is in.

    ``start`` is idempotent: starting a machine that runs or is starting
    changes nothing. Both methods raise ProviderError when the provider
    refuses (bad credentials, no such instance) and ProviderUnavailable when
    it cannot be reached; neither ever carries a secret in its message.
    """

    name: str

    async def start(self) -> ProviderStatus:
        """Ask for the machine to run; return the state right after asking."""
        ...

    async def status(self) -> ProviderStatus:
        """The machine's current state, as the provider sees it."""
        ...

    async def close(self) -> None:
        """Release clients and watchers (a started machine keeps running)."""
        ...


@dataclass(frozen=True)
class LocalSettings:
    """``local``: a command run on the control plane's host, e.g. ``agents-machine serve``."""

    command: tuple[str, ...]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment; the command otherwise gets only PATH, HOME and LANG."""

    def public(self) -> dict[str, Any]:
        return {"command": list(self.command), "cwd": self.cwd, "env": sorted(self.env)}

    def stored(self) -> dict[str, Any]:
        return {"command": list(self.command), "cwd": self.cwd, "env": dict(self.env)}


@dataclass(frozen=True)
class Ec2Settings:
    """``ec2``: an instance started and described through the EC2 API."""

    instance_id: str
    region: str
    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)

    def public(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "region": self.region,
            "endpoint_url": self.endpoint_url,
            "access_key_id": self.access_key_id,
            "secret_access_key": "(set)" if self.secret_access_key else None,
        }

    def stored(self) -> dict[str, Any]:
        return {**self.public(), "secret_access_key": self.secret_access_key}


ProviderSettings = LocalSettings | Ec2Settings


def _bad(name: str, key: str, reason: str) -> InvalidArgument:
    return InvalidArgument(f"settings.{key}", f"{reason} (provider {name})")


def _optional_str(name: str, data: Mapping[str, Any], key: str, limit: int = 2048) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        raise _bad(name, key, f"must be a string of 1 to {limit} characters")
    return value


def _check_keys(name: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise _bad(name, unknown[0], f"unknown setting; known: {', '.join(sorted(allowed))}")


def _parse_local(data: Mapping[str, Any]) -> LocalSettings:
    _check_keys("local", data, {"command", "cwd", "env"})
    command = data.get("command")
    if (
        not isinstance(command, list)
        or not 1 <= len(command) <= _MAX_ARGS
        or not all(isinstance(a, str) and a and len(a) <= _MAX_ARG for a in command)
        or any("\x00" in a for a in command)
    ):
        raise _bad("local", "command", f"must be a list of 1 to {_MAX_ARGS} non-empty strings")
    cwd = _optional_str("local", data, "cwd")
    if cwd is not None and not Path(cwd).is_absolute():
        raise _bad("local", "cwd", "must be an absolute path")
    env = data.get("env", {})
    if not isinstance(env, dict) or len(env) > 64:
        raise _bad("local", "env", "must be an object of at most 64 variables")
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise _bad("local", "env", f"{str(key)[:64]!r} is not a variable name")
        if not isinstance(value, str) or len(value) > _MAX_ARG or "\x00" in value:
            raise _bad("local", "env", f"{key}: value must be a string of at most {_MAX_ARG}")
    return LocalSettings(tuple(command), cwd, dict(env))


def _parse_ec2(data: Mapping[str, Any]) -> Ec2Settings:
    _check_keys(
        "ec2",
        data,
        {"instance_id", "region", "endpoint_url", "access_key_id", "secret_access_key"},
    )
    instance = data.get("instance_id")
    if not isinstance(instance, str) or not _INSTANCE_ID.match(instance):
        raise _bad("ec2", "instance_id", "must be an instance id such as i-0123456789abcdef0")
    region = data.get("region")
    if not isinstance(region, str) or not _REGION.match(region):
        raise _bad("ec2", "region", "must be a region such as eu-central-1")
    endpoint = _optional_str("ec2", data, "endpoint_url")
    if endpoint is not None and not endpoint.startswith(("https://", "http://")):
        raise _bad("ec2", "endpoint_url", "must be an http(s) URL")
    key_id = _optional_str("ec2", data, "access_key_id", 128)
    secret = _optional_str("ec2", data, "secret_access_key", 128)
    if key_id is not None and not _ACCESS_KEY.match(key_id):
        raise _bad("ec2", "access_key_id", "must be an AWS access key id")
    if (key_id is None) != (secret is None):
        raise _bad("ec2", "secret_access_key", "access_key_id and secret_access_key go together")
    return Ec2Settings(instance, region, endpoint, key_id, secret)


def parse_settings(name: str, data: object) -> ProviderSettings:
    """Check an admin's provider settings; InvalidArgument naming the field otherwise."""
    if name not in PROVIDER_NAMES:
        raise InvalidArgument(
            "provider", f"{name[:32]!r} is not one of {', '.join(PROVIDER_NAMES)}"
        )
    if not isinstance(data, dict):
        raise InvalidArgument("settings", f"must be a JSON object (provider {name})")
    return _parse_local(data) if name == "local" else _parse_ec2(data)
