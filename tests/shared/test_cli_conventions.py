"""Conventions both command lines keep (kubectl, gh, restic): ``--version``,
"did you mean", examples in every verb's help, ``--json`` in the same places,
shell completion."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable
from typing import Any

import pytest

from controlplane.cli.main import main as control_main
from machine.cli.main import main as machine_main
from shared.cli import UsageError, walk_parsers
from shared.version import package_version

CLIS: dict[str, Callable[[list[str] | None], int]] = {
    "agents-control": control_main,
    "agents-machine": machine_main,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() reads the real environment: keep the caller's settings out of it.
    for key in list(os.environ):
        if key.startswith(("AGENTS_CONTROL_", "AGENTS_MACHINE_", "AGENTS_DATA_DIR")):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_version_prints_the_cli_and_its_version(
    prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        CLIS[prog](["--version"])
    assert info.value.code == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"{prog} {package_version()}\n", "")
    assert package_version() != "unknown"  # the test venv has the distribution installed


@pytest.mark.parametrize(
    ("prog", "argv", "line", "hint"),
    [
        ("agents-control", ["machin", "list"], "invalid choice: 'machin'; did you mean 'machine'?",
         "agents-control --help"),
        ("agents-control", ["machine", "lst"],
         "machine: invalid choice: 'lst'; did you mean 'list'?", "agents-control machine --help"),
        ("agents-machine", ["agnet", "list"], "invalid choice: 'agnet'; did you mean 'agent'?",
         "agents-machine --help"),
        ("agents-machine", ["schedule", "paus", "sch_x"],
         "schedule: invalid choice: 'paus'; did you mean 'pause'?",
         "agents-machine schedule --help"),
    ],
)  # fmt: skip
def test_a_mistyped_command_or_verb_names_the_nearest(
    prog: str, argv: list[str], line: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert CLIS[prog](argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"{prog}: {line}", f"Try: {hint}"]


def test_a_choice_nothing_is_near_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert control_main(["machine", "explode"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "invalid choice: 'explode'" in line and "did you mean" not in line
    assert "'list'" in line  # argparse's own message: every verb


def test_an_option_choice_names_the_option_and_the_nearest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert control_main(["machine", "provider", "sett", "mc_x"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert line.endswith("argument action: invalid choice: 'sett'; did you mean 'set'?")


def test_a_different_word_is_not_taken_for_a_typo(capsys: pytest.CaptureFixture[str]) -> None:
    # 'explode' is not a typo of 'export': no suggestion, the list of commands.
    assert machine_main(["explode"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "did you mean" not in line and "'export'" in line


# ---------------------------------------------------------------- examples

_SHELL = {"|", "||", "&&", ";", "<", ">", ">>", "2>&1", "&"}


def _parsers() -> dict[str, tuple[argparse.ArgumentParser, Callable[[list[str]], Any]]]:
    from controlplane.cli import main as control
    from machine.cli import main as machine

    return {
        "agents-control": (control.build_parser(), control.parse_args),
        "agents-machine": (machine._parser(), machine.parse_args),
    }


def _examples(parser: argparse.ArgumentParser) -> list[str]:
    help_text = parser.format_help()
    assert "\nExamples:\n" in help_text, f"{parser.prog} --help has no Examples section"
    section = help_text.split("\nExamples:\n", 1)[1]
    return [line.strip() for line in section.splitlines() if line.strip()]


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_every_help_page_has_examples_that_parse(prog: str) -> None:
    from machine.cli.main import _check_args

    root, parse = _parsers()[prog]
    pages = list(walk_parsers(root))
    assert len(pages) > 20
    checked = 0
    for path, parser in pages:
        for line in _examples(parser):
            if not line.startswith(f"{prog} "):
                assert line.startswith("#"), f"{parser.prog}: {line!r} is neither a command nor #"
                continue
            words = shlex.split(line)[1:]
            cut = next((i for i, w in enumerate(words) if w in _SHELL), len(words))
            try:
                args = parse(words[:cut])
            except SystemExit as e:  # --version, --help: printed and done
                assert e.code == 0, line
                continue
            except UsageError as e:
                raise AssertionError(f"{parser.prog} example does not parse: {line!r}: {e}") from e
            if prog == "agents-machine":
                _check_args(args)  # ids well-formed, as main checks them
            if path:  # an example on a verb's page runs that verb
                assert tuple(words[: len(path)]) == path or path[0] in words, (path, line)
            checked += 1
    assert checked > len(pages)


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_the_examples_table_names_only_real_commands(prog: str) -> None:
    from controlplane.cli.examples import EXAMPLES as CONTROL
    from machine.cli.examples import EXAMPLES as MACHINE

    table = CONTROL if prog == "agents-control" else MACHINE
    paths = {path for path, _ in walk_parsers(_parsers()[prog][0])}
    assert set(table) == paths


def test_help_keeps_the_examples_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        control_main(["token", "create", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Examples:\n  agents-control token create --account acct_" in out
    assert (
        "\n  agents-control token create --account acct_01jfa2b3c4d5e6f7g8h9j0k1m2 --ttl 2h30m"
        in out
    )


# ---------------------------------------------------------------- --json

_ACCT = "acct_01jfa2b3c4d5e6f7g8h9j0k1m2"
_AGENT = "ag_01jfa2b3c4d5e6f7g8h9j0k1m2"


@pytest.mark.parametrize(
    ("prog", "command"),
    [
        ("agents-control", ["account", "list"]),
        ("agents-control", ["machine", "list", "--account", _ACCT]),
        ("agents-control", ["recovery-key", "new", "--out", "k"]),
        ("agents-control", ["fsck"]),
        ("agents-machine", ["agent", "list"]),
        ("agents-machine", ["agent", "show", _AGENT]),
        ("agents-machine", ["status"]),
        ("agents-machine", ["backup", "list"]),
    ],
)
def test_json_goes_before_the_command_or_after_the_verb(prog: str, command: list[str]) -> None:
    parse = _parsers()[prog][1]
    assert parse(command).json is False
    assert parse(["--json", *command]).json is True
    assert parse([*command, "--json"]).json is True


@pytest.mark.parametrize("command", [["serve"], ["init", "--store", "x"]])
def test_json_before_a_command_without_json_output_is_refused(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert control_main(["--json", *command]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"agents-control: --json: `{command[0]}` prints no JSON"
