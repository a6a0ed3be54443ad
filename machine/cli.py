"""``agents-machine``: the machine daemon and its local verbs.

Only this module prints and chooses exit codes (through :mod:`shared.cli`):
0 success, 1 a failed run or an unreachable daemon, 2 bad input or a refused
request (one line, and a "Try: ..." hint where one helps), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from machine.config import MachineConfig, server_data_dir
from machine.dbfaults import run_check
from machine.models import validate_runtime_ref
from shared.cli import (
    INT32_MAX,
    INT64_MAX,
    CliParser,
    Column,
    ExitCode,
    Handler,
    Output,
    UsageError,
    bind_error,
    bounded_int,
    check_argv,
    dispatch,
    message_dict,
    read_stdin_text,
    run_main,
    stdout_writable,
)
from shared.crypto import encode_private_key
from shared.errors import (
    AgentsError,
    ConfigError,
    InvalidArgument,
    InvalidState,
    NotFound,
    TransientError,
)
from shared.ids import validate_id
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.recovery_key import read_recovery_key
from shared.rpc import rpc_errors
from shared.timestamps import to_datetime

__all__ = ["main"]

logger = logging.getLogger(__name__)

PROG = "agents-machine"
_CHUNK = 256 * 1024
#: The largest message the CLI sends (a prompt read from stdin included).
_MAX_MESSAGE = 64 * 1024 * 1024
#: A permission request answered by a remembered rule is followed at once by its
#: answer (both are written in one transaction): wait this long for it before
#: telling the person the run waits for them.
_RULE_ANSWER_WAIT = 0.5


class _DaemonDown(AgentsError):
    """The daemon's socket does not answer."""

    def __init__(self, cfg: MachineConfig) -> None:
        super().__init__(f"the machine daemon is not running (no answer on {cfg.socket})")
        self.data_dir = cfg.data_dir


@dataclass
class _Ctx:
    """What every handler gets: the parsed arguments, the environment, the output."""

    args: argparse.Namespace
    env: dict[str, str]
    out: Output
    home: Path = field(default_factory=Path.home)

    @property
    def prog(self) -> str:
        """The command as typed so far: with ``--data-dir``/``--socket`` when given,
        so a suggested command reaches the same daemon."""
        return _prog(self.args)

    @cached_property
    def cfg(self) -> MachineConfig:
        """The config, built on first use (``join`` picks its data folder first)."""
        return _config(self.args, self.env, self.home)


# ---------------------------------------------------------------- output


def _state(agent: pb.Agent) -> str:
    name = pb.AgentState.Name(agent.state).removeprefix("AGENT_STATE_").lower()
    return name if agent.local else f"{name} (from {agent.origin_machine})"


def _agent_detail(out: Output, a: pb.Agent) -> None:
    out.detail(
        [
            ("id", a.id),
            ("name", a.name),
            ("state", _state(a)),
            ("runtime", a.runtime),
            ("settings", a.settings_json),
            ("folder", a.folder),
            ("origin", a.origin_machine),
            ("session", a.session_id or "-"),
            ("events", str(a.last_seq)),
            ("created", to_datetime(a.created_at).strftime("%Y-%m-%dT%H:%M:%SZ")),
        ]
    )


def _render_event(
    out: Output, ev: pb.RunEvent, state: dict[str, bool], prog: str = PROG
) -> int | None:
    """Print one event for people; return an exit code when the run ended.

    ``prog`` starts the commands it suggests (with the ``--data-dir`` in use)."""
    kind = ev.WhichOneof("payload")
    if kind == "text_delta":
        out.write(ev.text_delta.text)
        state["mid_line"] = True
        return None
    if state.get("mid_line"):
        out.write("\n")
        state["mid_line"] = False
    if kind == "run_started":
        out.lines(f"[run {ev.run_id}]")
    elif kind == "tool_call":
        out.lines(f"[tool {ev.tool_call.title}] {ev.tool_call.input_json}")
    elif kind == "tool_result":
        out.lines(f"[tool {ev.tool_result.status}] {ev.tool_result.output}")
    elif kind == "permission_request":
        req = ev.permission_request
        options = ", ".join(o.option_id for o in req.options)
        out.lines(
            f"[permission] {req.title}: waiting for an answer ({options})",
            f"Try: {prog} agent answer {ev.run_id} {req.request_id} OPTION [--remember]",
        )
    elif kind == "permission_answered":
        ans = ev.permission_answered
        how = "by a remembered rule" if ans.by_rule else "by a person"
        out.lines(f"[permission] {ans.option_id} ({how})")
    elif kind == "run_finished":
        fin = ev.run_finished
        out.lines(
            f"[done] {fin.stop_reason}, {fin.usage.input_tokens} in / "
            f"{fin.usage.output_tokens} out tokens, {fin.duration_ms} ms"
        )
        return ExitCode.OK
    elif kind == "run_error":
        code = pb.RunErrorCode.Name(ev.run_error.code)
        out.lines(f"[error {code}] {ev.run_error.message}")
        return ExitCode.FAILED
    return None


def _show(out: Output, msg: Message, text: Callable[[], None]) -> int:
    if out.as_json:
        out.json(message_dict(msg))
    else:
        text()
    return ExitCode.OK


def _show_agent(out: Output, agent: pb.Agent) -> int:
    return _show(out, agent, lambda: _agent_detail(out, agent))


def _show_run(out: Output, run: pb.Run) -> int:
    state = pb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower()
    return _show(out, run, lambda: out.lines(f"{run.id} {state}"))


# ---------------------------------------------------------------- client


@contextlib.asynccontextmanager
async def _client(cfg: MachineConfig) -> AsyncIterator[pb_grpc.MachineServiceAsyncStub]:
    if not cfg.socket.exists():
        raise _DaemonDown(cfg)
    async with grpc.aio.insecure_channel(
        f"unix://{cfg.socket}",
        options=[("grpc.max_send_message_length", _MAX_MESSAGE)],
    ) as channel:
        try:
            async with rpc_errors():
                yield pb_grpc.MachineServiceStub(channel)
        except TransientError:
            raise _DaemonDown(cfg) from None


async def _upload(stub: pb_grpc.MachineServiceAsyncStub, agent_id: str, path: Path) -> str:
    try:
        size = path.stat().st_size
        handle = path.open("rb")
    except OSError as e:
        raise UsageError(f"attach: cannot read {path}: {e.strerror}") from None

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


async def _events_with_rule_answers(events: Any) -> AsyncIterator[pb.RunEvent]:
    """The stream's events, with a permission request answered by a remembered rule
    folded into its answer: the request is dropped when its answer follows at once.

    Reading the next event runs in a task that is awaited again, never cancelled,
    so no event is lost when the wait times out.
    """
    it = aiter(events)
    pending: asyncio.Task[pb.RunEvent] | None = None
    while True:
        if pending is None:
            pending = asyncio.ensure_future(anext(it))
        try:
            ev = await pending
        except StopAsyncIteration:
            return
        pending = None
        if ev.WhichOneof("payload") != "permission_request":
            yield ev
            continue
        pending = asyncio.ensure_future(anext(it))
        done, _ = await asyncio.wait({pending}, timeout=_RULE_ANSWER_WAIT)
        if done and pending.exception() is None:
            following = pending.result()
            if (
                following.WhichOneof("payload") == "permission_answered"
                and following.permission_answered.by_rule
                and following.permission_answered.request_id == ev.permission_request.request_id
            ):
                continue  # the answer is printed; the request never waited
        yield ev


async def _stream(
    out: Output,
    events: Any,
    *,
    ask: Asker | None = None,
    stub: pb_grpc.MachineServiceAsyncStub | None = None,
    prog: str = PROG,
) -> int:
    state: dict[str, bool] = {}
    code: int | None = None
    if out.as_json:
        async for ev in events:
            out.json(message_dict(ev))
            kind = ev.WhichOneof("payload")
            if kind in ("run_finished", "run_error"):
                code = ExitCode.OK if kind == "run_finished" else ExitCode.FAILED
        return code if code is not None else ExitCode.OK
    async for ev in _events_with_rule_answers(events):
        got = _render_event(out, ev, state, prog)
        code = got if got is not None else code
        if (
            ask is not None
            and stub is not None
            and ev.WhichOneof("payload") == "permission_request"
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
        out.write("\n")
    return code if code is not None else ExitCode.OK


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


async def _cmd_status(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        st: pb.StatusResponse = await stub.Status(pb.StatusRequest())
    joined = st.joined
    return _show(
        ctx.out,
        st,
        lambda: ctx.out.detail(
            [
                ("version", st.version),
                ("data folder", st.data_dir),
                ("machine", f"{st.machine_id} ({'joined' if joined else 'stand-alone'})"),
                ("agents", f"{st.active_agents} active, {st.archived_agents} archived"),
                ("runs", f"{st.open_runs} open, {st.waiting_runs} waiting for a person"),
                ("runtimes", ", ".join(st.runtimes)),
                ("schema", str(st.schema_version)),
                *_backup_detail(st.backup),
            ]
        ),
    )


def _backup_detail(b: pb.BackupStatus) -> list[tuple[str, str]]:
    last = (
        f"{b.last_backup_id} at {_when(b.last_backup_at)}, {_human(b.last_backup_bytes)}"
        if b.last_backup_id
        else "none yet"
    )
    check = "not run since the daemon started"
    if b.HasField("last_check_at"):
        check = f"{'ok' if b.last_check_ok else 'FAILED'} at {_when(b.last_check_at)}"
        if b.last_check_problem:
            check += f": {b.last_check_problem}"
    pairs = [
        ("backup target", f"{b.target} (keep {b.keep})"),
        ("last backup", last),
        ("next backup", _when(b.next_run_at)),
        ("restore check", check),
        ("recovery key", "yes" if b.recovery_key else "none"),
    ]
    return pairs + [("warning", w) for w in b.warnings]


async def _cmd_check(ctx: _Ctx) -> int:
    """Full integrity check of machine.db: by the daemon, or here when it is not running
    (a damaged database keeps the daemon from starting)."""
    cfg = ctx.cfg
    try:
        async with _client(cfg) as stub:
            reply: pb.CheckDatabaseResponse = await stub.CheckDatabase(pb.CheckDatabaseRequest())
        ok, problems, path = reply.ok, list(reply.problems), reply.path
    except _DaemonDown:
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


async def _agent_create(ctx: _Ctx) -> int:
    args = ctx.args
    folder = args.folder or os.getcwd()
    async with _client(ctx.cfg) as stub:
        agent = await stub.CreateAgent(
            pb.CreateAgentRequest(
                name=args.name,
                folder=str(Path(folder).absolute()),
                runtime=args.runtime or "",
                settings_json=args.settings or "",
            )
        )
    return _show(ctx.out, agent, lambda: ctx.out.lines(agent.id))


async def _agent_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        listed = await stub.ListAgents(pb.ListAgentsRequest(include_archived=ctx.args.all))
    columns = [Column("id", whole=True), Column("name"), Column("runtime"), Column("state")]
    rows = [[a.id, a.name, a.runtime, _state(a), a.folder] for a in listed.agents]
    return _show(ctx.out, listed, lambda: ctx.out.table([*columns, Column("folder")], rows))


async def _agent_show(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        agent = await stub.GetAgent(pb.GetAgentRequest(agent_id=ctx.args.id))
    return _show_agent(ctx.out, agent)


async def _agent_rename(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        agent = await stub.RenameAgent(
            pb.RenameAgentRequest(agent_id=ctx.args.id, name=ctx.args.name)
        )
    return _show_agent(ctx.out, agent)


async def _agent_archive(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        agent = await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=ctx.args.id))
    return _show_agent(ctx.out, agent)


async def _agent_unarchive(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        agent = await stub.UnarchiveAgent(pb.UnarchiveAgentRequest(agent_id=ctx.args.id))
    return _show_agent(ctx.out, agent)


def _prompt_text(args: argparse.Namespace, limit: int) -> str:
    """The prompt from the arguments or stdin. A NUL byte is refused: prompts are
    text, and neither a terminal nor the conversation views can show one."""
    text = read_stdin_text("prompt", limit) if args.stdin else " ".join(args.text)
    if "\0" in text:
        where = text.index("\0")
        raise UsageError(f"prompt: contains a NUL byte (at character {where}); prompts are text")
    return text


async def _agent_prompt(ctx: _Ctx) -> int:
    args = ctx.args
    # Read no more than one message can carry; the daemon applies its own limit.
    text = _prompt_text(args, _MAX_MESSAGE)
    async with _client(ctx.cfg) as stub:
        shas = [await _upload(stub, args.id, Path(p)) for p in args.attach or []]
        # Ask inline only when a person is at the terminal (never for --stdin or scripts).
        interactive = not args.stdin and sys.stdin.isatty() and sys.stdout.isatty()
        return await _stream(
            ctx.out,
            stub.Prompt(pb.PromptRequest(agent_id=args.id, text=text, attachments=shas)),
            ask=_ask_at_terminal if interactive else None,
            stub=stub,
            prog=ctx.prog,
        )


async def _agent_replay(ctx: _Ctx) -> int:
    args = ctx.args
    async with _client(ctx.cfg) as stub:
        request = pb.ReplayRequest(agent_id=args.id, after_seq=args.after, follow=args.follow)
        return await _stream(ctx.out, stub.Replay(request), prog=ctx.prog)


async def _agent_cancel(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        run = await stub.CancelRun(pb.CancelRunRequest(run_id=ctx.args.run_id))
    return _show_run(ctx.out, run)


async def _agent_answer(ctx: _Ctx) -> int:
    args = ctx.args
    async with _client(ctx.cfg) as stub:
        answered = await stub.AnswerPermission(
            pb.AnswerPermissionRequest(
                run_id=args.run_id,
                request_id=args.request_id,
                option_id=args.option_id,
                remember=args.remember,
            )
        )
    return _show_run(ctx.out, answered.run)


async def _agent_runs(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        runs = await stub.ListRuns(pb.ListRunsRequest(agent_id=ctx.args.id, limit=ctx.args.limit))
    rows = []
    for r in runs.runs:
        state = pb.RunState.Name(r.state).removeprefix("RUN_STATE_").lower()
        tokens = f"{r.usage.input_tokens}/{r.usage.output_tokens}"
        rows.append([r.id, state, tokens, str(r.duration_ms), r.prompt])
    columns = [Column("run", whole=True), Column("state"), Column("tokens in/out")]
    return _show(
        ctx.out, runs, lambda: ctx.out.table([*columns, Column("ms"), Column("prompt")], rows)
    )


def _schedule_text(args: argparse.Namespace) -> str:
    """The prompt of ``schedule add``: ``--text`` or the UTF-8 file of ``--file``."""
    if args.file is None:
        text: str = args.text
    else:
        try:
            with Path(args.file).expanduser().open("rb") as f:
                data = f.read(_MAX_MESSAGE + 1)
        except OSError as e:
            raise UsageError(f"--file: cannot read {args.file}: {e.strerror or e}") from None
        if len(data) > _MAX_MESSAGE:
            raise UsageError(f"--file: {args.file} is larger than {_MAX_MESSAGE} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--file: {args.file} is not UTF-8 (at byte {e.start})") from None
    if "\0" in text:
        raise UsageError("prompt: contains a NUL byte; prompts are text")
    return text


def _schedule_row(s: pb.Schedule) -> list[str]:
    state = "enabled" if s.enabled else "paused"
    return [s.id, s.agent_id, s.cron, s.time_zone, state, s.missed, _when(s.next_run_at), s.prompt]


_SCHEDULE_COLUMNS = [
    Column("id", whole=True),
    Column("agent", whole=True),
    Column("cron"),
    Column("zone"),
    Column("state"),
    Column("missed"),
    Column("next"),
]


def _show_schedule(out: Output, s: pb.Schedule) -> int:
    return _show(
        out, s, lambda: out.table([*_SCHEDULE_COLUMNS, Column("prompt")], [_schedule_row(s)])
    )


async def _schedule_add(ctx: _Ctx) -> int:
    args = ctx.args
    text = _schedule_text(args)
    async with _client(ctx.cfg) as stub:
        s = await stub.CreateSchedule(
            pb.CreateScheduleRequest(
                agent_id=args.agent,
                cron=args.cron,
                prompt=text,
                time_zone=args.tz or "",
                missed=args.missed or "",
            )
        )
    return _show(ctx.out, s, lambda: ctx.out.lines(s.id))


async def _schedule_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        listed = await stub.ListSchedules(pb.ListSchedulesRequest(agent_id=ctx.args.agent or ""))
    rows = [_schedule_row(s) for s in listed.schedules]
    return _show(
        ctx.out, listed, lambda: ctx.out.table([*_SCHEDULE_COLUMNS, Column("prompt")], rows)
    )


async def _schedule_pause(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        s = await stub.PauseSchedule(pb.PauseScheduleRequest(schedule_id=ctx.args.schedule_id))
    return _show_schedule(ctx.out, s)


async def _schedule_resume(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        s = await stub.ResumeSchedule(pb.ResumeScheduleRequest(schedule_id=ctx.args.schedule_id))
    return _show_schedule(ctx.out, s)


async def _schedule_delete(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        done = await stub.DeleteSchedule(pb.DeleteScheduleRequest(schedule_id=ctx.args.schedule_id))
    return _show(ctx.out, done, lambda: ctx.out.lines(f"deleted {ctx.args.schedule_id}"))


async def _schedule_runs(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        runs = await stub.ListScheduleRuns(
            pb.ListScheduleRunsRequest(schedule_id=ctx.args.schedule_id, limit=ctx.args.limit)
        )
    rows = [[_when(r.fire_time), r.result, r.run_id or "-", r.detail] for r in runs.runs]
    columns = [Column("fire time"), Column("result"), Column("run", whole=True)]
    return _show(ctx.out, runs, lambda: ctx.out.table([*columns, Column("detail")], rows))


async def _agent_delete(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        reply = await stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=ctx.args.id))
    text = f"{reply.agent_id} erased"
    if reply.runtime_erasure_queued:
        text += "; its runtime's copy is being erased"
    return _show(
        ctx.out,
        reply,
        lambda: ctx.out.lines(text, f"Try: {ctx.prog} agent erasures  (the receipt)"),
    )


async def _agent_erasures(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        listed = await stub.ListErasures(pb.ListErasuresRequest())
    rows = [
        [e.agent_id, e.state, _when(e.erased_at), e.machine_data, e.attachments, e.runtime_copy,
         e.backups, str(e.attempts), e.detail]
        for e in listed.erasures
    ]  # fmt: skip
    columns = [
        Column("agent", whole=True),
        Column("state"),
        Column("erased"),
        Column("machine data"),
        Column("attachments"),
        Column("runtime copy"),
        Column("backups"),
        Column("tries"),
        Column("detail"),
    ]
    return _show(ctx.out, listed, lambda: ctx.out.table(columns, rows))


async def _agent_search(ctx: _Ctx) -> int:
    args = ctx.args
    async with _client(ctx.cfg) as stub:
        found = await stub.Search(
            pb.SearchRequest(
                query=" ".join(args.query), agent_id=args.agent or "", limit=args.limit
            )
        )
    rows = [
        [h.agent_id, h.agent_name + (" (archived)" if h.archived else ""), str(h.seq), h.source,
         h.snippet]
        for h in found.hits
    ]  # fmt: skip
    columns = [Column("agent", whole=True), Column("name"), Column("seq", whole=True)]
    if found.indexing and not ctx.out.as_json:
        ctx.out.note(
            f"{found.indexing} restored agent(s) still being indexed: "
            "their conversations are not found yet"
        )
    return _show(
        ctx.out, found, lambda: ctx.out.table([*columns, Column("source"), Column("match")], rows)
    )


# ---------------------------------------------------------------- backups


class _Bar:
    """A rich progress bar on a terminal (stderr), nothing otherwise (scripts, --json)."""

    def __init__(self, out: Output, what: str) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._what = what
        if not out.as_json and sys.stderr.isatty():
            from rich.progress import Progress  # imported late: only on a terminal

            self._bar = Progress(transient=True)

    def __enter__(self) -> _Bar:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(self._what, total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, stage: str, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(
                self._task, description=f"{self._what}: {stage}", completed=done, total=total
            )


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _when(ts: Any) -> str:
    return to_datetime(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S") if ts.seconds else "-"


def _recovery_text(args: argparse.Namespace) -> str:
    """The private key of ``--recovery-key FILE`` as text (sent over the local socket)."""
    if not getattr(args, "recovery_key", None):
        return ""
    return encode_private_key(read_recovery_key(Path(args.recovery_key)).private_key)


def _from_dir(args: argparse.Namespace) -> str:
    folder = getattr(args, "from_dir", None)
    if not folder:
        return ""
    path = Path(folder).expanduser().absolute()
    if not path.is_dir():
        raise UsageError(f"--from: {folder} is not a folder")
    return str(path)


async def _backup_now(ctx: _Ctx) -> int:
    done: pb.Backup | None = None
    async with _client(ctx.cfg) as stub:
        with _Bar(ctx.out, "backing up") as bar:
            async for update in stub.BackupNow(pb.BackupNowRequest()):
                if update.HasField("progress"):
                    p = update.progress
                    bar.update(p.stage, p.done, p.total)
                else:
                    done = update.backup
    if done is None:
        raise TransientError("backup now: the daemon ended the call without a result")
    b = done
    text = (
        f"{b.id}: {b.segments} segments ({b.uploaded_segments} new, "
        f"{_human(b.uploaded_bytes)} sent), {_human(b.size_bytes)} stored"
    )
    pruned = f"pruned {', '.join(b.pruned)}" if b.pruned else ""
    return _show(ctx.out, b, lambda: ctx.out.lines(text, *([pruned] if pruned else [])))


async def _backup_list(ctx: _Ctx) -> int:
    async with _client(ctx.cfg) as stub:
        listed = await stub.ListBackups(pb.ListBackupsRequest(from_dir=_from_dir(ctx.args)))
    rows = [
        [b.id, _when(b.created_at), str(b.agents) if b.opens else "?",
         str(b.segments) if b.opens else "?", "yes" if b.opens else "no (another key)"]
        for b in listed.backups
    ]  # fmt: skip
    columns = [Column("backup", whole=True), Column("created", whole=True), Column("agents")]
    return _show(
        ctx.out,
        listed,
        lambda: ctx.out.table([*columns, Column("segments"), Column("opens")], rows),
    )


async def _backup_verify(ctx: _Ctx) -> int:
    args = ctx.args
    req = pb.VerifyBackupRequest(
        backup_id=args.backup_id,
        from_dir=_from_dir(args),
        recovery_private_key=_recovery_text(args),
    )
    async with _client(ctx.cfg) as stub:
        with _Bar(ctx.out, "verifying"):
            reply = await stub.VerifyBackup(req)
    text = (
        f"{args.backup_id}: ok, {reply.segments} segments, "
        f"{_human(reply.plain_bytes)} authenticated in {reply.duration_ms / 1000:.1f} s"
    )
    return _show(ctx.out, reply, lambda: ctx.out.lines(text))


async def _backup_restore(ctx: _Ctx) -> int:
    args = ctx.args
    req = pb.RestoreRequest(
        backup_id=args.backup_id,
        from_dir=_from_dir(args),
        recovery_private_key=_recovery_text(args),
    )
    async with _client(ctx.cfg) as stub:
        with _Bar(ctx.out, "restoring"):
            reply = await stub.Restore(req)
    lines = [f"restored {len(reply.restored)} agents (archived; `agent unarchive ID` to run one)"]
    if reply.skipped:
        lines.append(f"skipped {len(reply.skipped)} already on this machine")
    if reply.skipped_erased:
        lines.append(f"skipped {len(reply.skipped_erased)} erased")
    return _show(ctx.out, reply, lambda: ctx.out.lines(*lines))


async def _backup_recovery_key(ctx: _Ctx) -> int:
    if not stdout_writable():
        raise UsageError(
            "backup recovery-key: stdout is not writable, so the key it prints only once "
            "would be lost; nothing was made"
        )
    async with _client(ctx.cfg) as stub:
        reply = await stub.CreateRecoveryKey(pb.CreateRecoveryKeyRequest())
    if ctx.out.as_json:
        ctx.out.json({"private_key": reply.private_key, "public_key": reply.public_key})
    else:
        ctx.out.lines(reply.private_key)
    ctx.out.note(
        "This recovery key is shown once and not stored anywhere on this machine.",
        "Keep it offline (a password manager or paper), away from this disk: with it, "
        "backups restore on a new machine after this one is lost.",
        "Save it to a file and restore with "
        f"`{ctx.prog} backup restore ID --from DIR --recovery-key FILE`.",
        "Backups made from now on are sealed to it; `backup now` makes one.",
    )
    return ExitCode.OK


async def _cmd_export(ctx: _Ctx) -> int:
    args = ctx.args
    ids = [validate_id("agent", a, "agent_id") for a in args.agents]
    folder = str(Path(args.folder).expanduser().absolute()) if args.folder else ""
    if not ids and not folder:
        raise UsageError(
            "export: name agents (AGENT…) or --folder F", f"{ctx.prog} agent list --all"
        )
    dest = Path(args.output or f"agents-export-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz").absolute()
    if dest.exists():
        raise UsageError(f"export: {dest} exists; refusing to overwrite it")
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        async with _client(ctx.cfg) as stub:
            with _Bar(ctx.out, "exporting"), open(tmp, "wb") as f:
                async for chunk in stub.Export(pb.ExportRequest(agent_ids=ids, folder=folder)):
                    f.write(chunk.data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dest)  # the export is whole at dest, or absent
    except OSError as e:
        raise UsageError(f"export: cannot write {dest}: {e.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    if ctx.out.as_json:
        ctx.out.json({"file": str(dest), "size": dest.stat().st_size})
    else:
        ctx.out.lines(str(dest))
    return ExitCode.OK


async def _cmd_import(ctx: _Ctx) -> int:
    path = Path(ctx.args.file)
    try:
        handle = path.open("rb")
    except OSError as e:
        raise UsageError(f"import: cannot read {path}: {e.strerror}") from None

    async def chunks() -> AsyncIterator[pb.ImportChunk]:
        with handle:
            while chunk := handle.read(_CHUNK):
                yield pb.ImportChunk(data=chunk)

    async with _client(ctx.cfg) as stub:
        with _Bar(ctx.out, "importing"):
            reply = await stub.Import(chunks())
    lines = [f"imported {len(reply.imported)} agents (archived)"]
    if reply.skipped:
        lines.append(f"skipped {len(reply.skipped)} already on this machine")
    if reply.skipped_erased:
        lines.append(f"skipped {len(reply.skipped_erased)} erased")
    return _show(ctx.out, reply, lambda: ctx.out.lines(*lines))


def _config(args: argparse.Namespace, env: dict[str, str], home: Path) -> MachineConfig:
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
        home=home,
        config_file=Path(config_file) if config_file else None,
    )


def _run_serve(cfg: MachineConfig) -> int:
    from machine.daemon import serve

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # replaces the silence main() set up for the verbs
    )
    os.umask(0o077)  # everything the daemon creates is private to its user
    try:
        asyncio.run(serve(cfg))
    except (OSError, RuntimeError) as e:
        raise bind_error(e) or e from None
    return ExitCode.OK


def _cmd_serve(ctx: _Ctx) -> int:
    return _run_serve(ctx.cfg)


def _cmd_join(ctx: _Ctx) -> int:
    # Imported here: only `join` needs the join flow and the service installer.
    from machine import identity
    from machine.join import join_control_plane, restore_after_join
    from machine.service_unit import install_service
    from shared.recovery_key import read_recovery_key

    args = ctx.args
    if not args.data_dir:
        # `join` installs a server: its folder is the server's, whatever else exists.
        args.data_dir = str(server_data_dir(ctx.home))
    cfg = ctx.cfg
    # Read before the join: a bad key file must not cost the one-time token.
    recovery = read_recovery_key(Path(args.recovery_key)) if args.recovery_key else None
    if identity.is_joined(cfg.data_dir):
        return _re_pair(ctx)
    result = asyncio.run(
        join_control_plane(
            data_dir=cfg.data_dir,
            address=args.address,
            token=args.token,
            ca_hash=args.ca_hash,
            name=args.name,
        )
    )
    ctx.out.lines(f"joined as machine {result.machine_id} (account {result.account_id})")
    if recovery is not None:
        done = asyncio.run(
            restore_after_join(
                data_dir=cfg.data_dir,
                db_path=cfg.db_path,
                attachments_dir=cfg.attachments_dir,
                recovery=recovery,
            )
        )
        ctx.out.lines(
            f"restored {len(done.restored)} agents (archived) from backup {done.backup_id}"
            if done.backup_id
            else "the control plane keeps no backup of this machine: nothing to restore"
        )
    if args.install_service:
        installed = install_service(data_dir=cfg.data_dir)
        ctx.out.lines(f"installed {installed.unit_path}")
        if installed.started:
            return ExitCode.OK
    return _run_serve(cfg)


def _re_pair(ctx: _Ctx) -> int:
    """``join`` on a joined data folder: re-pair (machine.join), back up at once, serve."""
    from machine.daemon import hold_data_dir
    from machine.join import backup_after_repair, join_control_plane

    args, cfg = ctx.args, ctx.cfg
    if args.recovery_key:
        raise UsageError(
            "join: this data folder is already joined: its data is here, so a re-pair "
            "restores nothing; drop --recovery-key"
        )
    # Held from before the join to after the backup: a daemon serving this folder
    # (with the old certificate) is refused here, before the token is spent.
    with hold_data_dir(cfg.data_dir, "join (re-pair): stop the running agents-machine first"):
        result = asyncio.run(
            join_control_plane(
                data_dir=cfg.data_dir,
                address=args.address,
                token=args.token,
                ca_hash=args.ca_hash,
                name=args.name,
            )
        )
        ctx.out.lines(
            f"re-paired as machine {result.machine_id} (account {result.account_id}): "
            "same id, agents and backups; new certificate"
        )
        backup_id = asyncio.run(backup_after_repair(cfg))
        ctx.out.lines(f"backup {backup_id} uploaded to the control plane")
    if args.install_service:
        from machine.service_unit import install_service

        installed = install_service(data_dir=cfg.data_dir)
        ctx.out.lines(f"installed {installed.unit_path}")
        if installed.started:
            return ExitCode.OK
    return _run_serve(cfg)


#: (command, verb) -> handler; a command without verbs has verb None.
COMMANDS: dict[tuple[str, str | None], Handler] = {
    ("serve", None): _cmd_serve,
    ("join", None): _cmd_join,
    ("status", None): _cmd_status,
    ("check", None): _cmd_check,
    ("agent", "create"): _agent_create,
    ("agent", "list"): _agent_list,
    ("agent", "show"): _agent_show,
    ("agent", "rename"): _agent_rename,
    ("agent", "archive"): _agent_archive,
    ("agent", "unarchive"): _agent_unarchive,
    ("agent", "prompt"): _agent_prompt,
    ("agent", "replay"): _agent_replay,
    ("agent", "cancel"): _agent_cancel,
    ("agent", "answer"): _agent_answer,
    ("agent", "runs"): _agent_runs,
    ("agent", "search"): _agent_search,
    ("agent", "delete"): _agent_delete,
    ("agent", "erasures"): _agent_erasures,
    ("backup", "now"): _backup_now,
    ("backup", "list"): _backup_list,
    ("backup", "verify"): _backup_verify,
    ("backup", "restore"): _backup_restore,
    ("backup", "recovery-key"): _backup_recovery_key,
    ("schedule", "add"): _schedule_add,
    ("schedule", "list"): _schedule_list,
    ("schedule", "pause"): _schedule_pause,
    ("schedule", "resume"): _schedule_resume,
    ("schedule", "delete"): _schedule_delete,
    ("schedule", "runs"): _schedule_runs,
    ("export", None): _cmd_export,
    ("import", None): _cmd_import,
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


def _prog(args: argparse.Namespace | None) -> str:
    words = [PROG]
    for flag, value in (("--data-dir", getattr(args, "data_dir", None)),
                        ("--socket", getattr(args, "socket", None))):  # fmt: skip
        if value:
            words += [flag, shlex.quote(str(value))]
    return " ".join(words)


def _hint(err: BaseException, prog: str) -> str | None:
    if isinstance(err, _DaemonDown):
        # Name the folder: a bare `serve` could start a second, stand-alone machine.
        return f"{PROG} --data-dir {shlex.quote(str(err.data_dir))} serve"
    if isinstance(err, NotFound) or (
        isinstance(err, InvalidArgument) and getattr(err, "field", "") == "agent_id"
    ):
        return f"{prog} agent list --all"
    if isinstance(err, InvalidState) and "archive it first" in err.message:
        return f"{prog} agent archive ID"
    if isinstance(err, InvalidState) and "archived" in err.message:
        return f"{prog} agent unarchive ID"
    if isinstance(err, ConfigError):
        return f"{PROG} serve --help"
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
        args = _parser().parse_args(argv)
        parsed.append(args)
        ctx = _Ctx(args, dict(os.environ), Output(as_json=args.json))
        if args.command not in (None, "serve", "join"):
            _check_args(args)
        return dispatch(COMMANDS, PROG, args.command, args.verb, ctx)

    return run_main(
        PROG,
        body,
        hint_for=lambda e: _hint(e, _prog(parsed[0] if parsed else None)),
        interrupted=f"interrupted (a run goes on; cancel it with `{PROG} agent cancel RUN`)",
    )
