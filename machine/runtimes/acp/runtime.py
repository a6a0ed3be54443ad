"""The ``acp`` runtime itself: runs, cancel, stop, session deletion.

The runtime starts the agent's configured command as a subprocess (cwd = the
agent's folder), speaks ACP over its stdin/stdout with the client side of the
``agent-client-protocol`` package, and turns the agent's ``session/update``
notifications into :mod:`machine.runtimes.base` events. One process serves
every run of one agent; it is started on the first run and again after it
died or its settings changed, and :meth:`AcpRuntime.close` stops it.

Ordering: the package handles each incoming message in its own task, and our
callbacks may wait on a slow disk (``ctx.emit``). So the client callbacks only
put what arrived on the run's queue, in arrival order, and one loop per run
(:meth:`AcpRuntime._pump`) emits from that queue; permission requests go
through the same queue so they stay after the tool call they are about.

This module holds the runtime and the registry's hooks; the pieces it drives
are, each in its own module of this package: ``settings`` (what an agent may
configure), ``process`` (the subprocess and the setup requests on its
connection), ``client`` (the client callbacks and the run's queue), ``updates``
(session updates into run events) and ``permissions`` (the permission
bridge). The client advertises neither file-system nor terminal capabilities
and answers such requests with an error: the agent works in its folder with
its own tools, gated by ``session/request_permission``.

See docs/runtimes-acp.md for settings, resume after a restart, and deleting
Claude/Codex session files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import acp

from machine.runtimes.acp.client import (
    PendingPermission,
    PromptDone,
    PromptFailed,
    Turn,
    Update,
)
from machine.runtimes.acp.permissions import bridge_permission
from machine.runtimes.acp.process import AgentProcess
from machine.runtimes.acp.settings import (
    KINDS,
    AcpSettings,
    validate_acp_settings,
    validate_settings,
)
from machine.runtimes.acp.updates import emit_update
from machine.runtimes.base import (
    RunContext,
    RunOutcome,
    RuntimeFailed,
    SessionStarted,
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
        self._settings = AcpSettings.parse(settings) if settings is not None else None
        self._base_env = dict(base_env) if base_env is not None else None
        self._claude_home = claude_home
        self._codex_home = codex_home
        self._handshake_timeout = handshake_timeout
        self._cancel_grace = cancel_grace
        self._close_grace = close_grace
        self._proc: AgentProcess | None = None
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
            settings = AcpSettings.parse(ctx.settings)
        except InvalidArgument as exc:
            raise RuntimeFailed(f"acp settings: {exc}") from None
        self._settings = settings
        async with self._lock:
            try:
                proc = await self._ensure_process(settings, ctx.folder)
                session_id = await proc.open_session(ctx.folder, ctx.session_id)
                await ctx.emit(SessionStarted(session_id))
                return await self._drive(proc, session_id, ctx)
            except RuntimeFailed:
                # A process that failed us once is not trusted for the next run.
                await self._stop_process()
                raise

    async def _ensure_process(self, settings: AcpSettings, folder: Path) -> AgentProcess:
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
        proc = await AgentProcess.start(
            settings, folder, env, handshake_timeout=self._handshake_timeout
        )
        self._proc = proc
        logger.info("acp agent %s started (pid %d)", settings.program, proc.process.pid)
        try:
            await proc.initialize()
        except BaseException:
            await self._stop_process()
            raise
        return proc

    async def _drive(self, proc: AgentProcess, session_id: str, ctx: RunContext) -> RunOutcome:
        turn = Turn(session_id)
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
    async def _prompt(proc: AgentProcess, turn: Turn, blocks: list[Any]) -> None:
        try:
            response = await proc.conn.prompt(session_id=turn.session_id, prompt=blocks)
        except Exception as exc:
            turn.queue.put_nowait(PromptFailed(exc))
        else:
            turn.queue.put_nowait(PromptDone(response))

    async def _pump(
        self,
        proc: AgentProcess,
        turn: Turn,
        ctx: RunContext,
        prompt_task: asyncio.Task[None],
    ) -> RunOutcome:
        while True:
            item = await turn.queue.get()
            if isinstance(item, Update):
                await emit_update(item.update, turn, ctx)
            elif isinstance(item, PendingPermission):
                await bridge_permission(item, turn, ctx, prompt_task)
            elif isinstance(item, PromptDone):
                usage = item.response.usage
                if usage is not None:
                    await ctx.emit(
                        UsageReport(
                            input_tokens=usage.input_tokens, output_tokens=usage.output_tokens
                        )
                    )
                return RunOutcome(stop_reason=str(item.response.stop_reason))
            else:
                raise await proc.prompt_failure(item.error)

    async def _cancel(
        self, proc: AgentProcess, turn: Turn, prompt_task: asyncio.Task[None]
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
            if isinstance(last, PromptDone):
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
                deleted = await proc.delete_on_agent(session_id)
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


def _home(from_settings: str | None, given: Path | None, default_name: str) -> Path:
    """The CLI folder the agent process was told to use (see ``_ensure_process``)."""
    if from_settings:
        return Path(from_settings)
    return given if given is not None else Path.home() / default_name
