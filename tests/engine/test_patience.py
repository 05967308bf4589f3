"""engine.patience: a wait on another party backs off, is heard in the log, and ends where it has a limit."""

from __future__ import annotations

import logging

import pytest

from engine.errors import AdmissionClosed, DatabaseUnavailable
from engine.patience import RETRY_FIRST_S, RETRY_MAX_S, SOON_S, SOON_TRIES, Patience


def test_it_backs_off_to_its_ceiling() -> None:
    wait = Patience("w", since=0.0)
    delays = [wait.next_delay(AdmissionClosed("closed"), now=1.0) for _ in range(8)]
    assert delays[0] == RETRY_FIRST_S and delays == sorted(delays) and delays[-1] == RETRY_MAX_S
    fixed = Patience("w", since=0.0, max_delay_s=RETRY_FIRST_S)
    assert {fixed.next_delay(AdmissionClosed("closed"), now=1.0) for _ in range(8)} == {RETRY_FIRST_S}


def test_a_limited_wait_raises_the_last_refusal_past_its_limit_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    wait = Patience("model call r.0.t3", limit_s=120.0, since=0.0)
    refusal = DatabaseUnavailable("the database does not answer")
    wait.next_delay(refusal, now=119.0)
    with caplog.at_level(logging.ERROR, "rollbook.wait"), pytest.raises(DatabaseUnavailable) as raised:
        wait.next_delay(refusal, now=120.5)
    assert raised.value is refusal
    assert "model call r.0.t3: gave up after 120 s of database_unavailable" in caplog.text


def test_an_unlimited_wait_never_raises_but_speaks_once_past_its_threshold_then_every_reminder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wait = Patience("dispatch of r-0001", limit_s=None, speak_after_s=15.0, remind_s=60.0, since=0.0)
    with caplog.at_level(logging.WARNING, "rollbook.wait"):
        for now in (1.0, 14.0, 16.0, 30.0, 75.0, 77.0, 140.0, 10_000.0):
            wait.next_delay(AdmissionClosed("a checkpoint is in progress"), now=now)
    spoken = [r.getMessage() for r in caplog.records]
    assert len(spoken) == 4, spoken  # at 16 s, 77 s (60 s later), 140 s and 10,000 s
    assert spoken[0].startswith("dispatch of r-0001: still waiting after 16 s (admission_closed:")
    assert spoken[0].endswith("asking again without a limit")


def test_the_limit_is_reached_only_past_it() -> None:
    wait = Patience("w", limit_s=10.0, since=0.0)
    wait.next_delay(AdmissionClosed("closed"), now=10.0)
    with pytest.raises(AdmissionClosed):
        wait.next_delay(AdmissionClosed("closed"), now=10.001)


def test_it_speaks_only_past_its_threshold_and_again_once_a_whole_reminder_has_passed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wait = Patience("w", limit_s=None, speak_after_s=15.0, remind_s=60.0, since=0.0)
    with caplog.at_level(logging.WARNING, "rollbook.wait"):
        spoke = []
        for now in (15.0, 15.5, 75.4, 75.5, 135.4):
            before = len(caplog.records)
            wait.next_delay(AdmissionClosed("closed"), now=now)
            spoke += [now] * (len(caplog.records) - before)
    assert spoke == [15.5, 75.5]


def test_each_refusal_doubles_the_delay_up_to_thirty_two_times_the_first() -> None:
    wait = Patience("w", since=0.0, max_delay_s=100.0)
    delays = [wait.next_delay(AdmissionClosed("closed"), now=1.0) for _ in range(8)]
    assert delays == [RETRY_FIRST_S * 2**n for n in (0, 1, 2, 3, 4, 5, 5, 5)]
    assert wait.tries == 8


def test_a_refusal_about_to_end_is_asked_again_soon_a_bounded_number_of_times_then_backs_off_as_before() -> None:
    wait = Patience("w", since=0.0)
    soon = [wait.next_delay(AdmissionClosed("closed"), now=1.0, soon=True) for _ in range(SOON_TRIES + 3)]
    assert soon == [SOON_S] * SOON_TRIES + [RETRY_FIRST_S, 2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S]
    assert SOON_S < RETRY_FIRST_S
