"""What every ``agents-control`` verb module shares: the handler context, the
Admin client a verb dials, and the output helpers.

Only the modules of ``controlplane.cli`` print.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from controlplane.cli.client import AdminClient
from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_ca_cert
from shared.cli import Column, ExitCode, Output
from shared.errors import ConfigError

__all__ = ["PROG", "Ctx", "admin_client", "emit", "listing", "once", "record"]

logger = logging.getLogger(__name__)

PROG = "agents-control"


def _address(cfg: ControlConfig) -> str:
    if cfg.address:
        return cfg.address
    try:
        info = json.loads(cfg.serve_path.read_text())
        return str(info["public"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            "address", f"no --address and no running daemon found ({cfg.serve_path})"
        ) from None


def admin_client(cfg: ControlConfig) -> AdminClient:
    """The Admin client, at ``--address`` or the running daemon's (serve.json),
    with the admin credential."""
    if not cfg.credential:
        raise ConfigError(
            "credential",
            "give --credential-file (or --credential), or set AGENTS_CONTROL_CREDENTIAL_FILE"
            " (or AGENTS_CONTROL_CREDENTIAL)",
        )
    return AdminClient(_address(cfg), load_ca_cert(cfg.home), cfg.credential)


@dataclass
class Ctx:
    """What every handler gets: the arguments, the config, the output."""

    args: argparse.Namespace
    cfg: ControlConfig
    out: Output


def emit(ctx: Ctx, data: dict[str, Any], *text: str) -> int:
    """``data`` as JSON with --json, else the lines ``text``."""
    if ctx.out.as_json or not text:
        ctx.out.json(data)
    else:
        ctx.out.lines(*text)
    return ExitCode.OK


def once(ctx: Ctx, data: dict[str, Any], line: str, note: str) -> int:
    """What is shown once: ``data`` as JSON with --json, else ``line`` alone on stdout
    (so ``$(…)`` gets just that) and ``note``, what it is, on stderr."""
    emit(ctx, data, line)
    if not ctx.out.as_json:
        ctx.out.note(note)
    return ExitCode.OK


def record(ctx: Ctx, data: dict[str, Any]) -> int:
    """One record: JSON with --json, else ``field  value`` lines."""
    if ctx.out.as_json:
        ctx.out.json(data)
    else:
        ctx.out.detail((key, "-" if value is None else str(value)) for key, value in data.items())
    return ExitCode.OK


def listing(
    ctx: Ctx, key: str, items: list[dict[str, Any]], columns: list[Column], rows: list[list[str]]
) -> int:
    """Many records: ``{key: items}`` with --json, else a table of ``rows``."""
    if ctx.out.as_json:
        ctx.out.json({key: items})
    else:
        ctx.out.table(columns, rows)
    return ExitCode.OK
