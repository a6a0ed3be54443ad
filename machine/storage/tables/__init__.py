"""SQL for machine.db: small synchronous functions run inside :class:`Database` jobs.

Each function takes the connection of the job it runs in, so a caller can put
several of them in one transaction (an event, its run state change and its
search index rows commit together or not at all). No other machine module
writes SQL: erasure and backups read and delete through this package.

Modules by table group: :mod:`.settings` (settings, machine log, counts),
:mod:`.agents`, :mod:`.runs`, :mod:`.events` (events, tool log, search,
summaries), :mod:`.permissions`, :mod:`.attachments`, :mod:`.schedules`, :mod:`.export`
(dump and load of whole agents for export, import and backups), :mod:`.rows`
(a row read into a record, a field of an archive line checked), and
:mod:`.erasures` (an agent's rows deleted, the erased list, receipts).
"""

from machine.storage.tables.agents import (
    OwnIds,
    count_agents,
    get_agent,
    insert_agent,
    list_agents,
    rename_agent,
    row_to_agent,
    set_agent_settings,
    set_agent_state,
    set_session_id,
)
from machine.storage.tables.attachments import (
    add_attachment_ref,
    attachment_referenced,
    record_attachment,
)
from machine.storage.tables.erasures import unreferenced_attachments
from machine.storage.tables.events import (
    append_event,
    append_events,
    read_events,
    run_events,
    search,
)
from machine.storage.tables.permissions import (
    answer_permission,
    cancel_pending_permissions,
    get_permission,
    insert_permission,
    remember_rule,
    rule_for,
    run_permissions,
)
from machine.storage.tables.runs import (
    count_open_runs,
    get_run,
    insert_run,
    last_event_time,
    list_runs,
    run_for_prompt,
    runs_in_states,
    set_run_state,
)
from machine.storage.tables.schedules import (
    agent_schedule_rows,
    delete_agent_schedules,
    delete_schedule,
    enabled_schedules,
    get_schedule,
    insert_schedule,
    insert_schedule_run,
    is_scheduled_run,
    list_schedule_runs,
    list_schedules,
    pause_agent_schedules,
    schedule_run_at,
    set_last_fire,
    set_schedule_enabled,
)
from machine.storage.tables.settings import (
    count_rows,
    get_setting,
    log,
    prune_log,
    set_setting,
    state_counts,
)

__all__ = [
    "OwnIds",
    "add_attachment_ref",
    "agent_schedule_rows",
    "answer_permission",
    "append_event",
    "append_events",
    "attachment_referenced",
    "cancel_pending_permissions",
    "count_agents",
    "count_open_runs",
    "count_rows",
    "delete_agent_schedules",
    "delete_schedule",
    "enabled_schedules",
    "get_agent",
    "get_permission",
    "get_run",
    "get_schedule",
    "get_setting",
    "insert_agent",
    "insert_permission",
    "insert_run",
    "insert_schedule",
    "insert_schedule_run",
    "is_scheduled_run",
    "last_event_time",
    "list_agents",
    "list_runs",
    "list_schedule_runs",
    "list_schedules",
    "log",
    "pause_agent_schedules",
    "prune_log",
    "read_events",
    "record_attachment",
    "remember_rule",
    "rename_agent",
    "row_to_agent",
    "rule_for",
    "run_events",
    "run_for_prompt",
    "run_permissions",
    "runs_in_states",
    "schedule_run_at",
    "search",
    "set_agent_settings",
    "set_agent_state",
    "set_last_fire",
    "set_run_state",
    "set_schedule_enabled",
    "set_session_id",
    "set_setting",
    "state_counts",
    "unreferenced_attachments",
]
