"""The admin credential from a file (``--credential-file``,
``AGENTS_CONTROL_CREDENTIAL_FILE``): a secret in argv shows in ``ps``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.config import read_credential
from shared import tls
from shared.errors import ConfigError

CREDENTIAL = "adm_" + "0" * 26 + "." + "A" * 43
OTHER = "adm_" + "1" * 26 + "." + "B" * 43


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("AGENTS_CONTROL_"):
            monkeypatch.delenv(key)


@pytest.fixture
def cred_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.cred"
    path.write_text(f"  {CREDENTIAL}  \nsecond line is ignored\n")
    return path


def test_the_first_line_stripped_is_the_credential(cred_file: Path) -> None:
    assert read_credential({"credential_file": str(cred_file)}, {}) == CREDENTIAL
    env = {"AGENTS_CONTROL_CREDENTIAL_FILE": str(cred_file)}
    assert read_credential({}, env) == CREDENTIAL


def test_a_file_without_a_newline_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "c"
    path.write_text(CREDENTIAL)
    assert read_credential({"credential_file": str(path)}, {}) == CREDENTIAL


def test_nothing_given_is_none() -> None:
    assert read_credential({"credential": None, "credential_file": None}, {}) is None


def test_flags_win_over_the_environment(cred_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_text(OTHER + "\n")
    file_env = "AGENTS_CONTROL_CREDENTIAL_FILE"
    # A flag of either kind wins over the environment of either kind.
    flag_file = {"credential_file": str(cred_file)}
    assert read_credential(flag_file, {"AGENTS_CONTROL_CREDENTIAL": OTHER}) == CREDENTIAL
    flag_text = {"credential": CREDENTIAL}
    assert read_credential(flag_text, {file_env: str(other)}) == CREDENTIAL
    # The environment's file is not even read when a flag gives the credential.
    assert read_credential(flag_text, {file_env: str(tmp_path / "gone")}) == CREDENTIAL


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        ({"credential": CREDENTIAL, "credential_file": "F"}, {},
         "both --credential and --credential-file given; give one"),
        ({}, {"AGENTS_CONTROL_CREDENTIAL": CREDENTIAL, "AGENTS_CONTROL_CREDENTIAL_FILE": "F"},
         "both AGENTS_CONTROL_CREDENTIAL and AGENTS_CONTROL_CREDENTIAL_FILE given; give one"),
    ],
)  # fmt: skip
def test_both_kinds_at_one_level_are_refused(
    flags: dict[str, str], env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        read_credential(flags, env)
    assert says in str(info.value) and CREDENTIAL not in str(info.value)


def _refusal(tmp_path: Path, path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        read_credential({"credential_file": str(path)}, {})
    message = str(info.value)
    assert message.startswith("config credential: --credential-file: ")
    assert str(path) in message and "\n" not in message
    return message


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    assert "No such file" in _refusal(tmp_path, tmp_path / "missing")


def test_a_folder_is_named(tmp_path: Path) -> None:
    assert "cannot read" in _refusal(tmp_path, tmp_path)


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked"
    path.write_text(CREDENTIAL)
    path.chmod(0)
    if os.geteuid() == 0:
        # Root reads any file: the open fails as it would for anyone else.
        real_open = Path.open

        def refused(self: Path, *args: object, **kwargs: object) -> object:
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "open", refused)
    message = _refusal(tmp_path, path)
    assert "Permission denied" in message and CREDENTIAL not in message


@pytest.mark.parametrize("content", [b"", b"\n", b"   \nadm_on_the_second_line\n"])
def test_an_empty_first_line_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty"
    path.write_bytes(content)
    assert "first line" in _refusal(tmp_path, path) and "empty" in _refusal(tmp_path, path)


def test_a_binary_file_is_refused_without_showing_it(tmp_path: Path) -> None:
    path = tmp_path / "bin"
    path.write_bytes(b"adm_\xff\xfe secret\n")
    message = _refusal(tmp_path, path)
    assert "not UTF-8" in message and "secret" not in message


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_the_cli_uses_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cred_file: Path
) -> None:
    (tmp_path / "ca.pem").write_bytes(tls.make_ca().cert_pem)
    base = ["account", "list", "--home", str(tmp_path), "--address", "127.0.0.1:1"]
    # Got as far as dialling: the credential was taken.
    code, out, lines = run(capsys, *base, "--credential-file", str(cred_file))
    assert (code, out) == (1, "") and "not reachable" in lines[0]


@pytest.mark.parametrize(
    ("extra", "env", "says"),
    [
        (["--credential-file", "{missing}"], {}, "--credential-file: cannot read {missing}"),
        (["--credential-file", "{cred}", "--credential", CREDENTIAL], {},
         "both --credential and --credential-file given"),
        ([], {"AGENTS_CONTROL_CREDENTIAL_FILE": "{missing}"},
         "AGENTS_CONTROL_CREDENTIAL_FILE: cannot read {missing}"),
        (["--credential-file", ""], {}, "--credential-file: empty"),
    ],
)  # fmt: skip
def test_the_cli_refuses_a_bad_credential_file_with_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cred_file: Path,
    extra: list[str],
    env: dict[str, str],
    says: str,
) -> None:
    names = {"missing": str(tmp_path / "missing"), "cred": str(cred_file)}
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(**names))
    argv = [a.format(**names) for a in extra]
    code, out, lines = run(capsys, "machine", "list", "--home", str(tmp_path), *argv)
    assert (code, out) == (2, "")
    assert len(lines) == 1 and lines[0].startswith("agents-control: ")
    assert says.format(**names) in lines[0] and CREDENTIAL not in lines[0]


def test_no_credential_names_the_file_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, lines = run(capsys, "machine", "list", "--home", str(tmp_path))
    assert code == 2 and "--credential-file" in lines[0]
    assert "AGENTS_CONTROL_CREDENTIAL_FILE" in lines[0]
