"""A delete's reply and erasure receipts to and from machine.v1 messages."""

from __future__ import annotations

import logging

from machine.api.codec.fields import time_field
from machine.erasure.service import DeleteResult, ErasureView
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

__all__ = ["delete_result_from_pb", "delete_result_to_pb", "erasure_from_pb", "erasure_to_pb"]

logger = logging.getLogger(__name__)


def erasure_to_pb(view: ErasureView) -> pb.Erasure:
    """An erasure receipt."""
    return pb.Erasure(
        agent_id=view.agent_id,
        state=view.state,
        attempts=view.attempts,
        erased_at=from_seconds(view.erased_at),
        machine_data=view.machine_data,
        attachments=view.attachments,
        runtime_copy=view.runtime_copy,
        backups=view.backups,
        detail=view.detail,
    )


def delete_result_to_pb(result: DeleteResult) -> pb.DeleteAgentResponse:
    """What a delete did -> reply."""
    return pb.DeleteAgentResponse(
        agent_id=result.agent_id, runtime_erasure_queued=result.runtime_erasure_queued
    )


# ------------------------------------------------------------ client side
# Each reader is the inverse of the writer above (see the package docstring).


def erasure_from_pb(msg: pb.Erasure) -> ErasureView:
    """Message -> erasure receipt."""
    return ErasureView(
        agent_id=msg.agent_id,
        state=msg.state,
        erased_at=time_field(msg, "erased_at") or 0.0,
        attempts=msg.attempts,
        machine_data=msg.machine_data,
        attachments=msg.attachments,
        runtime_copy=msg.runtime_copy,
        backups=msg.backups,
        detail=msg.detail,
    )


def delete_result_from_pb(msg: pb.DeleteAgentResponse) -> DeleteResult:
    """Reply -> what a delete did."""
    return DeleteResult(msg.agent_id, msg.runtime_erasure_queued)
