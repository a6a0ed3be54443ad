"""``agents-machine``: the machine daemon and its local verbs.

Only this module prints and chooses exit codes: 0 success, 1 a failed run or
an unreachable daemon, 2 bad input or a refused request (one line, and a
"Try: ..." hint where one helps), 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table
from rich.text import Text

from machine.config import MachineConfig, server_data_dir
from machine.dbfaults import run_check
from machine.models import validate_runtime_ref
from shared.errors import (
    AgentsError,
    AlreadyExists,
    ConfigError,
    InvalidArgument,
    InvalidState,
    NotFound,
    TransientError,
)
from shared.ids import validate_id
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.rpc import rpc_errors

__all__ = ["main"]

logger = logging.getLogger(__name__)

PROG = "agents-machine"
_CHUNK = 256 * 1024
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Usage(Exception):
    """A usage error found by the CLI itself."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class _DaemonDown(Exception):
    """The daemon's socket does not answer."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # main() puts "agents-machine: " in front; name only the subcommand here.
        where = self.prog.removeprefix(PROG).strip()
        raise _Usage(f"{where}: {message}" if where else message, f"{self.prog} --help")


# ---------------------------------------------------------------- output


class Out:
    """People get rich tables and streaming text; scripts get JSON (--json)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.console = Console(highlight=False, soft_wrap=True)

    def message(self, msg: Message) -> None:
        print(json.dumps(_to_dict(msg), sort_keys=True), flush=True)

    def line(self, text: str) -> None:
        self.console.print(text, markup=False)


def _to_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


def _state(agent: pb.Agent) -> str:
    name = pb.AgentState.Name(agent.state).removeprefix("AGENT_STATE_").lower()
    return name if agent.local else f"{name} (from {agent.origin_machine})"


def _agents_table(out: Out, agents: Sequence[pb.Agent]) -> None:
    table = Table("id", "name", "runtime", "state", "folder", box=None)
    for a in agents:
        table.add_row(*_cells(a.id, a.name, a.runtime, _state(a), a.folder))
    out.console.print(table)


def _agent_detail(out: Out, a: pb.Agent) -> None:
    table = Table(show_header=False, box=None)
    for key, value in (
        ("id", a.id),
        ("name", a.name),
        ("state", _state(a)),
        ("runtime", a.runtime),
        ("settings", a.settings_json),
        ("folder", a.folder),
        ("origin", a.origin_machine),
        ("session", a.session_id or "-"),
        ("events", str(a.last_seq)),
        ("created", a.created_at.ToDatetime().isoformat(timespec="seconds") + "Z"),
    ):
        table.add_row(*_cells(key, value))
    out.console.print(table)


def _render_event(out: Out, ev: pb.RunEvent, state: dict[str, bool]) -> int | None:
    """Print one event for people; return an exit code when the run ended."""
    kind = ev.WhichOneof("payload")
    write = sys.stdout.write
    if kind == "text_delta":
        write(ev.text_delta.text)
        sys.stdout.flush()
        state["mid_line"] = True
        return None
    if state.get("mid_line"):
        write("\n")
        state["mid_line"] = False
    if kind == "run_started":
        out.line(f"[run {ev.run_id}]")
    elif kind == "tool_call":
        out.line(f"[tool {ev.tool_call.title}] {ev.tool_call.input_json}")
    elif kind == "tool_result":
        out.line(f"[tool {ev.tool_result.status}] {ev.tool_result.output}")
    elif kind == "permission_request":
        req = ev.permission_request
        options = ", ".join(o.option_id for o in req.options)
        out.line(f"[permission] {req.title}: waiting for an answer ({options})")
        out.line(f"Try: {PROG} agent answer {ev.run_id} {req.request_id} OPTION [--remember]")
    elif kind == "permission_answered":
        ans = ev.permission_answered
        how = "by a remembered rule" if ans.by_rule else "by a person"
        out.line(f"[permission] {ans.option_id} ({how})")
    elif kind == "run_finished":
        fin = ev.run_finished
        out.line(
            f"[done] {fin.stop_reason}, {fin.usage.input_tokens} in / "
            f"{fin.usage.output_tokens} out tokens, {fin.duration_ms} ms"
        )
        return EXIT_OK
    elif kind == "run_error":
        code = pb.RunErrorCode.Name(ev.run_error.code)
        out.line(f"[error {code}] {ev.run_error.message}")
        return EXIT_FAILED
    return None


# ---------------------------------------------------------------- client


@contextlib.asynccontextmanager
async def _client(cfg: MachineConfig) -> AsyncIterator[pb_grpc.MachineServiceAsyncStub]:
    if not cfg.socket.exists():
        raise _DaemonDown(str(cfg.socket))
    async with grpc.aio.insecure_channel(
        f"unix://{cfg.socket}",
        options=[("grpc.max_send_message_length", 64 * 1024 * 1024)],
    ) as channel:
        try:
            async with rpc_errors():
                yield pb_grpc.MachineServiceStub(channel)
        except TransientError as e:
            raise _DaemonDown(str(cfg.socket)) from e


async def _upload(stub: pb_grpc.MachineServiceAsyncStub, agent_id: str, path: Path) -> str:
    try:
        size = path.stat().st_size
        handle = path.open("rb")
    except OSError as e:
        raise _Usage(f"attach: cannot read {path}: {e.strerror}") from None

    async def parts() -> AsyncIterator[pb.UploadAttachmentRequest]:
        yield pb.UploadAttachmentRequest(
            header=pb.AttachmentHeader(agent_id=agent_id, file_name=path.name, size=size)
        )
        with handle:
            while chunk := handle.read(_CHUNK):
                yield pb.UploadAttachmentRequest(chunk=chunk)

    reply: pb.Attachment = await stub.UploadAttachment(parts())
    return reply.sha256


#: A person's answer at the terminal: (option id, remember) or None to leave it pending.
Asker = Callable[[pb.PermissionRequest], Awaitable[tuple[str, bool] | None]]


def _choose(req: pb.PermissionRequest, reply: str) -> tuple[str, bool] | None:
    """Map what a person typed (a number or an option id; "+" = remember) to an answer."""
    reply = reply.strip()
    remember = reply.endswith("+")
    reply = reply.rstrip("+").strip()
    options = list(req.options)
    if reply.isdigit() and 1 <= int(reply) <= len(options):
        return options[int(reply) - 1].option_id, remember
    for option in options:
        if reply == option.option_id:
            return option.option_id, remember
    return None


async def _ask_at_terminal(req: pb.PermissionRequest) -> tuple[str, bool] | None:
    """Ask on the terminal; an empty line leaves the request pending."""
    choices = "  ".join(f"{i}) {o.name or o.option_id}" for i, o in enumerate(req.options, 1))
    prompt = f"allow {req.title}? {choices}  (number, + to remember, Enter to leave it): "
    while True:
        try:
            reply = await asyncio.to_thread(input, prompt)
        except EOFError:
            return None
        if not reply.strip():
            return None
        chosen = _choose(req, reply)
        if chosen is not None:
            return chosen


async def _stream(
    out: Out,
    events: Any,
    *,
    ask: Asker | None = None,
    stub: pb_grpc.MachineServiceAsyncStub | None = None,
) -> int:
    state: dict[str, bool] = {}
    code: int | None = None
    async for ev in events:
        if out.as_json:
            out.message(ev)
            kind = ev.WhichOneof("payload")
            if kind in ("run_finished", "run_error"):
                code = EXIT_OK if kind == "run_finished" else EXIT_FAILED
            continue
        got = _render_event(out, ev, state)
        code = got if got is not None else code
        if (
            ask is not None
            and stub is not None
            and ev.WhichOneof("payload") == ("permission_request")
        ):
            # A person is at the terminal: answer here (the stream carries the rest).
            chosen = await ask(ev.permission_request)
            if chosen is not None:
                option_id, remember = chosen
                await stub.AnswerPermission(
                    pb.AnswerPermissionRequest(
                        run_id=ev.run_id,
                        request_id=ev.permission_request.request_id,
                        option_id=option_id,
                        remember=remember,
                    )
                )
    if state.get("mid_line"):
        sys.stdout.write("\n")
    return code if code is not None else EXIT_OK


# ---------------------------------------------------------------- commands


# Positional or option -> (id kind, the field named in the error). Checked before
# the daemon is dialled, so a malformed id is a usage error even when it is down.
_ID_ARGS: dict[str, tuple[str, str]] = {
    "id": ("agent", "agent_id"),
    "agent": ("agent", "agent_id"),
    "run_id": ("run", "run_id"),
}


def _check_args(args: argparse.Namespace) -> None:
    """Validate ids and runtime references given on the command line."""
    for attr, (kind, field) in _ID_ARGS.items():
        value = getattr(args, attr, None)
        if value is not None:
            validate_id(kind, value, field)
    for attr in ("request_id", "option_id"):
        value = getattr(args, attr, None)
        if value is not None:
            validate_runtime_ref(value, attr)


async def _cmd_status(cfg: MachineConfig, args: argparse.Namespace, out: Out) -> int:
    async with _client(cfg) as stub:
        st: pb.StatusResponse = await stub.Status(pb.StatusRequest())
    joined = st.joined
    if out.as_json:
        print(json.dumps({**_to_dict(st), "joined": joined}, sort_keys=True), flush=True)
        return EXIT_OK
    table = Table(show_header=False, box=None)
    for key, value in (
        ("version", st.version),
        ("data folder", st.data_dir),
        ("machine", f"{st.machine_id} ({'joined' if joined else 'stand-alone'})"),
        ("agents", f"{st.active_agents} active, {st.archived_agents} archived"),
        ("runs", f"{st.open_runs} open, {st.waiting_runs} waiting for a person"),
        ("runtimes", ", ".join(st.runtimes)),
        ("schema", str(st.schema_version)),
    ):
        table.add_row(*_cells(key, value))
    out.console.print(table)
    return EXIT_OK


async def _cmd_check(cfg: MachineConfig, args: argparse.Namespace, out: Out) -> int:
    """Full integrity check of machine.db: by the daemon, or here when it is not running
    (a damaged database keeps the daemon from starting)."""
    try:
        async with _client(cfg) as stub:
            reply: pb.CheckDatabaseResponse = await stub.CheckDatabase(pb.CheckDatabaseRequest())
        ok, problems, path = reply.ok, list(reply.problems), reply.path
    except _DaemonDown:
        if not cfg.db_path.exists():
            raise
        result = await asyncio.to_thread(run_check, cfg.db_path, full=True)
        ok, problems, path = result.ok, list(result.problems), str(cfg.db_path)
    if out.as_json:
        print(json.dumps({"ok": ok, "path": path, "problems": problems}), flush=True)
    elif ok:
        out.line(f"{path}: ok")
    else:
        out.line(f"{path}: damaged ({len(problems)} problem(s) found); first: {problems[0]}")
        out.line("Keep a copy of the data folder, then restore machine.db from a backup")
        out.line("or salvage it with `sqlite3 machine.db .recover` (docs/machine.md).")
    return EXIT_OK if ok else EXIT_FAILED


async def _cmd_agent(cfg: MachineConfig, args: argparse.Namespace, out: Out) -> int:
    verb: str = args.verb
    async with _client(cfg) as stub:
        if verb == "create":
            folder = args.folder or os.getcwd()
            agent = await stub.CreateAgent(
                pb.CreateAgentRequest(
                    name=args.name,
                    folder=str(Path(folder).absolute()),
                    runtime=args.runtime or "",
                    settings_json=args.settings or "",
                )
            )
            return _show_agent(out, agent, created=True)
        if verb == "list":
            listed = await stub.ListAgents(pb.ListAgentsRequest(include_archived=args.all))
            if out.as_json:
                out.message(listed)
            else:
                _agents_table(out, listed.agents)
            return EXIT_OK
        if verb == "show":
            return _show_agent(out, await stub.GetAgent(pb.GetAgentRequest(agent_id=args.id)))
        if verb == "rename":
            agent = await stub.RenameAgent(pb.RenameAgentRequest(agent_id=args.id, name=args.name))
            return _show_agent(out, agent)
        if verb == "archive":
            return _show_agent(
                out, await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=args.id))
            )
        if verb == "unarchive":
            return _show_agent(
                out, await stub.UnarchiveAgent(pb.UnarchiveAgentRequest(agent_id=args.id))
            )
        if verb == "prompt":
            text = " ".join(args.text)
            if args.stdin:
                text = sys.stdin.read()
            shas = [await _upload(stub, args.id, Path(p)) for p in args.attach or []]
            # Ask inline only when a person is at the terminal (never for --stdin or scripts).
            interactive = not args.stdin and sys.stdin.isatty() and sys.stdout.isatty()
            return await _stream(
                out,
                stub.Prompt(pb.PromptRequest(agent_id=args.id, text=text, attachments=shas)),
                ask=_ask_at_terminal if interactive else None,
                stub=stub,
            )
        if verb == "replay":
            return await _stream(
                out,
                stub.Replay(
                    pb.ReplayRequest(agent_id=args.id, after_seq=args.after, follow=args.follow)
                ),
            )
        if verb == "cancel":
            run = await stub.CancelRun(pb.CancelRunRequest(run_id=args.run_id))
            return _show_run(out, run)
        if verb == "answer":
            answered = await stub.AnswerPermission(
                pb.AnswerPermissionRequest(
                    run_id=args.run_id,
                    request_id=args.request_id,
                    option_id=args.option_id,
                    remember=args.remember,
                )
            )
            return _show_run(out, answered.run)
        if verb == "runs":
            runs = await stub.ListRuns(pb.ListRunsRequest(agent_id=args.id, limit=args.limit))
            if out.as_json:
                out.message(runs)
                return EXIT_OK
            table = Table("run", "state", "tokens in/out", "ms", "prompt", box=None)
            for r in runs.runs:
                state = pb.RunState.Name(r.state).removeprefix("RUN_STATE_").lower()
                tokens = f"{r.usage.input_tokens}/{r.usage.output_tokens}"
                table.add_row(*_cells(r.id, state, tokens, str(r.duration_ms), r.prompt[:40]))
            out.console.print(table)
            return EXIT_OK
        if verb == "search":
            found = await stub.Search(
                pb.SearchRequest(
                    query=" ".join(args.query), agent_id=args.agent or "", limit=args.limit
                )
            )
            if out.as_json:
                out.message(found)
                return EXIT_OK
            table = Table("agent", "seq", "source", "match", box=None)
            for h in found.hits:
                name = h.agent_name + (" (archived)" if h.archived else "")
                table.add_row(*_cells(name, str(h.seq), h.source, h.snippet))
            out.console.print(table)
            return EXIT_OK
    raise _Usage(f"agent: unknown verb {verb!r}", f"{PROG} agent --help")


def _show_agent(out: Out, agent: pb.Agent, *, created: bool = False) -> int:
    if out.as_json:
        out.message(agent)
    elif created:
        out.line(agent.id)
    else:
        _agent_detail(out, agent)
    return EXIT_OK


def _show_run(out: Out, run: pb.Run) -> int:
    if out.as_json:
        out.message(run)
    else:
        out.line(f"{run.id} {pb.RunState.Name(run.state).removeprefix('RUN_STATE_').lower()}")
    return EXIT_OK


def _serve_config(
    args: argparse.Namespace, env: os._Environ[str] | dict[str, str]
) -> MachineConfig:
    flags = {
        "data_dir": args.data_dir,
        "socket_path": getattr(args, "socket", None),
        "tcp_address": getattr(args, "tcp", None),
        "metrics_address": getattr(args, "metrics", None),
        "prompt_limit": getattr(args, "prompt_limit", None),
        "attachment_limit": getattr(args, "attachment_limit", None),
        "background_loops": False if getattr(args, "no_background", False) else None,
        "shutdown_grace_seconds": getattr(args, "grace", None),
    }
    config_file = getattr(args, "config", None)
    return MachineConfig.build(
        flags=flags,
        env=env,
        home=Path.home(),
        config_file=Path(config_file) if config_file else None,
    )


def _run_serve(cfg: MachineConfig) -> int:
    from machine.daemon import serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.umask(0o077)  # everything the daemon creates is private to its user
    asyncio.run(serve(cfg))
    return EXIT_OK


def _cmd_join(args: argparse.Namespace, env: dict[str, str]) -> int:
    # Imported here: only `join` needs the join flow and the service installer.
    from machine.join import join_control_plane
    from machine.service_unit import install_service

    data_dir = Path(args.data_dir).absolute() if args.data_dir else server_data_dir(Path.home())
    args.data_dir = str(data_dir)
    cfg = _serve_config(args, env)
    result = asyncio.run(
        join_control_plane(
            data_dir=data_dir,
            address=args.address,
            token=args.token,
            ca_hash=args.ca_hash,
            name=args.name,
        )
    )
    print(f"joined as machine {result.machine_id} (account {result.account_id})", flush=True)
    if args.install_service:
        installed = install_service(data_dir=data_dir)
        print(f"installed {installed.unit_path}", flush=True)
        if installed.started:
            return EXIT_OK
    return _run_serve(cfg)


def _add_global_options(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "--data-dir",
        default=default,
        help="data folder (default: $AGENTS_DATA_DIR or the platform's)",
    )
    p.add_argument(
        "--socket", default=default, help="daemon socket (default: <data dir>/machine.sock)"
    )
    p.add_argument("--json", action="store_true", default=default, help="print JSON for scripts")


def _cells(*values: str) -> list[Text]:
    # Names, folders and snippets are user or agent text: never Rich markup.
    return [Text(v) for v in values]


def _parser() -> _Parser:
    p = _Parser(prog=PROG, description="The machine agent: runs your AI coding agents.")
    _add_global_options(p, argparse.SUPPRESS)
    p.set_defaults(data_dir=None, socket=None, json=False)
    # The same options are accepted after the subcommand too (`serve --data-dir D`),
    # as systemd units and pasted join commands put them there.
    common = _Parser(add_help=False)
    _add_global_options(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    # `join` serves once joined, so it takes the daemon's options too.
    serving = _Parser(add_help=False)
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

    sub.add_parser("status", parents=[common], help="the daemon's health and counts")
    sub.add_parser("check", parents=[common], help="run a full integrity check of machine.db")

    a = sub.add_parser("agent", parents=[common], help="agents and their runs")
    verbs = a.add_subparsers(dest="verb", parser_class=_Parser)
    c = verbs.add_parser("create", parents=[common], help="create an agent")
    c.add_argument("name")
    c.add_argument("--folder", help="the folder it works in (default: here)")
    c.add_argument("--runtime", help="echo (default) or acp")
    c.add_argument("--settings", help="runtime settings as a JSON object")
    ls = verbs.add_parser("list", parents=[common], help="list agents")
    ls.add_argument("--all", action="store_true", help="include archived agents")
    for verb in ("show", "archive", "unarchive"):
        verbs.add_parser(verb, parents=[common], help=f"{verb} an agent").add_argument("id")
    r = verbs.add_parser("rename", parents=[common], help="rename an agent")
    r.add_argument("id")
    r.add_argument("name")
    pr = verbs.add_parser("prompt", parents=[common], help="prompt an agent and stream the run")
    pr.add_argument("id")
    pr.add_argument("text", nargs="*")
    pr.add_argument("--stdin", action="store_true", help="read the prompt from stdin")
    pr.add_argument("--attach", action="append", help="attach a file (repeatable)")
    rp = verbs.add_parser("replay", parents=[common], help="stream an agent's stored events")
    rp.add_argument("id")
    rp.add_argument("--after", type=int, default=0, help="only events after this seq")
    rp.add_argument("--follow", action="store_true", help="keep streaming new events")
    cn = verbs.add_parser("cancel", parents=[common], help="cancel a run")
    cn.add_argument("run_id")
    an = verbs.add_parser("answer", parents=[common], help="answer a permission request")
    an.add_argument("run_id")
    an.add_argument("request_id")
    an.add_argument("option_id")
    an.add_argument("--remember", action="store_true", help="for this agent and tool, always")
    ru = verbs.add_parser("runs", parents=[common], help="an agent's runs: usage and time history")
    ru.add_argument("id")
    ru.add_argument("--limit", type=int, default=20)
    se = verbs.add_parser(
        "search", parents=[common], help="search conversations, tool logs and summaries"
    )
    se.add_argument("query", nargs="+")
    se.add_argument("--agent", help="only this agent")
    se.add_argument("--limit", type=int, default=20)
    return p


def _hint(err: AgentsError) -> str | None:
    if isinstance(err, NotFound) or (
        isinstance(err, InvalidArgument) and getattr(err, "field", "") == "agent_id"
    ):
        return f"{PROG} agent list --all"
    if isinstance(err, InvalidState) and "archived" in err.message:
        return f"{PROG} agent unarchive ID"
    if isinstance(err, ConfigError):
        return f"{PROG} serve --help"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    env = dict(os.environ)
    out = Out(as_json=False)

    def fail(message: str, hint: str | None, code: int) -> int:
        print(f"{PROG}: {message}", file=sys.stderr)
        if hint:
            print(f"Try: {hint}", file=sys.stderr)
        return code

    try:
        args = _parser().parse_args(argv)
        out = Out(as_json=args.json)
        if args.command is None:
            raise _Usage("missing command", f"{PROG} --help")
        if args.command == "join":
            return _cmd_join(args, env)
        cfg = _serve_config(args, env)
        if args.command == "serve":
            return _run_serve(cfg)
        handlers: dict[str, Callable[[MachineConfig, argparse.Namespace, Out], Any]] = {
            "status": _cmd_status,
            "check": _cmd_check,
            "agent": _cmd_agent,
        }
        if args.command == "agent" and args.verb is None:
            raise _Usage("agent: missing verb", f"{PROG} agent --help")
        _check_args(args)
        return int(asyncio.run(handlers[args.command](cfg, args, out)))
    except _Usage as e:
        return fail(e.message, e.hint, EXIT_USAGE)
    except _DaemonDown as e:
        return fail(
            f"the machine daemon is not running (no answer on {e})", f"{PROG} serve", EXIT_FAILED
        )
    except (InvalidArgument, NotFound, InvalidState, AlreadyExists, ConfigError) as e:
        return fail(e.message, _hint(e), EXIT_USAGE)
    except AgentsError as e:
        return fail(e.message, None, EXIT_FAILED)
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted (a run goes on; cancel it with `{PROG} agent cancel RUN`)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
