"""Install the machine daemon as a systemd service (``join --install-service``).

:func:`install_service` writes ``agents-machine.service`` running
``agents-machine serve --data-dir <dir> --metrics <address>`` into a unit folder
(default ``/etc/systemd/system``) and, when ``systemctl`` is available, reloads
systemd and enables and starts the unit: ``Type=notify``, so that returns once
the daemon answers (or its start failed). The metrics address is the one ``join``
was given, else :data:`machine.config.SERVICE_METRICS_ADDRESS`, the port
deploy/prometheus/prometheus.yml scrapes. Tests point ``unit_dir`` at a temp
folder and pass ``systemctl=None``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from machine.config import SERVICE_METRICS_ADDRESS
from shared.atomic import write_atomic
from shared.errors import InvalidArgument, InvalidState

__all__ = [
    "DEFAULT_UNIT_DIR",
    "UNIT_NAME",
    "InstalledService",
    "default_executable",
    "install_service",
    "render_unit",
]

logger = logging.getLogger(__name__)

DEFAULT_UNIT_DIR: Final = Path("/etc/systemd/system")
UNIT_NAME: Final = "agents-machine.service"
_SYSTEMCTL_TIMEOUT: Final = 60.0
#: The unit's TimeoutStartSec: a start may read all of machine.db (quick_check).
_START_SECONDS: Final = 300
#: ``systemctl enable --now`` waits for READY=1 (Type=notify), or for systemd to
#: give up on the start after _START_SECONDS.
_START_TIMEOUT: Final = _START_SECONDS + 30.0


@dataclass(frozen=True)
class InstalledService:
    """Where the unit was written and whether systemd started it."""

    unit_path: Path
    started: bool


def default_executable() -> Path:
    """The ``agents-machine`` script beside the running interpreter."""
    return Path(sys.executable).parent / "agents-machine"


def _quote(value: str, field: str) -> str:
    # systemd splits ExecStart like a shell but with its own rules: double-quote
    # each word, escape backslashes and quotes, and double '%' (a specifier).
    if any(ch in value for ch in "\n\r\0"):
        raise InvalidArgument(field, "must not contain newlines or NUL")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{escaped}"'


def render_unit(
    *,
    executable: Path,
    data_dir: Path,
    user: str | None = None,
    metrics_address: str = SERVICE_METRICS_ADDRESS,
    extra_args: tuple[str, ...] = (),
) -> str:
    """Return the text of the systemd unit for ``agents-machine serve``."""
    words = [
        _quote(str(executable), "executable"),
        "serve",
        "--data-dir",
        _quote(str(data_dir), "data_dir"),
        "--metrics",
        _quote(metrics_address, "metrics_address"),
        *(_quote(a, "extra_args") for a in extra_args),
    ]
    lines = [
        "[Unit]",
        "Description=Agents machine daemon",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        # READY=1 once the database is open and the socket answers, watchdog
        # pings from the event loop (docs/machine.md, "Under systemd").
        "Type=notify",
        "NotifyAccess=main",
        f"TimeoutStartSec={_START_SECONDS}",
        "WatchdogSec=30s",
        f"ExecStart={' '.join(words)}",
        "Restart=on-failure",
        "RestartSec=2",
        # Files the daemon makes are private (keys, database) whatever the umask.
        "UMask=0077",
        "NoNewPrivileges=yes",
        # Hardening that leaves the file system and the account's own powers
        # alone: this unit runs in whatever account joined, with agents working
        # in folders we do not know, so ProtectSystem=, ReadWritePaths= and an
        # empty CapabilityBoundingSet= belong to the reviewed unit in deploy/
        # only. systemd-analyze security: 7.0 (9.4 without these lines).
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "LockPersonality=yes",
        "KeyringMode=private",
        "SystemCallArchitectures=native",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=30",
    ]
    if user:
        if not user.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InvalidArgument("user", f"not a user name: {user!r}")
        lines.append(f"User={user}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def _run(systemctl: str, *args: str, timeout: float = _SYSTEMCTL_TIMEOUT) -> None:
    cmd = [systemctl, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InvalidState("systemd", f"{' '.join(cmd)} failed: {e}") from None
    if done.returncode != 0:
        err = (done.stderr or done.stdout).strip().splitlines()
        raise InvalidState(
            "systemd", f"{' '.join(cmd)} exited {done.returncode}: {err[-1] if err else ''}"
        )


def install_service(
    *,
    data_dir: Path,
    unit_dir: Path = DEFAULT_UNIT_DIR,
    executable: Path | None = None,
    user: str | None = None,
    metrics_address: str = SERVICE_METRICS_ADDRESS,
    systemctl: str | None = "",
    unit_name: str = UNIT_NAME,
) -> InstalledService:
    """Write the unit into ``unit_dir`` and start it with systemctl when there is one.

    ``systemctl=""`` (the default) looks ``systemctl`` up on PATH; ``None``
    never runs it (the unit is only written). A unit folder we cannot write
    raises InvalidState with the path, so the CLI can say "run as root".
    """
    if "/" in unit_name or not unit_name.endswith(".service"):
        raise InvalidArgument("unit_name", "must be a file name ending in .service")
    text = render_unit(
        executable=(executable or default_executable()).absolute(),
        data_dir=data_dir.absolute(),
        user=user,
        metrics_address=metrics_address,
    )
    path = unit_dir / unit_name
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode(), mode=0o644)
    except OSError as e:
        raise InvalidState(
            str(unit_dir), f"cannot write the systemd unit (run as root?): {e.strerror}"
        ) from None
    logger.info("wrote systemd unit %s", path)
    tool = shutil.which("systemctl") if systemctl == "" else systemctl
    if not tool:
        logger.warning("systemctl not found: %s written but not started", path)
        return InstalledService(unit_path=path, started=False)
    _run(tool, "daemon-reload")
    _run(tool, "enable", "--now", unit_name, timeout=_START_TIMEOUT)
    logger.info("started %s", unit_name)
    return InstalledService(unit_path=path, started=True)
