"""``agents-machine join``: join a control plane, then serve.

The data folder's lock (the one the daemon takes) is taken first and held
until the daemon this command runs stops: a daemon serving the folder refuses
the join before the token is used, and nothing can start on the folder
halfway. A fresh data folder spends the token and, with ``--recovery-key``
after a repair join, restores the machine's newest backup and backs it up at
once under this box's keys. A joined folder whose restore did not finish
restores now or starts without it, and one whose join is not confirmed yet
(its daemon never connected) starts, when given the same token (neither uses
the token again); any other joined folder re-pairs, or with ``--as-new``
joins again as a new machine. Then the systemd unit is installed
(``--install-service``) or the daemon serves here. docs/join.md lists the
states an interrupted join leaves and the command that goes on from each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

from machine.cli.common import PROG, Ctx
from machine.cli.daemon_verbs import run_serve
from machine.config import SERVICE_METRICS_ADDRESS, server_data_dir
from shared.atomic import ensure_private_dir
from shared.cli import ExitCode, UsageError
from shared.errors import AgentsError, InvalidArgument, InvalidState

if TYPE_CHECKING:
    from machine.daemon import HeldDataDir
    from machine.link.join import JoinResult
    from shared.crypto import BoxKeyPair

__all__ = ["cmd_join"]

logger = logging.getLogger(__name__)

#: What a join refused by a daemon on its folder says to do.
_STOP_FIRST: Final = (
    "stop it first (`systemctl stop agents-machine` when it runs as the service), then run"
    " the same join command again; the token was not used"
)


def cmd_join(ctx: Ctx) -> int:
    """``join ADDRESS --token T --ca-hash H``: join (or re-pair), maybe restore, serve."""
    args = ctx.args
    if not args.data_dir:
        # `join` installs a server: its folder is the server's, whatever else exists.
        args.data_dir = str(server_data_dir(ctx.home))
    cfg = ctx.cfg
    if args.recovery_key and args.no_restore:
        raise UsageError("join: --recovery-key restores the machine's backup; drop --no-restore")
    if args.recovery_key == "":  # "$KEY" of an unset variable: never "no key" instead
        raise UsageError("--recovery-key: empty; name the file that holds the key")
    with _holding(cfg.data_dir) as held:
        _join_here(ctx)
        if not args.install_service:
            return run_serve(cfg, held=held)
    # Released: the daemon systemd starts takes the lock.
    return _install_service(ctx)


@contextlib.contextmanager
def _holding(data_dir: Path) -> Iterator[HeldDataDir]:
    """The data folder's lock for the whole join (see the module doc). A folder made
    here for the lock goes again when the join fails without writing into it."""
    from machine.daemon import hold_data_dir

    made = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    try:
        ensure_private_dir(data_dir)
    except OSError as e:
        raise InvalidState(f"join {data_dir}", f"cannot use it as the data folder: {e}") from None
    with hold_data_dir(data_dir, "join", _STOP_FIRST) as held:
        try:
            yield held
        except BaseException:
            if made:
                _remove_unused(data_dir, made)
            raise


def _remove_unused(data_dir: Path, made: list[Path]) -> None:
    """Remove the folders ``made`` (``data_dir`` first) when they hold nothing but the lock."""
    from machine.daemon import LOCK_FILE

    # Still under the lock: a daemon starting meanwhile finds it held, or (once
    # unlinked) makes a lock file of its own, and then the folder stays.
    if os.listdir(data_dir) != [LOCK_FILE]:
        return
    (data_dir / LOCK_FILE).unlink()
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def _join_here(ctx: Ctx) -> None:
    """What ``join`` does on its data folder before the daemon starts (under its lock)."""
    from machine.link import identity
    from machine.link.deliveries import crash_after
    from shared.recovery_key import read_recovery_key

    args, cfg = ctx.args, ctx.cfg
    if identity.is_joined(cfg.data_dir):
        if identity.restore_pending(cfg.data_dir):
            _finish_join_restore(ctx)
        elif not _same_join_again(ctx):
            _re_pair(ctx)  # refuses --recovery-key: it restores nothing there
        return
    # Read before the join: a bad key file must not cost the one-time token.
    recovery = (
        read_recovery_key(Path(args.recovery_key), warn=ctx.out.note) if args.recovery_key else None
    )
    if args.as_new:
        raise UsageError("join: --as-new is for a data folder that was joined; this one is not")
    result = _join(ctx, recovery.public_key if recovery is not None else b"")
    ctx.out.lines(f"joined as machine {result.machine_id} (account {result.account_id})")
    if (crash := crash_after(cfg.crash_after_join, "a join's commit")) is not None:
        crash()
    if recovery is not None:
        _restore_after_join(ctx, recovery, first=True)


def _same_join_again(ctx: Ctx) -> bool:
    """The join command run again (its token) on a folder whose join the control plane
    has not confirmed (its daemon never connected): say so; the daemon starts next
    and its first connection confirms the join. False for anything else."""
    from machine.link import identity
    from machine.link.join import validate_token

    args, cfg = ctx.args, ctx.cfg
    join = identity.unconfirmed_join(cfg.data_dir)
    if join is None or args.as_new or validate_token(args.token) != join.token_id:
        return False
    ctx.out.lines(
        f"machine {join.machine_id} is joined already and has not connected to the control"
        " plane since: starting it (the token is not used again). If the control plane"
        " rolled this join back meanwhile (the daemon's log says so), stop the daemon and"
        " run this command again with --as-new"
    )
    return True


def _restore_after_join(ctx: Ctx, recovery: BoxKeyPair, *, first: bool = False) -> None:
    """Restore the machine's newest backup after a repair join; say what came back.
    ``first``: right after the join (not its rerun)."""
    from machine.cli.after_join import restore_after_join
    from machine.core.agents import SessionHomes
    from machine.link.deliveries import crash_after

    cfg = ctx.cfg
    try:
        done = asyncio.run(
            restore_after_join(
                data_dir=cfg.data_dir,
                db_path=cfg.db_path,
                attachments_dir=cfg.attachments_dir,
                recovery=recovery,
                after_load=crash_after(cfg.crash_in_transfer_after, "agents loaded in a restore"),
                settings=cfg.backup_settings(),
                homes=SessionHomes(cfg.claude_home, cfg.codex_home),
            )
        )
    except AgentsError as e:
        if first:
            # The key was read before the join: refused now, it is not the account's
            # (a plain token, or a control plane too old to check it first).
            ctx.out.note(
                "the machine is joined, its backup not restored yet: run the same join"
                " command again (with the account's recovery key) to restore it, or with"
                " --no-restore to start without it; the token is not used again"
            )
        elif not isinstance(e, InvalidArgument):  # a wrong key file says so itself
            ctx.out.note(
                "the machine is joined, its backup not restored yet: run the same join"
                " command again to restore it (the token is not used again)"
            )
        raise
    for refused in done.refused:
        ctx.out.lines(
            f"warning: backup {refused} was refused (forged or altered in the store;"
            " `agents-control fsck` names it): restoring the one before"
        )
    ctx.out.lines(
        f"restored {len(done.restored)} agents (archived) from backup {done.backup_id}"
        if done.backup_id
        else "the control plane keeps no backup of this machine: nothing to restore"
    )
    if done.settings or done.agent_settings or done.sessions:
        from machine.cli.backup import agent_settings_lines, settings_lines

        ctx.out.lines(
            *settings_lines(done.settings),
            *agent_settings_lines(ctx.prog, done.agent_settings),
            *done.sessions,
        )
    if done.backup_id:
        _backup_after_restore(ctx)


def _backup_after_restore(ctx: Ctx) -> None:
    """Back up the restored machine at once, under this box's keys.

    The machine's stored backups are sealed to the lost box's key: this box opens
    them with the recovery key only, so until it made one of its own, its start,
    `backup list` and the restore check find no backup of this machine (and
    BackupTooOld would fire). A backup that fails here leaves the restore as it
    is: the daemon's daily backup, or `backup now`, makes it.
    """
    from machine.cli.after_join import backup_after_repair

    try:
        made = asyncio.run(backup_after_repair(ctx.cfg))
    except AgentsError as e:
        ctx.out.note(
            f"warning: the first backup under this box's keys failed ({e.message}); the"
            f" restored agents are in place: run `{ctx.prog} backup now` once the daemon runs"
        )
        return
    ctx.out.lines(
        f"backup {made.backup_id} uploaded to the control plane: {made.uploaded} new"
        " segments, under this box's keys"
    )


def _finish_join_restore(ctx: Ctx) -> None:
    """``join`` again on a folder whose repair join committed and whose restore did
    not (killed, or the control plane unreachable): restore now (``--recovery-key``)
    or start without the backup (``--no-restore``); the token is not used again."""
    from machine.link import identity
    from shared.recovery_key import read_recovery_key

    args, cfg = ctx.args, ctx.cfg
    machine_id = identity.load_link(cfg.data_dir).machine_id
    if args.as_new:
        raise UsageError("join: --as-new is for a machine stopped for good; this one is not")
    if not args.recovery_key and not args.no_restore:
        raise UsageError(
            f"join: {cfg.data_dir} joined as machine {machine_id}, and the restore of its"
            " backup did not finish: run the join again with --recovery-key FILE to restore"
            " it (the token is not used again), or with --no-restore to start without it"
        )
    if args.no_restore:
        identity.clear_restore_pending(cfg.data_dir)
        ctx.out.lines(
            f"machine {machine_id} starts without its backup; the control plane keeps"
            " its backups until this machine's own push them out (the newest"
            f" {cfg.backup_keep} are kept): restore one before with `{ctx.prog} backup"
            " restore ID --recovery-key FILE` (`backup list`)"
        )
    else:
        recovery = read_recovery_key(Path(args.recovery_key), warn=ctx.out.note)
        ctx.out.lines(
            f"machine {machine_id} is joined already; restoring its backup"
            " (the token is not used again)"
        )
        _restore_after_join(ctx, recovery)


def _re_pair(ctx: Ctx) -> None:
    """``join`` on a joined data folder: re-pair (machine.link.join), or with ``--as-new``
    join again as a new machine; back up at once."""
    from machine.cli.after_join import backup_after_repair
    from machine.link import identity

    args, cfg = ctx.args, ctx.cfg
    was = identity.load_link(cfg.data_dir).machine_id
    if args.recovery_key or args.no_restore:
        # Typically the join command run again after it finished: nothing to do.
        raise UsageError(
            f"join: this data folder is already joined as machine {was} and holds its data:"
            f" start it with `{PROG} --data-dir {shlex.quote(str(cfg.data_dir))} serve`;"
            " a re-pair takes a new repair token and neither --recovery-key nor --no-restore"
        )
    stopped = identity.stopped_reason(cfg.data_dir)
    if stopped is None and identity.unconfirmed_join(cfg.data_dir) is not None:
        # The control plane may have rolled the join back: nothing of the machine
        # lives on there, so a new identity cannot make it run twice.
        stopped = "its join never confirmed"
    if args.as_new and stopped is None:
        # A live machine given a second identity would run the same agents twice.
        raise UsageError(
            f"join --as-new: machine {was} has not been stopped for good by the control"
            " plane (revoked, or its account deleted); a live machine re-pairs with a"
            f" repair token (agents-control machine repair {was}). If it was revoked"
            " while this daemon was down, start it once to find out"
        )
    result = _join(ctx)
    if args.as_new:
        ctx.out.lines(
            f"joined again as the new machine {result.machine_id} (account "
            f"{result.account_id}; was {was}, {stopped}): same agents, conversations"
            " and keys"
        )
    else:
        ctx.out.lines(
            f"re-paired as machine {result.machine_id} (account {result.account_id}): "
            "same id, agents and backups; new certificate"
        )
    made = asyncio.run(backup_after_repair(cfg))
    ctx.out.lines(f"backup {made.backup_id} uploaded to the control plane")


def _join(ctx: Ctx, recovery_public_key: bytes = b"") -> JoinResult:
    """Spend the join token: the control plane signs this folder's certificate
    (a takeover only when ``recovery_public_key``, if given, is the account's)."""
    from machine.link.join import join_control_plane, parse_link_addresses

    args = ctx.args
    # Checked before the token is spent: a bad address is exit 2, nothing written.
    links = parse_link_addresses(args.link_address) if args.link_address else ()
    return asyncio.run(
        join_control_plane(
            data_dir=ctx.cfg.data_dir,
            address=args.address,
            token=args.token,
            ca_hash=args.ca_hash,
            name=args.name,
            # A new box may take a machine over (a repair token) only when it
            # restores its backup or its operator said so (link.proto).
            take_over=bool(args.recovery_key) or args.no_restore,
            recovery_public_key=recovery_public_key,
            as_new=args.as_new,
            link_addresses=links,
        )
    )


def _install_service(ctx: Ctx) -> int:
    """Install the systemd unit, which serves; without systemctl, serve here."""
    from machine.cli.service_unit import install_service

    # The unit passes --metrics: the address this join was given (flag,
    # environment or machine.toml), else the one Prometheus is set up to scrape.
    metrics = ctx.cfg.metrics_address or SERVICE_METRICS_ADDRESS
    installed = install_service(data_dir=ctx.cfg.data_dir, metrics_address=metrics)
    ctx.out.lines(f"installed {installed.unit_path}")
    if installed.started:
        return ExitCode.OK
    return run_serve(ctx.cfg)
