"""Conventions both command lines keep (kubectl, gh, restic): ``--version``,
"did you mean", examples in every verb's help, ``--json`` in the same places,
shell completion."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
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
            if f"$({prog} " in line:  # eval "$(agents-machine completion bash)"
                line = line.split("$(", 1)[1].split(")", 1)[0]
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


# ---------------------------------------------------------------- completion

_MARKS = {
    "bash": "complete -o nospace -o default -o bashdefault -F _python_argcomplete {prog}",
    "zsh": "#compdef {prog}",
    "fish": "complete --command {prog} ",
}


@pytest.mark.parametrize("prog", sorted(CLIS))
@pytest.mark.parametrize("shell", sorted(_MARKS))
def test_completion_prints_the_script_for_each_shell(
    prog: str, shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert CLIS[prog](["completion", shell]) == 0
    out, err = capsys.readouterr()
    assert err == "" and _MARKS[shell].format(prog=prog) in out


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_completion_names_the_shells_it_knows(
    prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert CLIS[prog](["completion", "tcsh"]) == 2
    assert "invalid choice: 'tcsh'" in capsys.readouterr().err


def _complete(lines: dict[str, str], tmp_path: Path) -> dict[str, list[str]]:
    """What the shell gets for <Tab> at the end of each CLI's line: the CLI run as
    the completion script runs it (argcomplete's variables), in real processes
    (run side by side: each takes most of a second to start)."""
    procs = {}
    for prog, line in lines.items():
        module = "controlplane.cli" if prog == "agents-control" else "machine.cli"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTS_", "_ARC"))}
        env.update(
            _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n",
            _ARGCOMPLETE_STDOUT_FILENAME=str(tmp_path / prog),
            COMP_LINE=line, COMP_POINT=str(len(line)), AGENTS_DATA_DIR=str(tmp_path / "data"),
            PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        )  # fmt: skip
        code = f"import sys; from {module} import entry; sys.exit(entry())"
        procs[prog] = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    found = {}
    for prog, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (0, "", "")
        found[prog] = (tmp_path / prog).read_text().split("\n")
    return found


def test_the_completer_offers_commands_and_verbs(tmp_path: Path) -> None:
    found = _complete(
        {"agents-control": "agents-control mac", "agents-machine": "agents-machine agent li"},
        tmp_path,
    )
    # No daemon runs in that data folder: no agent ids there, and nothing printed.
    assert found == {"agents-control": ["machine "], "agents-machine": ["list "]}


def test_agent_ids_come_from_the_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from machine.cli import completion

    agents = [
        type("A", (), {"id": "ag_01jfa2b3c4d5e6f7g8h9j0k1m2", "name": "demo"})(),
        type("A", (), {"id": "ag_02zzzzzzzzzzzzzzzzzzzzzzzz", "name": "other"})(),
    ]
    seen: list[Path] = []

    class Fake:
        def __init__(self, cfg: Any) -> None:
            seen.append(cfg.data_dir)

        async def __aenter__(self) -> Fake:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def list_agents(self, *, include_archived: bool) -> list[Any]:
            assert include_archived
            return agents

    monkeypatch.setattr(completion, "MachineClient", Fake)
    args = argparse.Namespace(data_dir=str(tmp_path), socket=None)
    assert completion.agent_ids("ag_01", args, {}, tmp_path) == {
        "ag_01jfa2b3c4d5e6f7g8h9j0k1m2": "demo"
    }
    assert seen == [tmp_path]  # the data folder typed on the line so far


def test_agent_ids_are_nothing_when_the_daemon_is_down_or_slow(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from machine.cli import completion

    args = argparse.Namespace(data_dir=str(tmp_path), socket=None)
    assert completion.agent_ids("", args, {}, tmp_path) == {}  # no socket there

    class Slow:
        def __init__(self, cfg: Any) -> None:
            pass

        async def __aenter__(self) -> Slow:
            await asyncio.sleep(30)
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(completion, "MachineClient", Slow)
    monkeypatch.setattr(completion, "ID_TIMEOUT", 0.05)
    assert completion.agent_ids("", args, {}, tmp_path) == {}


def test_every_agent_id_argument_completes_from_the_daemon(tmp_path: Path) -> None:
    from machine.cli import completion
    from machine.cli.main import _parser

    parser = _parser()
    completion.add_completers(parser, {}, tmp_path)
    found = {
        (path, a.dest)
        for path, p in walk_parsers(parser)
        for a in p._actions
        if getattr(a, "completer", None) is not None
    }
    assert {(("agent", "show"), "id"), (("agent", "search"), "agent"),
            (("schedule", "add"), "agent"), (("export",), "agents")} <= found  # fmt: skip
    assert {dest for _, dest in found} == set(completion.AGENT_ID_ARGS)
