"""Tables of both CLIs: times in UTC with the zone written (one helper,
shared.cli.table_time), and the status/state column never cut."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared.cli import Column, Output, render_table, table_time

MOMENT = dt.datetime(2026, 12, 5, 9, 40, 12, 987654, tzinfo=dt.UTC)
SHOWN = "2026-12-05 09:40:12Z"


def test_table_time_is_utc_to_the_second_with_the_zone() -> None:
    assert table_time(MOMENT) == SHOWN
    berlin = MOMENT.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert table_time(berlin) == SHOWN  # the same moment, whatever zone it came in
    assert table_time(MOMENT.timestamp()) == SHOWN  # the machine's Unix seconds
    assert table_time(None) == "-" and table_time(0) == "-" and table_time(0.5) == "-"


def test_the_machine_cli_shows_times_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from machine.cli.common import when

    monkeypatch.setenv("TZ", "America/New_York")  # the local zone plays no part
    assert when(MOMENT.timestamp()) == SHOWN and when(None) == "-"


def test_a_whole_column_is_never_cut_the_others_give_way() -> None:
    columns = [Column("id", whole=True), Column("name"), Column("state", whole=True)]
    rows = [["ag_1", "a rather long agent name here", "running-a-long-state"]]
    lines = render_table(columns, rows, 40)
    assert all(len(line) <= 40 for line in lines), lines
    assert lines[1].endswith("running-a-long-state") and "…" in lines[1]


class _Narrow(Output):
    def _table_width(self) -> int | None:
        return 70


def _machine(n: int, **kw: Any) -> Any:
    from controlplane.cli.admin_types import Machine

    fields: dict[str, Any] = dict(
        machine_id=f"mc_{n:026d}", account_id="acct_" + "0" * 26,
        name="a machine with a long descriptive name " * 2, hostname="h", version="0.1.0",
        joined_at=MOMENT, last_seen_at=MOMENT, online=False, agent_count=3, revoked=False,
        certificate_serial="1", certificate_not_after=None, provider="", starting=True,
        next_fire_at=None, next_wake_at=None, has_provider=False,
    )  # fmt: skip
    fields.update(kw)
    return Machine(**fields)


async def test_machine_list_rows_keep_status_and_show_utc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from controlplane.cli import machines
    from controlplane.cli.common import Ctx
    from controlplane.config import ControlConfig

    listed = [_machine(1), _machine(2, revoked=True, last_seen_at=None)]

    class Fake:
        async def list_machines(self, account: str) -> list[Any]:
            return listed

    @contextlib.asynccontextmanager
    async def fake_client(cfg: object) -> AsyncIterator[Fake]:
        yield Fake()

    monkeypatch.setattr(machines, "admin_client", fake_client)
    out = io.StringIO()
    args = type("Args", (), {"account": ""})()
    ctx = Ctx(args, ControlConfig(home=tmp_path), _Narrow(as_json=False, stream=out))  # type: ignore[arg-type]
    assert await machines.machine_list(ctx) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:4] == ["machine", "name", "account", "status"]
    assert "starting" in lines[1] and SHOWN in lines[1]  # never "start…"
    assert "revoked" in lines[2] and " - " in lines[2]
    assert "…" in lines[1]  # the name gave way instead


def test_schedule_rows_keep_state_and_show_utc() -> None:
    from machine.api.views import ScheduleView
    from machine.cli import schedules
    from machine.models import ScheduleRecord

    record = ScheduleRecord(
        id="sch_" + "0" * 26, agent_id="ag_" + "0" * 26, cron="0 7 * * 1-5",
        time_zone="Europe/Berlin", prompt="summarise the night's failures " * 4, enabled=False,
        missed="skip", created_at=0, updated_at=0, last_fire=None,
    )  # fmt: skip
    row = schedules._row(ScheduleView(record, MOMENT.timestamp()))
    assert SHOWN in row
    lines = render_table(schedules._COLUMNS, [row], 100)
    assert " paused " in lines[1] and SHOWN in lines[1]


@pytest.mark.parametrize("prog", ["controlplane", "machine"])
def test_every_listing_keeps_its_state_and_time_columns_whole(prog: str) -> None:
    # Every Column of a state or a time written in the verb modules is whole: a cut
    # one ("start…", "2026-12-…") says nothing.
    import re

    names = (
        "state|status|result|signed up|expires|last seen|next wake|erased|created|next|fire time"
    )
    folder = Path(__file__).resolve().parents[2] / prog / "cli"
    found = []
    for path in sorted(folder.glob("*.py")):
        for m in re.finditer(rf'Column\("({names})"([^)]*)\)', path.read_text()):
            found.append((path.name, m.group(1), "whole=True" in m.group(2)))
    assert found and all(whole for *_, whole in found), found
