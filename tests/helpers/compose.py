"""deploy/compose.yaml read as Docker Compose reads it, and its services run as
local processes (there is no Docker here).

What Docker provides is swapped for a local equivalent; everything else (each
service's command, its environment, the order depends_on gives) is the file's:

- the image's executables are the venv's: ``PATH`` starts with the venv's bin;
- each named volume is a folder, and ``HOME`` is the one mounted at ``/root``
  (the image's home), else a folder of the service's own;
- the service names and ``0.0.0.0`` are ``127.0.0.1``, and each port the file
  names is a free port of 127.0.0.1 (tests never bind a fixed port).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests.helpers.moto_server import free_port

__all__ = [
    "COMPOSE",
    "LocalService",
    "LocalStack",
    "interpolate",
    "load_compose",
    "one_shots",
    "start_order",
]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
VENV_BIN = Path(sys.executable).parent
#: HOME of the image the daemons run in (python:3.11-slim runs as root).
IMAGE_HOME = "/root"

#: ``$$`` or ``${NAME:-default}``: the only interpolations the file may use.
_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+):-([^}]*)\}")


def load_compose(path: Path = COMPOSE) -> dict[str, Any]:
    """The file as YAML, anchors and merge keys resolved (as compose does)."""
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), path
    return loaded


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation: ``$$`` is ``$``; ``${NAME:-default}`` is NAME from
    ``env`` (the shell that runs ``docker compose``), or the default when it is
    unset or empty. Any other ``$`` raises ValueError: compose would fill it in
    from that shell, not from the container's environment."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1)) or match.group(2)

    rest = _INTERPOLATION.sub("", text)
    if "$" in rest:
        raise ValueError(f"a '$' compose would interpolate from the host: {text!r}")
    return _INTERPOLATION.sub(value, text)


def _depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """depends_on as {service: condition} (the list form means service_started)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def start_order(services: Mapping[str, Any]) -> list[str]:
    """The services in an order depends_on allows (by name among the ready ones)."""
    waiting = {name: set(_depends_on(spec)) for name, spec in services.items()}
    order: list[str] = []
    while waiting:
        ready = sorted(name for name, deps in waiting.items() if deps <= set(order))
        assert ready, f"depends_on has a cycle or names an unknown service: {waiting}"
        order.append(ready[0])
        del waiting[ready[0]]
    return order


def one_shots(services: Mapping[str, Any]) -> set[str]:
    """The services another one waits for to finish (``service_completed_successfully``)."""
    return {
        dep
        for spec in services.values()
        for dep, condition in _depends_on(spec).items()
        if condition == "service_completed_successfully"
    }


def _argv(service: Mapping[str, Any]) -> list[str]:
    words: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        assert isinstance(value, list), f"{key}: use the exec (list) form, got {value!r}"
        words += [str(w) for w in value]
    return words


def _named_volumes(service: Mapping[str, Any]) -> dict[str, str]:
    """{mount point: volume name} for the service's named volumes."""
    mounts = {}
    for entry in service.get("volumes") or []:
        source, target = str(entry).split(":")[:2]
        assert not source.startswith((".", "/")), f"a bind mount needs the host: {entry}"
        mounts[target] = source
    return mounts


@dataclass
class LocalService:
    """One service as a local command."""

    name: str
    argv: list[str]
    env: dict[str, str]
    one_shot: bool
    """Others wait for it to exit 0; else it runs until stopped."""


class LocalStack:
    """The file's services, ready to run under ``root`` (see the module doc)."""

    def __init__(self, compose: Mapping[str, Any], root: Path, host_env: Mapping[str, str]):
        self.services: Mapping[str, Any] = compose["services"]
        self.order = start_order(self.services)
        self._one_shots = one_shots(self.services)
        self._host_env = dict(host_env)
        self.root = root
        # Short folder names: the machine's socket lives in one, under 100 bytes.
        self.volumes = {name: root / f"v{i}" for i, name in enumerate(compose["volumes"])}
        for folder in self.volumes.values():
            folder.mkdir(parents=True)
        names = "|".join(re.escape(name) for name in self.services)
        self._host_port = re.compile(rf"(?<![\w.-])(?:{names}|0\.0\.0\.0)(?=:\d)")
        self._host_flag = re.compile(
            rf"(--advertise-host|--server-name|-H)(\s+|=)(?:{names}|0\.0\.0\.0)(?![\w.-])"
        )
        self.ports = {port: free_port() for port in self._ports()}

    def _ports(self) -> set[int]:
        """Every port the file names: exposed, published, or in a HOST:PORT."""
        found: set[int] = set()
        for name, spec in self.services.items():
            found.update(int(p) for p in spec.get("expose") or [])
            found.update(int(str(p).rsplit(":", 1)[-1]) for p in spec.get("ports") or [])
            for text in self._texts(name):
                found.update(int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", self._hosts(text)))
        return found

    def _texts(self, name: str) -> list[str]:
        spec = self.services[name]
        env = spec.get("environment") or {}
        return [interpolate(t, self._host_env) for t in [*_argv(spec), *map(str, env.values())]]

    def _hosts(self, text: str) -> str:
        text = self._host_port.sub("127.0.0.1", text)
        text = self._host_flag.sub(r"\1\g<2>127.0.0.1", text)
        return text.replace("0.0.0.0", "127.0.0.1")

    def volume(self, name: str) -> Path:
        """The folder standing for the named volume ``name``."""
        return self.volumes[name]

    def local(self, name: str, text: str) -> str:
        """``text`` (interpolated already) as service ``name`` sees it here."""
        text = self._hosts(text)
        for port, local in self.ports.items():
            text = re.sub(rf"(?<![\w.]){port}(?![\w.])", str(local), text)
        mounts = _named_volumes(self.services[name])
        for target in sorted(mounts, key=len, reverse=True):
            folder = str(self.volumes[mounts[target]])
            text = re.sub(rf"(?<![\w.-]){re.escape(target)}(?![\w.-])", folder, text)
        return text

    def service(self, name: str) -> LocalService:
        """Service ``name`` as a local command with its environment."""
        spec = self.services[name]
        mounts = _named_volumes(spec)
        home = self.volumes[mounts[IMAGE_HOME]] if IMAGE_HOME in mounts else self.root / f"h-{name}"
        home.mkdir(exist_ok=True)
        env = dict(self._host_env)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        env["HOME"] = str(home)
        for key, value in (spec.get("environment") or {}).items():
            env[key] = self.local(name, interpolate(str(value), self._host_env))
        argv = [self.local(name, interpolate(w, self._host_env)) for w in _argv(spec)]
        return LocalService(name, argv, env, one_shot=name in self._one_shots)

    def start(self, service: LocalService, log: Path) -> subprocess.Popen[bytes]:
        """Start a long-running service with its output in ``log``."""
        with log.open("ab") as out:
            return subprocess.Popen(
                service.argv, env=service.env, cwd=self.root, stdout=out, stderr=subprocess.STDOUT
            )

    def run(self, service: LocalService, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a one-shot service to its end."""
        return subprocess.run(
            service.argv,
            env=service.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
