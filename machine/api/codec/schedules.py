"""Schedules and their fires to and from machine.v1 messages.

A schedule's reply carries when it fires next; read back it is a
:class:`~machine.api.views.ScheduleView`. Its ``updated_at`` is not on the wire.
"""

from __future__ import annotations

import logging

from machine.api.codec.fields import time_field
from machine.api.views import ScheduleView
from machine.models import ScheduleRecord, ScheduleRunRecord
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

__all__ = ["schedule_from_pb", "schedule_run_from_pb", "schedule_run_to_pb", "schedule_to_pb"]

logger = logging.getLogger(__name__)


def schedule_to_pb(s: ScheduleRecord, next_fire: float | None) -> pb.Schedule:
    """Domain schedule (and when it fires next) -> message."""
    return pb.Schedule(
        id=s.id,
        agent_id=s.agent_id,
        cron=s.cron,
        prompt=s.prompt,
        next_run_at=from_seconds(next_fire),
        time_zone=s.time_zone,
        enabled=s.enabled,
        missed=s.missed,
        created_at=from_seconds(s.created_at),
        last_fire_at=from_seconds(s.last_fire),
    )


def schedule_run_to_pb(r: ScheduleRunRecord) -> pb.ScheduleRun:
    """Domain schedule fire -> message."""
    return pb.ScheduleRun(
        schedule_id=r.schedule_id,
        fire_time=from_seconds(r.fire_time),
        run_id=r.run_id,
        result=r.result,
        detail=r.detail,
        recorded_at=from_seconds(r.recorded_at),
    )


# ------------------------------------------------------------ client side
# Each reader is the inverse of the writer above (see the package docstring).


def schedule_from_pb(msg: pb.Schedule) -> ScheduleView:
    """Message -> domain schedule and when it fires next."""
    created = time_field(msg, "created_at") or 0.0
    record = ScheduleRecord(
        id=msg.id,
        agent_id=msg.agent_id,
        cron=msg.cron,
        time_zone=msg.time_zone,
        prompt=msg.prompt,
        enabled=msg.enabled,
        missed=msg.missed,
        created_at=created,
        updated_at=created,  # not on the wire
        last_fire=time_field(msg, "last_fire_at"),
    )
    return ScheduleView(record, time_field(msg, "next_run_at"))


def schedule_run_from_pb(msg: pb.ScheduleRun) -> ScheduleRunRecord:
    """Message -> domain schedule fire."""
    return ScheduleRunRecord(
        schedule_id=msg.schedule_id,
        fire_time=time_field(msg, "fire_time") or 0.0,
        run_id=msg.run_id,
        result=msg.result,
        detail=msg.detail,
        recorded_at=time_field(msg, "recorded_at") or 0.0,
    )
