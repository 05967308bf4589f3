"""engine.lineage: an attempt's effective history, whole or of the kinds a reader needs."""

from __future__ import annotations

from adapters.memory_store import MemoryEventStore
from engine import catalog as ev
from engine.events import NewEvent
from engine.identity import agent_stream, episode_stream, rollout_stream
from engine.lineage import effective_history
from engine.log import append_one


async def test_an_effective_history_of_some_kinds_keeps_the_lineage_and_only_those_kinds() -> None:
    """Input: attempt 1 continues attempt 0 from its second boundary; each has steps, agent
    boundaries and a model call's record. Asked for steps alone, the history still goes back through
    the origin (every attempt's start is read with them) and holds nothing else."""
    store = MemoryEventStore(writer="test")

    async def add(stream: str, kind: str, attempt: int, **data: object) -> int:
        return (await append_one(store, NewEvent(stream, kind, dict(data), "r", attempt))).position

    await add(rollout_stream("r"), ev.ATTEMPT_STARTED, 0, parent_attempt=None)
    seed = await add(episode_stream("r", 0), ev.EPISODE_STEP, 0, step="seed")
    boundary = await add(agent_stream("r", 0), ev.AGENT_BOUNDARY, 0, turn=0)
    await add(episode_stream("r", 0), ev.EPISODE_STEP, 0, step="agent")  # after the boundary: not inherited
    await add(rollout_stream("r"), ev.ATTEMPT_FENCED, 0, reason="restore")
    await add(rollout_stream("r"), ev.ATTEMPT_STARTED, 1, parent_attempt=0, origin_attempt=0, origin_position=boundary)
    own_step = await add(episode_stream("r", 1), ev.EPISODE_STEP, 1, step="agent")
    await add(agent_stream("r", 1), ev.AGENT_BOUNDARY, 1, turn=1)

    whole = await effective_history(store, "r", 1)
    steps = await effective_history(store, "r", 1, kinds=[ev.EPISODE_STEP])
    assert [e.position for e in steps] == [e.position for e in whole if e.kind in (ev.EPISODE_STEP, ev.ATTEMPT_STARTED)]
    assert [(e.attempt, e.kind) for e in steps] == [(0, ev.ATTEMPT_STARTED), (0, ev.EPISODE_STEP), (1, ev.ATTEMPT_STARTED),
                                                    (1, ev.EPISODE_STEP)]
    assert [e.position for e in steps if e.kind == ev.EPISODE_STEP] == [seed, own_step]
