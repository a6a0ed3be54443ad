"""Runtimes' portable_settings hook: what of an agent's settings may travel in a
backup or an export, and which session ids a restored agent may hold."""

from __future__ import annotations

import pytest

from machine.runtimes import RuntimeKind, check_session_id, default_registry, echo
from machine.runtimes.base import withhold_all
from shared.errors import InvalidArgument

UUID = "0b7c4a52-5a7e-4a38-9c3e-2f1d7e0f9a11"


def test_acp_keeps_command_and_kind_and_withholds_every_env_value() -> None:
    registry = default_registry()
    settings = registry.validate(
        "acp",
        {
            "command": ["claude-code-acp", "--verbose"],
            "env": {"ANTHROPIC_API_KEY": "s3cr3t-value", "A_FLAG": "1"},
            "kind": "claude",
        },
    )
    kept, withheld = registry.portable("acp", settings)
    assert kept == {"command": ["claude-code-acp", "--verbose"], "kind": "claude"}
    assert withheld == ["env.ANTHROPIC_API_KEY", "env.A_FLAG"]
    assert "s3cr3t-value" not in repr((kept, withheld))
    # What is kept is settings the runtime takes back (with no env).
    assert registry.validate("acp", kept) == {**kept, "env": {}}


def test_echo_keeps_its_delay_and_withholds_nothing() -> None:
    registry = default_registry()
    assert registry.portable("echo", {"delay_ms": 20}) == ({"delay_ms": 20}, [])
    assert registry.portable("echo", {}) == ({}, [])


def test_a_kind_that_does_not_say_and_an_unknown_runtime_keep_nothing() -> None:
    kind = RuntimeKind("probe", dict, echo.create_runtime)
    assert kind.portable_settings is withhold_all
    assert kind.portable_settings({"token": "x", "b": 1}) == ({}, ["b", "token"])
    assert default_registry().portable("martian", {"key": "v"}) == ({}, ["key"])


def test_session_ids_are_uuids_for_the_clis_and_printable_text_otherwise() -> None:
    assert check_session_id({"kind": "claude"}, UUID) == UUID
    assert check_session_id({"kind": "codex"}, UUID) == UUID
    with pytest.raises(InvalidArgument, match="session_id"):
        check_session_id({"kind": "claude"}, "../../etc/passwd")
    assert check_session_id({}, "echo-ag_x") == "echo-ag_x"
    assert check_session_id({"kind": "generic"}, "any id 1") == "any id 1"
    for bad in ("", "x" * 201, "line\nbreak", 7):
        with pytest.raises(InvalidArgument, match="session_id"):
            check_session_id({}, bad)
