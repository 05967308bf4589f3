"""The rules of admission every server shares (engine.admission): the drain budget, the drain, the
wait for events, the refusal while closed and the keys a retire mark ends."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.admission import ANSWER_MARGIN_S, JOINING, Admission, drain, drain_until, retired, wait_for_all
from engine.errors import AdmissionClosed


@given(now=st.floats(0, 1e6), left=st.floats(-10, 1e4))
def test_a_drain_ends_before_the_deadline_and_never_before_now_unless_the_deadline_passed(now: float, left: float) -> None:
    deadline = now + left
    stop = drain_until(deadline, now)
    assert stop <= deadline
    if left > 0:
        assert stop >= now - 1e-6  # it never stops before it started
        assert deadline - stop <= ANSWER_MARGIN_S + 1e-6
        # (floats near 1e6 carry about 1e-10 of error: the comparison allows for it)
        assert deadline - stop == pytest.approx(min(ANSWER_MARGIN_S, left * 0.1), abs=1e-6)
    else:
        assert stop == deadline  # past the deadline: stop at once


async def test_a_drain_returns_as_soon_as_nothing_blocks() -> None:
    left = [1, 2, 3]
    async def unblock() -> None:
        while left:
            await asyncio.sleep(0.01)
            left.pop()
    task = asyncio.ensure_future(unblock())
    started = time.time()
    assert await drain(lambda: list(left), time.time() + 10) == []
    assert time.time() - started < 5  # did not wait for the deadline
    await task


async def test_a_drain_gives_up_before_the_deadline_and_names_what_still_blocks() -> None:
    # Its budget stops it 200 ms before the deadline: room for a machine under load to wake it late.
    deadline = time.time() + 2.0
    assert await drain(lambda: ["stuck"], deadline) == ["stuck"]
    assert time.time() <= deadline


async def test_waiting_for_events_ends_when_they_are_set_or_before_the_deadline() -> None:
    ready, stuck = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, ready.set)
    started = time.time()
    await wait_for_all([ready], time.time() + 10)
    assert ready.is_set() and time.time() - started < 5
    deadline = time.time() + 2.0
    await wait_for_all([stuck], deadline)
    assert not stuck.is_set() and time.time() <= deadline


async def test_closed_admission_refuses_new_work_and_parked_work_goes_on_when_it_opens() -> None:
    admission = Admission()
    admission.require_open("a new episode")  # open: nothing raised
    admission.close()
    with pytest.raises(AdmissionClosed, match="a new episode refused") as refused:
        admission.require_open("a new episode")
    assert refused.value.code == "admission_closed"
    parked = asyncio.ensure_future(admission.wait_open())
    await asyncio.sleep(0.01)
    assert not parked.done()
    admission.open()
    await asyncio.wait_for(parked, 1)


@given(keys=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5)), unique=True),
       through=st.integers(-1, 5))
def test_a_retire_mark_ends_that_rollouts_attempts_at_or_below_it_and_nothing_else(
        keys: list[tuple[str, int]], through: int) -> None:
    ended = retired(keys, "a", through)
    assert set(ended) == {k for k in keys if k[0] == "a" and k[1] <= through}


async def test_admission_opens_only_when_every_hold_is_released() -> None:
    a = Admission()
    a.close(JOINING)  # not yet recorded in the log
    a.close()  # a checkpoint prepares it meanwhile
    a.open(JOINING)  # recorded: the checkpoint's hold still stands
    assert not a.is_open
    with pytest.raises(AdmissionClosed):
        a.require_open("a model call")
    a.open()  # resume
    assert a.is_open
    a.close(JOINING)
    a.open()  # a resume does not open an instance that is still joining
    assert not a.is_open
    a.open(JOINING)
    await asyncio.wait_for(a.wait_open(), 1)


_STEPS = st.lists(st.tuples(st.sampled_from(["close", "open", "close_joining", "open_joining"]),
                            st.sampled_from(["c1", "c2", "c3"])), max_size=12)


@given(steps=_STEPS, named=st.one_of(st.none(), st.sampled_from(["c1", "c2", "c3"])))
def test_a_refusal_is_about_to_end_only_when_it_names_the_checkpoint_this_server_last_resumed_from(
        steps: list[tuple[str, str]], named: str | None) -> None:
    """Whatever the order of checkpoints and joining holds: open here, and the peer refused for the
    very checkpoint this server reopened from last (so the peer's resume was sent with this one's)."""
    a, resumed, closed_for, holds = Admission(), None, None, set()
    for op, ck in steps:
        if op == "close":
            a.close(checkpoint_id=ck)
            holds.add("checkpoint")
            closed_for = ck
        elif op == "open":
            a.open(checkpoint_id=ck)
            holds.discard("checkpoint")
            resumed, closed_for = ck, None
        elif op == "close_joining":
            a.close(JOINING)
            holds.add(JOINING)
        else:
            a.open(JOINING)
            holds.discard(JOINING)
    refusal = AdmissionClosed("closed", **({} if named is None else {"checkpoint_id": named}))
    assert a.is_open == (not holds)
    assert a.callee_resuming(refusal) == (not holds and named is not None and named == resumed)
    assert a.closed_for == closed_for  # what its refusals name
