"""``agents-machine``: the machine daemon and its local verbs.

Only the CLI modules print and choose exit codes (through :mod:`shared.cli`):
0 success, 1 a failed run or an unreachable daemon, 2 bad input or a refused
request (one line, and a "Try: ..." hint where one helps), 130 Ctrl-C. This
module holds the entry point, the parser, the COMMANDS table and the daemon's
own verbs; ``machine.cli.agents``, ``cli_schedules`` and ``cli_backup`` hold
the others, and every verb reaches the daemon through
:class:`machine.client.MachineClient`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from machine.backups.engine import NOT_OURS
from machine.backups.service import BackupStatus
from machine.cli import agents, backup, schedules
from machine.cli.client import DaemonNotRunning
from machine.cli.common import PROG, Ctx, call, human, prog_of, show_record, when
from machine.config import MachineConfig, server_data_dir
from machine.models import validate_runtime_ref
from machine.storage.faults import run_check
from shared.cli import (
    INT32_MAX,
    INT64_MAX,
    CliParser,
    ExitCode,
    Handler,
    Output,
    UsageError,
    bind_error,
    bounded_int,
    check_argv,
    dispatch,
    run_main,
)
from shared.errors import (
    AgentsError,
    ConfigError,
    InvalidArgument,
    InvalidState,
    NotFound,
)
from shared.ids import validate_id

if TYPE_CHECKING:
    from machine.link.join import JoinResult
    from shared.crypto import BoxKeyPair

__all__ = ["main"]

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

# ---------------------------------------------------------------- commands


# Positional or option -> (id kind, the field named in the error). Checked before
# the daemon is dialled, so a malformed id is a usage error even when it is down.
_ID_ARGS: dict[str, tuple[str, str]] = {
    "id": ("agent", "agent_id"),
    "agent": ("agent", "agent_id"),
    "run_id": ("run", "run_id"),
    "backup_id": ("backup", "backup_id"),
    "schedule_id": ("schedule", "schedule_id"),
}


def _check_args(args: argparse.Namespace) -> None:
    """Validate ids and runtime references given on the command line."""
    for attr, (kind, name) in _ID_ARGS.items():
        value = getattr(args, attr, None)
        if value is not None:
            validate_id(kind, value, name)
    for attr in ("request_id", "option_id"):
        value = getattr(args, attr, None)
        if value is not None:
            validate_runtime_ref(value, attr)


async def _cmd_status(ctx: Ctx) -> int:
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
        ("restore check", check),
        ("recovery key", "yes" if b.recovery_key else "none"),
    ]
    return pairs + [("warning", w) for w in b.warnings]


async def _cmd_check(ctx: Ctx) -> int:
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


def _run_serve(cfg: MachineConfig, prog: str = PROG) -> int:
    from machine.daemon import serve

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # replaces the silence main() set up for the verbs
    )
    os.umask(0o077)  # everything the daemon creates is private to its user
    try:
        asyncio.run(serve(cfg, first=lambda: _first_start_recovery_key(cfg, prog)))
    except (OSError, RuntimeError) as e:
        raise bind_error(e) or e from None
    return ExitCode.OK


def _cmd_serve(ctx: Ctx) -> int:
    return _run_serve(ctx.cfg, ctx.prog)


def _cmd_join(ctx: Ctx) -> int:
    # Imported here: only `join` needs the join flow and the service installer.
    from machine.link import identity
    from shared.recovery_key import read_recovery_key

    args = ctx.args
    if not args.data_dir:
        # `join` installs a server: its folder is the server's, whatever else exists.
        args.data_dir = str(server_data_dir(ctx.home))
    cfg = ctx.cfg
    if args.recovery_key and args.no_restore:
        raise UsageError("join: --recovery-key restores the machine's backup; drop --no-restore")
    if args.recovery_key == "":  # "$KEY" of an unset variable: never "no key" instead
        raise UsageError("--recovery-key: empty; name the file that holds the key")
    if identity.is_joined(cfg.data_dir):
        if identity.restore_pending(cfg.data_dir):
            return _finish_join_restore(ctx)
        return _re_pair(ctx)  # refuses --recovery-key: it restores nothing there
    # Read before the join: a bad key file must not cost the one-time token.
    recovery = (
        read_recovery_key(Path(args.recovery_key), warn=ctx.out.note) if args.recovery_key else None
    )
    if args.as_new:
        raise UsageError("join: --as-new is for a data folder that was joined; this one is not")
    result = _join(ctx, recovery.public_key if recovery is not None else b"")
    ctx.out.lines(f"joined as machine {result.machine_id} (account {result.account_id})")
    if recovery is not None:
        from machine.daemon import hold_data_dir

        # Held as a rerun holds it: two restores never share the folder.
        with hold_data_dir(cfg.data_dir, "run the same join command again once it stopped"):
            _restore_after_join(ctx, recovery, first=True)
    return _install_then_serve(ctx)


def _restore_after_join(ctx: Ctx, recovery: BoxKeyPair, *, first: bool = False) -> None:
    """Restore the machine's newest backup after a repair join; say what came back.
    ``first``: right after the join (not its rerun)."""
    from machine.cli.after_join import restore_after_join
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


def _finish_join_restore(ctx: Ctx) -> int:
    """``join`` again on a folder whose repair join committed and whose restore did
    not (killed, or the control plane unreachable): restore now (``--recovery-key``)
    or start without the backup (``--no-restore``); the token is not used again."""
    from machine.daemon import hold_data_dir
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
    with hold_data_dir(cfg.data_dir, "join: stop the running agents-machine first"):
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
    return _install_then_serve(ctx)


def _re_pair(ctx: Ctx) -> int:
    """``join`` on a joined data folder: re-pair (machine.link.join), or with ``--as-new``
    join again as a new machine; back up at once, serve."""
    from machine.cli.after_join import backup_after_repair
    from machine.daemon import hold_data_dir
    from machine.link import identity

    args, cfg = ctx.args, ctx.cfg
    if args.recovery_key or args.no_restore:
        # Typically the join command run again after it finished: nothing to do.
        raise UsageError(
            f"join: this data folder is already joined as machine"
            f" {identity.load_link(cfg.data_dir).machine_id} and holds its data: start it"
            f" with `{PROG} --data-dir"
            f" {shlex.quote(str(cfg.data_dir))} serve`; a re-pair takes a new repair token"
            " and neither --recovery-key nor --no-restore"
        )
    # Held from before the join to after the backup: a daemon serving this folder
    # (with the old certificate) is refused here, before the token is spent.
    with hold_data_dir(cfg.data_dir, "join (re-pair): stop the running agents-machine first"):
        was = identity.load_link(cfg.data_dir).machine_id
        stopped = identity.stopped_reason(cfg.data_dir)
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
    return _install_then_serve(ctx)


def _join(ctx: Ctx, recovery_public_key: bytes = b"") -> JoinResult:
    """Spend the join token: the control plane signs this folder's certificate
    (a takeover only when ``recovery_public_key``, if given, is the account's)."""
    from machine.link.join import join_control_plane

    args = ctx.args
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
        )
    )


def _install_then_serve(ctx: Ctx) -> int:
    """After a join: install the systemd unit when asked (it serves), else serve here."""
    if ctx.args.install_service:
        from machine.cli.service_unit import install_service

        installed = install_service(data_dir=ctx.cfg.data_dir)
        ctx.out.lines(f"installed {installed.unit_path}")
        if installed.started:
            return ExitCode.OK
    return _run_serve(ctx.cfg)


#: (command, verb) -> handler; a command without verbs has verb None.
COMMANDS: dict[tuple[str, str | None], Handler] = {
    ("serve", None): _cmd_serve,
    ("join", None): _cmd_join,
    ("status", None): _cmd_status,
    ("check", None): _cmd_check,
    ("agent", "create"): agents.agent_create,
    ("agent", "list"): agents.agent_list,
    ("agent", "show"): agents.agent_show,
    ("agent", "rename"): agents.agent_rename,
    ("agent", "archive"): agents.agent_archive,
    ("agent", "unarchive"): agents.agent_unarchive,
    ("agent", "prompt"): agents.agent_prompt,
    ("agent", "replay"): agents.agent_replay,
    ("agent", "cancel"): agents.agent_cancel,
    ("agent", "answer"): agents.agent_answer,
    ("agent", "runs"): agents.agent_runs,
    ("agent", "search"): agents.agent_search,
    ("agent", "delete"): agents.agent_delete,
    ("agent", "erasures"): agents.agent_erasures,
    ("backup", "now"): backup.backup_now,
    ("backup", "list"): backup.backup_list,
    ("backup", "verify"): backup.backup_verify,
    ("backup", "restore"): backup.backup_restore,
    ("backup", "recovery-key"): backup.backup_recovery_key,
    ("schedule", "add"): schedules.schedule_add,
    ("schedule", "list"): schedules.schedule_list,
    ("schedule", "pause"): schedules.schedule_pause,
    ("schedule", "resume"): schedules.schedule_resume,
    ("schedule", "delete"): schedules.schedule_delete,
    ("schedule", "runs"): schedules.schedule_runs,
    ("export", None): backup.cmd_export,
    ("import", None): backup.cmd_import,
}


# ---------------------------------------------------------------- parser

_FROM = "a backup folder other than the configured one (a copied backup dir)"
_AGENT_ID = "the agent's id (ag_…; see `agent list --all`)"
_LIMIT = bounded_int(1, INT32_MAX)


def _add_global_options(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "--data-dir",
        default=default,
        help="data folder (default: $AGENTS_DATA_DIR, else a joined server's "
        "~/.agents-server/root when it exists, else the platform's)",
    )
    p.add_argument(
        "--socket", default=default, help="daemon socket (default: <data dir>/machine.sock)"
    )
    p.add_argument("--json", action="store_true", default=default, help="print JSON for scripts")


#: Verbs whose last positional takes every remaining word: words after an
#: option (``agent prompt ID --attach F more words``) are still its own
#: (argparse alone stops such a positional at the first option).
_TRAILING_WORDS: dict[tuple[str, str | None], str] = {
    ("agent", "prompt"): "text",
    ("agent", "search"): "query",
    ("export", None): "agents",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; UsageError for anything the verb does not take."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        field = _TRAILING_WORDS.get((args.command, args.verb))
        if field is None or any(word.startswith("-") for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, field, [*(getattr(args, field) or []), *extra])
    return args


def _parser() -> CliParser:
    p = CliParser(prog=PROG, description="The machine agent: runs your AI coding agents.")
    _add_global_options(p, argparse.SUPPRESS)
    p.set_defaults(data_dir=None, socket=None, json=False, verb=None)
    # The same options are accepted after the subcommand too (`serve --data-dir D`),
    # as systemd units and pasted join commands put them there.
    common = CliParser(add_help=False)
    _add_global_options(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", parser_class=CliParser)

    # `join` serves once joined, so it takes the daemon's options too.
    serving = CliParser(add_help=False)
    serving.add_argument("--tcp", help="also listen on HOST:PORT (loopback only)")
    serving.add_argument("--metrics", help="serve /metrics on HOST:PORT (loopback only)")
    serving.add_argument("--prompt-limit", help="largest prompt (default 1MiB)")
    serving.add_argument("--attachment-limit", help="largest attachment (default 20MiB)")
    serving.add_argument("--grace", type=float, help="seconds runs get to end at stop (default 10)")
    serving.add_argument("--no-background", action="store_true", help="no periodic jobs (tests)")
    serving.add_argument("--config", help="TOML config file (default <data dir>/machine.toml)")

    sub.add_parser("serve", parents=[common, serving], help="run the daemon")

    j = sub.add_parser("join", parents=[common, serving], help="join a control plane, then serve")
    j.add_argument("address", help="control plane HOST:PORT")
    j.add_argument("--token", required=True, help="one-time join token")
    j.add_argument("--ca-hash", required=True, help="sha256:HEX of the control plane CA key")
    j.add_argument("--name", help="this machine's name")
    j.add_argument("--install-service", action="store_true", help="install a systemd unit")
    j.add_argument(
        "--recovery-key",
        help="account recovery key FILE: after a repair join, restore the machine's newest backup",
    )
    j.add_argument(
        "--as-new",
        action="store_true",
        help="a joined box whose machine was revoked or whose account was deleted: "
        "join again as a new machine (a plain token), keeping its agents and data",
    )
    j.add_argument(
        "--no-restore",
        action="store_true",
        help="with a repair token on a new box: take the machine over empty, restoring nothing",
    )

    sub.add_parser("status", parents=[common], help="the daemon's health and counts")
    sub.add_parser("check", parents=[common], help="run a full integrity check of machine.db")

    a = sub.add_parser("agent", parents=[common], help="agents and their runs")
    verbs = a.add_subparsers(dest="verb", parser_class=CliParser)
    c = verbs.add_parser("create", parents=[common], help="create an agent")
    c.add_argument("name", help="a name to recognise it by")
    c.add_argument("--folder", help="the folder it works in (default: here)")
    c.add_argument("--runtime", help="echo (default) or acp")
    c.add_argument("--settings", help="runtime settings as a JSON object")
    ls = verbs.add_parser("list", parents=[common], help="list agents")
    ls.add_argument("--all", action="store_true", help="include archived agents")
    for verb in ("show", "archive", "unarchive"):
        verbs.add_parser(verb, parents=[common], help=f"{verb} an agent").add_argument(
            "id", help=_AGENT_ID
        )
    r = verbs.add_parser("rename", parents=[common], help="rename an agent")
    r.add_argument("id", help=_AGENT_ID)
    r.add_argument("name", help="the new name")
    pr = verbs.add_parser("prompt", parents=[common], help="prompt an agent and stream the run")
    pr.add_argument("id", help=_AGENT_ID)
    pr.add_argument("text", nargs="*", help="the prompt (words are joined by spaces)")
    pr.add_argument("--stdin", action="store_true", help="read the prompt (UTF-8) from stdin")
    pr.add_argument("--attach", action="append", help="attach a file (repeatable)")
    rp = verbs.add_parser("replay", parents=[common], help="stream an agent's stored events")
    rp.add_argument("id", help=_AGENT_ID)
    rp.add_argument(
        "--after", type=bounded_int(0, INT64_MAX), default=0, help="only events after this seq"
    )
    rp.add_argument("--follow", action="store_true", help="keep streaming new events")
    cn = verbs.add_parser("cancel", parents=[common], help="cancel a run")
    cn.add_argument("run_id", help="the run's id (run_…)")
    an = verbs.add_parser("answer", parents=[common], help="answer a permission request")
    an.add_argument("run_id", help="the run's id (run_…), as printed with the request")
    an.add_argument("request_id", help="the request's id, as printed with the request")
    an.add_argument("option_id", help="the option chosen, e.g. allow_once")
    an.add_argument("--remember", action="store_true", help="for this agent and tool, always")
    ru = verbs.add_parser("runs", parents=[common], help="an agent's runs: usage and time history")
    ru.add_argument("id", help=_AGENT_ID)
    ru.add_argument("--limit", type=_LIMIT, default=20, help="at most this many (default 20)")
    se = verbs.add_parser(
        "search", parents=[common], help="search conversations, tool logs and summaries"
    )
    se.add_argument("query", nargs="+", help="words to find")
    se.add_argument("--agent", help="only this agent")
    se.add_argument("--limit", type=_LIMIT, default=20, help="at most this many (default 20)")
    verbs.add_parser(
        "delete",
        parents=[common],
        help="erase an archived agent everywhere this machine can reach (cannot be undone)",
    ).add_argument("id", help=_AGENT_ID)
    verbs.add_parser(
        "erasures", parents=[common], help="erased agents and what was erased, per layer"
    )

    b = sub.add_parser(
        "backup", parents=[common], help="sealed backups: make, list, verify, restore"
    )
    bverbs = b.add_subparsers(dest="verb", parser_class=CliParser)
    bverbs.add_parser("now", parents=[common], help="back up now (then prune and check)")
    bl = bverbs.add_parser("list", parents=[common], help="backups at the target, newest first")
    bl.add_argument("--from", dest="from_dir", metavar="DIR", help=_FROM)
    for verb, text in (
        ("verify", "open a backup and authenticate every segment"),
        ("restore", "restore a backup's agents (archived), skipping existing ones"),
    ):
        bv = bverbs.add_parser(verb, parents=[common], help=text)
        bv.add_argument("backup_id", metavar="ID", help="the backup's id (bk_…; see `backup list`)")
        bv.add_argument("--from", dest="from_dir", metavar="DIR", help=_FROM)
        bv.add_argument(
            "--recovery-key",
            metavar="FILE",
            help="a recovery key file, for a backup made with another machine's key",
        )
    bverbs.add_parser(
        "recovery-key",
        parents=[common],
        help="make this stand-alone machine's recovery key; prints the private half once",
    )
    sc = sub.add_parser("schedule", parents=[common], help="prompts an agent runs on a cron")
    sverbs = sc.add_subparsers(dest="verb", parser_class=CliParser)
    sa = sverbs.add_parser("add", parents=[common], help="add a schedule to an active agent")
    sa.add_argument("agent", metavar="AGENT", help=_AGENT_ID)
    sa.add_argument("--cron", required=True, help='five-field cron, e.g. "0 7 * * 1-5"')
    source = sa.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the prompt")
    source.add_argument("--file", metavar="FILE", help="read the prompt (UTF-8) from FILE")
    sa.add_argument("--tz", help="IANA time zone, e.g. Europe/Berlin (default: the machine's)")
    sa.add_argument(
        "--missed",
        choices=("skip", "once"),
        help="fire times missed while the daemon was down: skip them (default) or run once",
    )
    sl = sverbs.add_parser("list", parents=[common], help="schedules, of one agent or all")
    sl.add_argument("agent", metavar="AGENT", nargs="?", help=_AGENT_ID)
    for verb, what in (("pause", "pause"), ("resume", "resume (from now)"), ("delete", "delete")):
        sverbs.add_parser(verb, parents=[common], help=f"{what} a schedule").add_argument(
            "schedule_id", metavar="ID", help="the schedule's id (sch_…; see `schedule list`)"
        )
    sr = sverbs.add_parser("runs", parents=[common], help="a schedule's fires, newest first")
    sr.add_argument("schedule_id", metavar="ID", help="the schedule's id (sch_…)")
    sr.add_argument("--limit", type=bounded_int(1, 1000), default=20, help="at most this many")
    ex = sub.add_parser("export", parents=[common], help="export agents as a .tar.gz")
    ex.add_argument("agents", nargs="*", metavar="AGENT", help="agents to export (ag_…)")
    ex.add_argument("--folder", help="export every agent working in this folder")
    ex.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the file to write (default ./agents-export-TIME.tar.gz)",
    )
    im = sub.add_parser("import", parents=[common], help="import a .tar.gz export (archived)")
    im.add_argument("file", metavar="FILE", help="the export to import")
    return p


# ---------------------------------------------------------------- main


#: The listing a "not found" points at, by the kind of thing missing.
_LISTING: Final = {
    "backup": "backup list",
    "schedule": "schedule list",
    "run": "agent runs AGENT",
}


def _hint(err: BaseException, prog: str) -> str | None:
    if isinstance(err, DaemonNotRunning):
        from machine.link import identity

        if identity.restore_pending(err.data_dir):  # serve refuses until it is done
            return (
                f"the same `{PROG} join … --recovery-key FILE` again: the restore after"
                " this machine's repair join did not finish"
            )
        # Name the folder: a bare `serve` could start a second, stand-alone machine.
        return f"{PROG} --data-dir {shlex.quote(str(err.data_dir))} serve"
    if isinstance(err, NotFound):
        # Point at the listing of the kind of thing that was not found.
        listing = _LISTING.get(getattr(err, "kind", ""), "agent list --all")
        return f"{prog} {listing}"
    if isinstance(err, InvalidArgument) and getattr(err, "field", "") == "agent_id":
        return f"{prog} agent list --all"
    if isinstance(err, InvalidState) and "archive it first" in err.message:
        return f"{prog} agent archive ID"
    if isinstance(err, InvalidState) and "archived" in err.message:
        return f"{prog} agent unarchive ID"
    if isinstance(err, ConfigError):
        return f"{PROG} serve --help"
    if NOT_OURS in str(err) and "another machine made it" in str(err):
        # Opened without a recovery key: a backup of another machine's key (a lost one's).
        return f"add --recovery-key FILE (`{prog} backup restore --help`)"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parsed: list[argparse.Namespace] = []  # for the hints, once parsed

    def body() -> int:
        # A verb's failure is the one line run_main prints: library warnings (a
        # refused join logs one) would add a second. `serve` sets up real logging.
        logging.getLogger().addHandler(logging.NullHandler())
        check_argv(argv)
        args = parse_args(argv)
        parsed.append(args)
        ctx = Ctx(args, dict(os.environ), Output(as_json=args.json))
        if args.command not in (None, "serve", "join"):
            _check_args(args)
        return dispatch(COMMANDS, PROG, args.command, args.verb, ctx)

    return run_main(
        PROG,
        body,
        hint_for=lambda e: _hint(e, prog_of(parsed[0] if parsed else None)),
        interrupted=f"interrupted (a run goes on; cancel it with `{PROG} agent cancel RUN`)",
    )
