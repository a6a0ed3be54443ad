"""The wire message of any record the CLI's client returns.

:class:`machine.cli.client.MachineClient` returns domain records and views;
the CLI prints ``--json`` as the message the daemon sent, which writing the
record again gives (each reader is the inverse of its writer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from machine.api.codec.agents import agent_to_pb, event_to_pb, run_to_pb, search_to_pb
from machine.api.codec.backups import backup_view_to_pb, in_result_to_pb, verify_to_pb
from machine.api.codec.erasure import delete_result_to_pb, erasure_to_pb
from machine.api.codec.schedules import schedule_run_to_pb, schedule_to_pb
from machine.api.codec.status import status_to_pb
from machine.api.views import BackupView, DaemonStatus, ScheduleView, SearchResult, VerifyReport
from machine.backups.transfer import InResult
from machine.erasure.service import DeleteResult, ErasureView
from machine.models import AgentRecord, RunRecord, ScheduleRunRecord, StoredEvent

__all__ = ["message_of"]

logger = logging.getLogger(__name__)


def message_of(record: object) -> Message:
    """The wire message of a record :class:`machine.cli.client.MachineClient` returned
    (what the CLI prints for --json, so its JSON is the daemon's reply)."""
    for cls, encode in _ENCODERS:
        if isinstance(record, cls):
            return encode(record)
    raise TypeError(f"no message for {type(record).__name__}")


_ENCODERS: tuple[tuple[type[Any], Callable[[Any], Message]], ...] = (
    (AgentRecord, agent_to_pb),
    (RunRecord, run_to_pb),
    (StoredEvent, event_to_pb),
    (ScheduleView, lambda v: schedule_to_pb(v.schedule, v.next_run_at)),
    (ScheduleRunRecord, schedule_run_to_pb),
    (SearchResult, search_to_pb),
    (ErasureView, erasure_to_pb),
    (DeleteResult, delete_result_to_pb),
    (InResult, in_result_to_pb),
    (BackupView, backup_view_to_pb),
    (VerifyReport, verify_to_pb),
    (DaemonStatus, status_to_pb),
)
