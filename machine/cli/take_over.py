"""``agents-machine backup take-over``: a fresh stand-alone box becomes a lost one.

A backup restored onto another machine brings agents it can read but never run
(their origin is the lost machine). For a joined machine, the repair join makes
the new box that machine (the control plane says so). A stand-alone machine
has no one to say so but its operator, who proves it with the lost machine's
recovery key: :func:`take_over` restores the backup and adopts the lost
machine's id in the restore's one transaction
(:func:`machine.link.machine_ids.adopt_machine_id`), so from the next start the
box *is* that machine: its agents are its own (archived, as every restore
leaves them; unarchived, they run) and its backups go on under its name, in the
same bucket prefix or folder if the operator points ``backup_target`` there.

In the CLI's room, as :mod:`machine.cli.after_join`: it opens the whole machine
in this process, with the daemon stopped (the verb holds the data folder's lock,
as ``join`` does; a running daemon would keep serving under the old id), then
backs up at once under this box's keys. Refused on a joined machine, on one that
holds agents of its own (a take-over is for a fresh box: merging two machines'
agents under one id is not one), and for a backup of this machine itself
(``backup restore`` brings its own agents back).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

from machine.api import codec
from machine.backups.keys import has_standalone_recovery_key, keep_standalone_recovery_key
from machine.backups.reader import key_refused
from machine.backups.transfer import InResult

# The same readings of --from, --recovery-key and --at as `backup restore`.
from machine.cli.backup import _arrived, _at, _from_dir, _recovery, settings_lines
from machine.cli.common import Ctx, show
from machine.config import MachineConfig
from machine.link import identity
from machine.link.machine_ids import adopt_machine_id
from shared.atomic import ensure_private_dir
from shared.cli import UsageError, message_dict
from shared.crypto import BoxKeyPair
from shared.errors import AgentsError, InvalidState
from shared.progress import Progress

__all__ = ["TakeOver", "backup_take_over", "take_over"]

logger = logging.getLogger(__name__)

_STOP_FIRST = "stop the daemon first (`systemctl stop agents-machine`, or end `serve`)"


@dataclass(frozen=True)
class TakeOver:
    """What a take-over did."""

    machine_id: str
    """The lost machine's id: this machine's from its next start."""
    previous_id: str
    """This box's id before (still one of its own)."""
    result: InResult
    recovery_key_kept: bool
    """The recovery key given now seals this machine's backups (it had none)."""


def _own_agents(conn: sqlite3.Connection, own: frozenset[str]) -> int:
    marks = ",".join("?" * len(own))
    row = conn.execute(
        f"SELECT COUNT(*) FROM agents WHERE origin_machine IN ({marks})", sorted(own)
    ).fetchone()
    return int(row[0])


def _refuse_own_agents(count: int) -> None:
    if count:
        raise InvalidState(
            "take-over",
            f"this machine holds {count} agents of its own; a take-over makes a fresh"
            " machine the lost one (restore onto this one with `backup restore` instead)",
        )


async def take_over(
    config: MachineConfig,
    *,
    source: str,
    recovery: BoxKeyPair,
    backup_id: str | None = None,
    at: float | None = None,
) -> TakeOver:
    """Restore the backup in ``source`` (a backup folder or ``s3://`` prefix: the
    newest, ``backup_id`` or the point at ``at``) opened with ``recovery``, and
    adopt its machine's id in the same transaction."""
    # Imported here: the other verbs never open the machine in this process.
    from machine.app import open_machine

    if identity.is_joined(config.data_dir):
        raise InvalidState(
            "take-over",
            "this machine is joined to a control plane: replace a lost joined machine with"
            " `agents-control machine repair` and a join with --recovery-key",
        )
    # Opened on a scratch backup folder: this run reads ``source`` only, and the
    # configured target (perhaps the lost machine's own prefix, whose owner is the
    # id adopted here) is first used under the adopted id, after the restart.
    scratch = Path(tempfile.mkdtemp(prefix=".take-over-", dir=config.data_dir))
    quiet = dataclasses.replace(
        config, background_loops=False, backup_target=None, backup_dir=scratch
    )
    try:
        async with open_machine(quiet) as machine:
            own = machine.ids.own
            previous = machine.ids.canonical
            async with machine.backups_at(source) as engine:
                lost = engine.machine_id
                if lost == previous:
                    raise InvalidState(
                        "take-over",
                        f"this machine is {lost} already (it took it over, or made these"
                        " backups): `backup restore` brings back what it lacks",
                    )
                if lost in own:
                    raise InvalidState(
                        "take-over",
                        f"{source} holds backups of {lost}, one of this machine's own ids:"
                        " `backup restore` brings its agents back",
                    )
                _refuse_own_agents(await machine.db.read(lambda c: _own_agents(c, own)))

                def adopt(conn: sqlite3.Connection) -> None:
                    # Again inside the transaction: an agent made since the look above.
                    _refuse_own_agents(_own_agents(conn, own))
                    adopt_machine_id(conn, lost)

                with key_refused(recovery):
                    result = await machine.require_backups().restore(
                        backup_id, at=at, recovery=recovery, engine=engine, in_commit=adopt
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    kept = False
    if not has_standalone_recovery_key(config.data_dir):
        # The key the operator holds keeps opening this machine's backups.
        keep_standalone_recovery_key(config.data_dir, recovery.public_key)
        kept = True
    logger.info(
        "took over machine %s (was %s): %d agents restored", lost, previous, len(result.restored)
    )
    return TakeOver(lost, previous, result, kept)


async def backup_take_over(ctx: Ctx) -> int:
    """``backup take-over [ID] --from SRC --recovery-key FILE``."""
    from machine.cli.after_join import backup_after_repair
    from machine.daemon import hold_data_dir

    args = ctx.args
    source, recovery, at = _from_dir(args), _recovery(ctx), _at(ctx)
    if not source:
        raise UsageError("take-over: --from names the lost machine's backups (a folder or s3://…)")
    if recovery is None:
        raise UsageError(
            "take-over: --recovery-key FILE: the lost machine's recovery key proves it is yours"
        )
    cfg = ctx.cfg
    data_dir: Path = cfg.data_dir
    try:
        ensure_private_dir(data_dir)  # a fresh box: the take-over makes its data folder
    except OSError as e:
        raise UsageError(f"take-over: cannot use {data_dir} as the data folder: {e}") from None
    with hold_data_dir(data_dir, "backup take-over", _STOP_FIRST):
        with Progress("taking over", quiet=ctx.out.as_json):
            done = await take_over(
                cfg, source=source, recovery=recovery, backup_id=args.backup_id or None, at=at
            )
        try:
            made = await backup_after_repair(cfg)
            backed_up = f"backup {made.backup_id} made under this box's keys"
            backup_id = made.backup_id
        except AgentsError as e:
            backed_up = (
                f"warning: the first backup under this box's keys failed ({e.message}); the"
                f" restored agents are in place: run `{ctx.prog} backup now` once the daemon runs"
            )
            backup_id = ""
    result = done.result
    lines = [
        f"this machine is now {done.machine_id} (it was {done.previous_id})",
        *_arrived(
            ctx,
            f"restored {len(result.restored)} agents (archived; `{ctx.prog} agent unarchive ID`"
            " to run one once the daemon runs)",
            result,
        ),
    ]
    if done.recovery_key_kept:
        lines.append("backups from now on are sealed to the recovery key given")
    else:
        lines.append(
            "backups stay sealed to the recovery key this box made before, not the one given:"
            " keep that one too"
        )
    lines += settings_lines(result.settings)
    lines.append(backed_up)
    lines.append(f"start the daemon: `{ctx.prog} serve`")
    # The restore's own fields as `backup restore --json` prints them, and the take-over's.
    data = {
        **(message_dict(codec.restore_result_to_pb(result)) if ctx.out.as_json else {}),
        "machine_id": done.machine_id,
        "previous_machine_id": done.previous_id,
        "recovery_key_kept": done.recovery_key_kept,
        "backup_id": backup_id,
    }
    return show(ctx.out, data, lambda: ctx.out.lines(*lines))
