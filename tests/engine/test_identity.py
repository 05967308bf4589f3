"""The identifiers of engine.identity at their edges: what each validator admits and refuses, with
which error, and the stream names every other module reads."""

from __future__ import annotations

import pytest

from engine.errors import InvalidIdentifier, RolloutIdRequired
from engine.identity import (
    ATTEMPT_MAX,
    MAX_ID_LENGTH,
    agent_stream,
    call_stream,
    capture_stream,
    checkpoint_stream,
    episode_stream,
    is_session_stream,
    parse_attempt,
    participant_stream,
    policy_stream,
    restore_stream,
    rollout_stream,
    session_stream,
    validate_attempt,
    validate_id,
    validate_tool_call_key,
)


@pytest.mark.parametrize("key", ["a0.t0.0", "a12.t3.7", "a999999999.t0.999999999"])
def test_a_tool_call_key_of_activation_turn_and_index_is_admitted(key: str) -> None:
    assert validate_tool_call_key(key) == key


@pytest.mark.parametrize("key", ["a0.t0", "a01.t0.0", "x0.t0.0", "a0.t0.0 ", "a1000000000.t0.0", ""])
def test_any_other_tool_call_key_is_refused(key: str) -> None:
    with pytest.raises(InvalidIdentifier, match="must be a<activation>.t<turn>.<index>"):
        validate_tool_call_key(key)


def test_an_id_of_the_alphabet_up_to_the_length_limit_is_admitted() -> None:
    assert MAX_ID_LENGTH == 128
    longest = "a" * MAX_ID_LENGTH
    assert validate_id(longest, "call id") == longest
    assert validate_id("r-1.x_2", "call id") == "r-1.x_2"


@pytest.mark.parametrize("value", ["a" * (MAX_ID_LENGTH + 1), "-r", "r/1", "r 1", "é"])
def test_an_id_too_long_or_outside_the_alphabet_is_refused(value: str) -> None:
    with pytest.raises(InvalidIdentifier, match="must match"):
        validate_id(value, "call id")


@pytest.mark.parametrize("value", [None, "", 7])
def test_a_missing_rollout_id_has_its_own_code_and_other_ids_say_they_are_required(value: object) -> None:
    with pytest.raises(RolloutIdRequired, match="a rollout id is required"):
        validate_id(value, "rollout id")
    with pytest.raises(InvalidIdentifier, match="checkpoint id is required") as refused:
        validate_id(value, "checkpoint id")
    assert not isinstance(refused.value, RolloutIdRequired)


@pytest.mark.parametrize("value", [0, 1, ATTEMPT_MAX])
def test_an_attempt_from_zero_to_the_maximum_is_admitted(value: int) -> None:
    assert ATTEMPT_MAX == 2**31 - 1
    assert validate_attempt(value) == value


@pytest.mark.parametrize("value", [-1, ATTEMPT_MAX + 1, True, "1", 1.0, None])
def test_any_other_attempt_is_refused(value: object) -> None:
    with pytest.raises(InvalidIdentifier, match=f"attempt must be an integer from 0 to {ATTEMPT_MAX}"):
        validate_attempt(value)


@pytest.mark.parametrize("raw, value", [("0", 0), ("7", 7), (str(ATTEMPT_MAX), ATTEMPT_MAX)])
def test_an_attempt_spelt_in_ascii_decimal_is_parsed(raw: str, value: int) -> None:
    assert parse_attempt(raw) == value


@pytest.mark.parametrize("raw", ["", "00", "+0", " 0", "0_0", "\u0660", str(ATTEMPT_MAX + 1), "99999999999", 0, None])
def test_every_other_spelling_of_an_attempt_is_refused(raw: object) -> None:
    with pytest.raises(InvalidIdentifier, match="header must be ASCII decimal digits"):
        parse_attempt(raw, "header")


def test_the_stream_names() -> None:
    assert rollout_stream("r") == "rollout:r"
    assert episode_stream("r", 1) == "episode:r:1"
    assert agent_stream("r", 1) == "agent:r:1"
    assert session_stream("r", 1) == "session:r:1"
    assert call_stream("c") == "call:c"
    assert capture_stream("r", 1) == "capture:r:1"
    assert checkpoint_stream("k") == "checkpoint:k"
    assert participant_stream("agent", "i") == "participant:agent:i"
    assert restore_stream("k") == "restore:k"
    assert policy_stream() == "policy"


def test_a_session_stream_is_recognised_for_any_rollout_or_for_one() -> None:
    assert is_session_stream("session:r:0")
    assert is_session_stream("session:r:0", "r")
    assert not is_session_stream("session:r2:0", "r")
    assert not is_session_stream("episode:r:0")
    assert not is_session_stream("episode:r:0", "r")


def test_a_refusal_quotes_at_most_forty_characters_of_what_it_refused() -> None:
    long = "x" * 39 + "YZ" + "-" * 200
    for refuse in (validate_tool_call_key, lambda v: validate_id(v, "call id"), parse_attempt):
        with pytest.raises(InvalidIdentifier) as refused:
            refuse(long)
        assert repr(long[:40]) in str(refused.value)


def test_an_attempt_refusal_is_at_most_160_characters() -> None:
    with pytest.raises(InvalidIdentifier) as refused:
        validate_attempt("9" * 500)
    message = str(refused.value)
    assert len(message) == 160
    assert message.startswith(f"attempt must be an integer from 0 to {ATTEMPT_MAX}, got '999")
