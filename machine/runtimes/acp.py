"""The ``acp`` runtime: an agent program that speaks the Agent Client Protocol.

The runtime starts the agent's configured command as a subprocess (cwd = the
agent's folder), speaks ACP over its stdin/stdout with the client side of the
``agent-client-protocol`` package, and turns the agent's ``session/update``
notifications into :mod:`machine.runtimes.base` events. One process serves
every run of one agent; it is started on the first run and again after it
died or its settings changed, and :meth:`AcpRuntime.close` stops it.

Ordering: the package handles each incoming message in its own task, and our
callbacks may wait on a slow disk (``ctx.emit``). So the client callbacks only
put what arrived on the run's queue, in arrival order, and one loop per run
emits from that queue; permission requests go through the same queue so they
stay after the tool call they are about.

The client advertises neither file-system nor terminal capabilities and
answers such requests with an error: the agent works in its folder with its
own tools, gated by ``session/request_permission``.

See docs/runtimes-acp.md for settings, resume after a restart, and deleting
Claude/Codex session files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
from acp.schema import (
    AgentMessageChunk,
    AllowedOutcome,
    ClientCapabilities,
    ContentToolCallContent,
    CreateElicitationResponse,
    CreateTerminalResponse,
    DeniedOutcome,
    ElicitationMode,
    EnvVariable,
    FileSystemCapabilities,
    Implementation,
    KillTerminalResponse,
    PromptResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    ResourceContentBlock,
    TerminalOutputResponse,
    TextContentBlock,
    ToolCallProgress,
    ToolCallStart,
    ToolCallUpdate,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)
from acp.schema import PermissionOption as AcpPermissionOption

from machine.runtimes.base import (
    PermissionDecision,
    PermissionOption,
    PermissionRequest,
    RunContext,
    RunOutcome,
    RuntimeFailed,
    SessionStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    UsageReport,
)
from machine.runtimes.claude_files import (
    claude_session_paths,
    codex_session_paths,
    remove_session_paths,
    validate_cli_session_id,
)
from shared.errors import InvalidArgument

__all__ = ["KINDS", "AcpRuntime", "create_runtime", "validate_acp_settings", "validate_settings"]

logger = logging.getLogger(__name__)

KINDS = ("claude", "codex", "generic")
"""Allowed values of the ``kind`` setting (which CLI's session files to delete)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MAX_ARGS = 256
_MAX_ARG_CHARS = 8192
_MAX_ENV = 256
_MAX_ENV_VALUE_CHARS = 32768
_MAX_SESSION_ID_CHARS = 256
_MAX_TOOL_OUTPUT_CHARS = 64 * 1024
# One JSON-RPC line may carry a large tool result or file; asyncio's 64 KiB
# default line limit would break the connection on it.
_STREAM_LIMIT = 32 * 1024 * 1024
_CLIENT_NAME = "agents-machine"
# JSON-RPC error ACP agents answer for an unknown session: already gone.
_RESOURCE_NOT_FOUND = -32002
_CLIENT_VERSION = "0.1.0"
_CANCELLED = RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))


def validate_acp_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check an agent's ``acp`` settings and return them normalised.

    ``command`` (required): non-empty list of strings, the program and its
    arguments. ``env`` (optional): map of variable name to string value, added
    to the agent process's environment. ``kind`` (optional, default
    ``"generic"``): ``"claude"``, ``"codex"`` or ``"generic"``. Unknown keys
    are refused so a typo does not pass silently. Raises InvalidArgument
    naming the field (``settings.command[1]``...); values of ``env`` never
    appear in messages.
    """
    if not isinstance(settings, Mapping):
        raise InvalidArgument("settings", "must be a map")
    unknown = sorted(str(k) for k in settings if k not in ("command", "env", "kind"))
    if unknown:
        raise InvalidArgument(f"settings.{unknown[0]}", "unknown setting for runtime acp")

    command = settings.get("command")
    if not isinstance(command, list | tuple) or not command:
        raise InvalidArgument("settings.command", "required: a non-empty list of strings")
    if len(command) > _MAX_ARGS:
        raise InvalidArgument("settings.command", f"at most {_MAX_ARGS} items")
    for i, arg in enumerate(command):
        name = f"settings.command[{i}]"
        if not isinstance(arg, str):
            raise InvalidArgument(name, "must be a string")
        if "\x00" in arg or len(arg) > _MAX_ARG_CHARS:
            raise InvalidArgument(name, f"no NUL bytes, at most {_MAX_ARG_CHARS} characters")
    if not command[0].strip():
        raise InvalidArgument("settings.command[0]", "the program must not be empty")

    env_in = settings.get("env") or {}
    if not isinstance(env_in, Mapping):
        raise InvalidArgument("settings.env", "must be a map of names to strings")
    if len(env_in) > _MAX_ENV:
        raise InvalidArgument("settings.env", f"at most {_MAX_ENV} variables")
    env: dict[str, str] = {}
    for key, value in env_in.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            shown = str(key)[:64]
            raise InvalidArgument("settings.env", f"invalid variable name {shown!r}")
        if not isinstance(value, str) or "\x00" in value or len(value) > _MAX_ENV_VALUE_CHARS:
            raise InvalidArgument(
                f"settings.env.{key}",
                f"must be a string without NUL bytes, at most {_MAX_ENV_VALUE_CHARS} characters",
            )
        env[key] = value

    kind = settings.get("kind", "generic")
    if kind not in KINDS:
        raise InvalidArgument("settings.kind", f"must be one of {', '.join(KINDS)}")
    return {"command": list(command), "env": env, "kind": kind}


def validate_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime registry's hook: :func:`validate_acp_settings` with errors on ``settings_json``.

    The registry reports every runtime's settings problem on the request field
    ``settings_json``; the reason still names the setting (``command[1]: ...``).
    """
    try:
        return validate_acp_settings(settings)
    except InvalidArgument as exc:
        inner = exc.field.removeprefix("settings.")
        raise InvalidArgument("settings_json", f"{inner}: {exc.reason}") from None


def create_runtime(
    *,
    agent_id: str,
    folder: Path,
    settings: Mapping[str, Any],
    base_env: Mapping[str, str] | None = None,
    claude_home: Path | None = None,
    codex_home: Path | None = None,
) -> AcpRuntime:
    """The runtime registry's hook: an :class:`AcpRuntime` for one agent.

    The daemon binds ``base_env``, ``claude_home`` and ``codex_home`` from its
    config (e.g. with ``functools.partial``); see :class:`AcpRuntime`.
    """
    return AcpRuntime(settings, base_env=base_env, claude_home=claude_home, codex_home=codex_home)


@dataclass(frozen=True)
class _Settings:
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    kind: str

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> _Settings:
        clean = validate_acp_settings(settings)
        return cls(tuple(clean["command"]), tuple(sorted(clean["env"].items())), clean["kind"])

    @property
    def program(self) -> str:
        # Only the program's base name goes into messages: arguments may hold secrets.
        return os.path.basename(self.command[0])


# -- items on a run's queue ---------------------------------------------------


@dataclass
class _Update:
    update: Any


@dataclass
class _Permission:
    tool_call: ToolCallUpdate
    options: list[AcpPermissionOption]
    reply: asyncio.Future[RequestPermissionResponse]


@dataclass
class _Done:
    response: PromptResponse


@dataclass
class _Failed:
    error: Exception


_Item = _Update | _Permission | _Done | _Failed


@dataclass
class _Turn:
    """State of the one run in flight on a process."""

    session_id: str
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    closed: bool = False
    titles: dict[str, str] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    resume_matched: bool = False

    def close(self) -> None:
        """Stop accepting items; answer permission requests still queued with cancelled."""
        self.closed = True
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Permission) and not item.reply.done():
                item.reply.set_result(_CANCELLED)


class _Client:
    """The ACP client side: hands what the agent sends to the current turn."""

    def __init__(self) -> None:
        self.turn: _Turn | None = None

    def _current(self, session_id: str) -> _Turn | None:
        turn = self.turn
        if turn is None or turn.closed or turn.session_id != session_id:
            return None
        return turn

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        # Must not await before put_nowait: arrival order is event order.
        turn = self._current(session_id)
        if turn is None:
            # Replay during session/load, or late updates after a cancel.
            return
        turn.queue.put_nowait(_Update(update))

    async def request_permission(
        self,
        session_id: str,
        tool_call: ToolCallUpdate,
        options: list[AcpPermissionOption],
        **kwargs: Any,
    ) -> RequestPermissionResponse:
        turn = self._current(session_id)
        if turn is None:
            return _CANCELLED
        reply: asyncio.Future[RequestPermissionResponse] = (
            asyncio.get_running_loop().create_future()
        )
        turn.queue.put_nowait(_Permission(tool_call, list(options), reply))
        return await reply

    # The agent works in its folder with its own tools; we offer no fs or
    # terminal, and refuse such requests even if the agent sends them anyway.

    async def read_text_file(
        self,
        session_id: str,
        path: str,
        line: int | None = None,
        limit: int | None = None,
        **kwargs: Any,
    ) -> ReadTextFileResponse:
        raise acp.RequestError.method_not_found("fs/read_text_file")

    async def write_text_file(
        self, session_id: str, path: str, content: str, **kwargs: Any
    ) -> WriteTextFileResponse | None:
        raise acp.RequestError.method_not_found("fs/write_text_file")

    async def create_terminal(
        self,
        session_id: str,
        command: str,
        args: list[str] | None = None,
        env: list[EnvVariable] | None = None,
        cwd: str | None = None,
        output_byte_limit: int | None = None,
        **kwargs: Any,
    ) -> CreateTerminalResponse:
        raise acp.RequestError.method_not_found("terminal/create")

    async def terminal_output(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> TerminalOutputResponse:
        raise acp.RequestError.method_not_found("terminal/output")

    async def release_terminal(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> ReleaseTerminalResponse | None:
        raise acp.RequestError.method_not_found("terminal/release")

    async def wait_for_terminal_exit(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> WaitForTerminalExitResponse:
        raise acp.RequestError.method_not_found("terminal/wait_for_exit")

    async def kill_terminal(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> KillTerminalResponse | None:
        raise acp.RequestError.method_not_found("terminal/kill")

    async def create_elicitation(
        self, message: str, mode: ElicitationMode, **kwargs: Any
    ) -> CreateElicitationResponse:
        raise acp.RequestError.method_not_found("elicitation/create")

    async def complete_elicitation(self, elicitation_id: str, **kwargs: Any) -> None:
        return None

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise acp.RequestError.method_not_found(f"_{method}")

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None

    def on_connect(self, conn: acp.Agent) -> None:
        return None


class _AgentProcess:
    """One running agent program and the ACP connection to it."""

    def __init__(
        self,
        settings: _Settings,
        folder: Path,
        process: asyncio.subprocess.Process,
        conn: Any,
        client: _Client,
    ) -> None:
        self.settings = settings
        self.folder = folder
        self.process = process
        self.conn = conn
        self.client = client
        self.can_load = False
        self.can_delete = False
        self.sessions: set[str] = set()
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def _drain_stderr(self) -> None:
        # Read stderr so a chatty agent never blocks on a full pipe. It is
        # the agent's own output and may hold anything: debug level only.
        stream = self.process.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            while line := await stream.readline():
                logger.debug(
                    "acp agent %s stderr: %s",
                    self.settings.program,
                    line[:500].decode("utf-8", "replace").rstrip(),
                )

    async def exit_code(self, timeout: float) -> int | None:
        """The process's exit code, waiting up to ``timeout`` seconds for it to exit."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), timeout)
        return self.process.returncode

    def _signal(self, sig: signal.Signals) -> None:
        if self.process.returncode is not None:
            return
        # The agent runs in its own session; signal the group so tools it
        # started go too. The group id is the pid, still ours while unreaped.
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.process.send_signal(sig)

    async def close(self, grace: float) -> None:
        """Close stdin, wait ``grace`` seconds, then SIGTERM, then SIGKILL."""
        try:
            with contextlib.suppress(Exception):
                await self.conn.close()
            if self.process.stdin is not None:
                with contextlib.suppress(Exception):
                    self.process.stdin.close()
            if await self.exit_code(grace) is None:
                self._signal(signal.SIGTERM)
                if await self.exit_code(grace) is None:
                    self._signal(signal.SIGKILL)
                    await self.process.wait()
        finally:
            # Even when cancelled halfway, leave no process behind.
            self._signal(signal.SIGKILL)
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stderr_task


class AcpRuntime:
    """Runs one agent's prompts through an ACP agent program.

    ``settings`` are the agent's ``acp`` settings (see
    :func:`validate_acp_settings`); each run uses ``ctx.settings`` and the
    process is restarted when they change. ``base_env`` is the environment the
    agent program starts from (the caller's choice, e.g. the daemon's own
    environment; ``None`` means the package's trimmed default of HOME, PATH,
    USER, SHELL, TERM, LOGNAME); ``settings.env`` is added on top.
    ``claude_home``/``codex_home`` are the CLIs' folders used by
    :meth:`delete_session` (the caller resolves ``CLAUDE_CONFIG_DIR`` /
    ``CODEX_HOME``, see :mod:`machine.runtimes.claude_files`); ``None`` means
    ``~/.claude`` / ``~/.codex``.
    """

    name = "acp"

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        *,
        base_env: Mapping[str, str] | None = None,
        claude_home: Path | None = None,
        codex_home: Path | None = None,
        handshake_timeout: float = 60.0,
        cancel_grace: float = 10.0,
        close_grace: float = 3.0,
    ) -> None:
        self._settings = _Settings.parse(settings) if settings is not None else None
        self._base_env = dict(base_env) if base_env is not None else None
        self._claude_home = claude_home
        self._codex_home = codex_home
        self._handshake_timeout = handshake_timeout
        self._cancel_grace = cancel_grace
        self._close_grace = close_grace
        self._proc: _AgentProcess | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The agent process's pid while it runs (for status and tests)."""
        proc = self._proc
        return proc.process.pid if proc is not None and proc.alive else None

    # -- runs -------------------------------------------------------------

    async def run(self, ctx: RunContext) -> RunOutcome:
        """Drive ``ctx.prompt`` through the agent; see the module docstring."""
        try:
            settings = _Settings.parse(ctx.settings)
        except InvalidArgument as exc:
            raise RuntimeFailed(f"acp settings: {exc}") from None
        self._settings = settings
        async with self._lock:
            try:
                proc = await self._ensure_process(settings, ctx.folder)
                session_id = await self._open_session(proc, ctx)
                await ctx.emit(SessionStarted(session_id))
                return await self._drive(proc, session_id, ctx)
            except RuntimeFailed:
                # A process that failed us once is not trusted for the next run.
                await self._stop_process()
                raise

    async def _ensure_process(self, settings: _Settings, folder: Path) -> _AgentProcess:
        proc = self._proc
        if proc is not None and proc.alive and proc.settings == settings and proc.folder == folder:
            return proc
        await self._stop_process()
        if not folder.is_dir():
            raise RuntimeFailed(f"acp start {settings.program}: agent folder does not exist")
        env = dict(self._base_env) if self._base_env is not None else acp.default_environment()
        # Keep the CLI's own folder and the one delete_session cleans the same.
        if settings.kind == "claude" and self._claude_home is not None:
            env.setdefault("CLAUDE_CONFIG_DIR", str(self._claude_home))
        if settings.kind == "codex" and self._codex_home is not None:
            env.setdefault("CODEX_HOME", str(self._codex_home))
        env.update(settings.env)
        try:
            process = await asyncio.create_subprocess_exec(
                *settings.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=folder,
                env=env,
                limit=_STREAM_LIMIT,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise RuntimeFailed(f"acp start {settings.program}: command not found") from None
        except PermissionError:
            raise RuntimeFailed(f"acp start {settings.program}: not executable") from None
        except OSError as exc:
            raise RuntimeFailed(f"acp start {settings.program}: {exc.strerror}") from None
        client = _Client()
        conn = acp.connect_to_agent(client, process.stdin, process.stdout)
        proc = _AgentProcess(settings, folder, process, conn, client)
        self._proc = proc
        logger.info("acp agent %s started (pid %d)", settings.program, process.pid)
        try:
            init = await self._handshake(
                proc,
                "initialize",
                conn.initialize(
                    protocol_version=acp.PROTOCOL_VERSION,
                    client_capabilities=ClientCapabilities(
                        fs=FileSystemCapabilities(read_text_file=False, write_text_file=False),
                        terminal=False,
                    ),
                    client_info=Implementation(name=_CLIENT_NAME, version=_CLIENT_VERSION),
                ),
            )
            if init.protocol_version != acp.PROTOCOL_VERSION:
                raise RuntimeFailed(
                    f"acp initialize {settings.program}: agent speaks protocol version "
                    f"{init.protocol_version}, we speak {acp.PROTOCOL_VERSION}"
                )
            caps = init.agent_capabilities
            proc.can_load = bool(caps is not None and caps.load_session)
            session_caps = caps.session_capabilities if caps is not None else None
            proc.can_delete = session_caps is not None and session_caps.delete is not None
        except BaseException:
            await self._stop_process()
            raise
        return proc

    async def _handshake(self, proc: _AgentProcess, step: str, call: Any) -> Any:
        """Await one setup request with a deadline, mapping failures to RuntimeFailed."""
        program = proc.settings.program
        try:
            return await asyncio.wait_for(call, self._handshake_timeout)
        except TimeoutError:
            raise RuntimeFailed(
                f"acp {step} {program}: no answer within {self._handshake_timeout:g}s"
            ) from None
        except acp.RequestError as exc:
            if exc.code == -32000:
                raise RuntimeFailed(
                    f"acp {step} {program}: the agent needs authentication; "
                    "log in with the agent's own CLI first"
                ) from None
            raise RuntimeFailed(f"acp {step} {program}: agent error {exc.code}: {exc}") from None
        except OSError:
            # ConnectionError (the pipe closed) is an OSError: the agent went away.
            code = await proc.exit_code(2.0)
            raise RuntimeFailed(
                f"acp {step} {program}: agent process exited (code {code})"
            ) from None
        except (ValueError, TypeError) as exc:
            # pydantic's ValidationError is a ValueError: the reply did not fit the schema.
            raise RuntimeFailed(
                f"acp {step} {program}: malformed reply ({type(exc).__name__})"
            ) from None

    async def _open_session(self, proc: _AgentProcess, ctx: RunContext) -> str:
        cwd = str(ctx.folder.resolve())
        wanted = ctx.session_id
        if wanted and wanted in proc.sessions:
            return wanted
        if wanted and proc.can_load:
            try:
                await self._handshake(
                    proc, "session/load", proc.conn.load_session(cwd=cwd, session_id=wanted)
                )
            except RuntimeFailed as exc:
                if not proc.alive:
                    raise
                logger.warning(
                    "acp: could not load the agent's session, starting a new one: %s", exc
                )
            else:
                proc.sessions.add(wanted)
                return wanted
        elif wanted:
            logger.info(
                "acp agent %s cannot load sessions; starting a new one", proc.settings.program
            )
        resp = await self._handshake(proc, "session/new", proc.conn.new_session(cwd=cwd))
        session_id = resp.session_id
        if not session_id or len(session_id) > _MAX_SESSION_ID_CHARS:
            raise RuntimeFailed(f"acp session/new {proc.settings.program}: bad session id")
        proc.sessions.add(session_id)
        return str(session_id)

    async def _drive(self, proc: _AgentProcess, session_id: str, ctx: RunContext) -> RunOutcome:
        turn = _Turn(session_id)
        proc.client.turn = turn
        blocks: list[Any] = [acp.text_block(ctx.prompt)]
        for path in ctx.attachments:
            blocks.append(acp.resource_link_block(name=path.name, uri=path.resolve().as_uri()))
        prompt_task = asyncio.create_task(self._prompt(proc, turn, blocks))
        try:
            return await self._pump(proc, turn, ctx, prompt_task)
        except asyncio.CancelledError:
            await self._cancel(proc, turn, prompt_task)
            raise
        finally:
            turn.close()
            if proc.client.turn is turn:
                proc.client.turn = None
            if not prompt_task.done():
                prompt_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await prompt_task

    @staticmethod
    async def _prompt(proc: _AgentProcess, turn: _Turn, blocks: list[Any]) -> None:
        try:
            response = await proc.conn.prompt(session_id=turn.session_id, prompt=blocks)
        except Exception as exc:
            turn.queue.put_nowait(_Failed(exc))
        else:
            turn.queue.put_nowait(_Done(response))

    async def _pump(
        self,
        proc: _AgentProcess,
        turn: _Turn,
        ctx: RunContext,
        prompt_task: asyncio.Task[None],
    ) -> RunOutcome:
        while True:
            item = await turn.queue.get()
            if isinstance(item, _Update):
                await self._on_update(item.update, turn, ctx)
            elif isinstance(item, _Permission):
                await self._on_permission(item, turn, ctx, prompt_task)
            elif isinstance(item, _Done):
                usage = item.response.usage
                if usage is not None:
                    await ctx.emit(
                        UsageReport(
                            input_tokens=usage.input_tokens, output_tokens=usage.output_tokens
                        )
                    )
                return RunOutcome(stop_reason=str(item.response.stop_reason))
            else:
                raise await self._failure(proc, item.error)

    async def _failure(self, proc: _AgentProcess, error: Exception) -> RuntimeFailed:
        program = proc.settings.program
        if isinstance(error, acp.RequestError):
            return RuntimeFailed(f"acp session/prompt {program}: agent error {error.code}: {error}")
        if isinstance(error, OSError):
            code = await proc.exit_code(2.0)
            return RuntimeFailed(
                f"acp session/prompt {program}: agent process exited (code {code}) during the run"
            )
        return RuntimeFailed(
            f"acp session/prompt {program}: protocol error ({type(error).__name__})"
        )

    async def _on_update(self, update: Any, turn: _Turn, ctx: RunContext) -> None:
        if isinstance(update, AgentMessageChunk):
            content = update.content
            if isinstance(content, TextContentBlock) and content.text:
                await ctx.emit(TextDelta(content.text))
        elif isinstance(update, ToolCallStart):
            call_id = update.tool_call_id
            turn.titles[call_id] = update.title
            raw = update.raw_input
            await ctx.emit(
                ToolCall(
                    call_id=call_id,
                    title=update.title,
                    kind=update.kind or "other",
                    input_json="{}" if raw is None else _json(raw),
                )
            )
            await self._maybe_result(update, turn, ctx)
        elif isinstance(update, ToolCallProgress):
            if update.title:
                turn.titles[update.tool_call_id] = update.title
            await self._maybe_result(update, turn, ctx)
        # Thoughts, plans, modes, commands and context-window usage have no
        # event of their own; they are dropped here on purpose.

    @staticmethod
    async def _maybe_result(
        update: ToolCallStart | ToolCallProgress, turn: _Turn, ctx: RunContext
    ) -> None:
        status = update.status
        if status not in ("completed", "failed") or update.tool_call_id in turn.finished:
            return
        turn.finished.add(update.tool_call_id)
        await ctx.emit(
            ToolResult(call_id=update.tool_call_id, status=status, output=_tool_output(update))
        )

    async def _on_permission(
        self,
        item: _Permission,
        turn: _Turn,
        ctx: RunContext,
        prompt_task: asyncio.Task[None],
    ) -> None:
        call_id = item.tool_call.tool_call_id
        title = item.tool_call.title or turn.titles.get(call_id) or call_id
        options = tuple(PermissionOption(o.option_id, o.name, o.kind) for o in item.options)
        request = PermissionRequest(
            request_id=self._request_id(ctx, turn, call_id, title, options),
            call_id=call_id,
            title=title,
            options=options,
        )
        ask = asyncio.ensure_future(ctx.ask_permission(request))
        try:
            # The agent may die while a person thinks: stop waiting then.
            await asyncio.wait({ask, prompt_task}, return_when=asyncio.FIRST_COMPLETED)
            if not ask.done():
                return
            decision = ask.result()
            if not item.reply.done():
                item.reply.set_result(_answer(decision, options))
        finally:
            if not ask.done():
                ask.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ask
            if not item.reply.done():
                item.reply.set_result(_CANCELLED)

    @staticmethod
    def _request_id(
        ctx: RunContext,
        turn: _Turn,
        call_id: str,
        title: str,
        options: tuple[PermissionOption, ...],
    ) -> str:
        """The tool call id, except for the request a resumed run re-asks.

        An agent may give the re-asked tool call a new id (Claude does); the
        first request of a resumed run with the paused request's title and
        options is that same request, so it keeps the paused request's id and
        the engine can answer it with the stored decision.
        """
        resume = ctx.resume
        if resume is None or turn.resume_matched:
            return call_id
        pending = resume.pending
        if call_id == pending.request_id or (
            title == pending.title
            and [o.option_id for o in options] == [o.option_id for o in pending.options]
        ):
            turn.resume_matched = True
            return pending.request_id
        return call_id

    async def _cancel(
        self, proc: _AgentProcess, turn: _Turn, prompt_task: asyncio.Task[None]
    ) -> None:
        """Tell the agent to stop (``session/cancel``) and wait a while for it to."""
        turn.close()
        try:
            await asyncio.wait_for(proc.conn.cancel(session_id=turn.session_id), 5.0)
        except Exception as exc:
            logger.warning("acp: could not send session/cancel (%s)", type(exc).__name__)
        done, _ = await asyncio.wait({prompt_task}, timeout=self._cancel_grace)
        if not done:
            logger.warning(
                "acp agent %s ignored session/cancel for %gs; stopping it",
                proc.settings.program,
                self._cancel_grace,
            )
            await self._stop_process()
            return
        while not turn.queue.empty():
            last = turn.queue.get_nowait()
            if isinstance(last, _Done):
                logger.info("acp run cancelled; agent stopped with %s", last.response.stop_reason)

    # -- lifecycle --------------------------------------------------------

    async def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.client.turn is not None:
            proc.client.turn.close()
            proc.client.turn = None
        await proc.close(self._close_grace)
        logger.info("acp agent %s stopped", proc.settings.program)

    async def close(self) -> None:
        """Stop the agent process (stdin closed, then SIGTERM, then SIGKILL); idempotent."""
        await self._stop_process()

    async def delete_session(self, session_id: str) -> None:
        """Remove the CLI's own files for ``session_id`` (kind claude or codex).

        The session id must be a UUID (InvalidArgument otherwise) before any
        path is built. Kind ``generic`` keeps nothing we know of: no-op. Stop
        the runtime first (:meth:`close`) so the agent does not write again.
        """
        settings = self._settings
        kind = settings.kind if settings is not None else "generic"
        if settings is None or kind == "generic":
            logger.debug("acp delete_session: kind generic keeps no files we know of")
            return
        validate_cli_session_id(session_id)
        own_env = dict(settings.env)
        if kind == "claude":
            base = _home(own_env.get("CLAUDE_CONFIG_DIR"), self._claude_home, ".claude")
            paths = await asyncio.to_thread(claude_session_paths, base, session_id)
        else:
            base = _home(own_env.get("CODEX_HOME"), self._codex_home, ".codex")
            paths = await asyncio.to_thread(codex_session_paths, base, session_id)
        removed = await asyncio.to_thread(remove_session_paths, base, paths)
        logger.info("acp delete_session (%s): removed %d path(s)", kind, removed)

    async def erase_session(self, session_id: str | None, folder: Path) -> tuple[str, str]:
        """Delete the agent's own copy of a session (see ``base.SessionEraser``).

        Starts the agent as it ran (its settings, in ``folder``) and calls
        ``session/delete`` when the agent advertises it (an unknown session
        counts as deleted); for kinds claude and codex the CLI's session files
        go too. RuntimeFailed when the agent does not start or answer.
        """
        if not session_id:
            return "done", "the agent never opened a session"
        settings = self._settings
        if settings is None:
            raise RuntimeFailed("acp session/delete: the agent's settings are unknown")
        async with self._lock:
            proc = await self._ensure_process(settings, folder)
            deleted = False
            if proc.can_delete:
                deleted = await self._delete_on_agent(proc, session_id)
        files = ""
        if settings.kind != "generic":
            try:
                await self.delete_session(session_id)
            except InvalidArgument:
                files = f"; its {settings.kind} session id is not a UUID: no files removed"
            else:
                return "done", f"session/delete: {'yes' if deleted else 'not offered'}; " + (
                    f"{settings.kind} session files removed"
                )
        if deleted:
            return "done", "deleted by the agent (session/delete)" + files
        return "unsupported", "the agent offers no session/delete and keeps files we do not know"

    async def _delete_on_agent(self, proc: _AgentProcess, session_id: str) -> bool:
        program = proc.settings.program
        # The package knows session/delete's schema but has no client method for
        # it yet: send the request on its connection ourselves.
        call = proc.conn._conn.send_request("session/delete", {"sessionId": session_id})
        try:
            await asyncio.wait_for(call, self._handshake_timeout)
        except acp.RequestError as exc:
            if exc.code == _RESOURCE_NOT_FOUND:
                return True  # a missing session is a deleted one
            raise RuntimeFailed(
                f"acp session/delete {program}: agent error {exc.code}: {exc}"
            ) from None
        except TimeoutError:
            raise RuntimeFailed(
                f"acp session/delete {program}: no answer within {self._handshake_timeout:g}s"
            ) from None
        except OSError:
            code = await proc.exit_code(2.0)
            raise RuntimeFailed(
                f"acp session/delete {program}: agent process exited (code {code})"
            ) from None
        return True


def _answer(
    decision: PermissionDecision, options: tuple[PermissionOption, ...]
) -> RequestPermissionResponse:
    if decision.cancelled or not decision.option_id:
        return _CANCELLED
    if decision.option_id not in {o.option_id for o in options}:
        logger.warning("acp: permission answer names an option the agent did not offer")
        return _CANCELLED
    return RequestPermissionResponse(
        outcome=AllowedOutcome(outcome="selected", option_id=decision.option_id)
    )


def _home(from_settings: str | None, given: Path | None, default_name: str) -> Path:
    """The CLI folder the agent process was told to use (see ``_ensure_process``)."""
    if from_settings:
        return Path(from_settings)
    return given if given is not None else Path.home() / default_name


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _tool_output(update: ToolCallStart | ToolCallProgress) -> str:
    """Text of a finished tool call: its text content, else its raw output."""
    parts: list[str] = []
    for item in update.content or ():
        if isinstance(item, ContentToolCallContent):
            block = item.content
            if isinstance(block, TextContentBlock):
                parts.append(block.text)
            elif isinstance(block, ResourceContentBlock):
                parts.append(block.uri)
    text = "\n".join(parts)
    if not text and update.raw_output is not None:
        raw = update.raw_output
        text = raw if isinstance(raw, str) else _json(raw)
    if len(text) > _MAX_TOOL_OUTPUT_CHARS:
        text = text[:_MAX_TOOL_OUTPUT_CHARS] + "\n[truncated]"
    return text
