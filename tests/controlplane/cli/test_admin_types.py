"""The Admin client's reply types: from_pb reads every field, to_json prints what --json did."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
from google.protobuf.message import Message

from controlplane.cli.admin_types import (
    Account,
    Deletion,
    JoinToken,
    Machine,
    NewAccount,
    NewCredential,
    NewJoinToken,
    PromptQueue,
    QueuedPrompt,
    SentPrompt,
    rfc3339,
)
from shared.cli import message_dict
from shared.pb.control.v1 import admin_pb2 as pb
from shared.timestamps import from_datetime

# Microseconds and a non-UTC zone: the codec must keep both (as UTC).
WHEN = dt.datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=dt.timezone(dt.timedelta(hours=2)))
LATER = dt.datetime(2026, 3, 5, tzinfo=dt.UTC)
TS, TS2 = from_datetime(WHEN), from_datetime(LATER)


def _account() -> pb.Account:
    return pb.Account(
        account_id="acct_1",
        github_user_id=2**40,
        github_login="alice",
        signed_up_at=TS,
        recovery_public_key=bytes(range(32)),
        state="active",
    )


def _token() -> pb.JoinToken:
    return pb.JoinToken(
        token_id="tok_1",
        account_id="acct_1",
        created_at=TS,
        expires_at=TS2,
        max_uses=3,
        uses=1,
        revoked=True,
        state="revoked",
        repair_machine_id="mc_1",
    )


def _machine() -> pb.Machine:
    return pb.Machine(
        machine_id="mc_1",
        account_id="acct_1",
        name="box",
        hostname="box.local",
        version="1.2.3",
        joined_at=TS,
        last_seen_at=TS2,
        online=True,
        agent_count=4,
        revoked=False,
        certificate_serial="ab12",
        certificate_not_after=TS2,
        provider="local",
        starting=True,
        next_fire_at=TS,
        next_wake_at=TS2,
        has_provider=True,
    )


def _prompt() -> pb.PromptInfo:
    return pb.PromptInfo(
        prompt_id="pr_1",
        agent_id="ag_1",
        created_at=TS,
        size=2**33,
        state="refused",
        age_seconds=12,
        run_id="run_1",
        reason="agent archived",
    )


# (type, a message with every field set): each also checked with every field unset.
CASES: list[tuple[Any, Message]] = [
    (Account, _account()),
    (NewAccount, pb.CreateAccountResponse(account=_account(), recovery_private_key=b"k" * 32)),
    (
        Deletion,
        pb.Deletion(
            account_id="acct_1",
            state="deleted",
            started_at=TS,
            finished_at=TS2,
            deleted_objects=2**35,
            deleted_by="adm_1",
        ),
    ),
    (JoinToken, _token()),
    (
        NewJoinToken,
        pb.CreateJoinTokenResponse(
            token=_token(), token_value="tok_1.s3cret", ca_hash="sha256:ab", join_address="h:1"
        ),
    ),
    (Machine, _machine()),
    (SentPrompt, pb.SendPromptResponse(prompt_id="pr_1", state="acknowledged", run_id="run_1")),
    (QueuedPrompt, _prompt()),
    (PromptQueue, pb.ListPromptsResponse(prompts=[_prompt(), _prompt()], provider_error="no")),
    (
        NewCredential,
        pb.CreateCredentialResponse(credential_id="adm_1", credential="adm_1.s3", account_id="a"),
    ),
]


@pytest.mark.parametrize(("kind", "msg"), CASES, ids=[c[0].__name__ for c in CASES])
def test_to_json_is_what_the_cli_printed_for_the_message(kind: Any, msg: Message) -> None:
    # --json used to print message_dict(reply): scripts parse that shape.
    full = kind.from_pb(msg)
    assert full.to_json() == message_dict(msg)
    empty = _empty(msg)
    assert kind.from_pb(empty).to_json() == message_dict(empty)


def _empty(msg: Message) -> Message:
    """``msg``'s type with no field set but the nested replies the server always sends."""
    out = type(msg)()
    for f in msg.DESCRIPTOR.fields:
        nested = f.message_type is not None and not f.message_type.full_name.startswith("google.")
        if nested and not f.is_repeated:
            getattr(out, f.name).SetInParent()
    return out


@pytest.mark.parametrize(("kind", "msg"), CASES, ids=[c[0].__name__ for c in CASES])
def test_every_field_of_the_message_is_read(kind: Any, msg: Message) -> None:
    # A field added to admin.proto but not to the type would vanish from --json.
    names = {f.name for f in msg.DESCRIPTOR.fields}
    assert set(kind.from_pb(msg).to_json()) == names


def test_times_are_aware_utc_and_unset_ones_none() -> None:
    m = Machine.from_pb(_machine())
    assert m.joined_at == WHEN and m.joined_at is not None and m.joined_at.tzinfo == dt.UTC
    assert m.next_wake_at == LATER
    # To the second (docs/cli-json.md): the microseconds are cut, not rounded.
    assert rfc3339(m.joined_at) == "2026-03-04T03:06:07Z"
    never = Machine.from_pb(pb.Machine(machine_id="mc_1"))
    # An unset Timestamp reads as 1970 in protobuf; here it is "never".
    assert never.last_seen_at is None and never.next_fire_at is None
    assert rfc3339(None) is None


def test_nested_and_repeated_replies_are_typed() -> None:
    made = NewJoinToken.from_pb(pb.CreateJoinTokenResponse(token=_token(), token_value="t.s"))
    assert isinstance(made.token, JoinToken) and made.token.expires_at == LATER
    queue = PromptQueue.from_pb(pb.ListPromptsResponse(prompts=[_prompt()]))
    assert [(p.prompt_id, p.size, p.reason) for p in queue.prompts] == [
        ("pr_1", 2**33, "agent archived")
    ]


@pytest.mark.parametrize(
    ("revoked", "online", "starting", "want"),
    [
        (True, True, True, "revoked"),
        (False, True, True, "online"),
        (False, False, True, "starting"),
        (False, False, False, "offline"),
    ],
)
def test_machine_presence(revoked: bool, online: bool, starting: bool, want: str) -> None:
    msg = pb.Machine(revoked=revoked, online=online, starting=starting)
    assert Machine.from_pb(msg).presence == want


def test_one_time_secrets_stay_out_of_repr() -> None:
    # A reply that reaches a log line or a test failure must not carry the secret.
    token = NewJoinToken.from_pb(pb.CreateJoinTokenResponse(token_value="tok_1.SECRET-T"))
    cred = NewCredential.from_pb(pb.CreateCredentialResponse(credential="adm_1.SECRET-C"))
    acct = NewAccount.from_pb(pb.CreateAccountResponse(recovery_private_key=b"SECRET-K" * 4))
    for reply, secret in ((token, "SECRET-T"), (cred, "SECRET-C"), (acct, "SECRET-K")):
        assert secret not in repr(reply)
    assert token.token_value == "tok_1.SECRET-T" and cred.credential == "adm_1.SECRET-C"


def test_replies_are_frozen() -> None:
    a = Account.from_pb(_account())
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.state = "deleting"  # type: ignore[misc]
