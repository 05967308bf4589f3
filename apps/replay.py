"""History and replay of a rollout, from the log alone, with no server running.

`history` lists every attempt of a rollout and its timeline. `replay` rebuilds one attempt's
state step by step (its origin's events up to the boundary it was restored from, then its own),
prints each step's change of state, and checks the rebuilt state against what the servers
recorded: revisions, restored sessions, agent boundaries, rewards and the session projection. A
disagreement is a `replay_divergence`, reported as an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine import catalog as ev
from engine import snapshots
from engine.boundaries import with_messages
from engine.checkpoint import ParticipantStore
from engine.errors import ReplayDivergence, UnknownAttempt
from engine.events import RecordedEvent, canonical_json
from engine.identity import is_session_stream
from engine.lineage import effective_history
from engine.sessions import SessionReplay, boundary_disagreement
from participants.environments import get_environment, open_from_log
from participants.environments.base import Task, Trajectory


@dataclass
class ReplayState:
    session: SessionReplay = field(default_factory=lambda: SessionReplay(open_from_log))  # engine.sessions
    turn: int = 0
    messages: int = 0
    calls: list[str] = field(default_factory=list)
    step: str | None = None
    reward: float | None = None
    final_answer: str | None = None
    conversation: list[dict[str, Any]] = field(default_factory=list)  # the last completed activation's messages
    latest: list[dict[str, Any]] = field(default_factory=list)  # the latest boundary's conversation

    @property
    def task(self) -> Task | None:
        return self.session.task  # type: ignore[no-any-return]

    @property
    def env_state(self) -> Any:
        return self.session.state

    @property
    def revision(self) -> int:
        return self.session.revision


@dataclass(frozen=True)
class Step:
    position: int
    attempt: int
    kind: str
    change: str


def diff(before: Any, after: Any, path: str = "", limit: int = 6) -> list[str]:
    """The paths where two JSON values differ, shallowest first, at most `limit` of them."""
    if canonical_json(before) == canonical_json(after):
        return []
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[str] = []
        for key in sorted(set(before) | set(after)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in before:
                out.append(f"+{sub}")
            elif key not in after:
                out.append(f"-{sub}")
            else:
                out += diff(before[key], after[key], sub, limit)
            if len(out) >= limit:
                return out[:limit] + ["..."]
        return out
    return [f"{path or '.'}: {_short(before)} -> {_short(after)}"]


def _short(v: Any) -> str:
    text = canonical_json(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _divergence(e: RecordedEvent, what: str) -> ReplayDivergence:
    return ReplayDivergence(f"at position {e.position} ({e.kind}, attempt {e.attempt}): {what}", position=e.position)


def apply(state: ReplayState, e: RecordedEvent) -> str:
    """Advance the replayed state by one event; return what changed. Raises on divergence."""
    before = state.session.state
    try:
        what = state.session.apply(e)  # the session's rules: engine.sessions
    except ReplayDivergence as exc:
        raise _divergence(e, exc.detail) from None
    if what in _SESSION_CHANGES:
        return _SESSION_CHANGES[what](state, e, before)
    by_kind = _BY_KIND.get(e.kind)
    if by_kind is not None:
        return by_kind(state, e)
    if e.kind.startswith("episode_"):
        state.step = e.data.get("step", e.kind.removeprefix("episode_"))
        return f"episode {state.step}"
    if e.kind in ev.CAPTURE_KINDS:
        return _capture_change(e)
    return e.kind.replace("_", " ")


def _opened(state: ReplayState, e: RecordedEvent, before: Any) -> str:
    assert state.task is not None
    return f"session opened: {state.task.env} task {state.task.task_id}"


def _restored(state: ReplayState, e: RecordedEvent, before: Any) -> str:
    where = e.data.get("restored_from") or f"the log (recovered from attempt {e.data.get('origin_attempt')})"
    return f"session restored from {where} at revision {state.revision}"


def _mutated(state: ReplayState, e: RecordedEvent, before: Any) -> str:
    d = e.data
    assert state.session.env is not None
    if state.session.env.state_mode != "exported":
        return f"r{d['revision']} {d.get('tool')}: live effect, not replayable ({state.session.env.state_mode})"
    return f"r{d['revision']} {d.get('tool')}({_short(d.get('arguments'))}): " + "; ".join(diff(before, state.env_state))


def _agent_boundary(state: ReplayState, e: RecordedEvent) -> str:
    d = e.data
    wrong = boundary_disagreement(d, state.session.revisions)
    if wrong is not None:
        raise _divergence(e, f"agent boundary saw {wrong[0]} at revision {wrong[1]}, replay has {wrong[2]}")
    state.latest = list(d.get("messages") or [])
    state.turn, state.messages = d.get("turn", state.turn), len(state.latest)
    return f"agent boundary turn {state.turn} ({d.get('state', '')}), {state.messages} messages"


def _activation_completed(state: ReplayState, e: RecordedEvent) -> str:
    # A completion stores no conversation: it is the boundary's recorded with it (engine.boundaries).
    state.conversation = list((e.data.get("reply") or {}).get("messages") or state.latest)
    return e.kind.replace("_", " ")


def _model_call(state: ReplayState, e: RecordedEvent) -> str:
    state.calls.append(e.data["call_id"])
    return f"model call {e.data['call_id']} {e.kind.removeprefix('call_')} ({e.data.get('disposition', '')})"


def _verified(state: ReplayState, e: RecordedEvent) -> str:
    d = e.data
    if state.task is not None and "final_answer" in d and get_environment(state.task.env).verification == "replay":
        env = get_environment(state.task.env)
        again = float(env.verify(state.task, state.env_state, Trajectory(state.conversation, d["final_answer"])))
        if abs(again - float(d["reward"])) > 1e-9:
            raise _divergence(e, f"verify on the replayed state gives {again}, the log recorded {d['reward']}")
    state.reward, state.final_answer = d.get("reward"), d.get("final_answer")
    return f"verified: reward {d.get('reward')}"


def _attempt_finished(state: ReplayState, e: RecordedEvent) -> str:
    state.reward = e.data.get("reward")
    return f"attempt finished, reward {e.data.get('reward')}"


_SESSION_CHANGES: dict[str, Callable[[ReplayState, RecordedEvent, Any], str]] = {
    "opened": _opened, "restored": _restored, "mutated": _mutated,
}
_BY_KIND: dict[str, Callable[[ReplayState, RecordedEvent], str]] = {
    ev.AGENT_BOUNDARY: _agent_boundary,
    ev.ACTIVATION_COMPLETED: _activation_completed,
    ev.CALL_COMPLETED: _model_call,
    ev.CALL_CUT: _model_call,
    ev.SESSION_VERIFIED: _verified,
    ev.ATTEMPT_FINISHED: _attempt_finished,
}


def _capture_change(e: RecordedEvent) -> str:
    d = e.data
    if e.kind == ev.CAPTURE_ENTRY_PUT:
        return (f"token capture: call {d['model_call_id']} recorded, {d['prompt_receipt']['tokens']} prompt + "
                f"{d['receipt']['tokens']} generated tokens")
    if e.kind == ev.CAPTURE_CALL_BEGUN:
        return f"token capture: call {d['model_call_id']} dispatched"
    if e.kind == ev.CAPTURE_INCOMPLETE:
        return f"token capture incomplete: call {d.get('model_call_id') or '?'} was not captured"
    if e.kind == ev.CAPTURE_FROZEN:
        return f"token capture frozen for a trainer, {d.get('entries')} calls"
    return f"token capture retired: snapshot {d.get('snapshot_id')} consumed at version {d.get('version')}"


async def replay(store: ParticipantStore, rollout_id: str, attempt: int, to: int | None = None) -> tuple[list[Step], ReplayState]:
    rows = await store.attempt_rows([rollout_id])
    if (rollout_id, attempt) not in rows:
        raise UnknownAttempt(f"rollout {rollout_id} has no attempt {attempt}", rollout_id=rollout_id, attempt=attempt)
    state, steps = ReplayState(), []
    history = await effective_history(store, rollout_id, attempt, to)
    opened: Mapping[str, Any] | None = None
    folded = 0
    for e in with_messages(history):  # whole conversations, not deltas
        steps.append(Step(e.position, e.attempt or 0, e.kind, apply(state, e)))
        opened, folded = snapshots.opening(e, opened), folded + is_session_stream(e.stream)
    # Replay re-derives every step (that is its check), so it starts from no snapshot; having paid
    # for the whole fold, it leaves one for the next restore or recovery of this session.
    if snapshots.worth_writing(folded):
        await snapshots.store_snapshots(store, [snapshots.capture(state.session, history, opened)])
    if to is None:
        recorded = await store.session_revision(rollout_id, attempt)
        if recorded is not None and recorded != state.revision:
            raise ReplayDivergence(f"the session projection records revision {recorded}, the replay reaches {state.revision}")
    return steps, state


async def history(store: ParticipantStore, rollout_id: str) -> dict[str, Any]:
    rows = await store.attempt_rows([rollout_id])
    events = await store.read_rollout(rollout_id)
    attempts = []
    for (_, n), row in sorted(rows.items()):
        own = [e for e in events if e.attempt == n]
        attempts.append({
            "attempt": n, "status": row["status"], "parent_attempt": row["parent_attempt"],
            "restored_from": row["restored_from"], "origin_position": row["origin_position"],
            "started_position": row["started_position"], "ended_position": row["ended_position"], "reward": row["reward"],
            "events": len(own),
            "model_calls": sum(e.kind == ev.CALL_COMPLETED for e in own),
            "mutations": sum(e.kind == ev.MUTATION_APPLIED for e in own),
        })
    timeline = [{"position": e.position, "attempt": e.attempt, "kind": e.kind, "stream": e.stream} for e in events]
    return {"rollout_id": rollout_id, "attempts": attempts, "timeline": timeline}
