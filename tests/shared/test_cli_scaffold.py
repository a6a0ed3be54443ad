"""The CLI scaffold both CLIs stand on: tables, JSON shape, argument checks."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile

import pytest

from shared.cli import (
    INT32_MAX,
    CliParser,
    Column,
    ExitCode,
    Output,
    UsageError,
    bounded_int,
    check_argv,
    dispatch,
    message_dict,
    read_stdin_text,
    render_table,
    run_main,
    stdout_writable,
)
from shared.errors import NotFound, StoreError
from shared.pb.machine.v1 import machine_pb2 as pb

AGENT_ID = "ag_01m8rvekj4q2z9phsh53v5p24s"


def test_ids_stay_whole_in_a_narrow_terminal_other_columns_give_way() -> None:
    columns = [Column("id", whole=True), Column("name"), Column("folder")]
    rows = [[AGENT_ID, "a rather long agent name", "/home/someone/src/" + "deep/" * 10]]
    lines = render_table(columns, rows, width=60)
    assert lines[1].startswith(AGENT_ID + "  ")
    assert len(lines[1]) <= 60
    assert "…" in lines[1]
    # Narrower than the id alone: the id is still whole (the terminal may wrap it).
    assert AGENT_ID in render_table(columns, rows, width=10)[1]


def test_a_pipe_cuts_nothing() -> None:
    columns = [Column("id", whole=True), Column("name")]
    name = "n" * 300
    lines = render_table(columns, [[AGENT_ID, name]], width=None)
    assert lines == ["id" + " " * (len(AGENT_ID)) + "name", f"{AGENT_ID}  {name}"]


def test_cells_are_one_line() -> None:
    lines = render_table([Column("a"), Column("b")], [["x\ny", "tab\there\x1b[31m"]], None)
    assert len(lines) == 2 and "\n" not in lines[1] and "\x1b" not in lines[1]


def test_json_has_every_field_and_numbers() -> None:
    assert message_dict(pb.ListAgentsResponse()) == {"agents": []}
    agent = message_dict(pb.Agent(id=AGENT_ID, last_seq=2**40))
    assert agent["last_seq"] == 2**40 and isinstance(agent["last_seq"], int)
    assert agent["name"] == "" and agent["local"] is False and agent["created_at"] is None
    ev = message_dict(pb.RunEvent(seq=7, text_delta=pb.TextDelta(text="hi")))
    assert ev["seq"] == 7 and ev["text_delta"] == {"text": "hi"}
    assert "run_finished" not in ev  # the other members of a oneof stay out


def test_output_json_is_one_line() -> None:
    stream = io.StringIO()
    Output(as_json=True, stream=stream).json({"b": [1, 2], "a": {"x": "é\x1b\x9b"}})
    assert stream.getvalue() == '{"a": {"x": "\\u00e9\\u001b\\u009b"}, "b": [1, 2]}\n'


def test_streamed_text_cannot_drive_the_terminal() -> None:
    stream = io.StringIO()
    Output(as_json=False, stream=stream).write("a\x1b]0;pwned\x07b\x9b31m\tc\n")
    assert stream.getvalue() == "a]0;pwnedb31m\tc\n"


def test_bounded_int_names_the_range() -> None:
    parse = bounded_int(1, INT32_MAX)
    assert parse("20") == 20
    for bad in ("0", "99999999999", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_argv_that_is_not_utf8_is_a_usage_error() -> None:
    check_argv(["agent", "prompt", "héllo"])
    with pytest.raises(UsageError, match="argument 2 is not valid UTF-8"):
        check_argv(["prompt", os.fsdecode(b"caf\xe9")])


def test_stdin_that_is_not_utf8_is_a_usage_error() -> None:
    assert read_stdin_text("prompt", 10, io.BytesIO("é".encode())) == "é"
    with pytest.raises(UsageError, match="prompt: stdin is not valid UTF-8"):
        read_stdin_text("prompt", 10, io.BytesIO(b"ok \xff"))
    with pytest.raises(UsageError, match="more than the limit of 3 bytes"):
        read_stdin_text("prompt", 3, io.BytesIO(b"abcd"))


def test_dispatch_table_and_missing_verbs() -> None:
    table = {("agent", "list"): lambda n: n + 1, ("status", None): lambda n: 0}
    assert dispatch(table, "prog", "agent", "list", 4) == 5
    with pytest.raises(UsageError, match="agent: missing verb") as info:
        dispatch(table, "prog", "agent", None, 4)
    assert info.value.hint == "prog agent --help"
    with pytest.raises(UsageError, match="missing command"):
        dispatch(table, "prog", None, None)

    async def handler() -> int:
        return 3

    assert dispatch({("x", None): handler}, "prog", "x", None) == 3


def test_parser_errors_name_the_subcommand() -> None:
    parser = CliParser(prog="prog")
    sub = parser.add_subparsers(dest="command", parser_class=CliParser)
    sub.add_parser("show").add_argument("id", help="the id")
    with pytest.raises(UsageError) as info:
        parser.parse_args(["show"])
    assert info.value.message == "show: the following arguments are required: id"
    assert info.value.hint == "prog show --help"


def test_run_main_one_line_per_error(capsys: pytest.CaptureFixture[str]) -> None:
    def raises(exc: BaseException) -> int:
        raise exc

    assert run_main("p", lambda: raises(NotFound("agent", "ag_x"))) == ExitCode.USAGE
    assert capsys.readouterr().err == "p: agent ag_x: not found\n"
    code = run_main("p", lambda: raises(StoreError("put k:\nbroken")), hint_for=lambda e: "fix")
    assert code == ExitCode.FAILED
    assert capsys.readouterr().err == "p: put k: broken\nTry: fix\n"
    assert run_main("p", lambda: raises(KeyboardInterrupt())) == ExitCode.INTERRUPTED


def test_stdout_writable_sees_a_closed_pipe() -> None:
    r, w = os.pipe()
    with os.fdopen(w, "w") as stream:
        assert stdout_writable(stream)
        os.close(r)
        assert not stdout_writable(stream)


def test_stdout_writable_sees_dev_null() -> None:
    # `> /dev/null` is what the closed-stdout message suggests: a secret printed
    # there once is as lost as one never printed.
    with open(os.devnull, "w") as stream:
        assert not stdout_writable(stream)
    with tempfile.TemporaryFile("w") as stream:
        assert stdout_writable(stream)


def test_a_stdout_that_fails_on_write_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    full = open("/dev/full", "w")  # noqa: SIM115  # closed below, its failing flush ignored
    out = Output(False, full)

    def body() -> int:
        out.lines("a secret shown once")
        return ExitCode.OK

    assert run_main("p", body) == ExitCode.FAILED
    with contextlib.suppress(OSError):
        full.close()
    assert capsys.readouterr().err == "p: could not write to stdout (No space left on device)\n"
