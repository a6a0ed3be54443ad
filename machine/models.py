"""Plain records the machine's domain works with (no protobuf, no SQL)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidArgument, TooLarge

__all__ = [
    "AgentRecord",
    "AgentState",
    "AttachmentRecord",
    "EventKind",
    "MachineIds",
    "PendingPermission",
    "RunErrorCode",
    "RunRecord",
    "RunState",
    "ScheduleRecord",
    "ScheduleRunRecord",
    "SearchHit",
    "StoredEvent",
    "TERMINAL_KINDS",
    "validate_runtime_ref",
]

logger = logging.getLogger(__name__)


#: Longest request or option id a runtime may issue (they have no fixed pattern).
MAX_RUNTIME_REF = 200


def check_prompt(text: str, limit: int) -> str:
    """``text`` if it is a prompt this machine takes (from any caller: the CLI,
    a schedule, the control plane); InvalidArgument or TooLarge naming ``prompt``."""
    if not text.strip():
        raise InvalidArgument("prompt", "must not be empty")
    if "\0" in text:
        raise InvalidArgument("prompt", "must not contain a NUL character")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise TooLarge("prompt", limit, size)
    return text


def validate_runtime_ref(value: str, field: str) -> str:
    """A permission request or option id (issued by a runtime): 1 to 200 characters.

    Runtimes make these, so they follow no id pattern; they are only ever
    compared and bound as SQL parameters, never used in a path.
    """
    if not value or len(value) > MAX_RUNTIME_REF:
        raise InvalidArgument(field, f"must be 1 to {MAX_RUNTIME_REF} characters")
    return value


@dataclass(frozen=True)
class MachineIds:
    """Who this machine is: its canonical id and every id that was ever its own.

    Before a join the canonical id is the one made with the database; once
    joined it is the id the control plane assigned (the one in the client
    certificate). Agents whose origin is any of ``own`` run here; any other
    origin is another machine's.
    """

    canonical: str
    own: frozenset[str]
    joined: bool

    def __post_init__(self) -> None:
        if self.canonical not in self.own:
            raise ValueError("the canonical machine id must be one of the own ids")


class AgentState(enum.StrEnum):
    """An agent's lifecycle state."""

    ACTIVE = "active"
    ARCHIVED = "archived"


class RunState(enum.StrEnum):
    """A run's state; the last four are final."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING_PERMISSION = "waiting_permission"
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"

    @property
    def open(self) -> bool:
        """True while the run has not ended."""
        return self in (RunState.QUEUED, RunState.RUNNING, RunState.WAITING_PERMISSION)


class EventKind(enum.StrEnum):
    """What a conversation event says (names match the proto enum)."""

    RUN_STARTED = "RUN_STARTED"
    TEXT_DELTA = "TEXT_DELTA"
    TOOL_CALL = "TOOL_CALL"
    TOOL_RESULT = "TOOL_RESULT"
    PERMISSION_REQUEST = "PERMISSION_REQUEST"
    PERMISSION_ANSWERED = "PERMISSION_ANSWERED"
    RUN_FINISHED = "RUN_FINISHED"
    RUN_ERROR = "RUN_ERROR"


TERMINAL_KINDS = frozenset({EventKind.RUN_FINISHED, EventKind.RUN_ERROR})


class RunErrorCode(enum.StrEnum):
    """Why a run ended with RUN_ERROR (names match the proto enum)."""

    RUN_INTERRUPTED = "RUN_INTERRUPTED"
    RUNTIME_FAILED = "RUNTIME_FAILED"
    CANCELLED = "CANCELLED"
    RUNTIME_UNAVAILABLE = "RUNTIME_UNAVAILABLE"
    STORAGE_FAILED = "STORAGE_FAILED"


@dataclass(frozen=True)
class AgentRecord:
    """One agent as stored."""

    id: str
    name: str
    folder: str
    runtime: str
    settings: dict[str, Any]
    state: AgentState
    origin_machine: str
    local: bool
    session_id: str | None
    created_at: float
    updated_at: float
    last_seq: int


@dataclass(frozen=True)
class StoredEvent:
    """One conversation event as stored (``payload`` is the kind's JSON object)."""

    agent_id: str
    seq: int
    run_id: str
    kind: EventKind
    payload: dict[str, Any]
    time: float

    @property
    def terminal(self) -> bool:
        """True for RUN_FINISHED and RUN_ERROR."""
        return self.kind in TERMINAL_KINDS


@dataclass(frozen=True)
class RunRecord:
    """One run: state plus usage and time history."""

    id: str
    agent_id: str
    state: RunState
    prompt: str
    attachments: tuple[str, ...]
    created_at: float
    started_at: float | None
    finished_at: float | None
    input_tokens: int | None
    """None: the runtime did not report usage (unknown, not 0)."""
    output_tokens: int | None
    duration_ms: int
    stop_reason: str | None
    error_code: RunErrorCode | None
    prompt_id: str | None = None
    """The control-plane prompt (``pr_...``) the run was made from, if delivered."""


@dataclass(frozen=True)
class PendingPermission:
    """A stored permission request and, once given, its answer."""

    run_id: str
    request_id: str
    agent_id: str
    call_id: str
    title: str
    options: tuple[tuple[str, str, str], ...]  # (option_id, name, kind)
    seq: int
    state: str
    option_id: str | None = None
    remember: bool = False


@dataclass(frozen=True)
class SearchHit:
    """One full-text search match."""

    agent_id: str
    agent_name: str
    archived: bool
    run_id: str
    seq: int
    source: str
    snippet: str


@dataclass(frozen=True)
class AttachmentRecord:
    """A stored attachment recorded against an agent."""

    sha256: str
    size: int
    agent_id: str
    file_name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    media_type: str = ""
    """``type/subtype``: declared by the upload or guessed from its file name."""


@dataclass(frozen=True)
class ScheduleRecord:
    """One schedule: an agent's prompt on a cron in a time zone."""

    id: str
    agent_id: str
    cron: str
    """Five-field cron expression."""
    time_zone: str
    """IANA zone the cron's wall times are read in."""
    prompt: str
    enabled: bool
    """False: paused (by a person, by archiving its agent, or by a restore)."""
    missed: str
    """``skip`` or ``once``: what a start does about fire times missed while down."""
    created_at: float
    updated_at: float
    last_fire: float | None
    """The latest fire time handled (run, refused or skipped), or None."""


@dataclass(frozen=True)
class ScheduleRunRecord:
    """One fire of a schedule: its fire time and the run it made (or why none)."""

    schedule_id: str
    fire_time: float
    run_id: str
    """Empty when the fire was refused."""
    result: str
    """``fired``, ``caught_up`` (a missed fire run once at start) or ``refused``."""
    detail: str
    recorded_at: float
