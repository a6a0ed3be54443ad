"""What every ``agents-machine`` command module shares: the handler context, the
one way a handler calls the daemon, and the output helpers.

Only the modules of ``machine.cli`` print.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import shlex
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, Any, TypeVar

from machine.api import codec
from machine.cli.client import MachineClient
from machine.config import MachineConfig
from shared.cli import ExitCode, Output, UsageError, message_dict, table_time
from shared.progress import human

__all__ = [
    "PROG",
    "Ctx",
    "build_config",
    "call",
    "human",
    "open_regular",
    "prog_of",
    "show",
    "show_record",
    "when",
    "wire",
]

logger = logging.getLogger(__name__)

PROG = "agents-machine"

_T = TypeVar("_T")


def build_config(args: argparse.Namespace, env: dict[str, str], home: Path) -> MachineConfig:
    """The daemon's config from the parsed flags, the environment and the file."""
    flags = {
        "data_dir": args.data_dir,
        "socket_path": getattr(args, "socket", None),
        "tcp_address": getattr(args, "tcp", None),
        "metrics_address": getattr(args, "metrics", None),
        "prompt_limit": getattr(args, "prompt_limit", None),
        "attachment_limit": getattr(args, "attachment_limit", None),
        "background_loops": False if getattr(args, "no_background", False) else None,
        "shutdown_grace_seconds": getattr(args, "grace", None),
        "log_level": getattr(args, "log_level", None),
        "log_format": getattr(args, "log_format", None),
    }
    config_file = getattr(args, "config", None)
    return MachineConfig.build(
        flags=flags,
        env=env,
        home=home,
        config_file=Path(config_file) if config_file else None,
    )


def prog_of(args: argparse.Namespace | None) -> str:
    """The command as typed so far: with ``--data-dir``/``--socket`` when given,
    so a suggested command reaches the same daemon."""
    words = [PROG]
    for flag, value in (("--data-dir", getattr(args, "data_dir", None)),
                        ("--socket", getattr(args, "socket", None))):  # fmt: skip
        if value:
            words += [flag, shlex.quote(str(value))]
    return " ".join(words)


@dataclass
class Ctx:
    """What every handler gets: the parsed arguments, the environment, the output."""

    args: argparse.Namespace
    env: dict[str, str]
    out: Output
    home: Path = field(default_factory=Path.home)

    @property
    def prog(self) -> str:
        """The command to suggest (see :func:`prog_of`)."""
        return prog_of(self.args)

    @cached_property
    def cfg(self) -> MachineConfig:
        """The config, built on first use (``join`` picks its data folder first)."""
        return build_config(self.args, self.env, self.home)


async def call(ctx: Ctx, rpc: Callable[[MachineClient], Awaitable[_T]]) -> _T:
    """Dial the daemon, make one call, hang up: what most verbs do."""
    async with MachineClient(ctx.cfg) as client:
        return await rpc(client)


def wire(record: object) -> dict[str, Any]:
    """A record the client returned, as the JSON the daemon's reply makes."""
    return message_dict(codec.message_of(record))


def show(out: Output, data: dict[str, Any], text: Callable[[], None]) -> int:
    """Print ``data`` for --json, else call ``text``; exit 0."""
    if out.as_json:
        out.json(data)
    else:
        text()
    return ExitCode.OK


def show_record(out: Output, record: object, text: Callable[[], None]) -> int:
    """:func:`show` for one record: its reply's JSON, or ``text``."""
    return show(out, wire(record) if out.as_json else {}, text)


def when(seconds: float | None) -> str:
    """A time in Unix seconds as every table shows one (:func:`shared.cli.table_time`:
    ``2026-12-05 09:40:12Z``), or "-" when not set."""
    return table_time(seconds)


def parse_when(text: str, option: str = "--at") -> float:
    """A moment as the CLI takes it: RFC 3339 (``2026-12-05T09:41:20Z``, an offset),
    a time as tables show one (``2026-12-05 09:41:20Z``), or a time without a zone,
    taken as local time (``2026-12-05 09:41[:20]``); Unix seconds."""
    raw = text.strip()
    try:
        moment = dt.datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"{option}: {text[:40]!r} is not a time",
            "2026-12-05T09:41:20Z, or a time as `backup list` shows one: 2026-12-05 09:41:20Z",
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # no zone given: local time
    return moment.timestamp()


def open_regular(path: Path, what: str, kind: str = "") -> tuple[IO[bytes], int]:
    """``path`` open for reading and its size, or UsageError naming ``what``: it
    must be a regular file (a device or a pipe never ends). Opened without
    blocking (opening a FIFO waits for a writer), then checked: what is checked
    is what was opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise UsageError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a folder too (fdopen would refuse it)
        os.close(fd)
        raise UsageError(f"{what}: {path} is not a regular file{kind}")
    return os.fdopen(fd, "rb"), info.st_size
