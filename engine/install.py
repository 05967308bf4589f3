"""What a restore installs: one atomic append that fences each rollout's live attempt and starts the
next (the continued ones from their boundary, the fresh ones from their input), and, at resume, which
of those attempts each participant hands the state it staged to."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any

from engine import catalog as ev
from engine.checkpoint import Cut
from engine.errors import InvalidCheckpointState
from engine.events import AppendRequest, NewEvent
from engine.identity import Key, restore_stream, rollout_stream


def restored_attempt(rows: dict[Key, dict[str, Any]], rollout_id: str, origin: int, checkpoint_id: str) -> int | None:
    """The attempt a restore of `checkpoint_id` installed for `rollout_id` over `origin` (None: none
    is live). Participants staged state at restore and hand it to this attempt at resume: only a
    live attempt above the origin whose start names this checkpoint qualifies; the latest, if a
    second restore from the same checkpoint fenced the first one's replacement."""
    live = [a for (r, a), row in rows.items()
            if r == rollout_id and a > origin and row["status"] == "live" and row.get("restored_from") == checkpoint_id]
    return max(live, default=None)


def restored_targets(rows: dict[Key, dict[str, Any]], staged: Iterable[Key], checkpoint_id: str) -> dict[Key, int]:
    """For each staged (rollout, origin attempt), the attempt the restore of `checkpoint_id` installed
    for it (`restored_attempt`). A rollout retired since the cut has none and is left out; any other
    without one means the install never happened, and nothing may be handed over: InvalidCheckpointState."""
    retired = retired_since(rows)
    targets: dict[Key, int] = {}
    for rid, origin in staged:
        target = restored_attempt(rows, rid, origin, checkpoint_id)
        if target is not None:
            targets[(rid, origin)] = target
        elif rid not in retired:
            raise InvalidCheckpointState(f"checkpoint {checkpoint_id} is not installed: rollout {rid} has no live "
                                         f"attempt restored from it", rollout_id=rid)
    return targets


def retired_since(rows: dict[Key, dict[str, Any]]) -> set[str]:
    """Rollouts whose latest attempt is at or below their retire mark (`retired_through` on a row).

    The framework gave them up after the cut was taken; only `forget` takes a retire back, so a
    restore leaves them retired: it neither fences their attempt (the mark refuses any write of it)
    nor starts another, and the rest of the cut is installed as usual."""
    latest: dict[str, int] = {}
    marks: dict[str, int] = {}
    for (r, a), row in rows.items():
        latest[r] = max(latest.get(r, -1), a)
        mark = row.get("retired_through")
        marks[r] = -1 if mark is None else int(mark)
    return {r for r, a in latest.items() if a <= marks[r]}


def install_request(cut: Cut, latest: dict[str, int], late: Sequence[Key] = (),
                    retired: Container[str] = frozenset()) -> AppendRequest:
    """One atomic request: fence each rollout's live attempt and start the next one.

    `latest` maps rollout id -> its latest attempt now (a second restore from the same checkpoint
    fences the replacement, not the original); `late` are attempts started after the cut; `retired`
    are rollouts retired since the cut (`retired_since`), which stay as they are."""
    events: list[NewEvent] = []
    scope = [s for s in cut.scope if s.rollout_id not in retired]
    fresh = [(r, a) for r, a in [*cut.fresh, *late] if r not in retired]
    for s in scope:
        n = latest.get(s.rollout_id, s.attempt)
        events += _fence_and_start(s.rollout_id, n, cut.checkpoint_id, origin={"attempt": s.attempt, "position": s.boundary})
    for r, a in fresh:
        events += _fence_and_start(r, latest.get(r, a), cut.checkpoint_id, origin=None)
    named = [*(s.rollout_id for s in cut.scope), *(r for r, _ in [*cut.fresh, *late])]
    events.append(NewEvent(restore_stream(cut.checkpoint_id), ev.RESTORE_INSTALLED, {
        "checkpoint_id": cut.checkpoint_id, "continued": len(scope),
        "fresh_dispatch": sum(1 for r, _ in cut.fresh if r not in retired),
        "left_retired": sorted({r for r in named if r in retired})}))
    return AppendRequest(tuple(events))


def _fence_and_start(rollout_id: str, live: int, checkpoint_id: str, origin: dict[str, int] | None) -> list[NewEvent]:
    stream = rollout_stream(rollout_id)
    return [
        NewEvent(stream, ev.ATTEMPT_FENCED, {"reason": "restore", "checkpoint_id": checkpoint_id}, rollout_id, live),
        NewEvent(
            stream,
            ev.ATTEMPT_STARTED,
            {
                "parent_attempt": live,
                "restored_from": checkpoint_id,
                "origin_attempt": origin["attempt"] if origin else None,
                "origin_position": origin["position"] if origin else None,
                "disposition": "continue" if origin else "fresh_dispatch",
            },
            rollout_id,
            live + 1,
        ),
    ]
