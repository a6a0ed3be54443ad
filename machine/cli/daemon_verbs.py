"""``agents-machine serve``, ``status`` and ``check``: the daemon's own verbs.

``serve`` runs the daemon (a stand-alone machine started in a terminal first
makes its recovery key and prints it once); ``status`` shows its health and
counts; ``check`` runs a full integrity check of machine.db, here when the
daemon is not running (a damaged database keeps it from starting).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from machine.backups.service import BackupStatus
from machine.cli import backup
from machine.cli.client import DaemonNotRunning
from machine.cli.common import PROG, Ctx, call, human, show_record, when
from machine.config import MachineConfig
from machine.storage.faults import run_check
from shared.cli import ExitCode, bind_error
from shared.durations import format_duration
from shared.logs import setup_logging

if TYPE_CHECKING:
    from machine.daemon import HeldDataDir
    from shared.crypto import BoxKeyPair

__all__ = ["cmd_check", "cmd_serve", "cmd_status", "run_serve"]

logger = logging.getLogger(__name__)

# A backup status when the daemon has no backup service (``status`` still shows the rows).
_NO_BACKUPS = BackupStatus(
    target="",
    keep=0,
    last_backup_at=None,
    last_backup_id="",
    last_backup_bytes=0,
    next_run_at=0.0,
    last_check=None,
    recovery_key=False,
    warnings=(),
)


async def cmd_status(ctx: Ctx) -> int:
    """``status``: the daemon's health, counts and backups."""
    st = await call(ctx, lambda c: c.status())
    m = st.machine
    return show_record(
        ctx.out,
        st,
        lambda: ctx.out.detail(
            [
                ("version", st.version),
                ("data folder", m.data_dir),
                ("machine", f"{m.machine_id} ({'joined' if m.joined else 'stand-alone'})"),
                ("agents", f"{m.active_agents} active, {m.archived_agents} archived"),
                ("runs", f"{m.open_runs} open, {m.waiting_runs} waiting for a person"),
                ("runtimes", ", ".join(m.runtimes)),
                ("schema", str(m.schema_version)),
                *_backup_detail(st.backup or _NO_BACKUPS),
            ]
        ),
    )


def _backup_detail(b: BackupStatus) -> list[tuple[str, str]]:
    last = (
        f"{b.last_backup_id} at {when(b.last_backup_at)}, {human(b.last_backup_bytes)}"
        if b.last_backup_id
        else "none yet"
    )
    check = "not run since the daemon started"
    if b.last_check is not None:
        check = f"{'ok' if b.last_check.ok else 'FAILED'} at {when(b.last_check.at)}"
        if b.last_check.problem:
            check += f": {b.last_check.problem}"
    pairs = [
        ("backup target", f"{b.target} (keep {b.keep})"),
        ("last backup", last),
        ("next backup", when(b.next_run_at)),
        *_increments(b),
        ("restore check", check),
        ("recovery key", "yes" if b.recovery_key else "none"),
    ]
    return pairs + [("warning", w) for w in b.warnings]


def _increments(b: BackupStatus) -> list[tuple[str, str]]:
    """Continuous backups: how often, and the newest increment (what a disk lost now
    would lose is what changed since)."""
    if not b.increment_interval:
        return []
    every = f"every {format_duration(b.increment_interval)}"
    last = (
        f"newest {when(b.last_increment_at)}"
        if b.last_increment_at
        else "none since the last backup"
    )
    return [("increments", f"{every}; {last}")]


async def cmd_check(ctx: Ctx) -> int:
    """Full integrity check of machine.db: by the daemon, or here when it is not running
    (a damaged database keeps the daemon from starting)."""
    cfg = ctx.cfg
    try:
        reply = await call(ctx, lambda c: c.check_database())
        ok, problems, path = reply.ok, list(reply.problems), reply.path
    except DaemonNotRunning:
        if not cfg.db_path.exists():
            raise
        result = await asyncio.to_thread(run_check, cfg.db_path, full=True)
        ok, problems, path = result.ok, list(result.problems), str(cfg.db_path)
    if ctx.out.as_json:
        ctx.out.json({"ok": ok, "path": path, "problems": problems})
    elif ok:
        ctx.out.lines(f"{path}: ok")
    else:
        ctx.out.lines(
            f"{path}: damaged ({len(problems)} problem(s) found); first: {problems[0]}",
            "Keep a copy of the data folder, then restore machine.db from a backup",
            "or salvage it with `sqlite3 machine.db .recover` (docs/machine.md).",
        )
    return ExitCode.OK if ok else ExitCode.FAILED


def _first_start_recovery_key(cfg: MachineConfig, prog: str) -> None:
    """A stand-alone machine started in a terminal without a recovery key yet (its
    first start, normally) makes its recovery key pair and prints the private
    half, once, with how to keep it; the public half is kept only once printed.

    Under a service manager (stdout not a terminal) nothing is made: the private
    half would land in its journal, a log. ``status`` then warns, and
    ``backup recovery-key`` makes one. A joined machine uses its account's key.
    """
    from machine.backups.keys import has_standalone_recovery_key, new_standalone_recovery_key
    from machine.link import identity
    from shared.crypto import encode_private_key

    if not sys.stdout.isatty() or identity.is_joined(cfg.data_dir):
        return
    if has_standalone_recovery_key(cfg.data_dir):
        return

    def show(pair: BoxKeyPair) -> None:
        sys.stdout.write(
            "This machine's recovery key (first start):\n"
            f"{encode_private_key(pair.private_key)}\n"
            + "".join(f"{line}\n" for line in backup.recovery_key_note(prog))
        )
        sys.stdout.flush()

    new_standalone_recovery_key(cfg.data_dir, show)


def run_serve(cfg: MachineConfig, prog: str = PROG, held: HeldDataDir | None = None) -> int:
    """Run the daemon on ``cfg`` until it stops, logging to stderr; ``prog`` is the
    command its first start suggests; ``held``: the data folder's lock, when the
    caller holds it (``join``)."""
    from machine.daemon import serve

    # Replaces the silence main() set up for the verbs.
    setup_logging(cfg.log_level, cfg.log_format, native=True)
    os.umask(0o077)  # everything the daemon creates is private to its user
    try:
        asyncio.run(serve(cfg, first=lambda: _first_start_recovery_key(cfg, prog), held=held))
    except (OSError, RuntimeError) as e:
        raise bind_error(e) or e from None
    return ExitCode.OK


def cmd_serve(ctx: Ctx) -> int:
    """``serve``: run the daemon."""
    return run_serve(ctx.cfg, ctx.prog)
