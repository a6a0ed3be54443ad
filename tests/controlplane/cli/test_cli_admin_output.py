"""agents-control's admin verbs print, from the typed AdminClient replies, exactly what
the server's messages say (the --json shape scripts parse), against one in-process daemon."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from controlplane.cli.client import AdminClient
from controlplane.cli.main import main
from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_ca_cert
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.server import ControlPlane
from shared.cli import message_dict
from shared.errors import NotFound
from shared.ids import new_id
from shared.pb.control.v1 import admin_pb2
from tests.helpers.json_style import assert_json_style, assert_listing


@dataclass
class Daemon:
    home: Path
    address: str
    operator: str

    def argv(self, *args: str) -> list[str]:
        return [*args, "--home", str(self.home), "--address", self.address]


@pytest.fixture
async def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    for key in list(os.environ):  # main() reads the environment: keep the caller's out
        if key.startswith("AGENTS_CONTROL_"):
            monkeypatch.delenv(key)
    cfg = ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()
    made = await init_control_plane(cfg)
    async with ControlPlane(cfg) as cp:
        daemon = Daemon(cfg.home, f"127.0.0.1:{cp.public_port}", made.operator_credential)
        monkeypatch.setenv("AGENTS_CONTROL_CREDENTIAL", daemon.operator)
        yield daemon


async def _cli(capsys: pytest.CaptureFixture[str], d: Daemon, *args: str) -> tuple[str, str]:
    code = await asyncio.to_thread(main, d.argv(*args))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


async def _raw(d: Daemon, rpc: str, request: Any) -> dict[str, Any]:
    """The server's own reply to ``rpc``, as message_dict (what --json printed before)."""
    async with AdminClient(d.address, load_ca_cert(d.home), d.operator) as client:
        stub: Any = client.stub  # typed for the sync API; on an aio channel it awaits
        reply = await getattr(stub, rpc)(
            request, metadata=(("authorization", f"Bearer {d.operator}"),), timeout=10
        )
    return message_dict(reply)


async def test_admin_verbs_print_what_the_server_answered(
    daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = await _cli(
        capsys, daemon, "account", "create", "--github-id", "5", "--github-login", "al", "--json"
    )
    made = json.loads(out)
    acct = made["account_id"]
    assert made["recovery_private_key"].startswith("agsk1_")

    # A record: the message's JSON, the recovery key as agpk1_ (as the CLI always did).
    shown = json.loads((await _cli(capsys, daemon, "account", "show", acct, "--json"))[0])
    raw = await _raw(daemon, "GetAccount", admin_pb2.GetAccountRequest(account_id=acct))
    assert raw["signed_up_at"].endswith("Z") and shown["recovery_public_key"].startswith("agpk1_")
    assert shown == {**raw, "recovery_public_key": shown["recovery_public_key"]}
    assert {k: v for k, v in made.items() if k != "recovery_private_key"} == shown

    # Text: `field  value` lines in the proto's order, unset values as "-".
    text, _ = await _cli(capsys, daemon, "account", "show", acct)
    lines = [line.split(None, 1) for line in text.splitlines()]
    assert [k for k, _ in lines] == list(admin_pb2.Account.DESCRIPTOR.fields_by_name)
    assert dict(lines)["signed_up_at"] == raw["signed_up_at"]

    # A token: the join command and the reply, the one-time value once.
    out, err = await _cli(capsys, daemon, "token", "create", "--account", acct, "--json")
    token = json.loads(out)
    assert token["join_command"] == (
        f"agents-machine join {token['join_address']} --token {token['token_value']} "
        f"--ca-hash {token['ca_hash']}"
    )
    listed = await _raw(daemon, "ListJoinTokens", admin_pb2.ListJoinTokensRequest())
    assert [token["token"]] == listed["tokens"] and err == ""
    out, _ = await _cli(capsys, daemon, "token", "list", "--json")
    assert json.loads(out) == listed
    out, err = await _cli(capsys, daemon, "token", "create", "--account", acct)
    assert out.startswith("agents-machine join ") and out.count("\n") == 1
    assert "expires 20" in err and "Z, uses 1" in err  # the RFC 3339 text, as before

    out, err = await _cli(capsys, daemon, "credential", "create", "--account", acct)
    assert out.startswith("adm_") and out.count("\n") == 1 and acct in err

    machines = await _raw(daemon, "ListMachines", admin_pb2.ListMachinesRequest())
    out, _ = await _cli(capsys, daemon, "machine", "list", "--json")
    assert json.loads(out) == machines == {"machines": []}

    # Every listing is {"<things>": [...]} in the one style (docs/cli-json.md), with
    # --json before the command as after the verb (as agents-machine takes it).
    for words, key in ((["account", "list"], "accounts"), (["token", "list"], "tokens")):
        first, _ = await _cli(capsys, daemon, "--json", *words)
        last, _ = await _cli(capsys, daemon, *words, "--json")
        assert first == last and assert_listing(json.loads(first), key)
    assert_json_style(shown)
    assert_json_style(token)

    # A deletion, watched to the end: the last read is the server's record.
    out, _ = await _cli(capsys, daemon, "account", "delete", acct, "--wait", "--json")
    done = json.loads(out)
    raw = await _raw(daemon, "GetDeletion", admin_pb2.GetDeletionRequest(account_id=acct))
    assert done == raw and done["state"] == "deleted" and done["finished_at"]
    text, _ = await _cli(capsys, daemon, "account", "deletion", acct)
    assert text.splitlines()[0].split() == ["account_id", acct]


async def test_a_refusal_is_the_domain_error_with_the_grpc_error_as_cause(
    daemon: Daemon,
) -> None:
    async with AdminClient(daemon.address, load_ca_cert(daemon.home), daemon.operator) as client:
        with pytest.raises(NotFound) as info:
            await client.get_account(new_id("account"))
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
    assert info.value.__cause__.code() == grpc.StatusCode.NOT_FOUND


class _Terminal(io.StringIO):
    """stderr as a terminal: what is written to it is kept."""

    def isatty(self) -> bool:
        return True


async def test_delete_wait_shows_a_spinner_on_a_terminal_only_without_json(
    daemon: Daemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    for n, flags in enumerate(([], ["--json"])):
        out, _ = await _cli(
            capsys, daemon, "account", "create", "--github-id", str(10 + n), "--github-login",
            f"u{n}", "--json",
        )  # fmt: skip
        acct = json.loads(out)["account_id"]
        terminal = _Terminal()
        with monkeypatch.context() as patch:
            patch.setattr(sys, "stderr", terminal)
            code = await asyncio.to_thread(
                main, daemon.argv("account", "delete", acct, "--wait", *flags)
            )
        assert code == 0, terminal.getvalue()
        assert "deleted" in capsys.readouterr().out  # the reply, on stdout
        seen.append(terminal.getvalue())
    assert "deleting acct_" in seen[0]
    assert seen[1] == ""  # --json: nothing on stderr, even at a terminal
