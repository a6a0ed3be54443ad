"""agents-control behaviour that needs no daemon: how errors print, and input checks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from controlplane.cli.main import main
from shared import tls
from tests.helpers.control_proc import agents_control_exe

CREDENTIAL = "adm_" + "0" * 26 + "." + "A" * 43


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() reads the real environment: keep the caller's settings out of it.
    for key in list(os.environ):
        if key.startswith("AGENTS_CONTROL_"):
            monkeypatch.delenv(key)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def _assert_one_error_line(lines: list[str], *, hint: bool) -> None:
    assert lines and lines[0].startswith("agents-control"), lines
    if hint:
        assert len(lines) == 2 and lines[1].startswith("Try: "), lines
    else:
        assert len(lines) == 1, lines


def test_long_error_stays_one_line_in_a_narrow_pipe(tmp_path: Path) -> None:
    # A long path makes the message far wider than 40 columns; COLUMNS=40 is what
    # a narrow terminal (or a CI runner) would set. A real process, stderr a pipe.
    home = tmp_path / ("deep-folder-name-" * 4) / "home"
    home.mkdir(parents=True)
    (home / "x").write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_CONTROL_")}
    env["COLUMNS"] = "40"
    proc = subprocess.run(
        [str(agents_control_exe()), "init", "--home", str(home), "--store", str(tmp_path / "s")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    _assert_one_error_line(lines, hint=False)
    assert str(home) in lines[0] and "not empty" in lines[0]
    assert len(lines[0]) > 80


def test_usage_error_is_one_line_and_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, lines = run(capsys, "machine", "explode")
    assert code == 2
    _assert_one_error_line(lines, hint=True)
    assert "invalid choice" in lines[0]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        *(("--uses", v) for v in ("0", "-3", "two", "1001")),  # 1,000 at most, as served
        *(("--ttl", v) for v in ("0", "0h")),
    ],
)
def test_token_create_refuses_values_below_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str
) -> None:
    # Refused while parsing: nothing is contacted (the address would not answer).
    code, out, lines = run(
        capsys,
        "token",
        "create",
        "--home",
        str(tmp_path),
        "--address",
        "127.0.0.1:1",
        "--credential",
        CREDENTIAL,
        "--account",
        "acct_" + "0" * 26,
        flag,
        value,
    )
    assert code == 2 and out == ""
    _assert_one_error_line(lines, hint=True)
    assert flag in lines[0]


def test_init_without_store_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, lines = run(capsys, "init", "--home", str(tmp_path / "home"))
    assert code == 2
    _assert_one_error_line(lines, hint=False)
    assert "store" in lines[0] and "required" in lines[0]
    assert not (tmp_path / "home").exists()  # refused before anything was written


def test_unreachable_control_plane_is_one_plain_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "ca.pem").write_bytes(tls.make_ca().cert_pem)
    code, out, lines = run(
        capsys,
        "account",
        "list",
        "--home",
        str(tmp_path),
        "--address",
        "127.0.0.1:1",
        "--credential",
        CREDENTIAL,
    )
    assert code == 1 and out == ""
    assert lines == [
        "agents-control: control plane not reachable at 127.0.0.1:1 "
        "(is `agents-control serve` running?)"
    ]


def test_every_positional_argument_has_help() -> None:
    from controlplane.cli.main import build_parser
    from tests.helpers.cli_parsers import positionals

    found = list(positionals(build_parser()))
    assert len(found) >= 5
    assert [f"{prog} {a.dest}" for prog, a in found if not a.help] == []


def test_every_option_is_documented() -> None:
    from controlplane.cli.main import build_parser
    from tests.helpers.cli_parsers import long_options

    page = (Path(__file__).resolve().parents[3] / "docs" / "cli-control.md").read_text()
    assert sorted(o for o in long_options(build_parser()) if o not in page) == []


def test_a_prompt_file_that_is_not_utf8_is_named_plainly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "prompt.bin"
    bad.write_bytes(b"ok \xff\xfe")
    code, out, lines = run(
        capsys, "prompt", "send", "--home", str(tmp_path), "--address", "127.0.0.1:1",
        "--credential", CREDENTIAL, "--machine", "mc_" + "0" * 26, "--agent", "ag_" + "0" * 26,
        "--file", str(bad),
    )  # fmt: skip
    assert code == 2 and out == ""
    assert (
        lines[0]
        == f"agents-control: prompt send: {bad} is not UTF-8 text (byte 3); prompts are text"
    )
    assert "codec" not in lines[0]


@pytest.mark.parametrize("flag", ["--home", "--address", "--credential"])
def test_an_empty_option_is_refused_not_taken_for_absent(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    code, out, lines = run(capsys, "account", "list", flag, "")
    assert (code, out) == (2, "")
    assert lines == [f"agents-control: {flag}: empty; give a value or leave the option out"]


def test_home_before_the_command_is_the_home(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "ca.pem").write_bytes(tls.make_ca().cert_pem)
    argv = ["account", "list", "--address", "127.0.0.1:1", "--credential", CREDENTIAL]
    # Found the CA in that home, so it got as far as dialling the address.
    code, _, lines = run(capsys, "--home", str(tmp_path), *argv)
    assert (code, lines) == (
        1,
        [
            "agents-control: control plane not reachable at 127.0.0.1:1 "
            "(is `agents-control serve` running?)"
        ],
    )
    # The same folder on both sides is that folder; two folders are refused.
    code, _, lines = run(capsys, "--home", str(tmp_path), *argv, "--home", str(tmp_path))
    assert code == 1
    code, _, lines = run(capsys, "--home", str(tmp_path), *argv, "--home", f"{tmp_path}/")
    assert code == 1  # the same folder, written another way
    other = tmp_path / "other"
    code, _, lines = run(capsys, "--home", str(tmp_path), *argv, "--home", str(other))
    assert code == 2
    assert lines == [f"agents-control: --home given twice ({tmp_path} and {other}); give it once"]


def test_a_prompt_file_past_the_largest_limit_is_refused_without_reading_it_all(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # /dev/zero never ends: before, the whole "file" was read into memory.
    code, out, lines = run(
        capsys, "prompt", "send", "--home", str(tmp_path), "--address", "127.0.0.1:1",
        "--credential", CREDENTIAL, "--machine", "mc_" + "0" * 26, "--agent",
        "ag_" + "0" * 26, "--file", "/dev/zero",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert lines[0] == (
        "agents-control: prompt send: /dev/zero is larger than the 4 MiB a prompt may be"
        " at most (the control plane's prompt_max_bytes, 1 MiB by default)"
    )


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_serve_on_a_home_that_is_not_a_folder_is_one_line_and_makes_nothing(
    tmp_path: Path, kind: str
) -> None:
    home = tmp_path / "home"
    if kind == "file":
        home.write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_CONTROL_")}
    proc = subprocess.run(
        [str(agents_control_exe()), "serve", "--home", str(home)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    _assert_one_error_line(lines, hint=False)
    assert str(home) in lines[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "missing" else ["home"])
