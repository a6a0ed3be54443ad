"""``agents-machine``: the entry point, the parser and the COMMANDS table.

Only the CLI modules print and choose exit codes (through :mod:`shared.cli`):
0 success, 1 a failed run or an unreachable daemon, 2 bad input or a refused
request (one line, and a "Try: ..." hint where one helps), 130 Ctrl-C. This
module parses, checks ids and dispatches; the verbs are in
:mod:`machine.cli.daemon_verbs` (serve, status, check), :mod:`machine.cli.joining`
(join), :mod:`machine.cli.agents`, :mod:`machine.cli.backup` (also export and
import) and :mod:`machine.cli.schedules`, and every verb reaches the daemon
through :class:`machine.cli.client.MachineClient`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Final

from machine.backups.reader import NOT_OURS
from machine.cli import agents, backup, completion, daemon_verbs, joining, schedules, take_over
from machine.cli.client import DaemonNotRunning
from machine.cli.common import PROG, Ctx, prog_of
from machine.cli.examples import EXAMPLES
from machine.models import validate_runtime_ref
from shared.cli import (
    INT32_MAX,
    INT64_MAX,
    SHELLS,
    CliParser,
    Handler,
    Output,
    add_examples,
    add_version,
    bounded_int,
    check_argv,
    complete,
    dispatch,
    duration,
    run_main,
)
from shared.errors import ConfigError, InvalidArgument, InvalidState, NotFound
from shared.ids import is_backup_id, validate_id
from shared.logs import add_log_options

__all__ = ["main", "parse_args"]

logger = logging.getLogger(__name__)

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
        if value is not None and not (kind == "backup" and is_backup_id(value)):
            validate_id(kind, value, name)  # a backup: a daily point's or an increment's
    for attr in ("request_id", "option_id"):
        value = getattr(args, attr, None)
        if value is not None:
            validate_runtime_ref(value, attr)


#: (command, verb) -> handler; a command without verbs has verb None.
COMMANDS: dict[tuple[str, str | None], Handler] = {
    ("serve", None): daemon_verbs.cmd_serve,
    ("join", None): joining.cmd_join,
    ("status", None): daemon_verbs.cmd_status,
    ("check", None): daemon_verbs.cmd_check,
    ("agent", "create"): agents.agent_create,
    ("agent", "list"): agents.agent_list,
    ("agent", "show"): agents.agent_show,
    ("agent", "rename"): agents.agent_rename,
    ("agent", "configure"): agents.agent_configure,
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
    ("backup", "take-over"): take_over.backup_take_over,
    ("schedule", "add"): schedules.schedule_add,
    ("schedule", "list"): schedules.schedule_list,
    ("schedule", "pause"): schedules.schedule_pause,
    ("schedule", "resume"): schedules.schedule_resume,
    ("schedule", "delete"): schedules.schedule_delete,
    ("schedule", "runs"): schedules.schedule_runs,
    ("export", None): backup.cmd_export,
    ("import", None): backup.cmd_import,
    ("completion", None): completion.cmd_completion,
}


# ---------------------------------------------------------------- parser

_FROM = (
    "backups other than the configured target: a backup folder (a copied backup dir) or"
    " s3://bucket/prefix (reached with this machine's backup_store_* settings)"
)
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
    add_version(p)
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
    serving.add_argument(
        "--grace", type=duration(), help="time runs get to end at stop: 10s, 1m (default 10s)"
    )
    serving.add_argument("--no-background", action="store_true", help="no periodic jobs (tests)")
    serving.add_argument("--config", help="TOML config file (default <data dir>/machine.toml)")
    add_log_options(serving)

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
        help="a joined box whose machine was revoked, whose account was deleted or whose "
        "join was rolled back: join again as a new machine (a plain token), keeping its "
        "agents and data",
    )
    j.add_argument(
        "--link-address",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the link addresses of the control plane's other replicas: the machine "
        "moves to one of them when its replica goes (docs/controlplane.md)",
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
    cf = verbs.add_parser("configure", parents=[common], help="replace an agent's runtime settings")
    cf.add_argument("id", help=_AGENT_ID)
    cf.add_argument(
        "--settings",
        required=True,
        help="its whole runtime settings as a JSON object ('-': read them from stdin)",
    )
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
    bl.add_argument("--from", dest="from_dir", metavar="DIR|URL", help=_FROM)
    bl.add_argument(
        "--recovery-key",
        metavar="FILE",
        help="a recovery key file: list what backups made with another machine's key hold",
    )
    for verb, text in (
        ("verify", "open a backup (and its increments) and authenticate every segment"),
        ("restore", "restore a backup's agents (archived), skipping existing ones"),
    ):
        bv = bverbs.add_parser(verb, parents=[common], help=text)
        bv.add_argument(
            "backup_id",
            metavar="ID",
            nargs="?",
            help="the backup's id (bk_… or an increment's bki_…; see `backup list`);"
            " default: the newest, increments included",
        )
        if verb == "restore":
            bv.add_argument(
                "--at",
                metavar="TIME",
                help="restore to this time: the newest daily backup and increments at or"
                " before it (RFC 3339, or a time as `backup list` shows it)",
            )
        bv.add_argument("--from", dest="from_dir", metavar="DIR|URL", help=_FROM)
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
    bt = bverbs.add_parser(
        "take-over",
        parents=[common],
        help="make this fresh stand-alone box the lost machine whose backups --from holds"
        " (the daemon stopped)",
    )
    bt.add_argument(
        "backup_id",
        metavar="ID",
        nargs="?",
        help="the backup (bk_… or bki_…); default: the newest, increments included",
    )
    bt.add_argument(
        "--at", metavar="TIME", help="the newest point and increments at or before TIME"
    )
    bt.add_argument("--from", dest="from_dir", metavar="DIR|URL", required=True, help=_FROM)
    bt.add_argument(
        "--recovery-key", metavar="FILE", required=True, help="the lost machine's recovery key file"
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
    co = sub.add_parser(
        "completion", help="print the shell completion script (bash, zsh, fish) to source"
    )
    co.add_argument("shell", choices=SHELLS, help="the shell: bash, zsh or fish")
    add_examples(p, EXAMPLES)
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
        if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer, exit
            parser = _parser()
            completion.add_completers(parser, os.environ, Path.home())
            complete(parser, os.environ)
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
