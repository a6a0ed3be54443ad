"""Conventions both command lines keep (kubectl, gh, restic): ``--version``,
"did you mean", examples in every verb's help, ``--json`` in the same places,
shell completion."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from controlplane.cli.main import main as control_main
from machine.cli.main import main as machine_main
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
