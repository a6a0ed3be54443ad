"""``agents-control``: the entry point, the parser and the COMMANDS table.

Only the modules of ``controlplane.cli`` print and pick exit codes (through
:mod:`shared.cli`): 0 success, 1 failure, 2 bad input or a refused request
(one line, maybe a hint). The environment is read only through
:func:`controlplane.config.load_config`. This module parses and dispatches;
the verbs are in :mod:`controlplane.cli.deployment` (init, serve),
:mod:`controlplane.cli.recovery` (recovery-key, restore, drill, fsck, cert,
ca), :mod:`controlplane.cli.accounts` (account, token, credential) and
:mod:`controlplane.cli.machines` (machine, prompt).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from controlplane.access.tokens import MAX_USES
from controlplane.cli import accounts, deployment, machines, recovery, store
from controlplane.cli.client import ControlPlaneUnreachable
from controlplane.cli.common import PROG, Ctx
from controlplane.cli.drill import MAX_MACHINES
from controlplane.cli.examples import EXAMPLES
from controlplane.config import load_config
from shared.cli import (
    INT64_MAX,
    SHELLS,
    CliParser,
    Handler,
    Output,
    UsageError,
    add_examples,
    add_version,
    bounded_int,
    check_argv,
    complete,
    completion_script,
    dispatch,
    duration,
    run_main,
    stdout_writable,
    whole_seconds,
)
from shared.logs import add_log_options, setup_logging

__all__ = ["build_parser", "main", "parse_args"]

logger = logging.getLogger(__name__)


UINT32_MAX = 2**32 - 1
# On the wire 0 means "the default": on the command line it would be a surprise, so
# at least 1 s. The field is uint32; the server refuses more than a day with a
# message naming the limit, so cap only what protobuf cannot carry.
_ttl = whole_seconds(1, UINT32_MAX)
_TTL_HELP = "lifetime: 90m, 1h30m, 1d (default 1h, max 24h)"
_uses = bounded_int(1, MAX_USES)
_drill_machines = bounded_int(1, MAX_MACHINES)
_github_id = bounded_int(1, INT64_MAX)


def _common(p: argparse.ArgumentParser, *, client: bool = True) -> None:
    p.add_argument("--home", help="control-plane home (AGENTS_CONTROL_HOME)")
    if client:
        p.add_argument("--address", help="host:port of the daemon (default: from serve.json)")
        p.add_argument(
            "--credential",
            help="admin credential (AGENTS_CONTROL_CREDENTIAL); shown by `ps`: prefer a file",
        )
        p.add_argument(
            "--credential-file",
            metavar="PATH",
            help="read the admin credential from the first line of PATH "
            "(AGENTS_CONTROL_CREDENTIAL_FILE)",
        )
        p.add_argument("--json", action="store_true", help="print JSON")


def _daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", dest="store_url", help="s3://bucket/prefix or a folder")
    p.add_argument("--store-endpoint", help="S3 endpoint URL (MinIO, moto)")
    p.add_argument("--store-region", help="S3 region")
    p.add_argument(
        "--store-object-lock",
        action="store_true",
        default=None,
        help="the bucket has S3 Object Lock with a default retention: check it at every "
        "start and refuse the store without it (docs/security.md)",
    )
    p.add_argument("--listen", help="public listener host:port (Join, Admin)")
    p.add_argument("--link-listen", help="mutual-TLS link listener host:port")
    p.add_argument("--metrics-listen", help="/metrics host:port ('' disables)")
    p.add_argument("--advertise-host", help="host printed in join commands")
    p.add_argument(
        "--heartbeat-interval", type=duration(), help="time between heartbeats (15s, 500ms)"
    )
    add_log_options(p)


def _verbs(
    sub: argparse._SubParsersAction[CliParser], cmd: str, text: str
) -> argparse._SubParsersAction[CliParser]:
    """The verbs of a command (``agents-control CMD VERB``); ``text`` is its help."""
    return sub.add_parser(cmd, help=text).add_subparsers(dest="verb", parser_class=CliParser)


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    root = CliParser(prog=PROG, description="The agents control plane.")
    root.set_defaults(verb=None)
    add_version(root)
    # Also before the command (`agents-control --home H machine list`), as
    # agents-machine takes --data-dir; each command takes it after itself too.
    root.add_argument("--home", dest="root_home", help="control-plane home (AGENTS_CONTROL_HOME)")
    # --json too: both CLIs take it before the command and after the verb.
    root.add_argument("--json", dest="root_json", action="store_true", help="print JSON")
    sub = root.add_subparsers(dest="cmd", parser_class=CliParser)

    p = sub.add_parser("init", help="make keys, config and the first operator credential")
    _common(p, client=False)
    _daemon_flags(p)
    p.add_argument(
        "--server-name",
        action="append",
        dest="server_names",
        default=None,
        help="extra DNS name or IP for the server certificate (repeatable)",
    )
    p.add_argument(
        "--recovery-public-key",
        help="agpk1_... the key bundle is sealed to (required for S3; "
        "default for a folder store: generate, print once)",
    )
    p.add_argument(
        "--adopt",
        action="store_true",
        help="the keys are lost: new keys over this existing store, keeping its accounts, "
        "machines, queues and backups (machines then re-pair: `machine repair`)",
    )

    rk = _verbs(sub, "recovery-key", "the operator recovery key")
    p = rk.add_parser("new", help="make a recovery key pair; the private half goes to --out")
    p.add_argument("--out", required=True, help="new file for the private key (0600; kept offline)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("restore", help="rebuild a home from the store and the recovery key")
    _common(p, client=False)
    p.add_argument(
        "--store", dest="store_url", required=True, help="s3://bucket/prefix or a folder"
    )
    p.add_argument("--store-endpoint", help="S3 endpoint URL (MinIO, moto)")
    p.add_argument("--store-region", help="S3 region")
    p.add_argument("--recovery-key", required=True, help="the recovery private key file")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("drill", help="rehearse losing and restoring the control plane (local)")
    p.add_argument("--machines", type=_drill_machines, required=True, help="machines to start")
    p.add_argument("--store", dest="store_url", help="store to use (default: a temporary folder)")
    p.add_argument("--store-endpoint", help="S3 endpoint URL (MinIO, moto)")
    p.add_argument("--workdir", help="keep the drill's files and logs here (default: temporary)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("serve", help="run the daemon")
    _common(p, client=False)
    _daemon_flags(p)
    p.add_argument(
        "--cluster",
        dest="cluster_url",
        metavar="NATS_URL",
        help="run one replica of a deployment served by several, coordinated through "
        "this NATS server (nats://host:port; docs/controlplane.md, Replicas)",
    )

    p = sub.add_parser("fsck", help="check the store for inconsistencies (read-only)")
    _common(p, client=False)
    _daemon_flags(p)
    p.add_argument("--repair", action="store_true", help="fix what can be fixed (serve stopped)")
    p.add_argument(
        "--vouch-backups",
        action="store_true",
        help="with --repair: MAC backup manifests written without one (once, after upgrading)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    acc = _verbs(sub, "account", "accounts")
    p = acc.add_parser("create", help="create an account")
    _common(p)
    p.add_argument("--github-id", type=_github_id, required=True, help="GitHub numeric user id")
    p.add_argument("--github-login", required=True, help="GitHub login")
    p.add_argument("--recovery-public-key", help="agpk1_... (default: generate, print once)")
    p = acc.add_parser("show", help="show an account")
    _common(p)
    p.add_argument("account_id", help="the account's id (acct_…)")
    p = acc.add_parser("list", help="list accounts")
    _common(p)
    p = acc.add_parser("delete", help="delete an account and everything it stored")
    _common(p)
    p.add_argument("account_id", help="the account's id (acct_…)")
    p.add_argument("--wait", action="store_true", help="wait until the deletion has finished")
    p = acc.add_parser("deletion", help="show an account deletion's progress or result")
    _common(p)
    p.add_argument("account_id", help="the account's id (acct_…)")

    tok = _verbs(sub, "token", "join tokens")
    p = tok.add_parser("create", help="create a join token and print the join command")
    _common(p)
    p.add_argument("--account", required=True, help="account id")
    p.add_argument("--ttl", type=_ttl, default=None, help=_TTL_HELP)
    p.add_argument("--uses", type=_uses, default=1, help="how many joins (default 1)")
    p = tok.add_parser("list", help="list join tokens")
    _common(p)
    p.add_argument("--account", default="", help="account id")
    p = tok.add_parser("revoke", help="revoke a join token")
    _common(p)
    p.add_argument("token_id", help="the token's id (tok_…)")

    mac = _verbs(sub, "machine", "machines")
    p = mac.add_parser("list", help="list machines")
    _common(p)
    p.add_argument("--account", default="", help="account id")
    for verb in ("show", "revoke"):
        p = mac.add_parser(verb, help=f"{verb} a machine")
        _common(p)
        p.add_argument("machine_id", help="the machine's id (mc_…)")
    p = mac.add_parser(
        "repair", help="print a join command that replaces a lost machine (keeps its id)"
    )
    _common(p)
    p.add_argument("machine_id", help="the machine's id (mc_…)")
    p.add_argument("--ttl", type=_ttl, default=None, help=_TTL_HELP)

    p = mac.add_parser("provider", help="set what starts a stopped machine (local, ec2)")
    _common(p)
    p.add_argument("action", choices=["set", "clear"], help="set or clear the provider")
    p.add_argument("machine_id", help="the machine's id (mc_…)")
    p.add_argument("provider", nargs="?", default="", help="local or ec2 (for set)")
    p.add_argument(
        "--settings",
        default="{}",
        help='provider settings as JSON, e.g. {"command": ["agents-machine", "serve"]}',
    )
    p = mac.add_parser("rename", help="rename a machine")
    _common(p)
    p.add_argument("machine_id", help="the machine's id (mc_…)")
    p.add_argument("name", help="the new name")

    prv = _verbs(sub, "prompt", "prompts for machines (queued while they are off)")
    p = prv.add_parser("send", help="send a prompt to an agent of a machine")
    _common(p)
    p.add_argument("--machine", required=True, help="the machine's id (mc_…)")
    p.add_argument("--agent", required=True, help="the agent's id (ag_…)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the prompt text")
    text.add_argument("--file", help="read the prompt text from this file (UTF-8)")
    p.add_argument(
        "--idempotency-key", default="", help="a retry with the same key queues nothing new"
    )
    p = prv.add_parser("list", help="list a machine's prompts (ids, states, ages, sizes)")
    _common(p)
    p.add_argument("--machine", required=True, help="the machine's id (mc_…)")

    cred = _verbs(sub, "credential", "admin credentials")
    p = cred.add_parser("create", help="create an account-scoped admin credential")
    _common(p)
    p.add_argument("--account", required=True, help="account id")
    p.add_argument("--label", default="account admin", help="a label to recognise it by")

    sto = _verbs(sub, "store", "the deployment's object store")
    p = sto.add_parser(
        "migrate", help="move the control plane to another store (serve stopped; resumable)"
    )
    _common(p, client=False)
    p.add_argument("--to", dest="to_url", required=True, help="s3://bucket/prefix or a folder")
    p.add_argument("--store-endpoint", dest="to_endpoint", help="the new store's S3 endpoint")
    p.add_argument("--store-region", dest="to_region", help="the new store's S3 region")
    p.add_argument(
        "--store-object-lock",
        dest="to_object_lock",
        action="store_true",
        help="the new bucket has S3 Object Lock with a default retention (docs/security.md)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    cert = _verbs(sub, "cert", "the server TLS certificate")
    p = cert.add_parser(
        "rotate-server", help="issue a new server certificate under the same CA (no re-pairing)"
    )
    _common(p)
    ca = _verbs(sub, "ca", "the certificate authority")
    p = ca.add_parser(
        "rollover", help="start a CA rollover (or report on it); machines renew by themselves"
    )
    _common(p)
    p.add_argument(
        "--retire-old",
        action="store_true",
        help="retire the old CA (refused while a machine still holds one of its certificates)",
    )
    p = sub.add_parser(
        "completion", help="print the shell completion script (bash, zsh, fish) to source"
    )
    p.add_argument("shell", choices=SHELLS, help="the shell: bash, zsh or fish")
    add_examples(root, EXAMPLES)
    return root


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "home store_url store_endpoint store_region store_object_lock listen link_listen "
        "metrics_listen "
        "advertise_host heartbeat_interval log_level log_format address credential credential_file "
        "server_names cluster_url"
    ).split()
    for name in ("home", "address", "credential", "credential_file"):
        # "$VAR" of an unset variable: never the default home, serve.json's
        # address or the environment's credential instead.
        if getattr(args, name, None) == "":
            flag = name.replace("_", "-")
            raise UsageError(f"--{flag}: empty; give a value or leave the option out")
    return {n: getattr(args, n, None) for n in names}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


#: (command, verb) -> handler; a command without verbs has verb None.
COMMANDS: dict[tuple[str, str | None], Handler] = {
    ("init", None): deployment.cmd_init,
    ("serve", None): deployment.cmd_serve,
    ("fsck", None): recovery.cmd_fsck,
    ("recovery-key", "new"): recovery.recovery_key_new,
    ("restore", None): recovery.cmd_restore,
    ("drill", None): recovery.cmd_drill,
    ("account", "create"): accounts.account_create,
    ("account", "show"): accounts.account_show,
    ("account", "list"): accounts.account_list,
    ("account", "delete"): accounts.account_delete,
    ("account", "deletion"): accounts.account_deletion,
    ("token", "create"): accounts.token_create,
    ("token", "list"): accounts.token_list,
    ("token", "revoke"): accounts.token_revoke,
    ("machine", "list"): machines.machine_list,
    ("machine", "show"): machines.machine_show,
    ("machine", "rename"): machines.machine_rename,
    ("machine", "revoke"): machines.machine_revoke,
    ("machine", "repair"): machines.machine_repair,
    ("machine", "provider"): machines.machine_provider,
    ("credential", "create"): accounts.credential_create,
    ("prompt", "send"): machines.prompt_send,
    ("prompt", "list"): machines.prompt_list,
    ("cert", "rotate-server"): recovery.cert_rotate_server,
    ("ca", "rollover"): recovery.ca_rollover,
    ("store", "migrate"): store.store_migrate,
}

#: Commands that print a secret once (it is stored only as a hash, or not at all):
#: refused up front when nobody can read stdout, so no secret is made and lost.
PRINTS_SECRET = {
    ("init", None),
    ("account", "create"),
    ("token", "create"),
    ("machine", "repair"),
    ("credential", "create"),
}


def _message(exc: BaseException) -> str | None:
    if isinstance(exc, ControlPlaneUnreachable):
        return f"{exc} (is `{PROG} serve` running?)"
    return None


def _merge_home(args: argparse.Namespace) -> None:
    """``--home`` given before the command counts as given after it; twice, with
    two different folders, is a usage error (which one was meant?)."""
    before = getattr(args, "root_home", None)
    if before is None:
        return
    after = getattr(args, "home", None)
    if after is not None and os.path.abspath(after) != os.path.abspath(before):
        raise UsageError(f"--home given twice ({before} and {after}); give it once")
    args.home = before


def _merge_json(args: argparse.Namespace) -> None:
    """``--json`` before the command counts as given after it; for a command that
    prints no JSON (``init``, ``serve``) it is a usage error, not ignored."""
    if not getattr(args, "root_json", False) or args.cmd is None:
        return
    if not hasattr(args, "json"):
        where = " ".join(filter(None, (args.cmd, args.verb)))
        raise UsageError(f"--json: `{where}` prints no JSON", f"{PROG} {where} --help")
    args.json = True


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, with the options given before the command merged in."""
    args = build_parser().parse_args(argv)
    _merge_home(args)
    _merge_json(args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``agents-control``."""
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer, exit
            complete(build_parser(), os.environ)
        check_argv(argv)
        args = parse_args(argv)
        if args.cmd == "completion":  # needs no home, config or daemon
            Output(as_json=False).write(completion_script(PROG, args.shell))
            return 0
        key = (args.cmd, args.verb)
        if key in COMMANDS and key in PRINTS_SECRET and not stdout_writable():
            raise UsageError(
                f"{' '.join(filter(None, key))}: stdout is closed, a pipe nobody reads or"
                " /dev/null, so the secret it prints only once would be lost; nothing was made"
            )
        # Library warnings (a refused call, a retry) would add a second line to the
        # one-line error of an admin verb; the daemon verbs log as configured.
        # A home that does not exist yet has no config.toml to read.
        fresh = args.cmd in ("init", "restore", "recovery-key", "drill")
        cfg = load_config(_flags(args), os.environ, read_file=not fresh)
        if args.cmd == "serve":
            setup_logging(cfg.log_level, cfg.log_format, native=True)
        else:
            # init prints a secret the operator must copy: keep its output to that
            # (and to real warnings), not the store's progress lines.
            _setup_logging("WARNING" if args.cmd == "init" else "CRITICAL")
        ctx = Ctx(args, cfg, Output(as_json=bool(getattr(args, "json", False) or args.root_json)))
        return dispatch(COMMANDS, PROG, args.cmd, args.verb, ctx)

    return run_main(PROG, body, message_for=_message)


if __name__ == "__main__":
    sys.exit(main())
