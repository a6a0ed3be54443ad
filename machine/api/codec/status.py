"""The daemon's status and its database check to and from machine.v1 messages."""

from __future__ import annotations

import logging

from machine.api.codec.backups import backup_status_from_pb, backup_status_to_pb
from machine.api.codec.fields import time_field
from machine.api.views import DaemonStatus, DatabaseCheck
from machine.app import MachineStatus
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

__all__ = ["check_from_pb", "status_from_pb", "status_to_pb"]

logger = logging.getLogger(__name__)


def status_to_pb(st: DaemonStatus) -> pb.StatusResponse:
    """The daemon's status -> reply."""
    m = st.machine
    return pb.StatusResponse(
        joined=m.joined,
        version=st.version,
        data_dir=m.data_dir,
        machine_id=m.machine_id,
        active_agents=m.active_agents,
        archived_agents=m.archived_agents,
        open_runs=m.open_runs,
        waiting_runs=m.waiting_runs,
        runtimes=m.runtimes,
        started_at=from_seconds(m.started_at),
        schema_version=m.schema_version,
        backup=backup_status_to_pb(st.backup) if st.backup else None,
        attachment_limit=m.attachment_limit,
    )


# ------------------------------------------------------------ client side
# Each reader is the inverse of the writer above (see the package docstring).


def status_from_pb(msg: pb.StatusResponse) -> DaemonStatus:
    """Reply -> the daemon's status."""
    machine = MachineStatus(
        data_dir=msg.data_dir,
        machine_id=msg.machine_id,
        joined=msg.joined,
        active_agents=msg.active_agents,
        archived_agents=msg.archived_agents,
        open_runs=msg.open_runs,
        waiting_runs=msg.waiting_runs,
        runtimes=list(msg.runtimes),
        started_at=time_field(msg, "started_at") or 0.0,
        schema_version=msg.schema_version,
        attachment_limit=msg.attachment_limit,
    )
    backup = backup_status_from_pb(msg.backup) if msg.HasField("backup") else None
    return DaemonStatus(msg.version, machine, backup)


def check_from_pb(msg: pb.CheckDatabaseResponse) -> DatabaseCheck:
    """Reply -> the daemon's integrity check of machine.db."""
    return DatabaseCheck(
        ok=msg.ok,
        problems=tuple(msg.problems),
        path=msg.path,
        checked_at=time_field(msg, "checked_at"),
        duration_ms=msg.duration_ms,
    )
