"""The one JSON style of both CLIs (docs/cli-json.md), as shared.cli makes it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor

from shared.cli import enum_text, id_key, json_time, message_dict
from shared.pb.control.v1 import admin_pb2, link_pb2
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

AGENT_ID = "ag_0123456789abcdefghijklmnop"
RUN_ID = "run_0123456789abcdefghijklmno"


def test_enums_lose_their_type_prefix_and_case() -> None:
    assert message_dict(pb.Agent(state=pb.AGENT_STATE_ACTIVE))["state"] == "active"
    run = message_dict(pb.Run(state=pb.RUN_STATE_WAITING_PERMISSION))
    assert run["state"] == "waiting_permission"
    # Values not named after their type are only lower-cased.
    assert message_dict(pb.RunEvent(kind=pb.TEXT_DELTA))["kind"] == "text_delta"
    assert message_dict(pb.Run(error_code=pb.RUNTIME_FAILED))["error_code"] == "runtime_failed"
    assert message_dict(pb.Run())["state"] == "unspecified"
    assert enum_text("RunState", 99) == 99  # a value this CLI does not know: its number


def test_timestamps_are_rfc3339_utc_to_the_second() -> None:
    agent = message_dict(pb.Agent(created_at=from_seconds(1_796_463_612.75)))
    assert agent["created_at"] == "2026-12-05T09:40:12Z"  # cut, not rounded
    assert message_dict(pb.Agent(created_at=from_seconds(1_796_463_612)))["created_at"] == (
        "2026-12-05T09:40:12Z"
    )
    assert message_dict(pb.Agent())["created_at"] is None  # unset: null, not 1970
    assert json_time("1970-01-01T00:00:00.000000001Z") == "1970-01-01T00:00:00Z"


def test_own_id_is_under_the_key_others_use() -> None:
    agent = message_dict(pb.Agent(id=AGENT_ID))
    assert agent["agent_id"] == AGENT_ID and "id" not in agent
    run = message_dict(pb.Run(id=RUN_ID, agent_id=AGENT_ID))
    assert (run["run_id"], run["agent_id"]) == (RUN_ID, AGENT_ID) and "id" not in run
    assert message_dict(pb.Schedule(id="sch_1"))["schedule_id"] == "sch_1"
    assert message_dict(pb.Backup(id="bk_1"))["backup_id"] == "bk_1"
    assert id_key("RunEventKind") == "run_event_kind_id"


def test_nested_and_repeated_messages_follow_the_same_rules() -> None:
    reply = pb.ListRunsResponse(
        runs=[
            pb.Run(id=RUN_ID, state=pb.RUN_STATE_FINISHED, duration_ms=2**40),
            pb.Run(id="run_2", created_at=from_seconds(0.5)),
        ]
    )
    data = message_dict(reply)
    assert [r["run_id"] for r in data["runs"]] == [RUN_ID, "run_2"]
    assert data["runs"][0]["state"] == "finished"
    assert data["runs"][0]["duration_ms"] == 2**40
    assert data["runs"][1]["created_at"] == "1970-01-01T00:00:00Z"
    ev = message_dict(
        pb.RunEvent(kind=pb.RUN_ERROR, run_error=pb.RunError(code=pb.CANCELLED, message="x"))
    )
    assert ev["run_error"] == {"code": "cancelled", "message": "x"}
    assert "text_delta" not in ev  # the other members of a oneof stay out


def test_64_bit_integers_are_numbers() -> None:
    data = message_dict(pb.Agent(last_seq=2**62 + 1))
    assert data["last_seq"] == 2**62 + 1
    assert json.loads(json.dumps(data))["last_seq"] == 2**62 + 1  # not "4611686018427387905"
    deletion = message_dict(admin_pb2.Deletion(deleted_objects=2**64 - 1))
    assert deletion["deleted_objects"] == 2**64 - 1


def _messages(desc: Any) -> list[Descriptor]:
    found = list(desc.message_types_by_name.values())
    nested = [n for m in found for n in m.nested_types]
    return found + nested


@pytest.mark.parametrize("module", [pb, admin_pb2, link_pb2], ids=lambda m: m.__name__)
def test_no_renamed_id_meets_a_field_of_that_name(module: Any) -> None:
    """The id rule may never make two keys one: ``Run.id`` → ``run_id`` needs a
    Run without a ``run_id`` field."""
    for desc in _messages(module.DESCRIPTOR):
        if "id" in desc.fields_by_name:
            assert id_key(desc.name) not in desc.fields_by_name, desc.full_name
