"""agents-control as a new user meets it: the real console script against a real daemon
on a folder store. Regression tests for the CLI defects of issue 8."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.ids import new_id
from tests.helpers.control_proc import (
    ControlProc,
    agents_control_exe,
    control_plane,
    init_argv,
    run_init,
)
from tests.helpers.machine_proc import AGENTS_MACHINE
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

CREDENTIAL = re.compile(r"adm_[0-9a-z]{26}\.[A-Za-z0-9_-]{43}")


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlProc]:
    root = tmp_path_factory.mktemp("cp")
    with control_plane(root / "home", str(root / "store")) as proc:
        yield proc


@pytest.fixture(scope="module")
def account(cp: ControlProc) -> str:
    res = cp.cli("account", "create", "--github-id", "77", "--github-login", "someone", "--json")
    assert res.code == 0, res.err
    return str(json.loads(res.out)["account_id"])


def _shell(cp: ControlProc, pipeline: str) -> subprocess.CompletedProcess[str]:
    env = {**cp.env, "AGENTS_CONTROL_CREDENTIAL": cp.operator}
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {pipeline}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _one_error_line(err: str, says: str) -> None:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) in (1, 2) and lines[0].startswith("agents-control: "), err
    assert says in lines[0], err
    assert all(line.startswith("Try: ") for line in lines[1:]), err


def _store_credentials(cp: ControlProc) -> list[Path]:
    store = cp.home.parent / "store"
    return sorted(p for p in store.rglob("*") if "credentials" in p.parts and p.is_file())


def test_credential_is_not_made_when_stdout_is_closed(cp: ControlProc, account: str) -> None:
    before = _store_credentials(cp)
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(
            [str(agents_control_exe()), "credential", "create", "--account", account,
             "--json", "--home", str(cp.home)],
            env={**cp.env, "AGENTS_CONTROL_CREDENTIAL": cp.operator},
            stdout=w, stderr=subprocess.PIPE, text=True, timeout=30, check=False,
        )  # fmt: skip
    finally:
        os.close(w)
    assert proc.returncode == 2
    _one_error_line(proc.stderr, "credential create: stdout is closed, a pipe nobody reads")
    assert _store_credentials(cp) == before  # nothing made, nothing lost


def test_the_first_line_holds_the_secret(cp: ControlProc, account: str) -> None:
    exe, home = agents_control_exe(), shlex.quote(str(cp.home))
    as_json = _shell(
        cp, f"{exe} credential create --account {account} --json --home {home} | head -1"
    )
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["credential"].startswith("adm_")
    text = _shell(cp, f"{exe} credential create --account {account} --home {home} | head -1")
    assert text.returncode == 0 and CREDENTIAL.fullmatch(text.stdout.strip()), text
    token = _shell(cp, f"{exe} token create --account {account} --home {home} | head -1")
    assert token.stdout.startswith("agents-machine join "), token


def test_init_prints_the_operator_credential_first(tmp_path: Path) -> None:
    exe = agents_control_exe()
    home, store = tmp_path / "home", tmp_path / "store"
    res = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {exe} init --home {home} --store {store} | head -1"],
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert CREDENTIAL.fullmatch(res.stdout.strip()), res.stdout


def test_init_on_a_store_that_is_a_file_is_refused_and_makes_no_home(tmp_path: Path) -> None:
    """Before: a traceback, a half-made home (so init was refused for ever after)
    and the file chmod'ed 0700."""
    home, store = tmp_path / "home", tmp_path / "notes.txt"
    store.write_text("mine")
    store.chmod(0o644)
    res = subprocess.run(
        init_argv(home, str(store)),
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr == f"agents-control: store: {store} is not a folder\n"
    assert not home.exists()
    assert store.read_text() == "mine" and stat.S_IMODE(store.stat().st_mode) == 0o644


def test_json_listings_have_one_shape(cp: ControlProc, account: str) -> None:
    fresh = cp.cli("account", "create", "--github-id", "78", "--github-login", "x", "--json")
    empty_account = json.loads(fresh.out)["account_id"]
    tokens = cp.cli("token", "list", "--account", empty_account, "--json")
    assert tokens.code == 0 and json.loads(tokens.out) == {"tokens": []}
    machines = cp.cli("machine", "list", "--account", empty_account, "--json")
    assert json.loads(machines.out) == {"machines": []}
    accounts = json.loads(cp.cli("account", "list", "--json").out)["accounts"]
    mine = next(a for a in accounts if a["account_id"] == account)
    assert mine["github_user_id"] == 77  # a 64-bit integer is a number
    made = json.loads(cp.cli("token", "create", "--account", empty_account, "--json").out)
    assert made["token"]["uses"] == 0 and made["token"]["revoked"] is False
    assert made["token"]["repair_machine_id"] == ""


def test_tables_keep_ids_whole_in_a_pipe(cp: ControlProc) -> None:
    login = "a-login-long-enough-to-squeeze-every-other-column-of-the-table-" * 2
    made = cp.cli("account", "create", "--github-id", "79", "--github-login", login[:39], "--json")
    assert made.code == 0, made.err
    account_id = json.loads(made.out)["account_id"]
    for _ in range(2):
        assert cp.cli("token", "create", "--account", account_id).code == 0
    listed = cp.cli("token", "list", "--account", account_id)
    lines = listed.out.splitlines()
    assert len(lines) == 3, lines  # a header and one line per token: nothing wrapped
    assert all(re.match(rf"tok_[0-9a-z]{{26}}  {account_id} ", line) for line in lines[1:])
    accounts = cp.cli("account", "list").out.splitlines()
    assert any(line.startswith(f"{account_id}  {login[:39]} ") for line in accounts), accounts


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("account", "create", "--github-id", "99999999999999999999", "--github-login", "x"),
         "argument --github-id"),
        (("machine", "rename", "mc_x", os.fsdecode(b"\xffname")), "is not valid UTF-8"),
        (("token", "create", "--account", "acct_x", "--uses", "99999999999"), "argument --uses"),
        (("token", "create", "--account", "acct_x", "--ttl", "9999999999d"), "argument --ttl"),
    ],
)  # fmt: skip
def test_bad_numbers_and_text_are_one_line(
    cp: ControlProc, args: tuple[str, ...], says: str
) -> None:
    res = cp.cli(*args)
    assert res.code == 2 and res.out == ""
    _one_error_line(res.err, says)


def test_a_refusal_is_one_line(cp: ControlProc) -> None:
    res = cp.cli("machine", "show", new_id("machine"))
    assert res.code == 2
    _one_error_line(res.err, "not found")


def test_a_second_serve_of_a_home_is_refused_and_leaves_the_first_running(
    cp: ControlProc,
) -> None:
    # Before: it took the store's epoch, then failed to bind the ports in use: the
    # running control plane was fenced out and stopped, and serve.json was gone.
    serve_json = (cp.home / "serve.json").read_bytes()
    res = cp.cli("serve", timeout=60)
    assert res.code == 2, res.err
    _one_error_line(res.err, "another agents-control serve is running on this home")
    assert (cp.home / "serve.json").read_bytes() == serve_json
    assert cp.process is not None and cp.process.poll() is None
    listed = cp.cli("account", "list", "--json")
    assert listed.code == 0, listed.err


def test_a_copied_home_whose_ports_are_taken_leaves_the_live_one_serving(
    cp: ControlProc, tmp_path: Path
) -> None:
    # Before: the copy took the store's next epoch, then failed to bind: the live
    # control plane was fenced out by a start that never served.
    (epoch_file,) = (cp.home.parent / "store").rglob("epoch.json*")
    epoch_before = epoch_file.read_bytes()
    copy = tmp_path / "copied-home"
    shutil.copytree(cp.home, copy, ignore=shutil.ignore_patterns("serve.json"))
    res = subprocess.run(
        [str(agents_control_exe()), "serve", "--home", str(copy), "--listen", cp.public],
        env=cp.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    _one_error_line(res.stderr, cp.public)
    assert epoch_file.read_bytes() == epoch_before
    assert cp.process is not None and cp.process.poll() is None
    made = cp.cli("account", "create", "--github-id", "7301", "--github-login", "copy-check")
    assert made.code == 0, made.err
    assert cp.process.poll() is None


def test_a_refused_join_is_one_line(cp: ControlProc, tmp_path: Path) -> None:
    bogus = f"{new_id('token')}.{'A' * 43}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    res = subprocess.run(
        [str(AGENTS_MACHINE), "join", cp.public, "--token", bogus, "--ca-hash", cp.ca_hash,
         "--data-dir", str(tmp_path / "m")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode != 0
    lines = res.stderr.splitlines()
    assert len(lines) in (1, 2) and lines[0].startswith("agents-machine: "), res.stderr
    assert all(line.startswith("Try: ") for line in lines[1:]), res.stderr


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ("token_tll = 600\n", "config token_tll: unknown key in"),
        ("renew_threshold = true\n", "config renew_threshold: must be a number in"),
        ("credential = 'adm_x'\n", "config credential: unknown key in"),
    ],
)
def test_config_mistakes_stop_the_daemon(tmp_path: Path, toml: str, says: str) -> None:
    home = tmp_path / "home"
    run_init(home, str(tmp_path / "store"), {})
    with (home / "config.toml").open("a") as f:
        f.write(toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    res = subprocess.run(
        [str(agents_control_exe()), "serve", "--home", str(home)],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 2
    _one_error_line(res.stderr, says)
    assert str(home / "config.toml") in res.stderr


@pytest.mark.parametrize("command", [("serve",), ("account", "list", "--credential", "adm_x")])
def test_home_that_is_a_file(tmp_path: Path, command: tuple[str, ...]) -> None:
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    res = subprocess.run(
        [str(agents_control_exe()), *command, "--home", str(file)],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 2
    _one_error_line(res.stderr, f"config home: {file} is a file, not a folder")


def test_readme_tour_after_join_reaches_the_joined_machine(
    cp: ControlProc, account: str, tmp_path: Path
) -> None:
    made = cp.cli("token", "create", "--account", account)
    line = next(x for x in made.out.splitlines() if x.startswith("agents-machine join "))
    command = shlex.split(line)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env["HOME"] = str(home)
    log = tmp_path / "join.log"
    with log.open("wb") as out:
        joined = subprocess.Popen(
            [str(AGENTS_MACHINE), *command[1:], "--no-background"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        socket = home / ".agents-server" / "root" / "machine.sock"

        def serving() -> bool:
            assert joined.poll() is None, log.read_text()
            return socket.exists()

        poll_until(serving, deadline=20, what="the joined daemon's socket")
        # The tour's next command, with no --data-dir: it reaches the joined daemon.
        work = tmp_path / "work"
        work.mkdir()
        res = subprocess.run(
            [str(AGENTS_MACHINE), "agent", "create", "hello", "--folder", str(work)],
            env=env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert re.fullmatch(r"ag_[0-9a-z]{26}", res.stdout.strip())
    finally:
        joined.terminate()
        joined.wait(timeout=15)


def test_show_prints_a_record_or_json(cp: ControlProc, account: str) -> None:
    text = cp.cli("account", "show", account)
    assert text.code == 0, text.err
    assert f"account_id           {account}" in text.out.splitlines()
    assert any(line.startswith("github_user_id       77") for line in text.out.splitlines())
    shown = json.loads(cp.cli("account", "show", account, "--json").out)
    assert shown["account_id"] == account and shown["github_user_id"] == 77


@pytest.mark.parametrize("reuseport", [False, True])
def test_a_port_in_use_is_one_line(tmp_path: Path, reuseport: bool) -> None:
    """Also when the holder set SO_REUSEPORT, as gRPC servers do by default."""
    home = tmp_path / "home"
    run_init(home, str(tmp_path / "store"), {})
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(
            [str(agents_control_exe()), "serve", "--home", str(home),
             "--listen", f"127.0.0.1:{port}"],
            env=env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.splitlines()[-1]
    says = f"cannot listen on 127.0.0.1:{port}: in use, or not this host's"
    assert last == f"agents-control: config listen: {says}"
