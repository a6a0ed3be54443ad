"""``--log-format json`` on the real daemons: every line they write is one JSON object.

A stand-alone machine at DEBUG (the third-party libraries held at WARNING), then
a control plane and a machine joined to it, both in JSON: each line parses,
names its time (RFC 3339 UTC), level, logger and message, and the lines about
the join carry the machine's and the account's ids as keys of their own.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
from pathlib import Path
from typing import Any

from tests.helpers.control_proc import control_plane, join_new_account
from tests.helpers.machine_proc import MachineProc, run_cli
from tests.helpers.poll import poll_until

DEADLINE = 30.0


def _objects(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object with the four fields (fails on any other)."""
    out = []
    for line in text.splitlines():
        obj = json.loads(line)  # a line that is not JSON fails here, naming it
        assert isinstance(obj, dict), line
        assert {"time", "level", "logger", "message"} <= obj.keys(), line
        assert obj["time"].endswith("Z"), line
        assert dt.datetime.fromisoformat(obj["time"]).utcoffset() == dt.timedelta(0), line
        out.append(obj)
    assert out, "no log lines"
    return out


def test_a_stand_alone_machine_logs_json_lines(tmp_path: Path) -> None:
    data_dir = tmp_path / "machine"
    machine = MachineProc(data_dir, "--log-format", "json", "--log-level", "debug")
    with machine:
        assert run_cli(data_dir, "status").returncode == 0
        assert machine.stop() == 0
    objects = _objects(machine.log())
    loggers = {o["logger"] for o in objects}
    assert any(name.startswith("machine.") for name in loggers), loggers
    assert "DEBUG" in {o["level"] for o in objects}
    capped = ("botocore", "aiobotocore", "urllib3", "asyncio")
    assert not [o for o in objects if o["logger"].split(".")[0] in capped and o["level"] == "DEBUG"]


def test_a_control_plane_and_its_machine_log_json_with_their_ids(tmp_path: Path) -> None:
    with control_plane(
        tmp_path / "home", str(tmp_path / "store"), serve_args=["--log-format", "json"]
    ) as cp:
        data, log = tmp_path / "machine", tmp_path / "machine.log"
        proc = join_new_account(
            cp,
            data,
            log,
            github_id=7,
            login="logs",
            extra=["--log-format", "json"],
            out=tmp_path / "machine.out",  # join's own report, not a log line
        )
        try:
            up = poll_until(
                lambda: [o for o in _lines(log) if o["message"].startswith("control link up")],
                deadline=DEADLINE,
                what="the machine's link",
                fail=lambda: AssertionError(log.read_text()),
            )
            machine_id = up[0]["machine_id"]

            def confirmed() -> list[dict[str, Any]]:
                assert cp.log_path is not None
                return [o for o in _lines(cp.log_path) if o["message"].endswith("join confirmed")]

            said = poll_until(
                confirmed,
                deadline=DEADLINE,
                what="the join confirmed",
                fail=lambda: AssertionError(cp.log_path.read_text() if cp.log_path else ""),
            )
            assert said[0]["machine_id"] == machine_id and said[0]["account_id"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=DEADLINE)
    assert cp.log_path is not None
    joined = [o for o in _objects(cp.log_path.read_text()) if "joined account" in o["message"]]
    assert joined and joined[0]["machine_id"] == machine_id and joined[0]["token_id"]
    _objects(log.read_text())


def _lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines written so far, parsed (the last may be half written)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return _objects(complete) if complete else []
