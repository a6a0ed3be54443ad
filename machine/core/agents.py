"""The agents service: create, list, show, rename, configure, archive, unarchive,
search; and an agent's settings as they travel in backups and exports.

An agent's settings leave the machine only as its runtime makes them portable
(:func:`portable_settings`: secrets withheld, their names kept) and come back
only as its runtime accepts them (:class:`ArrivingSettings`): a restore or an
import never fails for an agent's settings, it loads the agent without them
and says so, and the person sets them again with :meth:`AgentsService.configure`.
The CLIs' session files travel with them (``machine.runtimes.session_files``,
re-exported here for the backups, which reach the runtimes through the core).
"""

from __future__ import annotations

import builtins
import functools
import json
import logging
import os
import sqlite3
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine.models import AgentRecord, AgentState, MachineIds, SearchHit
from machine.runtimes import RuntimeRegistry, check_session_id, default_registry
from machine.runtimes.session_files import (
    SessionCapture,
    SessionHomes,
    SessionRestore,
    capture_session_files,
    restore_session_tar,
)
from machine.storage import restored, tables
from machine.storage.db import Database
from machine.storage.tables import search_backlog
from shared.errors import InvalidArgument, InvalidState, TooLarge
from shared.ids import new_id, validate_id

__all__ = [
    "AgentsService",
    "ArrivingSettings",
    "SessionCapture",
    "SessionHomes",
    "SessionRestore",
    "SettingsNote",
    "capture_session_files",
    "portable_settings",
    "restore_session_tar",
    "validate_name",
]

logger = logging.getLogger(__name__)

_MAX_NAME = 200
_MAX_SETTINGS = 64 * 1024
_MAX_QUERY = 1000
_MAX_FOLDER = 4096


def validate_name(name: str, field: str = "name") -> str:
    """A display name: 1 to 200 characters after trimming, no control characters."""
    name = name.strip()
    if not name:
        raise InvalidArgument(field, "must not be empty")
    if len(name) > _MAX_NAME:
        raise InvalidArgument(field, f"longer than {_MAX_NAME} characters")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise InvalidArgument(field, "must not contain control characters")
    return name


def _validate_folder(folder: str) -> str:
    if not folder:
        raise InvalidArgument("folder", "must not be empty")
    if len(folder) > _MAX_FOLDER or "\x00" in folder:
        raise InvalidArgument("folder", "not a usable path")
    path = Path(folder)
    if not path.is_absolute():
        raise InvalidArgument("folder", f"must be an absolute path, got {folder!r}")
    if not path.is_dir():
        raise InvalidArgument("folder", f"{folder!r} is not an existing folder")
    # Without "..", "." or a trailing slash: an export by folder finds it by that path.
    normal = os.path.normpath(folder)
    if normal != folder and not os.path.samefile(folder, normal):
        # "link/.." is the folder above the link's target, not above the link.
        raise InvalidArgument(
            "folder", f"{folder!r} has '..' after a symbolic link; give the folder's own path"
        )
    return normal


def _parse_settings(settings_json: str) -> dict[str, Any]:
    if not settings_json.strip():
        return {}
    if len(settings_json.encode()) > _MAX_SETTINGS:
        raise TooLarge("settings_json", _MAX_SETTINGS, len(settings_json.encode()))
    try:
        value = json.loads(settings_json)
    except json.JSONDecodeError as e:
        raise InvalidArgument("settings_json", f"not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("settings_json", "must be a JSON object")
    return value


@functools.cache
def _builtin_runtimes() -> RuntimeRegistry:
    # Splitting and checking settings needs none of the daemon's config (the
    # CLIs' homes are for running): a backup's worker processes use it too.
    return default_registry()


def portable_settings(
    runtime: str, settings: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """``(kept, withheld)`` of an agent's settings for a backup or an export
    (``machine.runtimes.base.PortableSettings``); the same in every process."""
    return _builtin_runtimes().portable(runtime, settings)


#: Withheld setting names a record may carry (each "field" or "field.NAME").
_MAX_WITHHELD = 256
_MAX_WITHHELD_NAME = 200


@dataclass(frozen=True)
class SettingsNote:
    """An agent that came in (a restore, an import) without all of its settings."""

    agent_id: str
    withheld: tuple[str, ...] = ()
    """Settings whose values stayed behind ("env.NAME"): set them with configure."""
    problem: str = ""
    """Why its settings did not come back at all (it loaded with none), or ''."""


def _withheld_names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    names = [
        v
        for v in value[:_MAX_WITHHELD]
        if isinstance(v, str) and 0 < len(v) <= _MAX_WITHHELD_NAME and v.isprintable()
    ]
    return tuple(sorted(set(names)))


class ArrivingSettings:
    """The settings and session agents loaded from records get, checked by their runtime.

    Called with each agent's checked record (a ``RecordSettings`` hook of
    ``machine.storage.tables.export``); never raises: settings the runtime
    refuses (or a runtime this machine lacks) load as none, a session id the
    runtime could not hold loads as none, and :meth:`notes` names each agent
    that came without all of its settings. A record written before settings
    travelled loads as such records always did.
    """

    def __init__(self, runtimes: RuntimeRegistry | None = None) -> None:
        self._runtimes = runtimes or _builtin_runtimes()
        self._notes: dict[str, SettingsNote] = {}
        self._sessions: dict[str, str | None] = {}

    def session_id(self, agent_id: str) -> str | None:
        """The runtime session ``agent_id`` loaded with (None: none, or not loaded)."""
        return self._sessions.get(agent_id)

    def __call__(self, record: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        agent_id = str(record["agent_id"])
        runtime = str(record["runtime"])
        withheld = _withheld_names(record.get("settings_withheld"))
        kept = record.get("runtime_settings")
        problem = ""
        settings: dict[str, Any] = {}
        try:
            if "runtime_settings" not in record:
                # Written before settings travelled: none, as then; said only when
                # the runtime cannot run without them (an acp agent's command).
                self._runtimes.validate(runtime, {})
            elif not isinstance(kept, dict):
                raise InvalidArgument("runtime_settings", "not a JSON object")
            else:
                settings = self._runtimes.validate(runtime, kept)
        except InvalidArgument as e:
            settings = {}
            problem = (
                "its archive keeps no settings"
                if "runtime_settings" not in record
                else f"its settings were not restored ({e})"
            )
        session_id: str | None = None
        if record.get("session_id") is not None:
            try:
                session_id = check_session_id(settings, record["session_id"])
            except InvalidArgument as e:
                logger.warning("agent %s: runtime session not restored: %s", agent_id, e.reason)
        self._sessions[agent_id] = session_id
        if withheld or problem:
            self._notes[agent_id] = SettingsNote(agent_id, withheld, problem)
        else:
            self._notes.pop(agent_id, None)  # a transaction tried again
        return settings, session_id

    def notes(self, agent_ids: builtins.list[str] | tuple[str, ...]) -> tuple[SettingsNote, ...]:
        """The notes of ``agent_ids`` (those that came in), in that order."""
        return tuple(self._notes[a] for a in agent_ids if a in self._notes)


class AgentsService:
    """Agent records on this machine. Only agents whose origin is one of its own ids run."""

    def __init__(
        self,
        db: Database,
        *,
        ids: MachineIds,
        runtimes: RuntimeRegistry,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self.ids = ids
        self._own = ids.own
        self._runtimes = runtimes
        self._clock = clock

    async def create(
        self, *, name: str, folder: str, runtime: str = "", settings_json: str = ""
    ) -> AgentRecord:
        """Create an active agent of this machine (its origin: the canonical id)."""
        name = validate_name(name)
        folder = _validate_folder(folder)
        runtime = runtime.strip() or "echo"
        settings = self._runtimes.validate(runtime, _parse_settings(settings_json))
        now = self._clock()
        agent = AgentRecord(
            id=new_id("agent"),
            name=name,
            folder=folder,
            runtime=runtime,
            settings=settings,
            state=AgentState.ACTIVE,
            origin_machine=self.ids.canonical,
            local=True,
            session_id=None,
            created_at=now,
            updated_at=now,
            last_seq=0,
        )

        def write(conn: sqlite3.Connection) -> None:
            tables.insert_agent(conn, agent)
            tables.log(conn, now, "agent.created", agent.id)

        await self._db.write(write)
        logger.info("agent %s created (runtime %s)", agent.id, runtime)
        return agent

    async def get(self, agent_id: str) -> AgentRecord:
        """One agent; NotFound when missing."""
        validate_id("agent", agent_id, "agent_id")
        return await self._db.read(lambda c: tables.get_agent(c, agent_id, self._own))

    async def list(self, *, include_archived: bool = False) -> list[AgentRecord]:
        """Agents, newest first."""
        return await self._db.read(
            lambda c: tables.list_agents(c, self._own, include_archived=include_archived)
        )

    async def rename(self, agent_id: str, name: str) -> AgentRecord:
        """Set a new display name."""
        validate_id("agent", agent_id, "agent_id")
        name = validate_name(name)
        now = self._clock()

        def write(conn: sqlite3.Connection) -> AgentRecord:
            tables.get_agent(conn, agent_id, self._own)
            tables.rename_agent(conn, agent_id, name, now)
            return tables.get_agent(conn, agent_id, self._own)

        return await self._db.write(write)

    async def configure(self, agent_id: str, settings_json: str) -> AgentRecord:
        """Replace an agent's runtime settings, checked as :meth:`create` checks them.

        Allowed whatever its state (a restored agent is archived: its withheld
        settings are set back before it is unarchived); refused for an agent of
        another machine (it can only be read here). The next run uses them: a
        runtime compares each run's settings with those its process started with
        (the acp runtime restarts its agent program when they differ).
        """
        validate_id("agent", agent_id, "agent_id")
        parsed = _parse_settings(settings_json)
        now = self._clock()

        def write(conn: sqlite3.Connection) -> AgentRecord:
            agent = tables.get_agent(conn, agent_id, self._own)
            if not agent.local:
                raise InvalidState(
                    f"configure agent {agent_id}",
                    f"its origin is machine {agent.origin_machine}; it can only be read",
                )
            settings = self._runtimes.validate(agent.runtime, parsed)
            tables.set_agent_settings(conn, agent_id, settings, now)
            # The log names the agent, never the settings (env values are secrets).
            tables.log(conn, now, "agent.configured", agent_id)
            return tables.get_agent(conn, agent_id, self._own)

        agent = await self._db.write(write)
        logger.info("agent %s configured", agent_id)
        return agent

    async def archive(self, agent_id: str) -> AgentRecord:
        """Archive an agent; refused while one of its runs is open."""
        validate_id("agent", agent_id, "agent_id")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> AgentRecord:
            agent = tables.get_agent(conn, agent_id, self._own)
            if agent.state is AgentState.ARCHIVED:
                return agent
            if tables.count_open_runs(conn, agent_id):
                raise InvalidState(
                    f"archive agent {agent_id}", "a run is in flight or waiting; cancel it first"
                )
            tables.set_agent_state(conn, agent_id, AgentState.ARCHIVED, now)
            # Its schedules pause with it (in the same transaction); unarchiving
            # leaves them paused for a person to resume.
            tables.pause_agent_schedules(conn, agent_id, now)
            tables.log(conn, now, "agent.archived", agent_id)
            return tables.get_agent(conn, agent_id, self._own)

        return await self._db.write(write)

    async def unarchive(self, agent_id: str) -> AgentRecord:
        """Make an archived agent of this machine active again."""
        validate_id("agent", agent_id, "agent_id")
        await restored.ensure_loaded(self._db, agent_id)  # a restored one runs on its history
        now = self._clock()

        def write(conn: sqlite3.Connection) -> AgentRecord:
            agent = tables.get_agent(conn, agent_id, self._own)
            if not agent.local:
                raise InvalidState(
                    f"unarchive agent {agent_id}",
                    f"its origin is machine {agent.origin_machine}; it can only be read",
                )
            if agent.state is AgentState.ACTIVE:
                return agent
            tables.set_agent_state(conn, agent_id, AgentState.ACTIVE, now)
            tables.log(conn, now, "agent.unarchived", agent_id)
            return tables.get_agent(conn, agent_id, self._own)

        return await self._db.write(write)

    async def search(
        self, query: str, *, agent_id: str = "", limit: int = 20
    ) -> builtins.list[SearchHit]:
        """Full-text search over every agent (archived included)."""
        if agent_id:
            validate_id("agent", agent_id, "agent_id")
        if not query.strip():
            raise InvalidArgument("query", "must not be empty")
        if len(query) > _MAX_QUERY:
            raise InvalidArgument("query", f"longer than {_MAX_QUERY} characters")
        if limit < 0 or limit > 200:
            raise InvalidArgument("limit", "must be 0 to 200")
        return await self._db.read(lambda c: tables.search(c, query, agent_id or None, limit or 20))

    async def search_indexing(self) -> int:
        """Restored agents whose conversations are not searchable yet (being indexed)."""
        return await self._db.read(search_backlog.backlog_count, what="search backlog")
