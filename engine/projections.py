"""Projections: tables derived from the log, and the one function that derives them.

Storage applies `changes_for(event)` in the append transaction (so the tables are never behind
the log) and again, from an empty table, when it rebuilds one: a rebuild from the log alone must
equal the live table. Each change is an upsert of the named columns; events carry the absolute
values they set, so no change needs to read the row it updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import catalog as ev
from engine.events import RecordedEvent


@dataclass(frozen=True)
class Change:
    table: str
    key: dict[str, Any]
    values: dict[str, Any]
    # "live_through": not an upsert but an update of every row of key["rollout_id"] whose attempt is at
    # or below key["attempt"] and whose status is still live. A retire ends whichever attempts were
    # live without knowing which: the event carries the mark, the live rows take the new status.
    guard: str | None = None


# table -> key columns; every other column is nullable so a partial upsert can insert the row.
TABLES: dict[str, tuple[str, ...]] = {
    "attempt_state": ("rollout_id", "attempt"),
    "rollout_state": ("rollout_id",),
    "episode_state": ("rollout_id", "attempt"),
    "session_state": ("rollout_id", "attempt"),
    "model_call_state": ("call_id",),
    "checkpoint_state": ("checkpoint_id",),
}


# The columns a change sets to the position of the event that makes it, and no others: an append
# that plans before it knows its positions (adapters.postgres) moves exactly these by the same amount
# as its events. A position an event's data names (origin_position, a checkpoint's cut) is not one.
POSITION_COLUMNS = frozenset({"started_position", "ended_position", "updated_position", "accepted_position",
                              "published_position"})


def _attempt_key(e: RecordedEvent) -> dict[str, Any]:
    return {"rollout_id": e.rollout_id, "attempt": e.attempt}


def _attempt_started(e: RecordedEvent) -> list[Change]:
    d = e.data
    return [
        Change("attempt_state", _attempt_key(e), {
            "status": "live",
            "parent_attempt": d.get("parent_attempt"),
            "restored_from": d.get("restored_from"),
            "origin_position": d.get("origin_position"),
            "started_position": e.position,
        }),
        Change("rollout_state", {"rollout_id": e.rollout_id}, {"latest_attempt": e.attempt}),
    ]


def _attempt_fenced(e: RecordedEvent) -> list[Change]:
    return [Change("attempt_state", _attempt_key(e), {"status": "fenced", "ended_position": e.position})]


def _attempt_finished(e: RecordedEvent) -> list[Change]:
    values = {"status": "finished", "ended_position": e.position, "reward": e.data.get("reward")}
    return [Change("attempt_state", _attempt_key(e), values)]


def _rollout_retired(e: RecordedEvent) -> list[Change]:
    # A retired attempt has ended: it must leave `live`, or later cuts would include (and fence) it.
    return [
        Change("rollout_state", {"rollout_id": e.rollout_id}, {"retired_through": e.data["through"]}),
        Change("attempt_state", {"rollout_id": e.rollout_id, "attempt": e.data["through"]},
               {"status": "retired", "ended_position": e.position}, guard="live_through"),
    ]


def _rollout_forgotten(e: RecordedEvent) -> list[Change]:
    return [Change("rollout_state", {"rollout_id": e.rollout_id}, {"retired_through": -1})]


def _episode(e: RecordedEvent) -> list[Change]:
    values: dict[str, Any] = {"status": e.data.get("status", e.kind.removeprefix("episode_")),
                              "updated_position": e.position}
    values.update({col: e.data[col] for col in ("env", "task_id", "step", "reward") if col in e.data})
    if e.kind == ev.EPISODE_STARTED:
        values["started_position"] = e.position
    return [Change("episode_state", _attempt_key(e), values)]


def _session(e: RecordedEvent) -> list[Change]:
    values: dict[str, Any] = {"updated_position": e.position, "stream_version": e.stream_version}
    if e.kind == ev.SESSION_OPENED:
        values.update(status="open", env=e.data.get("env"), revision=e.data.get("revision", 0))
    elif e.kind == ev.MUTATION_APPLIED:
        values["revision"] = e.data["revision"]
    else:
        values["status"] = e.kind.removeprefix("session_")
    return [Change("session_state", _attempt_key(e), values)]


def _call(e: RecordedEvent) -> list[Change]:
    d = e.data
    # Every custody event names the rollout: a call refused before it was accepted has a row too.
    values: dict[str, Any] = {"status": e.kind.removeprefix("call_"), "updated_position": e.position,
                              "rollout_id": e.rollout_id, "attempt": e.attempt}
    if e.kind == ev.CALL_ACCEPTED:
        values.update(parent_call_id=d.get("parent_call_id"), policy_version=d.get("policy_version"),
                      accepted_position=e.position)
    values.update({col: d[col] for col in ("receipt", "tokens", "disposition") if col in d})
    if e.kind == ev.CALL_COMPLETED and d.get("parent_call_id"):
        # A captured call's parent is known only when its record lands (it was resolved after acceptance).
        values["parent_call_id"] = d["parent_call_id"]
    return [Change("model_call_state", {"call_id": d["call_id"]}, values)]


def _checkpoint(e: RecordedEvent) -> list[Change]:
    d = e.data
    values: dict[str, Any] = {"phase": e.kind.removeprefix("checkpoint_"), "updated_position": e.position}
    if e.kind == ev.CHECKPOINT_STARTED:
        values["started_position"] = e.position
    if e.kind == ev.CHECKPOINT_COMMITTED:
        values.update(position=d["position"], scope_size=len(d["scope"]), digest=d["digest"])
    if e.kind == ev.CHECKPOINT_PUBLISHED:
        values["published_position"] = e.position
    return [Change("checkpoint_state", {"checkpoint_id": d["checkpoint_id"]}, values)]


_BY_KIND: dict[str, Callable[[RecordedEvent], list[Change]]] = {
    ev.ATTEMPT_STARTED: _attempt_started,
    ev.ATTEMPT_FENCED: _attempt_fenced,
    ev.ATTEMPT_FINISHED: _attempt_finished,
    ev.ROLLOUT_RETIRED: _rollout_retired,
    ev.ROLLOUT_FORGOTTEN: _rollout_forgotten,
    ev.MUTATION_APPLIED: _session,
}
_BY_PREFIX: tuple[tuple[str, Callable[[RecordedEvent], list[Change]]], ...] = (
    ("episode_", _episode), ("session_", _session), ("call_", _call), ("checkpoint_", _checkpoint),
)


def changes_for(e: RecordedEvent) -> list[Change]:
    """The rows of the projection tables that event `e` changes; none for a kind they do not track."""
    handler = _BY_KIND.get(e.kind) or next((h for prefix, h in _BY_PREFIX if e.kind.startswith(prefix)), None)
    return [] if handler is None else handler(e)
