"""``agents-control``: the control-plane daemon and its admin verbs.

Only this module prints and picks exit codes (through :mod:`shared.cli`):
0 success, 1 failure, 2 bad input or a refused request (one line, maybe a
hint). The environment is read only through :func:`controlplane.config.load_config`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.access.tokens import MAX_USES
from controlplane.cli.admin_types import Account, Machine, NewJoinToken, rfc3339
from controlplane.cli.client import AdminClient, ControlPlaneUnreachable
from controlplane.cli.drill import MAX_MACHINES, DrillReport, run_drill
from controlplane.config import ControlConfig, load_config
from controlplane.integrity.keys import load_ca_cert
from controlplane.recovery.adopt import adopt_control_plane
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.recovery.fsck import fsck_deployment, serving_pid
from controlplane.recovery.restore import restore_home
from controlplane.server import run_daemon
from shared.cli import (
    INT64_MAX,
    CliParser,
    Column,
    ExitCode,
    Handler,
    Output,
    StdoutError,
    UsageError,
    bind_error,
    bounded_int,
    check_argv,
    dispatch,
    run_main,
    stdout_writable,
)
from shared.crypto import BoxKeyPair, decode_public_key, encode_private_key, encode_public_key
from shared.errors import AgentsError, ConfigError
from shared.recovery_key import read_recovery_key, write_recovery_key

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)

PROG = "agents-control"


def _duration(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 30m, 1h)")
    seconds = int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds < 1:
        # On the wire 0 means "the default"; on the command line it would be a surprise.
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text!r}")
    # The wire field is uint32; anything longer than a day is refused by the server
    # with a message naming the limit, so cap only what protobuf cannot carry.
    if seconds > UINT32_MAX:
        raise argparse.ArgumentTypeError(f"too long: {text!r}")
    return seconds


UINT32_MAX = 2**32 - 1
_uses = bounded_int(1, MAX_USES)
_drill_machines = bounded_int(1, MAX_MACHINES)
_github_id = bounded_int(1, INT64_MAX)


def _common(p: argparse.ArgumentParser, *, client: bool = True) -> None:
    p.add_argument("--home", help="control-plane home (AGENTS_CONTROL_HOME)")
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


def _verbs(
    sub: argparse._SubParsersAction[CliParser], cmd: str, text: str
) -> argparse._SubParsersAction[CliParser]:
    """The verbs of a command (``agents-control CMD VERB``); ``text`` is its help."""
    return sub.add_parser(cmd, help=text).add_subparsers(dest="verb", parser_class=CliParser)


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    root = CliParser(prog=PROG, description="The agents control plane.")
    root.set_defaults(verb=None)
    # Also before the command (`agents-control --home H machine list`), as
    # agents-machine takes --data-dir; each command takes it after itself too.
    root.add_argument("--home", dest="root_home", help="control-plane home (AGENTS_CONTROL_HOME)")
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
    p.add_argument("--ttl", type=_duration, default=None, help="lifetime (default 1h, max 24h)")
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
    p.add_argument("--ttl", type=_duration, default=None, help="lifetime (default 1h, max 24h)")

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
    return root


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "home store_url store_endpoint store_region listen link_listen metrics_listen "
        "advertise_host heartbeat_interval log_level address credential server_names"
    ).split()
    for name in ("home", "address", "credential"):
        # "$VAR" of an unset variable: never the default home, serve.json's
        # address or the environment's credential instead.
        if getattr(args, name, None) == "":
            raise UsageError(f"--{name}: empty; give a value or leave the option out")
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
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            "address", f"no --address and no running daemon found ({cfg.serve_path})"
        ) from None


def _client(cfg: ControlConfig) -> AdminClient:
    if not cfg.credential:
        raise ConfigError("credential", "give --credential or set AGENTS_CONTROL_CREDENTIAL")
    return AdminClient(_address(cfg), load_ca_cert(cfg.home), cfg.credential)


def _account_view(a: Account) -> dict[str, Any]:
    """An account as printed: its recovery public key as ``agpk1_…`` ("" when not a key)."""
    raw = a.recovery_public_key
    return {**a.to_json(), "recovery_public_key": encode_public_key(raw) if len(raw) == 32 else ""}


def _join_command(reply: NewJoinToken) -> str:
    return (
        f"agents-machine join {reply.join_address} --token {reply.token_value} "
        f"--ca-hash {reply.ca_hash}"
    )


@dataclass
class _Ctx:
    """What every handler gets: the arguments, the config, the output."""

    args: argparse.Namespace
    cfg: ControlConfig
    out: Output


def _emit(ctx: _Ctx, data: dict[str, Any], *text: str) -> int:
    """``data`` as JSON with --json, else the lines ``text``."""
    if ctx.out.as_json or not text:
        ctx.out.json(data)
    else:
        ctx.out.lines(*text)
    return ExitCode.OK


def _once(ctx: _Ctx, data: dict[str, Any], line: str, note: str) -> int:
    """What is shown once: ``data`` as JSON with --json, else ``line`` alone on stdout
    (so ``$(…)`` gets just that) and ``note``, what it is, on stderr."""
    _emit(ctx, data, line)
    if not ctx.out.as_json:
        ctx.out.note(note)
    return ExitCode.OK


def _record(ctx: _Ctx, data: dict[str, Any]) -> int:
    """One record: JSON with --json, else ``field  value`` lines."""
    if ctx.out.as_json:
        ctx.out.json(data)
    else:
        ctx.out.detail((key, "-" if value is None else str(value)) for key, value in data.items())
    return ExitCode.OK


def _listing(
    ctx: _Ctx, key: str, items: list[dict[str, Any]], columns: list[Column], rows: list[list[str]]
) -> int:
    if ctx.out.as_json:
        ctx.out.json({key: items})
    else:
        ctx.out.table(columns, rows)
    return ExitCode.OK


def _recovery_lines(private: bytes | None) -> list[str]:
    """The recovery private key init/adopt made, with what to do with it (shown once)."""
    if private is None:
        return []
    return [
        encode_private_key(private),
        "^ recovery private key (shown ONCE, never stored): save it to a file kept "
        "OFFLINE; `agents-control restore` needs it to rebuild this control plane",
    ]


async def _init(ctx: _Ctx) -> int:
    if ctx.args.adopt:
        return await _adopt(ctx)
    given = ctx.args.recovery_public_key
    public = decode_public_key(given) if given else None
    result = await init_control_plane(ctx.cfg, public)
    # The credential first, in one write: a reader that keeps only the first line
    # (`| head -1`) still gets the one thing that is never shown again.
    lines = [
        result.operator_credential,
        "^ operator credential (shown ONCE, stored only as a hash)",
    ]
    lines += _recovery_lines(result.recovery_private_key)
    try:
        ctx.out.lines(
            *lines,
            f"control plane initialised in {ctx.cfg.home}",
            f"CA hash: {result.ca_hash}",
        )
    except StdoutError as e:
        raise AgentsError(
            f"init: {e}: the control plane in {ctx.cfg.home} is made, but nobody has its"
            " operator credential (shown only once); remove that folder and the store's"
            " objects, then run init again with a working stdout"
        ) from None
    return ExitCode.OK


async def _recovery_key_new(ctx: _Ctx) -> int:
    pair = BoxKeyPair.generate()
    out = Path(ctx.args.out)
    write_recovery_key(out, pair, "the control plane's key bundle (agents-control restore)")
    public = encode_public_key(pair.public_key)
    return _once(
        ctx,
        {"public_key": public, "private_key_file": str(out)},
        public,
        f"private key written to {out} (0600): keep it offline; give the public key "
        "above to `agents-control init --recovery-public-key`",
    )


async def _adopt(ctx: _Ctx) -> int:
    given = ctx.args.recovery_public_key
    adopted = await adopt_control_plane(ctx.cfg, decode_public_key(given) if given else None)
    # As for init: the credential first, on a line of its own.
    ctx.out.lines(
        adopted.operator_credential,
        "^ operator credential (shown ONCE, stored only as a hash)",
        *_recovery_lines(adopted.recovery_private_key),
        f"store adopted with new keys in {ctx.cfg.home} "
        f"({adopted.objects_adopted} objects re-authenticated)",
        f"CA hash: {adopted.ca_hash}",
    )
    ctx.out.note(
        f"machines must re-pair: `{PROG} machine repair MACHINE` for each, then run the "
        "printed join command on that machine (it keeps its id, agents and backups)"
    )
    if adopted.provider_secrets_lost:
        ctx.out.note(
            f"{adopted.provider_secrets_lost} machine provider setting(s) were sealed with the "
            f"lost key: set them again (`{PROG} machine provider set`)"
        )
    return ExitCode.OK


async def _restore(ctx: _Ctx) -> int:
    recovery = read_recovery_key(Path(ctx.args.recovery_key), warn=ctx.out.note)
    result = await restore_home(ctx.cfg, recovery)
    data = {
        "home": str(result.home),
        "deployment_id": result.deployment_id,
        "ca_hash": result.ca_hash,
        "epoch": result.epoch,
    }
    return _emit(
        ctx,
        data,
        f"restored {result.home} (deployment {result.deployment_id}, epoch {result.epoch})",
        f"CA hash: {result.ca_hash} (unchanged: machines reconnect with their certificates)",
        f"next: agents-control serve --home {result.home}",
    )


async def _serve(ctx: _Ctx) -> int:
    try:
        await run_daemon(ctx.cfg)
    except (OSError, RuntimeError) as e:
        raise bind_error(e) or e from None
    return ExitCode.OK


async def _fsck(ctx: _Ctx) -> int:
    """Exit 0 when clean (or all repaired), 1 when something is left, 2 for bad usage."""
    args, cfg = ctx.args, ctx.cfg
    pid = serving_pid(cfg) if args.repair else None
    if pid is not None:
        raise UsageError(
            f"fsck: --repair needs serve stopped (pid {pid} runs)",
            "stop agents-control serve, then run fsck --repair again",
        )
    if args.vouch_backups and not args.repair:
        raise UsageError(
            "fsck: --vouch-backups writes: give --repair too",
            "agents-control fsck --repair --vouch-backups",
        )
    report = await fsck_deployment(cfg, repair=args.repair, vouch_backups=args.vouch_backups)
    if ctx.out.as_json:
        ctx.out.json(report.to_dict())
    else:
        ctx.out.lines(
            *(
                f"{f.kind} {f.key}: {f.detail}" + (" [repaired]" if f.repaired else "")
                for f in report.findings
            )
        )
        ctx.out.lines(
            *(f"deleting {acct}: account deletion in progress" for acct in report.deleting)
        )
        state = "clean" if report.clean else f"{len(report.findings)} finding(s)"
        ctx.out.lines(f"checked {report.objects} objects: {state}")
    return ExitCode.OK if report.clean else ExitCode.FAILED


async def _account_create(ctx: _Ctx) -> int:
    args = ctx.args
    public = decode_public_key(args.recovery_public_key) if args.recovery_public_key else b""
    async with _client(ctx.cfg) as c:
        reply = await c.create_account(args.github_id, args.github_login, public)
    acct = _account_view(reply.account)
    private = reply.recovery_private_key
    if ctx.out.as_json:
        if private:
            acct["recovery_private_key"] = encode_private_key(private)
        return _emit(ctx, acct)
    lines = [
        f"account {acct['account_id']} created for {acct['github_login']}",
        f"recovery public key: {acct['recovery_public_key']}",
    ]
    if private:
        lines = [
            encode_private_key(private),
            "^ recovery private key (shown ONCE, never stored; keep it offline)",
            *lines,
        ]
    ctx.out.lines(*lines)
    return ExitCode.OK


async def _account_show(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        return _record(ctx, _account_view(await c.get_account(ctx.args.account_id)))


async def _account_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        accounts = await c.list_accounts()
    rows = [
        [
            a.account_id,
            a.github_login,
            str(a.github_user_id),
            rfc3339(a.signed_up_at) or "",
            a.state,
        ]
        for a in accounts
    ]
    columns = [Column("account", whole=True), Column("login"), Column("github id", whole=True)]
    views = [_account_view(a) for a in accounts]
    return _listing(ctx, "accounts", views, [*columns, Column("signed up"), Column("state")], rows)


async def _token_create(ctx: _Ctx) -> int:
    args = ctx.args
    # No --ttl: send 0, which the control plane reads as its configured default.
    ttl = 0 if args.ttl is None else args.ttl
    async with _client(ctx.cfg) as c:
        reply = await c.create_token(args.account, ttl, args.uses)
    token = reply.token
    return _join_once(
        ctx,
        reply,
        _join_command(reply),
        f"token {token.token_id} for {token.account_id}, expires {rfc3339(token.expires_at)}, "
        f"uses {token.max_uses}: run the command above on the machine (shown once)",
    )


def _join_once(ctx: _Ctx, reply: NewJoinToken, command: str, note: str) -> int:
    """A new token's join ``command`` (shown once), with the reply under --json."""
    return _once(ctx, {**reply.to_json(), "join_command": command}, command, note)


async def _token_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        tokens = await c.list_tokens(ctx.args.account)
    rows = [
        [t.token_id, t.account_id, t.state, f"{t.uses}/{t.max_uses}", rfc3339(t.expires_at) or ""]
        for t in tokens
    ]
    columns = [Column("token", whole=True), Column("account", whole=True), Column("state")]
    more = [Column("uses"), Column("expires")]
    return _listing(ctx, "tokens", [t.to_json() for t in tokens], [*columns, *more], rows)


async def _token_revoke(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        reply = await c.revoke_token(ctx.args.token_id)
    return _emit(ctx, reply.to_json(), f"token {reply.token_id} revoked")


def _wake(m: Machine) -> str:
    """When a schedule of the machine wakes it (through its provider), or why not."""
    if m.next_fire_at is None:
        return "-"
    if not m.has_provider:
        return "no provider set"
    return rfc3339(m.next_wake_at) or "-"


async def _machine_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        machines = await c.list_machines(ctx.args.account)
    rows = [
        [
            m.machine_id,
            m.name,
            m.account_id,
            m.presence,
            rfc3339(m.last_seen_at) or "-",
            m.version,
            str(m.agent_count),
            _wake(m),
        ]
        for m in machines
    ]
    columns = [Column("machine", whole=True), Column("name"), Column("account", whole=True)]
    more = [Column("status"), Column("last seen"), Column("version"), Column("agents")]
    more.append(Column("next wake"))
    return _listing(ctx, "machines", [m.to_json() for m in machines], [*columns, *more], rows)


async def _machine_show(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        return _record(ctx, (await c.get_machine(ctx.args.machine_id)).to_json())


async def _machine_rename(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        reply = await c.rename_machine(ctx.args.machine_id, ctx.args.name)
    return _emit(ctx, reply.to_json(), f"machine {reply.machine_id} renamed to {reply.name}")


async def _machine_revoke(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        reply = await c.revoke_machine(ctx.args.machine_id)
    return _emit(ctx, reply.to_json(), f"machine {reply.machine_id} revoked")


async def _machine_repair(ctx: _Ctx) -> int:
    ttl = 0 if ctx.args.ttl is None else ctx.args.ttl
    async with _client(ctx.cfg) as c:
        reply = await c.create_repair_token(ctx.args.machine_id, ttl)
    # The new box restores the machine's newest backup with the account's recovery key.
    command = _join_command(reply) + " --recovery-key RECOVERY-KEY-FILE"
    return _join_once(
        ctx,
        reply,
        command,
        f"repair token {reply.token.token_id} for machine {ctx.args.machine_id}, expires "
        f"{rfc3339(reply.token.expires_at)}: run the command above on the NEW machine "
        "(shown once); the old machine's certificate is refused once it joins",
    )


async def _machine_provider(ctx: _Ctx) -> int:
    args = ctx.args
    if args.action == "set" and not args.provider:
        raise UsageError("machine provider set: name a provider (local or ec2)")
    name = args.provider if args.action == "set" else ""
    async with _client(ctx.cfg) as c:
        reply = await c.set_provider(args.machine_id, name, args.settings)
    what = f"provider {name} set" if name else "provider cleared"
    return _emit(ctx, reply.to_json(), f"machine {reply.machine_id}: {what}")


async def _credential_create(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        reply = await c.create_credential(ctx.args.account, ctx.args.label)
    return _once(
        ctx,
        reply.to_json(),
        reply.credential,
        f"credential {reply.credential_id} for {reply.account_id} "
        "(shown ONCE, stored only as a hash)",
    )


#: Seconds between two progress reads of ``account delete --wait``.
_DELETION_POLL = 0.5


async def _account_delete(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        deletion = await c.delete_account(ctx.args.account_id)
        while ctx.args.wait and deletion.state != "deleted":
            await asyncio.sleep(_DELETION_POLL)  # the daemon does the work; we only watch
            deletion = await c.get_deletion(ctx.args.account_id)
    return _record(ctx, deletion.to_json())


async def _account_deletion(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        return _record(ctx, (await c.get_deletion(ctx.args.account_id)).to_json())


#: The most a control plane takes as a prompt (``prompt_max_bytes`` is at most 4 MiB):
#: a --file read stops one byte past it (``/dev/zero`` must not fill the memory).
_PROMPT_FILE_MAX = 4 * 1024 * 1024


def _prompt_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return str(args.text)
    try:
        with open(args.file, "rb") as f:
            raw = f.read(_PROMPT_FILE_MAX + 1)
        if len(raw) > _PROMPT_FILE_MAX:
            raise UsageError(
                f"prompt send: {args.file} is larger than the 4 MiB a prompt may be at most"
                " (the control plane's prompt_max_bytes, 1 MiB by default)"
            )
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"prompt send: {args.file} is not UTF-8 text (byte {e.start}); prompts are text"
        ) from None
    except OSError as e:
        raise UsageError(f"prompt send: cannot read {args.file}: {e.strerror or e}") from None


async def _prompt_send(ctx: _Ctx) -> int:
    args = ctx.args
    text = _prompt_text(args)
    async with _client(ctx.cfg) as c:
        reply = await c.send_prompt(args.machine, args.agent, text, args.idempotency_key)
    if reply.state == "refused":
        # The machine refused it for good (an online machine answers at once; a
        # key sent again answers the first outcome): nothing will run. Exit 2,
        # as any refusal.
        raise UsageError(
            f"prompt send: prompt {reply.prompt_id} was refused by the machine:"
            f" {reply.reason or 'no reason given'}"
        )
    line = f"prompt {reply.prompt_id} {reply.state}"
    if reply.run_id:
        line += f" (run {reply.run_id})"
    return _emit(ctx, reply.to_json(), line)


async def _prompt_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        reply = await c.list_prompts(ctx.args.machine)
    if ctx.out.as_json:
        ctx.out.json(reply.to_json())
        return ExitCode.OK
    rows = [
        [
            p.prompt_id,
            p.agent_id,
            p.state + (f": {p.reason}" if p.reason else ""),
            p.run_id or "-",
            f"{p.age_seconds}s",
            str(p.size),
        ]
        for p in reply.prompts
    ]
    columns = [Column("prompt", whole=True), Column("agent", whole=True), Column("state")]
    more = [Column("run", whole=True), Column("age"), Column("size")]
    ctx.out.table([*columns, *more], rows)
    if reply.provider_error:
        ctx.out.note(f"provider: {reply.provider_error}")
    return ExitCode.OK


def _drill_text(r: DrillReport) -> list[str]:
    return [
        f"drill: {r.machines} machines, {r.stopped} stopped with {r.prompts_queued} "
        "prompts queued; control plane SIGKILLed and its home deleted",
        f"restore:            {r.restore_seconds:.2f} s",
        f"serving again:      {r.listening_seconds:.2f} s from the start of the restore",
        f"every machine back: {r.connected_seconds:.2f} s from the start of the restore "
        "(target < 5 s; the reference product's drill: 26 s for one machine)",
        f"prompts delivered:  {r.prompts_delivered}/{r.prompts_queued} "
        f"({r.delivered_seconds:.2f} s)",
        f"lost: {r.prompts_lost}  re-paired: {r.repaired}  not connected: {r.not_connected}",
        "result: " + ("OK" if r.ok else "FAILED"),
    ]


async def _drill(ctx: _Ctx) -> int:
    """Exit 0 when nothing was lost or paired again, 1 otherwise."""
    args = ctx.args
    env = dict(os.environ)  # the daemons it starts read their settings from it
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agents-drill-")))
        report = await run_drill(
            workdir,
            machines=args.machines,
            env=env,
            store_url=args.store_url or "",
            store_endpoint=args.store_endpoint or "",
        )
    _emit(ctx, report.to_dict(), *_drill_text(report))
    return ExitCode.OK if report.ok else ExitCode.FAILED


async def _cert_rotate_server(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        rotated = await c.rotate_server_certificate()
    data = {"serial": rotated.serial, "not_after": rotated.not_after.isoformat()}
    return _emit(
        ctx,
        data,
        f"server certificate rotated: serial {rotated.serial}, valid until {data['not_after']}",
    )


async def _ca_rollover(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as c:
        r = await c.rollover_ca(retire_old=ctx.args.retire_old)
    data = dataclasses.asdict(r)
    if r.state == "retired":
        text = f"old CA {r.old_ca_hash} retired; the CA is now {r.ca_hash}"
    else:
        text = (
            f"CA rollover in progress: new CA {r.ca_hash} (old {r.old_ca_hash} still trusted); "
            f"{r.machines_pending} machine(s) still to renew, {r.machines_notified} told now; "
            f"retire with `{PROG} ca rollover --retire-old` once none is left"
        )
    return _emit(ctx, data, text)


#: (command, verb) -> handler; a command without verbs has verb None.
COMMANDS: dict[tuple[str, str | None], Handler] = {
    ("init", None): _init,
    ("serve", None): _serve,
    ("fsck", None): _fsck,
    ("recovery-key", "new"): _recovery_key_new,
    ("restore", None): _restore,
    ("drill", None): _drill,
    ("account", "create"): _account_create,
    ("account", "show"): _account_show,
    ("account", "list"): _account_list,
    ("account", "delete"): _account_delete,
    ("account", "deletion"): _account_deletion,
    ("token", "create"): _token_create,
    ("token", "list"): _token_list,
    ("token", "revoke"): _token_revoke,
    ("machine", "list"): _machine_list,
    ("machine", "show"): _machine_show,
    ("machine", "rename"): _machine_rename,
    ("machine", "revoke"): _machine_revoke,
    ("machine", "repair"): _machine_repair,
    ("machine", "provider"): _machine_provider,
    ("credential", "create"): _credential_create,
    ("prompt", "send"): _prompt_send,
    ("prompt", "list"): _prompt_list,
    ("cert", "rotate-server"): _cert_rotate_server,
    ("ca", "rollover"): _ca_rollover,
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``agents-control``."""
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        check_argv(argv)
        args = build_parser().parse_args(argv)
        _merge_home(args)
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
        # init prints a secret the operator must copy: keep its output to that
        # (and to real warnings), not the store's progress lines.
        level = {"serve": cfg.log_level, "init": "WARNING"}.get(args.cmd, "CRITICAL")
        _setup_logging(level)
        ctx = _Ctx(args, cfg, Output(as_json=bool(getattr(args, "json", False))))
        return dispatch(COMMANDS, PROG, args.cmd, args.verb, ctx)

    return run_main(PROG, body, message_for=_message)


if __name__ == "__main__":
    sys.exit(main())
