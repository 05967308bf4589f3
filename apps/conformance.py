"""The environment conformance suite: every environment, checkpointed at every boundary, must end as
an uninterrupted run. rollbook runs it over its own environments (tests/participants/environments/test_conformance.py), and a
package that brings an environment runs it over its own (docs/testing.md, "Testing your environment"):

    from apps.conformance import check_environment

    async def test_my_environment_conforms() -> None:
        await check_environment("my_env")  # every agent kind, on a log in memory: no PostgreSQL needed

For each (environment, agent) the same fixed task runs once uninterrupted through the four real
servers, then once per agent boundary of that run: a checkpoint lands exactly at that boundary,
every server is closed without a handover (the crash), four fresh servers on the same database
restore and resume, and the episode is driven to its end. A continued episode must end exactly as
the uninterrupted one (trajectory, tool outputs, final environment state, reward) without any model
turn generated twice or any mutation revision applied twice; a restart-only one must be classified
fresh_dispatch and finish from its input.

Pinning a checkpoint to a boundary: at a before_model boundary the backend holds the model call it
just accepted after its first token until the model server closes admission (so the call is in
flight at prepare with tokens of its own, and prepare cuts it there: the restore continues it from
that prefix); at an after_turn boundary the agent under test,
subclassed only for this, waits right after recording that boundary until prepare has closed it.
Neither changes what the servers do: each only removes the race of who gets there first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from apps.demo import REPEATED_CALLS, REPEATED_MUTATIONS
from apps.stack import Backing, MemoryBacking, Stack, backing_of, of, start_stack, turn_of
from engine import catalog as ev
from engine.boundaries import completed_activations
from engine.checkpoint import Cut, CutStore
from engine.coordinator import CheckpointStore
from engine.events import NewEvent, RecordedEvent
from engine.lineage import effective_history
from participants.agent import server as agent_server
from participants.agent.server import AgentParticipant
from participants.environments import ENVIRONMENTS, Environment, Task
from participants.environments.tasks import make_task
from participants.model import server as model_server
from participants.model.backends import Event, Prefix, Step
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from participants.model.backends.scripted import ScriptedBackend

LATENCY = 0.005  # per model call, so calls are genuinely in flight
# Each environment's fixed task is `make_task(env, cls.conformance_seed)`, one with few turns under the scripted
# policy (apps.stack.SEED): workplace 3 turns, blackjack 4 (look, hit, stand, answer: two mutations, the second
# drawn from the RNG the first left), math and string_match 1, sandbox 5 (four commands, then the answer). Every registered environment runs.
GENUINE: dict[str, type[Environment]] = dict(ENVIRONMENTS)  # the reducers the final state is computed with


class RestartOnlyAgent(AgentParticipant):
    supports_continuation = False


AGENTS: dict[str, type[AgentParticipant]] = {"simple": AgentParticipant, "restart_only": RestartOnlyAgent}


# ---- pinning the checkpoint to a boundary ---------------------------------------------------------


@dataclass
class Pin:
    """Where the checkpoint of one boundary run must land: the k-th agent boundary of attempt 0."""

    rollout_id: str
    index: int  # k: the boundary's index among attempt 0's agent boundaries
    state: str  # before_model | after_turn
    turn: int
    reached: asyncio.Event = field(default_factory=asyncio.Event)


async def held_after_first_step(events: AsyncIterator[Event], pin: Pin | None, generation: int,
                                participant: model_server.ModelParticipant | None) -> AsyncIterator[Event]:
    """The generation, and if it is the pinned turn's, held after its first token (saved, so that
    prepare cuts the call there) until the model server has closed admission for prepare."""
    held = pin is None or pin.state != "before_model" or generation != pin.turn or participant is None
    async for event in events:
        yield event
        if not held and isinstance(event, Step):
            held = True
            await participant.progress.save()  # type: ignore[union-attr]  # the step is the call's by now
            pin.reached.set()  # type: ignore[union-attr]
            while participant.admission_open:  # type: ignore[union-attr]
                await asyncio.sleep(0.002)


class HoldingBackend(ScriptedBackend):
    """Holds the generation of one turn after its first token until the model server has closed admission."""

    def __init__(self, pin: Pin | None) -> None:
        super().__init__(latency_s=LATENCY)
        self.pin = pin
        self.participant: model_server.ModelParticipant | None = None

    async def generate(self, request: dict[str, Any], prefix: Prefix | None) -> AsyncIterator[Event]:
        # Attempt 0 makes exactly one call per turn, in order, so generation n is turn n's call.
        n = self.generations
        async for event in held_after_first_step(super().generate(request, prefix), self.pin, n, self.participant):
            yield event


def pinned(agent_cls: type[AgentParticipant]) -> type[AgentParticipant]:
    class Pinned(agent_cls):  # type: ignore[valid-type, misc]
        pin: ClassVar[Pin | None] = None

        async def _record(self, s: agent_server.Session, *events: NewEvent, seen: int | None = None) -> None:
            await super()._record(s, *events, seen=seen)
            pin = self.pin
            if (pin is not None and s.key == (pin.rollout_id, 0) and pin.state == "after_turn"
                    and any(e.kind == agent_server.BOUNDARY and (e.data["state"], e.data["turn"]) == (pin.state, pin.turn)
                            for e in events)):
                pin.reached.set()
                while self.admission.is_open:  # until prepare closes this agent; then it parks right here
                    await asyncio.sleep(0.002)

    Pinned.__name__ = f"Pinned{agent_cls.__name__}"
    return Pinned


# ---- the four servers -------------------------------------------------------------------------


class HoldingUpstream(OpenAICompatibleBackend):
    """The same hold, in front of the fake vLLM server (testkit/fake_vllm.py) instead of the scripted policy."""

    def __init__(self, url: str, pin: Pin | None) -> None:
        super().__init__(url, model="fake-policy", policy_version="scripted-v1")
        self.pin = pin
        self.participant: model_server.ModelParticipant | None = None
        self.generations = 0

    async def generate(self, request: dict[str, Any], prefix: Prefix | None) -> AsyncIterator[Event]:
        n = self.generations
        self.generations += 1
        async for event in held_after_first_step(super().generate(request, prefix), self.pin, n, self.participant):
            yield event


async def start_conformance_stack(database: Backing, tag: str, agent_cls: type[AgentParticipant], pin: Pin | None = None,
                                  upstream: str | None = None) -> Stack:
    backend: Any = HoldingUpstream(upstream, pin) if upstream else HoldingBackend(pin)
    s = await start_stack(database, tag, backend, pinned(agent_cls) if pin else agent_cls)
    backend.participant = s.participant("model")  # type: ignore[assignment]
    if pin is not None:
        s.participant("agent").pin = pin  # type: ignore[attr-defined]
    return s


# ---- reading the log --------------------------------------------------------------------------


def mutations(events: list[RecordedEvent]) -> list[tuple[int, str, Any, Any]]:
    return [(e.data["revision"], e.data["tool"], e.data["arguments"], e.data["effect"]) for e in of(events, ev.MUTATION_APPLIED)]


def final_state(history: list[RecordedEvent]) -> Any:
    """The session's state at the end, from its events alone, with the genuine reducers."""
    env: Environment | None = None
    state: Any = None
    records: list[Any] = []
    for e in history:
        if e.kind == ev.SESSION_OPENED and e.data.get("restored_from") is None:
            env = GENUINE[e.data["env"]]()
            state, records = env.initial_state(Task.from_json(e.data["task"])), []
        elif e.kind == ev.MUTATION_APPLIED:
            assert env is not None, "a mutation before any session"
            if env.state_mode == "restart_only":
                records.append(e.data["effect"])  # a live shell: the effects are records, not state
            else:
                state = env.apply(state, e.data["effect"])
    return {"state": state, "records": records}


@dataclass(frozen=True)
class Outcome:
    """What an episode ended with, as the log says."""

    reward: float
    messages: list[dict[str, Any]]
    tool_outputs: list[Any]
    final_answer: str | None
    state: Any
    mutations: list[tuple[int, str, Any, Any]]  # the effective ones, in order


async def outcome(store: CutStore, rid: str, attempt: int) -> Outcome:
    history = await effective_history(store, rid, attempt)
    (finished,) = of(history, ev.ATTEMPT_FINISHED, attempt)
    (reply,) = completed_activations(history).values()  # exactly one activation completed in the episode
    return Outcome(float(finished.data["reward"]), reply["messages"],
                   [m["content"] for m in reply["messages"] if m.get("role") == "tool"], reply["final_answer"],
                   final_state(history), mutations(history))


async def repeated(store: CutStore, rid: str) -> tuple[int, int]:
    """Model calls generated again and mutations applied again by a continued attempt, through the public
    SQL views (on PostgreSQL; a memory store has no views, and the checks of the log's events stand alone)."""
    if not isinstance(store, PostgresEventStore):
        return 0, 0
    async with store.engine.connect() as conn:
        calls = (await conn.execute(text(REPEATED_CALLS), {"p": rid})).scalar()
        muts = (await conn.execute(text(REPEATED_MUTATIONS), {"p": rid})).scalar()
    return int(calls), int(muts)


# ---- the conformance check --------------------------------------------------------------------


async def checkpoint_at(database: Backing, store: CheckpointStore, task: Task, rid: str, pin: Pin,
                        agent_cls: type[AgentParticipant], upstream: str | None = None) -> tuple[Cut, dict[str, Any]]:
    """Run to the pinned boundary, checkpoint there, crash, restore into fresh servers, finish."""
    old = await start_conformance_stack(database, f"{rid}-old", agent_cls, pin, upstream)
    running = asyncio.create_task(old.episode(task, rid))
    try:
        await asyncio.wait_for(pin.reached.wait(), 20)
        coordinator = old.coordinator(store)
        prepared = await coordinator.prepare(f"ck-{rid}", time.time() + 10)
        assert prepared["ready"], prepared
        cut = await coordinator.commit(f"ck-{rid}", time.time() + 10)  # scope: live attempts less prepare's restarts
    finally:
        await old.close()  # the crash: every server of this generation is gone, nothing handed over
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    new = await start_conformance_stack(database, f"{rid}-new", agent_cls, upstream=upstream)
    try:
        coordinator = new.coordinator(store)
        await coordinator.restore(f"ck-{rid}", time.time() + 10)
        await coordinator.resume(f"ck-{rid}")
        # Joins the continued episode, or dispatches a restart-only one again from its input.
        result = await asyncio.wait_for(new.episode(task, rid), 30)
    finally:
        await new.close()
    return cut, result


@dataclass(frozen=True)
class Boundary:
    """One checkpoint run of the suite: the k-th agent boundary of the reference run, and where it is told."""

    rid: str
    k: int
    state: str
    turn: int
    turns: int  # of the whole episode
    where: str

    @property
    def last_turn(self) -> bool:
        return self.state == "after_turn" and self.turn == self.turns - 1


async def reference_run(database: Backing, store: CheckpointStore, task: Task, agent_cls: type[AgentParticipant],
                        ref_id: str, upstream: str | None) -> tuple[Outcome, list[tuple[str, int]], int]:
    """The uninterrupted run: its outcome, its agent boundaries (state, turn) and its number of turns."""
    ref_stack = await start_conformance_stack(database, ref_id, agent_cls, upstream=upstream)
    try:
        ref_result = await asyncio.wait_for(ref_stack.episode(task, ref_id), 30)
    finally:
        await ref_stack.close()
    assert ref_result["attempt"] == 0
    ref = await outcome(store, ref_id, 0)
    assert ref.reward == ref_result["reward"]
    ref_events = await store.read_rollout(ref_id)
    boundaries = [(b.data["state"], b.data["turn"]) for b in of(ref_events, ev.AGENT_BOUNDARY)]
    turns = len(of(ref_events, ev.CALL_ACCEPTED))
    assert boundaries == [(s, t) for t in range(turns) for s in ("before_model", "after_turn")]
    return ref, boundaries, turns


def assert_landed_at(b: Boundary, events: list[RecordedEvent], cut: Cut) -> RecordedEvent:
    """The checkpoint landed exactly at the append holding boundary k of attempt 0: nothing of attempt 0
    went past it. A turn's end is appended with the next turn's start (the cut's boundary is then the
    latter), and the last turn's end with the activation's completion. Returns the boundary it landed on."""
    mine = of(events, ev.AGENT_BOUNDARY, 0)
    landed = b.k + 1 if b.state == "after_turn" and not b.last_turn else b.k
    assert len(mine) == landed + 1, f"{b.where}: attempt 0 recorded {len(mine)} boundaries"
    at = mine[landed]
    assert (mine[b.k].data["state"], mine[b.k].data["turn"]) == (b.state, b.turn), b.where
    assert at.position <= cut.position, b.where
    assert at.position - mine[b.k].position == landed - b.k, f"{b.where}: the two boundaries were not one append"

    def past(e: RecordedEvent) -> bool:
        completes_last_turn = b.last_turn and e.kind == ev.ACTIVATION_COMPLETED and e.position == at.position + 1
        return (e.attempt == 0 and e.position > at.position and not completes_last_turn
                and e.kind in (ev.AGENT_BOUNDARY, ev.MUTATION_APPLIED, ev.ACTIVATION_COMPLETED))

    assert not [e for e in events if past(e)], b.where
    return at


async def assert_continued(b: Boundary, events: list[RecordedEvent], cut: Cut, at: RecordedEvent, got: Outcome,
                           store: CheckpointStore) -> None:
    """A continued episode resumed from the cut's boundary and redid nothing done before it."""
    # The activation completed with the last turn's end, so the environment may have recorded its agent
    # step before the cut: the rollout then resumes from that step, past the agent's boundary.
    allowed = {at.position} | ({e.position for e in of(events, ev.EPISODE_STEP, 0) if e.data["step"] == "agent"}
                               if b.last_turn else set())
    (started,) = of(events, ev.ATTEMPT_STARTED, 1)
    assert [(s.rollout_id, s.attempt) for s in cut.scope] == [(b.rid, 0)], b.where
    assert cut.scope[0].boundary in allowed and cut.fresh == (), b.where
    assert started.data["disposition"] == "continue", b.where
    assert started.data["origin_position"] == cut.scope[0].boundary, b.where
    reopened = of(events, ev.SESSION_OPENED, 1)
    assert [e.data["restored_from"] for e in reopened] == [f"ck-{b.rid}"], f"{b.where}: {reopened}"
    # No turn generated twice: attempt 0's generations up to the cut and attempt 1's, one per turn.
    generated = [turn_of(e.data["call_id"]) for e in of(events, ev.CALL_COMPLETED)
                 if e.data["disposition"] == "generated" and (e.attempt == 1 or e.position <= cut.position)]
    assert sorted(generated) == list(range(b.turns)), f"{b.where}: generated turns {generated}"
    if b.state == "before_model":
        assert_call_continued(b, events)
    # No revision applied twice: attempt 0's up to its boundary, then attempt 1's, each once.
    revisions = [m[0] for m in got.mutations]
    assert revisions == list(range(1, len(revisions) + 1)), f"{b.where}: revisions {revisions}"
    assert await repeated(store, b.rid) == (0, 0), b.where


def assert_call_continued(b: Boundary, events: list[RecordedEvent]) -> None:
    """The model call in flight at the cut was cut at a token boundary and is continued from there."""
    first = of(events, ev.CALL_COMPLETED, 1)[0]
    cut_calls = of(events, ev.CALL_CUT, 0)
    assert [e.data["call_id"] for e in cut_calls] == [f"{b.rid}.0.t{b.turn}"], f"{b.where}: {cut_calls}"
    assert first.data["replaces"] == f"{b.rid}.0.t{b.turn}", b.where
    assert first.data["prefix_tokens"] == cut_calls[0].data["tokens"], b.where


def assert_restarted(b: Boundary, events: list[RecordedEvent], cut: Cut) -> None:
    """A restart-only episode was dispatched fresh and ran again from its input."""
    (started,) = of(events, ev.ATTEMPT_STARTED, 1)
    assert cut.scope == () and (b.rid, 0) in cut.fresh, f"{b.where}: {cut}"
    assert started.data["disposition"] == "fresh_dispatch", b.where
    assert started.data["origin_position"] is None, b.where
    opened = of(events, ev.SESSION_OPENED, 1)
    assert len(opened) == 1 and opened[0].data.get("restored_from") is None, f"{b.where}: {opened}"
    assert [e.data["step"] for e in of(events, ev.EPISODE_STEP, 1)] == ["seed", "agent", "verify", "close"], b.where
    first = of(events, ev.AGENT_BOUNDARY, 1)[0]
    assert first.data["turn"] == 0 and first.data["replaces_call_id"] is None, b.where
    assert sorted(turn_of(e.data["call_id"]) for e in of(events, ev.CALL_COMPLETED, 1)
                  if e.data["disposition"] == "generated") == list(range(b.turns)), b.where


def assert_same_end(b: Boundary, got: Outcome, ref: Outcome) -> None:
    assert got.messages == ref.messages, f"{b.where}: the trajectory differs"
    assert got.tool_outputs == ref.tool_outputs, f"{b.where}: the tool outputs differ"
    assert got.final_answer == ref.final_answer, b.where
    assert got.state == ref.state, f"{b.where}: the final environment state differs"
    assert [m[1:] for m in got.mutations] == [m[1:] for m in ref.mutations], f"{b.where}: the mutations differ"
    assert got.reward == ref.reward, f"{b.where}: reward {got.reward} != {ref.reward}"


async def assert_conformant(database: str | Backing, store: CheckpointStore, env_name: str,
                            agent_cls: type[AgentParticipant], tag: str, upstream: str | None = None) -> dict[str, Any]:
    """Raise AssertionError, naming the environment, the agent and the boundary, where `env_name` does
    not end as an uninterrupted run; else a summary. `store` reads the log `database` holds; `upstream`
    is the URL of a vLLM-style server to generate through instead of the scripted policy."""
    database = backing_of(database)
    task = make_task(env_name, ENVIRONMENTS[env_name].conformance_seed)
    continues = ENVIRONMENTS[env_name].state_mode != "restart_only" and agent_cls.supports_continuation
    ref, boundaries, turns = await reference_run(database, store, task, agent_cls, f"{tag}-ref", upstream)

    covered: list[tuple[str, int]] = []
    for k, (state, turn) in enumerate(boundaries):
        b = Boundary(f"{tag}-k{k}", k, state, turn, turns, f"{env_name}/{agent_cls.__name__} boundary {k} ({state} turn {turn})")
        cut, result = await checkpoint_at(database, store, task, b.rid, Pin(b.rid, k, state, turn), agent_cls, upstream)
        events = await store.read_rollout(b.rid)
        at = assert_landed_at(b, events, cut)
        covered.append((state, turn))
        assert result["attempt"] == 1, f"{b.where}: {result}"
        got = await outcome(store, b.rid, 1)
        assert got.reward == result["reward"], b.where
        if continues:
            await assert_continued(b, events, cut, at, got, store)
        else:
            assert_restarted(b, events, cut)
        assert_same_end(b, got, ref)  # either way the episode ends as if nothing had happened
    assert covered == boundaries  # every boundary was the cut's boundary once
    return {"boundaries": len(boundaries), "reward": ref.reward, "continues": continues}


async def check_environment(env_name: str, agent: str | None = None, database: str | Backing | None = None) -> list[dict[str, Any]]:
    """The conformance suite over one registered environment, with every agent kind (or the one named
    in AGENTS), on `database` (a PostgreSQL DSN, or by default a fresh log in memory). Raises
    AssertionError naming the boundary that did not end as the uninterrupted run; else one summary per
    agent kind, each with the number of boundaries checked."""
    backing = backing_of(database) if database is not None else MemoryBacking()
    reader = backing.store("conformance")
    try:
        return [await assert_conformant(backing, reader, env_name, AGENTS[name], f"{env_name}-{name}".replace("_", "-"))
                for name in ([agent] if agent else sorted(AGENTS))]
    finally:
        await reader.close()
