"""An agent session's opening, from its task, and where it goes on from (participants/agent/session.py)."""

from __future__ import annotations

from typing import Any

import pytest

from adapters.memory_store import MemoryEventStore
from engine import catalog as ev
from engine.boundaries import full_boundary
from engine.errors import InvalidRequest
from engine.events import NewEvent, RecordedEvent
from engine.forks import inherited_boundary
from engine.identity import agent_stream, rollout_stream
from engine.lineage import effective_history
from engine.log import append_one
from participants.agent.session import RunRequest, fresh_session, session_for
from participants.environments import ENVIRONMENTS, Task
from participants.environments.nemo_gym_relay import GymServer, register
from participants.environments.tasks import make_task


def test_a_row_the_chat_form_cannot_hold_is_the_callers_bad_input_with_its_code_not_an_internal_error() -> None:
    """Input: a NeMo Gym row whose user message holds a file part (a chat message holds no file)."""
    register([GymServer("gym_pictures", "resources_servers.image_tools.app", "replay")])
    try:
        _refused_as_bad_input()
    finally:
        ENVIRONMENTS.pop("gym_pictures")  # the registry is the process's: other tests read every environment in it


def _refused_as_bad_input() -> None:
    row = {"responses_create_params": {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in it?"},
                                     {"type": "input_file", "file_id": "file-1"}]}]}}
    req = RunRequest(task=Task("gym_pictures", "0", "What is in it?", {"row": row}).to_json(), seed=1)
    with pytest.raises(InvalidRequest) as refused:
        fresh_session(("pictures", 0), 0, req)
    assert refused.value.status == 400 and refused.value.context["task_error"] == "bad_row"
    assert "input_file" in refused.value.detail and "task 0 of gym_pictures" in refused.value.detail


async def test_an_activation_goes_on_from_its_own_attempts_boundary_before_the_one_a_restore_staged() -> None:
    """Input: attempt 1 continues attempt 0 from its turn-1 boundary (a restore staged that boundary on
    every agent instance); one instance went on from it and recorded turn 1's end and turn 2's start,
    then died. The instance asked next, holding the same staged boundary, goes on at turn 2 from the
    attempt's own boundary (not recorded again), not at turn 1 from the staged one, which would record
    turn 1's boundaries a second time in the attempt."""
    store = MemoryEventStore(writer="test")
    req = RunRequest(task=make_task("workplace", 3).to_json(), seed=1)

    async def add(attempt: int, stream: str, kind: str, data: dict[str, Any]) -> RecordedEvent:
        return await append_one(store, NewEvent(stream, kind, data, "r", attempt))

    await add(0, rollout_stream("r"), ev.ATTEMPT_STARTED, {"parent_attempt": None})
    first = fresh_session(("r", 0), 0, req)
    await add(0, agent_stream("r", 0), ev.AGENT_BOUNDARY, first.boundary_data("before_model", 0, "r.0.t0"))
    first.messages.append({"role": "assistant", "content": "thinking"})
    first.turn = 1
    cut = await add(0, agent_stream("r", 0), ev.AGENT_BOUNDARY, first.boundary_data("before_model", 1, "r.0.t1"))
    await add(0, rollout_stream("r"), ev.ATTEMPT_FENCED, {"reason": "restore"})
    await add(1, rollout_stream("r"), ev.ATTEMPT_STARTED,
              {"parent_attempt": 0, "origin_attempt": 0, "origin_position": cut.position})
    staged = inherited_boundary(full_boundary(await effective_history(store, "r", 1), cut), "r")

    went_on = session_for(("r", 1), 0, req, await effective_history(store, "r", 1), dict(staged), True)
    assert (went_on.turn, went_on.resumed) == (1, False)  # nothing of its own yet: from the staged boundary
    await add(1, agent_stream("r", 1), ev.AGENT_BOUNDARY, went_on.boundary_data("before_model", 1, "r.1.t1"))
    went_on.messages.append({"role": "assistant", "content": "done thinking"})
    went_on.turn = 2
    await add(1, agent_stream("r", 1), ev.AGENT_BOUNDARY, went_on.boundary_data("after_turn", 1, None))
    await add(1, agent_stream("r", 1), ev.AGENT_BOUNDARY, went_on.boundary_data("before_model", 2, "r.1.t2"))

    taken_over = session_for(("r", 1), 0, req, await effective_history(store, "r", 1), dict(staged), True)
    assert (taken_over.turn, taken_over.resumed) == (2, True)
    assert taken_over.messages == went_on.messages
    # A restart-only agent starts the activation afresh, whatever the log or the restore holds.
    assert fresh_session(("r", 1), 0, req).messages == session_for(
        ("r", 1), 0, req, await effective_history(store, "r", 1), dict(staged), False).messages
