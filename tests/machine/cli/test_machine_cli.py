"""CLI behaviour that needs no daemon: usage errors and a stopped daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from machine.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_command_is_usage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path))
    assert code == 2
    assert err.splitlines()[0] == "agents-machine: missing command"
    assert err.splitlines()[1].startswith("Try: ")


def test_unknown_verb_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "agent", "explode")
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 2 and "invalid choice" in lines[0] and lines[1].startswith("Try:")


def test_daemon_not_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "agent", "list")
    assert code == 1
    assert "the machine daemon is not running" in err.splitlines()[0]


def test_bad_config_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "serve", "--tcp", "0.0.0.0:1")
    assert code == 2
    assert err.splitlines()[0].startswith("agents-machine: config tcp_address:")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("explode",), "argument command: invalid choice: 'explode'"),
        (("--bogus", "status"), "unrecognized arguments: --bogus"),
        (("agent", "show"), "agent show: the following arguments are required: id"),
        (("agent", "answer", "run_x"), "agent answer: the following arguments are required"),
        (("agent", "runs", "ag_x", "--limit", "many"), "agent runs: argument --limit"),
        (("join", "127.0.0.1:1"), "join: the following arguments are required: --token"),
    ],
)
def test_usage_errors_have_one_prefix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], says: str
) -> None:
    code, out, err = run(capsys, "--data-dir", str(tmp_path), *argv)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("agents-machine: ") and says in lines[0], lines
    assert lines[0].count("agents-machine:") == 1, lines
    assert len(lines) <= 2 and all(line.startswith("Try: ") for line in lines[1:]), lines
    assert "Traceback" not in err


GOOD_RUN = "run_0000000000aaaaaaaaaaaaaaaa"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("agent", "show", "../../etc"), "agent_id: invalid agent id '../../etc'"),
        (("agent", "archive", "ag_nope"), "agent_id: invalid agent id"),
        (("agent", "unarchive", ""), "agent_id: invalid agent id"),
        (("agent", "rename", "x/y", "new"), "agent_id: invalid agent id"),
        (("agent", "prompt", "ag_../x", "hi"), "agent_id: invalid agent id"),
        (("agent", "replay", "run_0000000000aaaaaaaaaaaaaaaa"), "agent_id: invalid agent id"),
        (("agent", "runs", "nope"), "agent_id: invalid agent id"),
        (("agent", "search", "q", "--agent", "../a"), "agent_id: invalid agent id"),
        (("agent", "cancel", "../../etc"), "run_id: invalid run id"),
        (("agent", "answer", "ag_0000000000aaaaaaaaaaaaaaaa", "r", "o"), "run_id: invalid run id"),
        (("agent", "answer", GOOD_RUN, "", "allow"), "request_id: must be 1 to 200"),
        (("agent", "answer", GOOD_RUN, "r" * 201, "allow"), "request_id: must be 1 to 200"),
        (("agent", "answer", GOOD_RUN, "r", ""), "option_id: must be 1 to 200"),
    ],
)
def test_bad_ids_refused_before_dialling(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], says: str
) -> None:
    # No daemon runs on tmp_path: a dialled command would say "not running", exit 1.
    code, out, err = run(capsys, "--data-dir", str(tmp_path), *argv)
    assert code == 2 and out == "", err
    lines = err.splitlines()
    assert lines[0].startswith("agents-machine: ") and says in lines[0], lines
    assert len(lines) <= 2 and all(line.startswith("Try: ") for line in lines[1:]), lines
    assert "not running" not in err


def test_good_ids_still_dial(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "agent", "cancel", GOOD_RUN)
    assert code == 1 and "the machine daemon is not running" in err


def test_every_positional_argument_has_help() -> None:
    from machine.cli.main import _parser
    from tests.helpers.cli_parsers import positionals

    found = list(positionals(_parser()))
    assert len(found) >= 10
    assert [f"{prog} {a.dest}" for prog, a in found if not a.help] == []


def test_every_option_is_documented() -> None:
    from machine.cli.main import _parser
    from tests.helpers.cli_parsers import long_options

    page = (Path(__file__).resolve().parents[3] / "docs" / "cli-machine.md").read_text()
    assert sorted(o for o in long_options(_parser()) if o not in page) == []


@pytest.mark.parametrize(
    ("kind", "listing"),
    [
        ("agent", "agent list --all"),
        ("backup", "backup list"),
        ("schedule", "schedule list"),
        ("run", "agent runs AGENT"),
    ],
)
def test_not_found_points_at_its_own_listing(kind: str, listing: str) -> None:
    from machine.cli.main import _hint
    from shared.errors import NotFound

    assert _hint(NotFound(kind, "x_1"), "agents-machine") == f"agents-machine {listing}"


@pytest.mark.parametrize(
    ("argv", "field", "words"),
    [
        (
            ["agent", "prompt", "ag_1", "--attach", "f", "hello", "there"],
            "text",
            ["hello", "there"],
        ),
        (["agent", "prompt", "ag_1", "hi", "--attach", "f", "there"], "text", ["hi", "there"]),
        (["agent", "search", "--limit", "3", "a", "b"], "query", ["a", "b"]),
        (["agent", "search", "a", "--limit", "3", "b"], "query", ["a", "b"]),
        (["export", "ag_1", "-o", "x.tar.gz", "ag_2"], "agents", ["ag_1", "ag_2"]),
    ],
)
def test_words_after_an_option_still_belong_to_the_trailing_positional(
    argv: list[str], field: str, words: list[str]
) -> None:
    from machine.cli.main import parse_args

    assert getattr(parse_args(argv), field) == words


def test_stray_words_and_unknown_options_are_still_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for argv in (
        ["agent", "show", "ag_1", "extra"],
        ["agent", "prompt", "ag_1", "--attach", "f", "--bogus"],
    ):
        code, out, err = run(capsys, "--data-dir", str(tmp_path), *argv)
        assert code == 2 and out == ""
        assert err.startswith("agents-machine: unrecognized arguments: "), err


@pytest.mark.parametrize(
    "argv",
    [
        ["agents-machine", "--data-dir", "{tmp}/m", "agent", "create", "x", "--folder", "{tmp}"],
        ["agents-control", "--home", "{tmp}/h", "account", "list"],
    ],
)
def test_a_closed_stdout_is_refused_before_anything_is_done(
    tmp_path: Path, argv: list[str]
) -> None:
    """Started with descriptor 1 closed (``>&-``): one line, exit 2, and nothing made
    (before, a verb made its object, then failed with a traceback at its print)."""
    import subprocess
    import sys

    exe = Path(sys.executable).parent / argv[0]
    args = [exe, *(a.format(tmp=tmp_path) for a in argv[1:])]
    res = subprocess.run(
        args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(),
        preexec_fn=lambda: os.close(1), timeout=60, check=False,
    )  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert err == f"{argv[0]}: stdout is closed; nothing was done (redirect it: > /dev/null)\n"
    assert not (tmp_path / "m").exists() and not (tmp_path / "h").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["agent", "create", "x", "--folder", ""],
            "--folder: empty; name the agent's working folder",
        ),
        (
            ["agent", "prompt", "ag_01234567890123456789012345", "text", "--stdin"],
            "prompt: give the text or --stdin, not both",
        ),
    ],
)
def test_input_that_would_be_silently_replaced_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], says: str
) -> None:
    """Refused by the CLI before any daemon is asked (none runs here): before, an
    empty --folder became the current folder and the text beside --stdin was dropped."""
    code, out, err = run(capsys, "--data-dir", str(tmp_path), *argv)
    assert code == 2 and out == ""
    assert err.splitlines()[0] == f"agents-machine: {says}"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--recovery-key", "k", "--no-restore"], "--recovery-key restores the machine's backup"),
        (["--recovery-key", ""], "--recovery-key: empty"),
        (["--as-new"], "--as-new is for a data folder that was joined"),
        (["--link-address", "127.0.0.1:7444,bad"], "link_address: must be HOST:PORT"),
        (["--link-address", "127.0.0.1:0"], "link_address: port must be 1..65535"),
    ],
)
def test_join_refuses_contradictory_or_empty_options_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], says: str
) -> None:
    """No control plane listens at the address: each is refused first, and the
    data folder is not made."""
    data = tmp_path / "d"
    token = "tok_01234567890123456789012345." + "s" * 43
    code, out, err = run(
        capsys, "--data-dir", str(data), "join", "127.0.0.1:9", "--token", token,
        "--ca-hash", "sha256:" + "0" * 64, *extra,
    )  # fmt: skip
    assert code == 2 and out == ""
    assert says in err.splitlines()[0], err
    assert not data.exists()


def test_join_beside_a_holder_of_the_data_folder_is_refused_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The data folder's lock is held (here by this process, as a daemon holds it):
    refused, naming the folder and the holder, before the control plane is dialled
    (none listens). A join that fails later leaves no folder it made behind."""
    from machine.daemon import hold_data_dir

    data = tmp_path / "d"
    data.mkdir()
    join = ("join", "127.0.0.1:9", "--token", "tok_01234567890123456789012345." + "s" * 43,
            "--ca-hash", "sha256:" + "0" * 64)  # fmt: skip
    with hold_data_dir(data, "serve"):
        code, out, err = run(capsys, "--data-dir", str(data), *join)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"agents-machine: join {data}: another agents-machine (pid {os.getpid()}) is already"
        " using this data folder; stop it first (`systemctl stop agents-machine` when it runs"
        " as the service), then run the same join command again; the token was not used"
    ]
    assert sorted(p.name for p in data.iterdir()) == ["machine.lock"]
    # Nobody holds it: the join goes on (and finds no control plane); nothing it made stays.
    nested = tmp_path / "new" / "data"
    code, out, err = run(capsys, "--data-dir", str(nested), *join)
    assert code == 1 and "cannot reach the control plane" in err, err
    assert not (tmp_path / "new").exists()


def test_export_to_a_folder_says_it_is_a_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(
        capsys, "--data-dir", str(tmp_path / "d"), "export",
        "ag_0000000000aaaaaaaaaaaaaaaa", "-o", str(tmp_path),
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert err.splitlines()[0] == (
        f"agents-machine: export: {tmp_path} is a folder; -o names the file to write (.tar.gz)"
    )


def _joined_with_restore_pending(data: Path) -> str:
    """A data folder whose repair join committed and whose restore did not; its id."""
    import datetime as dt

    from machine.link import identity
    from shared import tls
    from shared.crypto import BoxKeyPair
    from shared.ids import new_id

    ca = tls.make_ca()
    keys = identity.NewKeys.generate()
    machine_id, account_id = new_id("machine"), new_id("account")
    cert = tls.sign_client_csr(
        ca, keys.csr_pem(), account_id=account_id, machine_id=machine_id,
        lifetime=dt.timedelta(hours=1),
    )  # fmt: skip
    link = identity.LinkRecord(
        control_address="127.0.0.1:9",
        machine_id=machine_id,
        account_id=account_id,
        account_recovery_public_key=BoxKeyPair.generate().public_key,
        heartbeat_interval=1.0,
        cert_not_after=tls.cert_not_after(cert.cert_pem),
        cert_received_at=dt.datetime.now(dt.UTC),
    )
    with identity.staged_join(data) as stage:
        identity.write_identity(
            stage, keys, cert_pem=cert.cert_pem, ca_cert_pem=ca.cert_pem, link=link
        )
        identity.mark_restore_pending(stage)
    return machine_id


def test_join_again_after_an_unfinished_restore_never_spends_the_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The join committed, its restore did not: the same command again restores
    (integration: test_backup_repair), or with --no-restore starts without the
    backup; without either it says what to do. No control plane listens here."""
    from machine.cli import joining
    from machine.link import identity

    data = tmp_path / "d"
    machine_id = _joined_with_restore_pending(data)
    join = ("--data-dir", str(data), "join", "127.0.0.1:9", "--token", "tok_x",
            "--ca-hash", "sha256:" + "0" * 64)  # fmt: skip
    code, out, err = run(capsys, *join)
    assert (code, out) == (2, "")
    assert f"joined as machine {machine_id}, and the restore of its backup did not" in err
    assert "--recovery-key FILE to restore it (the token is not used again)" in err
    assert identity.restore_pending(data)
    code, out, err = run(capsys, *join, "--as-new")
    assert code == 2 and "--as-new is for a machine stopped for good" in err
    garbage = tmp_path / "not-a-key"
    garbage.write_text("nonsense\n")
    garbage.chmod(0o600)
    code, out, err = run(capsys, *join, "--recovery-key", str(garbage))
    assert code == 2 and "recovery_key" in err.splitlines()[0], err
    assert "Traceback" not in err and identity.restore_pending(data)
    served: list[Path] = []
    monkeypatch.setattr(joining, "run_serve", lambda cfg, **kw: served.append(cfg.data_dir) or 0)
    code, out, err = run(capsys, *join, "--no-restore")
    assert code == 0, err
    assert out.startswith(f"machine {machine_id} starts without its backup;")
    assert not identity.restore_pending(data) and served == [data]


def test_a_backup_failing_after_a_repair_restore_warns_and_keeps_the_restore(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The backup a repair join makes after its restore fails (the control plane
    gone meanwhile): one warning naming why and what to run; the join goes on."""
    import argparse

    from machine.cli import after_join, joining
    from machine.cli.common import Ctx
    from shared.cli import Output
    from shared.errors import TransientError

    async def unreachable(config: object) -> None:
        raise TransientError("control plane unreachable")

    monkeypatch.setattr(after_join, "backup_after_repair", unreachable)
    args = argparse.Namespace(data_dir=str(tmp_path / "d"))
    joining._backup_after_restore(Ctx(args=args, env={}, out=Output(as_json=False)))
    out, err = capsys.readouterr()
    assert out == ""
    assert "warning: the first backup under this box's keys failed" in err
    assert "control plane unreachable" in err and "backup now` once the daemon runs" in err
