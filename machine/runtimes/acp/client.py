"""The client side of an ACP connection and the queue of the run in flight.

:class:`AcpClient` is what the ``agent-client-protocol`` package calls when
the agent sends something. The package handles each incoming message in its
own task, and emitting an event may wait on a slow disk (``ctx.emit``), so
the callbacks only put what arrived on the current :class:`Turn`'s queue, in
arrival order, and one loop per run (``AcpRuntime``) emits from that queue.
Permission requests go through the same queue so they stay after the tool
call they are about; the agent's task waits on the request's reply future.

The client advertises neither file-system nor terminal capabilities and
answers such requests with an error: the agent works in its folder with its
own tools, gated by ``session/request_permission``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import acp
from acp.schema import (
    CreateElicitationResponse,
    CreateTerminalResponse,
    DeniedOutcome,
    ElicitationMode,
    EnvVariable,
    KillTerminalResponse,
    PromptResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalOutputResponse,
    ToolCallUpdate,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)
from acp.schema import PermissionOption as AcpPermissionOption

__all__ = [
    "CANCELLED",
    "AcpClient",
    "PendingPermission",
    "PromptDone",
    "PromptFailed",
    "Turn",
    "TurnItem",
    "Update",
]

logger = logging.getLogger(__name__)

CANCELLED = RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
"""The answer to a permission request nobody will decide (run over, agent gone)."""


# -- items on a run's queue ---------------------------------------------------


@dataclass
class Update:
    """A ``session/update`` notification's payload."""

    update: Any


@dataclass
class PendingPermission:
    """A ``session/request_permission``; the agent waits until ``reply`` is set."""

    tool_call: ToolCallUpdate
    options: list[AcpPermissionOption]
    reply: asyncio.Future[RequestPermissionResponse]


@dataclass
class PromptDone:
    """The ``session/prompt`` request returned: the run is over."""

    response: PromptResponse


@dataclass
class PromptFailed:
    """The ``session/prompt`` request failed."""

    error: Exception


TurnItem = Update | PendingPermission | PromptDone | PromptFailed


@dataclass
class Turn:
    """State of the one run in flight on a process."""

    session_id: str
    queue: asyncio.Queue[TurnItem] = field(default_factory=asyncio.Queue)
    closed: bool = False
    # Tool call titles by call id: a permission request may come without one.
    titles: dict[str, str] = field(default_factory=dict)
    # Tool calls whose result was emitted: a later update must not emit it again.
    finished: set[str] = field(default_factory=set)
    # A resumed run's re-asked permission request was found (permissions).
    resume_matched: bool = False

    def close(self) -> None:
        """Stop accepting items; answer permission requests still queued with cancelled."""
        self.closed = True
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, PendingPermission) and not item.reply.done():
                item.reply.set_result(CANCELLED)


class AcpClient:
    """The ACP client side: hands what the agent sends to the current turn."""

    def __init__(self) -> None:
        self.turn: Turn | None = None

    def _current(self, session_id: str) -> Turn | None:
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
        turn.queue.put_nowait(Update(update))

    async def request_permission(
        self,
        session_id: str,
        tool_call: ToolCallUpdate,
        options: list[AcpPermissionOption],
        **kwargs: Any,
    ) -> RequestPermissionResponse:
        turn = self._current(session_id)
        if turn is None:
            return CANCELLED
        reply: asyncio.Future[RequestPermissionResponse] = (
            asyncio.get_running_loop().create_future()
        )
        turn.queue.put_nowait(PendingPermission(tool_call, list(options), reply))
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
