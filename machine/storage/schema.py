"""machine.db schema and its migrations.

``MIGRATIONS[i]`` moves a database from version ``i`` to ``i + 1``; the
current version is kept in ``schema_version``. A database written by a newer
agents-machine (a higher version than we know) is refused rather than
guessed at.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Final

from shared.errors import InvalidState

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "migrate"]

logger = logging.getLogger(__name__)

_V1: Final = """
CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE agents (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    folder         TEXT NOT NULL,
    runtime        TEXT NOT NULL,
    settings_json  TEXT NOT NULL DEFAULT '{}',
    state          TEXT NOT NULL CHECK (state IN ('active', 'archived')),
    origin_machine TEXT NOT NULL,
    session_id     TEXT,
    created_at     REAL NOT NULL,
    updated_at     REAL NOT NULL,
    last_seq       INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE runs (
    id               TEXT PRIMARY KEY,
    agent_id         TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    state            TEXT NOT NULL CHECK (state IN ('queued', 'running',
                         'waiting_permission', 'finished', 'failed', 'interrupted',
                         'cancelled')),
    prompt           TEXT NOT NULL,
    attachments_json TEXT NOT NULL DEFAULT '[]',
    created_at       REAL NOT NULL,
    started_at       REAL,
    finished_at      REAL,
    input_tokens     INTEGER NOT NULL DEFAULT 0,
    output_tokens    INTEGER NOT NULL DEFAULT 0,
    duration_ms      INTEGER NOT NULL DEFAULT 0,
    stop_reason      TEXT,
    error_code       TEXT
);
CREATE INDEX runs_agent ON runs (agent_id, created_at);
CREATE INDEX runs_state ON runs (state);

CREATE TABLE events (
    id           INTEGER PRIMARY KEY,
    agent_id     TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    seq          INTEGER NOT NULL,
    run_id       TEXT NOT NULL,
    kind         TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    time         REAL NOT NULL,
    UNIQUE (agent_id, seq)
);
CREATE INDEX events_run ON events (run_id, seq);

CREATE TABLE summaries (
    run_id     TEXT PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE,
    agent_id   TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    text       TEXT NOT NULL,
    created_at REAL NOT NULL
);

CREATE TABLE tool_log (
    id         INTEGER PRIMARY KEY,
    agent_id   TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    run_id     TEXT NOT NULL,
    call_id    TEXT NOT NULL,
    title      TEXT NOT NULL,
    tool_kind  TEXT NOT NULL,
    input_json TEXT NOT NULL,
    status     TEXT,
    output     TEXT,
    started_at REAL NOT NULL,
    ended_at   REAL,
    UNIQUE (run_id, call_id)
);

CREATE TABLE permissions (
    run_id       TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    request_id   TEXT NOT NULL,
    agent_id     TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    call_id      TEXT NOT NULL,
    title        TEXT NOT NULL,
    options_json TEXT NOT NULL,
    seq          INTEGER NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('pending', 'answered', 'cancelled')),
    option_id    TEXT,
    remember     INTEGER NOT NULL DEFAULT 0,
    requested_at REAL NOT NULL,
    answered_at  REAL,
    PRIMARY KEY (run_id, request_id)
);

CREATE TABLE permission_rules (
    agent_id   TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    tool       TEXT NOT NULL,
    decision   TEXT NOT NULL CHECK (decision IN ('allow', 'reject')),
    created_at REAL NOT NULL,
    PRIMARY KEY (agent_id, tool)
);

CREATE TABLE attachments (
    sha256     TEXT PRIMARY KEY,
    size       INTEGER NOT NULL,
    created_at REAL NOT NULL
);

CREATE TABLE attachment_refs (
    sha256     TEXT NOT NULL REFERENCES attachments(sha256),
    agent_id   TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    run_id     TEXT NOT NULL DEFAULT '',
    file_name  TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (sha256, agent_id, run_id)
);

CREATE TABLE machine_log (
    id     INTEGER PRIMARY KEY,
    time   REAL NOT NULL,
    kind   TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX machine_log_time ON machine_log (time);

CREATE VIRTUAL TABLE search USING fts5 (
    text,
    agent_id UNINDEXED,
    run_id UNINDEXED,
    seq UNINDEXED,
    source UNINDEXED,
    tokenize = 'unicode61'
);
"""

# Version 2: whether the runtime reported a run's usage. Runs stored before
# keep 1 (their counts stand as they were shown); new runs start at 0, so
# usage a runtime never reports reads as unknown, not as 0 tokens.
_V2 = """
ALTER TABLE runs ADD COLUMN usage_reported INTEGER NOT NULL DEFAULT 1;
"""

# v3: a run made from a control-plane delivery records its prompt id, unique,
# so a redelivered prompt finds its run instead of running twice.
_V3 = """
ALTER TABLE runs ADD COLUMN prompt_id TEXT;
CREATE UNIQUE INDEX runs_prompt_id ON runs (prompt_id) WHERE prompt_id IS NOT NULL;
"""

# Erasure (issue 11): the erased list (agents that restore and import skip:
# at most 10,000, each kept 400 days) and one receipt per erased agent, whose
# runtime_copy = 'pending' rows are the runtime erasure queue (at most 1,000).
# A receipt keeps what the runtime erasure needs (runtime, folder, settings,
# session) only while it is pending; each layer reads done, unsupported,
# failed or pending.
_V4_ERASURE = """
CREATE TABLE erased (
    agent_id  TEXT PRIMARY KEY,
    erased_at REAL NOT NULL
);
CREATE INDEX erased_time ON erased (erased_at);

CREATE TABLE erasures (
    agent_id        TEXT PRIMARY KEY,
    erased_at       REAL NOT NULL,
    runtime         TEXT NOT NULL,
    folder          TEXT NOT NULL,
    settings_json   TEXT NOT NULL DEFAULT '{}',
    session_id      TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_attempt_at REAL,
    machine_data    TEXT NOT NULL
        CHECK (machine_data IN ('done', 'unsupported', 'failed', 'pending')),
    attachments     TEXT NOT NULL
        CHECK (attachments IN ('done', 'unsupported', 'failed', 'pending')),
    runtime_copy    TEXT NOT NULL
        CHECK (runtime_copy IN ('done', 'unsupported', 'failed', 'pending')),
    detail          TEXT NOT NULL DEFAULT ''
);
CREATE INDEX erasures_queue ON erasures (runtime_copy, erased_at);
"""

# Schedules: a cron expression in a time zone and a prompt, per agent, and
# each fire as a schedule_runs row. (schedule_id, fire_time) is the primary
# key, so a fire time is recorded at most once whatever restarts happen; the
# row is written in the transaction that inserts its run. ``last_fire`` is the
# latest fire time handled (run, refused or skipped as missed). ``run_id`` has
# no foreign key: a restore may bring schedule runs back without their runs.
_V4_SCHEDULES = """
CREATE TABLE schedules (
    id          TEXT PRIMARY KEY,
    agent_id    TEXT NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    cron        TEXT NOT NULL,
    time_zone   TEXT NOT NULL,
    prompt      TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('enabled', 'paused')),
    missed      TEXT NOT NULL CHECK (missed IN ('skip', 'once')),
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    last_fire   REAL
);
CREATE INDEX schedules_agent ON schedules (agent_id, created_at);

CREATE TABLE schedule_runs (
    schedule_id TEXT NOT NULL REFERENCES schedules(id) ON DELETE CASCADE,
    fire_time   REAL NOT NULL,
    run_id      TEXT NOT NULL DEFAULT '',
    result      TEXT NOT NULL CHECK (result IN ('fired', 'caught_up', 'refused')),
    detail      TEXT NOT NULL DEFAULT '',
    recorded_at REAL NOT NULL,
    PRIMARY KEY (schedule_id, fire_time)
);
CREATE INDEX schedule_runs_run ON schedule_runs (run_id);
"""

# Backup speed: restored agents whose conversations the background indexer
# has not put in the full-text index yet (machine/storage/tables/search_backlog.py); and
# per-agent indexes on summaries and the tool log, which a backup and the
# indexer read agent by agent (without them each read scans the whole table).
_V4_BACKUP_SPEED = """
CREATE TABLE search_backlog (
    agent_id  TEXT PRIMARY KEY REFERENCES agents(id) ON DELETE CASCADE,
    queued_at REAL NOT NULL
);
CREATE INDEX summaries_agent ON summaries (agent_id, run_id);
CREATE INDEX tool_log_agent ON tool_log (agent_id, id);
"""

# Restore speed: a restore commits each agent's record and leaves its history in
# a pack file of authenticated segments, loaded afterwards agent by agent
# (machine/storage/tables/restore_pending.py); ``failed`` says why one did not load.
_V4_RESTORE_PENDING = """
CREATE TABLE restore_pending (
    agent_id    TEXT PRIMARY KEY REFERENCES agents(id) ON DELETE CASCADE,
    pack        TEXT NOT NULL,
    pack_offset INTEGER NOT NULL,
    pack_length INTEGER NOT NULL,
    usage_json  TEXT NOT NULL,
    queued_at   REAL NOT NULL,
    failed      TEXT
);
CREATE INDEX restore_pending_pack ON restore_pending (pack);
"""

# An upload's media type (machine.core.attachments.media_type_for) on its
# reference; '' on a run's references and on uploads made before it was kept.
_V8_ATTACHMENT_MEDIA_TYPE = """
ALTER TABLE attachment_refs ADD COLUMN media_type TEXT NOT NULL DEFAULT '';
"""

#: MIGRATIONS[i] upgrades version i to i + 1.
MIGRATIONS: Final[tuple[str, ...]] = (
    _V1,
    _V2,
    _V3,
    _V4_ERASURE,
    _V4_SCHEDULES,
    _V4_BACKUP_SPEED,
    _V4_RESTORE_PENDING,
    _V8_ATTACHMENT_MEDIA_TYPE,
)
SCHEMA_VERSION: Final = len(MIGRATIONS)


def _current_version(conn: sqlite3.Connection) -> int:
    row = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if row is None:
        return 0
    got = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(got[0] or 0)


def migrate(conn: sqlite3.Connection, *, where: str = "machine.db") -> int:
    """Bring ``conn``'s schema to :data:`SCHEMA_VERSION`; return the version.

    Each step runs in its own transaction together with its version bump, so
    a crash mid-migration leaves the previous version intact.
    """
    version = _current_version(conn)
    if version > SCHEMA_VERSION:
        raise InvalidState(
            where,
            f"schema version {version} is newer than this agents-machine supports "
            f"({SCHEMA_VERSION}); upgrade agents-machine",
        )
    while version < SCHEMA_VERSION:
        script = MIGRATIONS[version]
        logger.info("%s: migrating schema %d -> %d", where, version, version + 1)
        # executescript commits implicitly; wrap the step in one explicit transaction.
        try:
            conn.executescript(
                "BEGIN IMMEDIATE;\n"
                "CREATE TABLE IF NOT EXISTS schema_version "
                "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL);\n"
                f"{script}\n"
                f"INSERT INTO schema_version VALUES ({version + 1}, "
                "CAST(strftime('%s', 'now') AS REAL));\n"
                "COMMIT;"
            )
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        version += 1
    return version
