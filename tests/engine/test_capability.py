"""A capability (engine.capability) opens exactly one attempt of one rollout under one secret."""

from __future__ import annotations

import pytest

from engine.capability import PREFIX, capability, capability_opens


def test_a_capability_names_its_rollout_and_attempt_and_opens_them() -> None:
    token = capability("s3cret", "r-1", 2)
    assert token.startswith(f"{PREFIX}r-1.2.")
    assert len(token.rpartition(".")[2]) == 64  # HMAC-SHA256, hex
    assert capability_opens(token, "s3cret", "r-1", "2")


@pytest.mark.parametrize("secret, rollout, attempt", [
    ("other", "r-1", "2"), ("s3cret", "r-2", "2"), ("s3cret", "r-1", "3"), ("s3cret", "r-1", "02"),
    ("s3cret", None, "2"), ("s3cret", "r-1", None), ("s3cret", None, None),
])
def test_a_capability_opens_nothing_else(secret: str, rollout: str | None, attempt: str | None) -> None:
    assert not capability_opens(capability("s3cret", "r-1", 2), secret, rollout, attempt)


def test_a_token_without_the_prefix_or_with_an_edited_mac_opens_nothing() -> None:
    token = capability("s3cret", "r", 0)
    assert not capability_opens(token[len(PREFIX):], "s3cret", "r", "0")
    assert not capability_opens("x" + token, "s3cret", "r", "0")
    edited = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert not capability_opens(edited, "s3cret", "r", "0")


def test_a_rollout_id_with_dots_cannot_borrow_another_attempts_capability() -> None:
    # "a.1" attempt 2 and "a" attempt "1.2" spell the same text before the mac: the mac tells them apart.
    token = capability("s", "a.1", 2)
    assert capability_opens(token, "s", "a.1", "2")
    assert not capability_opens(token, "s", "a", "1.2")


def test_only_the_prefix_itself_marks_a_capability() -> None:
    token = capability("s", "r", 0)
    assert not capability_opens("RBCAP1." + token[len(PREFIX):], "s", "r", "0")


def test_a_route_outside_any_attempt_is_opened_by_no_capability_whatever_it_names() -> None:
    # What the path lacks is not spelt "None": a capability for a rollout named "None" opens only that one.
    assert not capability_opens(capability("s", "None", 0), "s", None, "0")
    assert not capability_opens(capability("s", "r", "None"), "s", "r", None)  # type: ignore[arg-type]
    assert capability_opens(capability("s", "None", 0), "s", "None", "0")
