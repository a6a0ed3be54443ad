"""The one small interface every agent runtime implements.

A runtime turns a prompt into a stream of :data:`RuntimeEvent` values. The
machine's run engine owns durability: the runtime hands each event to
``ctx.emit`` and that call returns only once the event is stored (so a slow
disk slows the runtime down instead of buffering without bound). A runtime
that needs a person's decision calls ``ctx.ask_permission`` and waits; the
engine records the request, pauses the run and returns the decision once it
is answered (possibly after a daemon restart, see :class:`ResumeInfo`).

Cancellation is asyncio cancellation: the engine cancels the task running
:meth:`Runtime.run`; the runtime tells its backend to stop (ACP
``session/cancel``) and re-raises ``CancelledError``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shared.errors import RuntimeFailed

__all__ = [
    "PermissionDecision",
    "PermissionOption",
    "PermissionRequest",
    "PortableSettings",
    "ResumeInfo",
    "RunContext",
    "RunOutcome",
    "Runtime",
    "RuntimeEvent",
    "RuntimeFailed",
    "SessionEraser",
    "SessionStarted",
    "TextDelta",
    "ToolCall",
    "ToolResult",
    "UsageReport",
    "withhold_all",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionStarted:
    """The backend opened (or loaded) a session; the engine persists its id."""

    session_id: str


@dataclass(frozen=True)
class TextDelta:
    """A piece of the agent's reply text."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """The agent started a tool call."""

    call_id: str
    title: str
    kind: str = "other"
    input_json: str = "{}"


@dataclass(frozen=True)
class ToolResult:
    """A tool call finished (status: "completed" or "failed")."""

    call_id: str
    status: str
    output: str = ""


@dataclass(frozen=True)
class PermissionOption:
    """One answer a person may give (ACP kinds: allow_once, allow_always,
    reject_once, reject_always)."""

    option_id: str
    name: str
    kind: str


@dataclass(frozen=True)
class PermissionRequest:
    """The agent asks before running a tool.

    ``request_id`` must be stable for the same request when a run is driven
    again after a restart (use the tool call id), so the engine can match it
    with the stored pending request.
    """

    request_id: str
    call_id: str
    title: str
    options: tuple[PermissionOption, ...]


@dataclass(frozen=True)
class PermissionDecision:
    """The person's answer: the chosen option id (empty when cancelled)."""

    option_id: str
    cancelled: bool = False


@dataclass(frozen=True)
class UsageReport:
    """Token usage reported by the backend for this run (added up by the engine)."""

    input_tokens: int = 0
    output_tokens: int = 0


RuntimeEvent = SessionStarted | TextDelta | ToolCall | ToolResult | UsageReport


@dataclass(frozen=True)
class ResumeInfo:
    """Set when the engine drives a run again after a restart.

    The run was paused on ``pending`` and the person has answered
    ``decision``. The runtime re-opens its session (``session_id``) and drives
    the prompt again; the engine suppresses events it already stored and
    answers the matching permission request with ``decision`` at once.
    """

    pending: PermissionRequest
    decision: PermissionDecision


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended normally (stop_reason e.g. "end_turn", "cancelled")."""

    stop_reason: str = "end_turn"


@dataclass
class RunContext:
    """Everything a runtime needs for one run; built by the engine."""

    agent_id: str
    run_id: str
    folder: Path
    prompt: str
    settings: Mapping[str, Any]
    emit: Callable[[RuntimeEvent], Awaitable[None]]
    ask_permission: Callable[[PermissionRequest], Awaitable[PermissionDecision]]
    session_id: str | None = None
    attachments: tuple[Path, ...] = ()
    resume: ResumeInfo | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Runtime(Protocol):
    """One agent's connection to its backend. Created per agent, reused across runs."""

    name: str

    async def run(self, ctx: RunContext) -> RunOutcome:
        """Drive one prompt to its end, emitting events through ``ctx.emit``."""
        ...

    async def close(self) -> None:
        """Stop the backend (process) if any; idempotent."""
        ...

    async def delete_session(self, session_id: str) -> None:
        """Remove the backend's own stored session (files under ~/.claude...)."""
        ...


PortableSettings = Callable[[Mapping[str, Any]], tuple[dict[str, Any], list[str]]]
"""A runtime kind's hook that splits an agent's (validated) settings for a backup
or an export: ``(kept, withheld)``.

``kept`` is what may travel (it goes into every backup and export and is
checked by the kind's ``validate_settings`` when it comes back);
``withheld`` names, as ``"field"`` or ``"field.NAME"``, each value left out
because it may be a secret. The names travel (they are shown to the person
who restores, to set the values again); the values never do. So a runtime
must keep secrets only in settings it withholds: the ``acp`` runtime keeps
``command`` and withholds every ``env`` value, so a credential belongs in
``env`` (or the daemon's own environment, or the CLI's login files), never
in the command's arguments.
"""


def withhold_all(settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The hook of a kind that does not say what is safe: nothing kept, every key withheld."""
    return {}, sorted(str(k) for k in settings)


@runtime_checkable
class SessionEraser(Protocol):
    """A runtime that can erase its backend's own copy of a session (agent erasure).

    A runtime without it reads "unsupported" in the erasure receipt.
    """

    async def erase_session(self, session_id: str | None, folder: Path) -> tuple[str, str]:
        """Delete the backend's copy of ``session_id`` (the agent ran in ``folder``).

        Returns ("done" or "unsupported", a detail for the receipt): done when
        the copy is gone (deleted, missing, or never made); unsupported when the
        backend keeps it and cannot delete it. Raises RuntimeFailed when the
        backend does not start or answer: the erasure is tried again later.
        """
        ...
