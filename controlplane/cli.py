"""``agents-control``: the control-plane daemon and its admin verbs.

Only this module prints and picks exit codes: 0 success, 1 failure, 2 bad
input (one line with a hint). The environment is read only through
:func:`controlplane.config.load_config`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table
from rich.text import Text

from controlplane.bootstrap import init_control_plane
from controlplane.client import AdminClient, ControlPlaneUnreachable
from controlplane.config import ControlConfig, load_config
from controlplane.fsck import fsck_deployment, serving_pid
from controlplane.keys import load_ca_cert
from controlplane.server import run_daemon
from shared.crypto import decode_public_key, encode_private_key, encode_public_key
from shared.errors import (
    AgentsError,
    AlreadyExists,
    ConfigError,
    InvalidArgument,
    InvalidState,
    NotFound,
)

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_BAD_INPUT = (ConfigError, InvalidArgument, NotFound, AlreadyExists, InvalidState)


class UsageError(Exception):
    """Bad command-line input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _duration(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 30m, 1h)")
    seconds = int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds < 1:
        # On the wire 0 means "the default"; on the command line it would be a surprise.
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text!r}")
    return seconds


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _common(p: argparse.ArgumentParser, *, client: bool = True) -> None:
    p.add_argument("--home", type=Path, help="control-plane home (AGENTS_CONTROL_HOME)")
    if client:
        p.add_argument("--address", help="host:port of the daemon (default: from serve.json)")
        p.add_argument("--credential", help="admin credential (AGENTS_CONTROL_CREDENTIAL)")
        p.add_argument("--json", action="store_true", help="print JSON")


def _daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", dest="store_url", help="s3://bucket/prefix or a folder")
    p.add_argument("--store-endpoint", help="S3 endpoint URL (MinIO, moto)")
    p.add_argument("--store-region", help="S3 region")
    p.add_argument("--listen", help="public listener host:port (Join, Admin)")
    p.add_argument("--link-listen", help="mutual-TLS link listener host:port")
    p.add_argument("--metrics-listen", help="/metrics host:port ('' disables)")
    p.add_argument("--advertise-host", help="host printed in join commands")
    p.add_argument("--heartbeat-interval", type=float, help="seconds between heartbeats")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    root = _Parser(prog="agents-control", description="The agents control plane.")
    sub = root.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

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

    p = sub.add_parser("serve", help="run the daemon")
    _common(p, client=False)
    _daemon_flags(p)

    p = sub.add_parser("fsck", help="check the store for inconsistencies (read-only)")
    _common(p, client=False)
    _daemon_flags(p)
    p.add_argument("--repair", action="store_true", help="fix what can be fixed (serve stopped)")
    p.add_argument("--json", action="store_true", help="print JSON")

    acc = sub.add_parser("account", help="accounts").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = acc.add_parser("create", help="create an account")
    _common(p)
    p.add_argument("--github-id", type=int, required=True, help="GitHub numeric user id")
    p.add_argument("--github-login", required=True, help="GitHub login")
    p.add_argument("--recovery-public-key", help="agpk1_... (default: generate, print once)")
    p = acc.add_parser("show", help="show an account")
    _common(p)
    p.add_argument("account_id")
    p = acc.add_parser("list", help="list accounts")
    _common(p)

    tok = sub.add_parser("token", help="join tokens").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = tok.add_parser("create", help="create a join token and print the join command")
    _common(p)
    p.add_argument("--account", required=True, help="account id")
    p.add_argument("--ttl", type=_duration, default=None, help="lifetime (default 1h, max 24h)")
    p.add_argument("--uses", type=_at_least_one, default=1, help="how many joins (default 1)")
    p = tok.add_parser("list", help="list join tokens")
    _common(p)
    p.add_argument("--account", default="", help="account id")
    p = tok.add_parser("revoke", help="revoke a join token")
    _common(p)
    p.add_argument("token_id")

    mac = sub.add_parser("machine", help="machines").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = mac.add_parser("list", help="list machines")
    _common(p)
    p.add_argument("--account", default="", help="account id")
    for verb in ("show", "revoke"):
        p = mac.add_parser(verb, help=f"{verb} a machine")
        _common(p)
        p.add_argument("machine_id")
    p = mac.add_parser("rename", help="rename a machine")
    _common(p)
    p.add_argument("machine_id")
    p.add_argument("name")

    cred = sub.add_parser("credential", help="admin credentials").add_subparsers(
        dest="verb", required=True, parser_class=_Parser
    )
    p = cred.add_parser("create", help="create an account-scoped admin credential")
    _common(p)
    p.add_argument("--account", required=True, help="account id")
    p.add_argument("--label", default="account admin", help="a label to recognise it by")
    return root


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "home store_url store_endpoint store_region listen link_listen metrics_listen "
        "advertise_host heartbeat_interval log_level address credential server_names"
    ).split()
    return {n: getattr(args, n, None) for n in names}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _address(cfg: ControlConfig) -> str:
    if cfg.address:
        return cfg.address
    try:
        info = json.loads(cfg.serve_path.read_text())
        return str(info["public"])
    except (OSError, ValueError, KeyError):
        raise ConfigError(
            "address", f"no --address and no running daemon found ({cfg.serve_path})"
        ) from None


def _client(cfg: ControlConfig) -> AdminClient:
    if not cfg.credential:
        raise ConfigError("credential", "give --credential or set AGENTS_CONTROL_CREDENTIAL")
    return AdminClient(_address(cfg), load_ca_cert(cfg.home), cfg.credential)


def _print_table(console: Console, columns: Sequence[str], rows: list[list[str]]) -> None:
    table = Table()
    for column in columns:
        # Ids must print whole: fold rather than truncate them.
        table.add_column(column, overflow="fold")
    for row in rows:
        # Cells carry what machines and users typed: text, never Rich markup.
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)


def _pubkey(b64: str) -> str:
    raw = base64.b64decode(b64) if b64 else b""
    return encode_public_key(raw) if len(raw) == 32 else ""


def _account_view(a: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    out["recovery_public_key"] = _pubkey(str(a.get("recovery_public_key", "")))
    return out


def _join_command(reply: dict[str, Any]) -> str:
    return (
        f"agents-machine join {reply['join_address']} --token {reply['token_value']} "
        f"--ca-hash {reply['ca_hash']}"
    )


async def _run_admin(args: argparse.Namespace, cfg: ControlConfig, out: Console) -> int:
    as_json = bool(getattr(args, "json", False))

    def emit(data: Any, columns: Sequence[str] = (), rows: list[list[str]] | None = None) -> None:
        if as_json or rows is None:
            print(json.dumps(data, indent=2, sort_keys=True))
        else:
            _print_table(out, columns, rows)

    async with _client(cfg) as c:
        cmd, verb = args.cmd, args.verb
        if cmd == "account" and verb == "create":
            public = (
                decode_public_key(args.recovery_public_key) if args.recovery_public_key else b""
            )
            reply = await c.create_account(args.github_id, args.github_login, public)
            acct = _account_view(reply["account"])
            private = base64.b64decode(reply.get("recovery_private_key") or "")
            if as_json:
                if private:
                    acct["recovery_private_key"] = encode_private_key(private)
                emit(acct)
            else:
                print(f"account {acct['account_id']} created for {acct['github_login']}")
                print(f"recovery public key: {acct['recovery_public_key']}")
                if private:
                    print("recovery private key (shown ONCE, never stored; keep it offline):")
                    print(encode_private_key(private))
            return EXIT_OK
        if cmd == "account" and verb == "show":
            emit(_account_view(await c.get_account(args.account_id)))
            return EXIT_OK
        if cmd == "account" and verb == "list":
            accounts = [_account_view(a) for a in await c.list_accounts()]
            rows = [
                [
                    a["account_id"],
                    a["github_login"],
                    str(a["github_user_id"]),
                    a.get("signed_up_at", ""),
                    a["state"],
                ]
                for a in accounts
            ]
            emit(accounts, ["account", "login", "github id", "signed up", "state"], rows)
            return EXIT_OK
        if cmd == "token" and verb == "create":
            # No --ttl: send 0, which the control plane reads as its configured default.
            ttl = 0 if args.ttl is None else args.ttl
            reply = await c.create_token(args.account, ttl, args.uses)
            command = _join_command(reply)
            if as_json:
                emit({**reply, "join_command": command})
            else:
                print(
                    f"token {reply['token']['token_id']} for {reply['token']['account_id']}, "
                    f"expires {reply['token']['expires_at']}, uses {reply['token']['max_uses']}"
                )
                print("run this on the machine (shown once):")
                print(command)
            return EXIT_OK
        if cmd == "token" and verb == "list":
            tokens = await c.list_tokens(args.account)
            rows = [
                [
                    t["token_id"],
                    t["account_id"],
                    t["state"],
                    f"{t['uses']}/{t['max_uses']}",
                    t.get("expires_at", ""),
                ]
                for t in tokens
            ]
            emit(tokens, ["token", "account", "state", "uses", "expires"], rows)
            return EXIT_OK
        if cmd == "token" and verb == "revoke":
            reply = await c.revoke_token(args.token_id)
            print(f"token {reply['token_id']} revoked") if not as_json else emit(reply)
            return EXIT_OK
        if cmd == "machine" and verb == "list":
            machines = await c.list_machines(args.account)
            rows = [
                [
                    m["machine_id"],
                    m["name"],
                    m["account_id"],
                    "revoked" if m["revoked"] else "online" if m["online"] else "offline",
                    m.get("last_seen_at", "") or "-",
                    m["version"],
                    str(m["agent_count"]),
                ]
                for m in machines
            ]
            emit(
                machines,
                ["machine", "name", "account", "status", "last seen", "version", "agents"],
                rows,
            )
            return EXIT_OK
        if cmd == "machine" and verb == "show":
            emit(await c.get_machine(args.machine_id))
            return EXIT_OK
        if cmd == "machine" and verb == "rename":
            reply = await c.rename_machine(args.machine_id, args.name)
            print(
                f"machine {reply['machine_id']} renamed to {reply['name']}"
            ) if not as_json else emit(reply)
            return EXIT_OK
        if cmd == "machine" and verb == "revoke":
            reply = await c.revoke_machine(args.machine_id)
            print(f"machine {reply['machine_id']} revoked") if not as_json else emit(reply)
            return EXIT_OK
        if cmd == "credential" and verb == "create":
            reply = await c.create_credential(args.account, args.label)
            if as_json:
                emit(reply)
            else:
                print(
                    f"credential {reply['credential_id']} for {reply['account_id']} "
                    "(shown ONCE, stored only as a hash):"
                )
                print(reply["credential"])
            return EXIT_OK
    raise UsageError(f"agents-control: unknown command {args.cmd} {getattr(args, 'verb', '')}")


async def _run(args: argparse.Namespace, cfg: ControlConfig, out: Console) -> int:
    if args.cmd == "init":
        result = await init_control_plane(cfg)
        print(f"control plane initialised in {cfg.home}")
        print(f"CA hash: {result.ca_hash}")
        print("operator credential (shown ONCE, stored only as a hash):")
        print(result.operator_credential)
        return EXIT_OK
    if args.cmd == "serve":
        await run_daemon(cfg)
        return EXIT_OK
    if args.cmd == "fsck":
        return await _fsck(args, cfg)
    return await _run_admin(args, cfg, out)


async def _fsck(args: argparse.Namespace, cfg: ControlConfig) -> int:
    """Exit 0 when clean (or all repaired), 1 when something is left, 2 for bad usage."""
    pid = serving_pid(cfg) if args.repair else None
    if pid is not None:
        raise UsageError(f"agents-control fsck: --repair needs serve stopped (pid {pid} runs)")
    report = await fsck_deployment(cfg, repair=args.repair)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        for f in report.findings:
            print(f"{f.kind} {f.key}: {f.detail}" + (" [repaired]" if f.repaired else ""))
        state = "clean" if report.clean else f"{len(report.findings)} finding(s)"
        print(f"checked {report.objects} objects: {state}")
    return EXIT_OK if report.clean else EXIT_FAIL


def _fail(line: str, hint: str | None = None) -> None:
    """Print an error as ONE line on stderr (plus an optional "Try:" line).

    Plain print, not rich: rich wraps at the terminal width (80 columns when
    stderr is a pipe), which would split the line. Newlines inside a message
    (a path, a server's text) are folded for the same reason.
    """
    print(" ".join(line.split()), file=sys.stderr)
    if hint:
        print(f"Try: {hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``agents-control``."""
    try:
        args = build_parser().parse_args(argv)
        cfg = load_config(_flags(args), os.environ, read_file=args.cmd != "init")
    except UsageError as e:
        _fail(str(e), "agents-control --help")
        return EXIT_USAGE
    except (ConfigError, InvalidArgument) as e:
        _fail(f"agents-control: {e}")
        return EXIT_USAGE
    _setup_logging(cfg.log_level if args.cmd in ("serve", "init") else "WARNING")
    try:
        return asyncio.run(_run(args, cfg, Console(highlight=False)))
    except UsageError as e:
        _fail(str(e), "agents-control --help")
        return EXIT_USAGE
    except _BAD_INPUT as e:
        # What the caller named is wrong (malformed, missing, in the wrong state):
        # exit 2, as the machine CLI does.
        _fail(f"agents-control: {e}")
        return EXIT_USAGE
    except ControlPlaneUnreachable as e:
        _fail(f"agents-control: {e} (is `agents-control serve` running?)")
        return EXIT_FAIL
    except AgentsError as e:
        _fail(f"agents-control: {e}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
