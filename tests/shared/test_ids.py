"""Ids: fresh ones validate, anything else is refused with a clear error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import InvalidArgument, InvalidId
from shared.ids import KINDS, is_valid_id, new_id, validate_id, validate_sha256


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_new_ids_validate_for_their_kind_only(kind: str) -> None:
    ident = new_id(kind)
    assert validate_id(kind, ident) == ident
    others = [k for k in KINDS if k != kind]
    assert not any(is_valid_id(k, ident) for k in others)


def test_ids_sort_by_creation_time() -> None:
    early, late = new_id("agent", now_ms=1_000), new_id("agent", now_ms=2_000)
    assert early < late


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "ag_",
        "ag_../../etc/passwd",
        "AG_0123456789abcdefghjkmnpqrs",
        "ag_0123456789abcdefghjkmnpqr\n",
        "/ag_0123456789abcdefghjkmnpqrs",
        "ag_0123456789abcdefghjkmnpqrsu",
        "ag_0123456789abcdefghjkmnpqr",
    ],
)
def test_malformed_agent_ids_are_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(InvalidId) as info:
        validate_id("agent", bad, field="agent_id")
    assert isinstance(info.value, InvalidArgument)
    assert info.value.field == "agent_id"
    assert str(info.value).startswith("agent_id: invalid agent id")


@given(st.text(max_size=40))
def test_random_text_never_passes_unless_well_formed(text: str) -> None:
    if is_valid_id("machine", text):
        assert text.startswith("mc_") and len(text) == 29


def test_long_values_are_shortened_in_messages() -> None:
    with pytest.raises(InvalidId) as info:
        validate_id("agent", "x" * 10_000)
    assert len(str(info.value)) < 120


def test_sha256_validation() -> None:
    good = "a" * 64
    assert validate_sha256(good) == good
    for bad in ("A" * 64, "a" * 63, "../" + "a" * 61):
        with pytest.raises(InvalidId):
            validate_sha256(bad)


def test_id_time_ms_reads_back_the_time_an_id_was_made_at() -> None:
    from shared.ids import id_time_ms

    for ms in (0, 1, 1_800_000_000_123, 2**50 - 1):
        assert id_time_ms(new_id("backup", now_ms=ms)) == ms


def test_a_secret_pasted_as_an_id_is_not_echoed() -> None:
    from shared.errors import InvalidId
    from shared.ids import validate_id

    secret = "hyHIu4_uNgLf3up9vXWCCIOC7ZA_Bl0000000000000"
    with pytest.raises(InvalidId) as bad:
        validate_id("token", f"tok_{'0' * 26}.{secret}")
    assert secret[:6] not in str(bad.value)
    assert str(bad.value).endswith(f"invalid token id 'tok_{'0' * 26}.<hidden>'")
