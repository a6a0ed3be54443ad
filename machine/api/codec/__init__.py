"""Translate domain records to and from machine.v1 protobuf messages.

Only the servicer and the CLI's client (:mod:`machine.cli.client`) use this
package: protobuf stops here. The servicer writes records into messages; the
client reads the daemon's replies back into records. Each reader is the
inverse of its writer: writing a record read here gives the message it was
read from (the CLI prints ``--json`` that way, :func:`message_of`).

``agents`` (agents, runs, events, search hits), ``schedules`` (schedules and
their fires), ``erasure`` (deletes and erasure receipts), ``backups``
(backups, verifies, imports, restores, the backup status), ``status`` (the
daemon's status, the database check), ``messages`` (:func:`message_of`) and
``fields`` (the conventions they share: an unset time is None). Callers use
``codec.<name>``; every name is re-exported here.

May import what ``machine.api`` may: ``machine.app`` and the rooms below it,
``shared``.
"""

from machine.api.codec.agents import (
    agent_from_pb,
    agent_to_pb,
    event_from_pb,
    event_to_pb,
    hit_from_pb,
    hit_to_pb,
    run_from_pb,
    run_to_pb,
    search_from_pb,
    search_to_pb,
)
from machine.api.codec.backups import (
    backup_info_to_pb,
    backup_result_to_pb,
    backup_status_from_pb,
    backup_status_to_pb,
    backup_view_from_pb,
    backup_view_to_pb,
    in_result_from_pb,
    in_result_to_pb,
    recovery_key_from_pb,
    restore_result_to_pb,
    verify_from_pb,
    verify_to_pb,
)
from machine.api.codec.erasure import (
    delete_result_from_pb,
    delete_result_to_pb,
    erasure_from_pb,
    erasure_to_pb,
)
from machine.api.codec.messages import message_of
from machine.api.codec.schedules import (
    schedule_from_pb,
    schedule_run_from_pb,
    schedule_run_to_pb,
    schedule_to_pb,
)
from machine.api.codec.status import check_from_pb, status_from_pb, status_to_pb

__all__ = [
    "agent_from_pb",
    "agent_to_pb",
    "backup_info_to_pb",
    "backup_result_to_pb",
    "backup_status_from_pb",
    "backup_status_to_pb",
    "backup_view_from_pb",
    "backup_view_to_pb",
    "check_from_pb",
    "delete_result_from_pb",
    "delete_result_to_pb",
    "erasure_from_pb",
    "erasure_to_pb",
    "event_from_pb",
    "event_to_pb",
    "hit_from_pb",
    "hit_to_pb",
    "in_result_from_pb",
    "in_result_to_pb",
    "message_of",
    "recovery_key_from_pb",
    "restore_result_to_pb",
    "run_from_pb",
    "run_to_pb",
    "schedule_from_pb",
    "schedule_run_from_pb",
    "schedule_run_to_pb",
    "schedule_to_pb",
    "search_from_pb",
    "search_to_pb",
    "status_from_pb",
    "status_to_pb",
    "verify_from_pb",
    "verify_to_pb",
]
