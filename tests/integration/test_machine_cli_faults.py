"""agents-machine as a new user meets it: the real console script against a real daemon.

Each test is a regression test for a defect of issue 8 ("Both CLIs"): bad input
gives one line and exit 2, never a traceback; ``--json`` has one shape; tables
keep ids whole; one rule for the data folder; config mistakes stop the daemon.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc

pytestmark = pytest.mark.integration

AGENT_ID = re.compile(r"ag_[0-9a-z]{26}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env.update(extra)
    return env


def cli(
    data_dir: Path | None,
    *args: str,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    stdout: int | None = subprocess.PIPE,
) -> subprocess.CompletedProcess[bytes]:
    """``agents-machine [--data-dir D] ARGS`` with bytes in and out."""
    head = ["--data-dir", str(data_dir)] if data_dir is not None else []
    return subprocess.run(
        [str(AGENTS_MACHINE), *head, *args],
        input=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env or _env(),
        timeout=30,
        check=False,
    )


def one_line_error(res: subprocess.CompletedProcess[bytes], says: str) -> None:
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert lines and lines[0].startswith("agents-machine: "), err
    assert says in lines[0], err
    assert len(lines) <= 2 and all(line.startswith("Try: ") for line in lines[1:]), err


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[MachineProc]:
    with MachineProc(tmp_path / "data") as proc:
        yield proc


@pytest.fixture
def agent(daemon: MachineProc, tmp_path: Path) -> str:
    res = cli(daemon.data_dir, "agent", "create", "a", "--folder", str(tmp_path))
    assert res.returncode == 0, res.stderr
    return res.stdout.decode().strip()


def test_prompt_argument_that_is_not_utf8(daemon: MachineProc, agent: str) -> None:
    res = cli(daemon.data_dir, "agent", "prompt", agent, os.fsdecode(b"caf\xe9"))
    one_line_error(res, "is not valid UTF-8")


def test_prompt_on_stdin_that_is_not_utf8(daemon: MachineProc, agent: str) -> None:
    res = cli(daemon.data_dir, "agent", "prompt", agent, "--stdin", stdin=b"caf\xe9 \xff")
    one_line_error(res, "prompt: stdin is not valid UTF-8")


def test_nul_in_a_prompt_is_refused_and_nothing_runs(daemon: MachineProc, agent: str) -> None:
    res = cli(daemon.data_dir, "agent", "prompt", agent, "--stdin", stdin=b"before\0after")
    one_line_error(res, "prompt: contains a NUL byte")
    runs = cli(daemon.data_dir, "--json", "agent", "runs", agent)
    assert json.loads(runs.stdout) == {"runs": []}


def test_an_attachment_that_cannot_be_sent_whole_is_refused_before_anything_is_sent(
    daemon: MachineProc, agent: str, tmp_path: Path
) -> None:
    """Over the daemon's limit (as ``status`` tells), a device or FIFO (never ends)
    or an empty name: one line, exit 2, no run and no attachment stored. Before, a
    refusal mid-upload often reached the CLI as gRPC's INTERNAL error."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(20 * 1024 * 1024 + 1)  # the default limit, plus one; sparse
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    small = tmp_path / "small.txt"
    small.write_text("fine")
    cases = [
        ((str(big),), f"attachment: {big} is larger than the limit of 20971520 bytes"),
        ((str(small), str(big)), "is larger than the limit"),  # the first is not sent either
        (("/dev/zero",), "attach: /dev/zero is not a regular file"),
        ((str(fifo),), f"attach: {fifo} is not a regular file"),
        ((str(tmp_path),), f"attach: {tmp_path} is not a regular file"),
        (("",), "--attach: empty"),
    ]
    for files, says in cases:
        attach = [arg for name in files for arg in ("--attach", name)]
        one_line_error(cli(daemon.data_dir, "agent", "prompt", agent, "hi", *attach), says)
    assert not any((daemon.data_dir / "attachments").glob("*"))
    runs = json.loads(cli(daemon.data_dir, "agent", "runs", agent, "--json").stdout)
    assert runs["runs"] == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("runs", "{agent}", "--limit", "99999999999"), "argument --limit: must be from 1"),
        (("search", "x", "--limit", "99999999999"), "argument --limit: must be from 1"),
        (("replay", "{agent}", "--after", "99999999999999999999"), "argument --after"),
        (("replay", "{agent}", "--after", "-1"), "argument --after"),
    ],
)
def test_numbers_the_wire_cannot_carry(
    daemon: MachineProc, agent: str, args: tuple[str, ...], says: str
) -> None:
    argv = [a.format(agent=agent) for a in args]
    one_line_error(cli(daemon.data_dir, "agent", *argv), says)


@pytest.mark.parametrize("command", [("agent", "list"), ("serve", "--no-background")])
def test_data_dir_that_is_a_file(tmp_path: Path, command: tuple[str, ...]) -> None:
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    one_line_error(cli(file, *command), f"data_dir: {file} is a file, not a folder")
    one_line_error(cli(file / "below", *command), f"data_dir: {file} is a file")


def test_closed_pipe_is_one_line_not_a_traceback(daemon: MachineProc, agent: str) -> None:
    for _ in range(3):
        assert cli(daemon.data_dir, "agent", "prompt", agent, "hello").returncode == 0
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        res = cli(daemon.data_dir, "--json", "agent", "replay", agent, stdout=w)
    finally:
        os.close(w)
    one_line_error(res, "stdout was closed")


def test_json_has_one_shape(daemon: MachineProc, agent: str) -> None:
    archived = cli(daemon.data_dir, "--json", "agent", "list")
    assert len(json.loads(archived.stdout)["agents"]) == 1
    assert cli(daemon.data_dir, "agent", "archive", agent).returncode == 0
    empty = cli(daemon.data_dir, "--json", "agent", "list")
    assert empty.returncode == 0 and json.loads(empty.stdout) == {"agents": []}
    shown = json.loads(cli(daemon.data_dir, "--json", "agent", "show", agent).stdout)
    assert shown["last_seq"] == 0 and shown["session_id"] == "" and shown["local"] is True
    assert cli(daemon.data_dir, "agent", "unarchive", agent).returncode == 0
    assert cli(daemon.data_dir, "agent", "prompt", agent, "hi").returncode == 0
    replay = cli(daemon.data_dir, "--json", "agent", "replay", agent)
    events = [json.loads(line) for line in replay.stdout.decode().splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    finished = events[-1]["run_finished"]
    assert isinstance(finished["duration_ms"], int)
    assert isinstance(finished["usage"]["input_tokens"], int)
    none = cli(daemon.data_dir, "--json", "agent", "search", "nothing-matches-this")
    assert json.loads(none.stdout) == {"hits": [], "indexing": 0}  # every field, zeros too


def test_table_keeps_ids_whole_in_a_pipe(daemon: MachineProc, tmp_path: Path) -> None:
    folder = tmp_path / ("a-long-folder-name-" * 5)
    folder.mkdir()
    name = "an agent with a name long enough to squeeze the table"
    made = cli(daemon.data_dir, "agent", "create", name, "--folder", str(folder))
    agent_id = made.stdout.decode().strip()
    res = cli(daemon.data_dir, "agent", "list", env=_env(COLUMNS="40"))
    lines = res.stdout.decode().splitlines()
    assert len(lines) == 2, lines  # a header and one row: nothing wrapped
    assert lines[1].startswith(agent_id + " ") and str(folder) in lines[1]


def test_remembered_rule_does_not_say_waiting(daemon: MachineProc, agent: str) -> None:
    with subprocess.Popen(
        [str(AGENTS_MACHINE), "--data-dir", str(daemon.data_dir), "agent", "prompt", agent,
         "/tool write x"],
        stdout=subprocess.PIPE, env=_env(),
    ) as first:  # fmt: skip
        try:
            assert first.stdout is not None
            asked = ""
            deadline = time.monotonic() + 20
            while "OPTION" not in asked:  # bounded by the deadline
                assert time.monotonic() < deadline and first.poll() is None, asked
                asked += first.stdout.readline().decode()
            assert "waiting for an answer" in asked
            # The suggested command reaches this daemon: it names the folder in use.
            assert f"Try: agents-machine --data-dir {daemon.data_dir} agent answer" in asked
            hint = re.search(r"agent answer (\S+) (\S+) OPTION", asked)
            assert hint, asked
            answer = cli(
                daemon.data_dir, "agent", "answer", *hint.groups(), "allow_once", "--remember"
            )
            assert answer.returncode == 0, answer.stderr
            assert first.wait(timeout=20) == 0
        finally:
            first.kill()
    second = cli(daemon.data_dir, "agent", "prompt", agent, "/tool write y")
    out = second.stdout.decode()
    assert second.returncode == 0, second.stderr
    assert "by a remembered rule" in out and "waiting for an answer" not in out, out
    assert "Try:" not in out
    # A /tool run of the echo runtime reports no usage: unknown, shown "?", not 0.
    assert "? in / ? out tokens" in out, out
    runs = cli(daemon.data_dir, "agent", "runs", agent).stdout.decode()
    assert re.search(r"\?/\?", runs) and " 0/0 " not in runs, runs


def _home_with_server(tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    server = home / ".agents-server" / "root"
    return home, server


def test_a_joined_servers_folder_is_the_default(
    tmp_path: Path, machine_proc: Callable[..., MachineProc]
) -> None:
    home, server = _home_with_server(tmp_path)
    with MachineProc(server):
        env = _env(HOME=str(home))
        res = cli(None, "--json", "status", env=env)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["data_dir"] == str(server)


def test_hint_names_the_folder_it_means(tmp_path: Path) -> None:
    home, server = _home_with_server(tmp_path)
    server.mkdir(parents=True)
    res = cli(None, "agent", "list", env=_env(HOME=str(home)))
    assert res.returncode == 1
    lines = res.stderr.decode().splitlines()
    assert str(server / "machine.sock") in lines[0]
    assert lines[1] == f"Try: agents-machine --data-dir {server} serve"


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ("prompt_limt = 5\n", "config prompt_limt: unknown key in"),
        ("prompt_limit = true\n", "config prompt_limit: must be an integer or a string"),
        ("socket_path = 5\n", "config socket_path: must be a string"),
        ("background_loops = 'sometimes'\n", "config background_loops: must be a boolean"),
    ],
)
def test_config_mistakes_stop_the_daemon(tmp_path: Path, toml: str, says: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "machine.toml").write_text(toml)
    res = cli(data, "serve", "--no-background")
    one_line_error(res, says)
    assert str(data / "machine.toml") in res.stderr.decode()


def test_config_file_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    res = cli(tmp_path / "data", "serve", "--no-background", "--config", str(missing))
    one_line_error(res, f"{missing}: no such file")


def test_agent_text_cannot_drive_the_terminal(daemon: MachineProc, agent: str) -> None:
    # The echo runtime repeats the prompt: the reply carries the escape sequences.
    res = cli(daemon.data_dir, "agent", "prompt", agent, "hi \x1b]0;retitled\x07 \x1b[31mred")
    assert res.returncode == 0, res.stderr
    assert b"\x1b" not in res.stdout and b"\x07" not in res.stdout
    assert b"retitled" in res.stdout and b"red" in res.stdout


@pytest.mark.parametrize(
    ("flag", "says", "reuseport"),
    [
        ("--tcp", "cannot listen on 127.0.0.1:", False),
        # As another gRPC server holds its port (gRPC's default): the daemon's
        # own server must not share it (it would take some of its connections).
        ("--tcp", "cannot listen on 127.0.0.1:", True),
        ("--metrics", "cannot listen on a configured", False),
    ],
)
def test_a_port_in_use_is_one_line(tmp_path: Path, flag: str, says: str, reuseport: bool) -> None:
    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = cli(tmp_path / "data", "serve", "--no-background", flag, f"127.0.0.1:{port}")
    err = res.stderr.decode()
    assert res.returncode == 2 and "Traceback" not in err, err
    # The daemon logs as it starts; its last words are the one-line error and a hint.
    assert err.splitlines()[-2].startswith(f"agents-machine: config listen: {says}"), err


def test_hints_name_the_folder_in_use(daemon: MachineProc) -> None:
    res = cli(daemon.data_dir, "agent", "show", "ag_0000000000aaaaaaaaaaaaaaaa")
    assert res.returncode == 2
    hint = res.stderr.decode().splitlines()[1]
    assert hint == f"Try: agents-machine --data-dir {daemon.data_dir} agent list --all"


def test_import_of_what_is_no_export_file_is_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    """No daemon runs: each is refused by the CLI itself, at once (a device such
    as /dev/zero never ends; the daemon would refuse an oversized one only
    after receiving its limit)."""
    big = tmp_path / "big.tar.gz"
    with open(big, "wb") as f:
        f.truncate(9 * 1024**3)  # sparse: no disk used
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {
        "/dev/zero": "is not a regular file",
        str(fifo): "is not a regular file",
        str(big): "larger than an import may be (8.0 GiB)",
        "": "FILE is empty",
        str(tmp_path): "is not a regular file",
        str(tmp_path / "missing.tar.gz"): "cannot read",
    }
    for name, says in cases.items():
        one_line_error(cli(tmp_path / "data", "import", name), says)


def test_an_empty_option_value_is_refused_not_taken_as_not_given(tmp_path: Path) -> None:
    """``--from "$DIR"`` with DIR unset must not read the configured target, nor an
    empty ``--recovery-key`` fall back to the machine's own key; ``-o -`` is not
    a file named "-"."""
    data = tmp_path / "data"
    backup = "bk_01m8v23psxnftfa8rbt9mkf1b3"
    agent = "ag_01m8v0gjpnzxga8nkqt8mhhs1n"
    cases = [
        (("backup", "list", "--from", ""), "--from: empty"),
        (("backup", "restore", backup, "--from", ""), "--from: empty"),
        (("backup", "verify", backup, "--recovery-key", ""), "--recovery-key: empty"),
        (("export", agent, "-o", "-"), "name the file to write"),
        (("export", agent, "-o", ""), "name the file to write"),
        (
            ("schedule", "add", agent, "--cron", "* * * * *", "--text", "x", "--tz", ""),
            "--tz: empty",
        ),
    ]
    for args, says in cases:
        one_line_error(cli(data, *args), says)
    assert not list(tmp_path.glob("-")) and not (Path.cwd() / "-").exists()
