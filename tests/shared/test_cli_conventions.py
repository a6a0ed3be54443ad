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
