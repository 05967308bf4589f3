"""Projections: tables derived from the log, and the one function that derives them.

Storage applies `changes_for(event)` in the append transaction (so the tables are never behind
the log) and again, from an empty table, when it rebuilds one: a rebuild from the log alone must
equal the live table. Each change is an upsert of the named columns; events carry the absolute
values they set, so no change needs to read the row it updates.
"""

from __future__ import annotations

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


def _attempt_key(e: RecordedEvent) -> dict[str, Any]:
    return {"rollout_id": e.rollout_id, "attempt": e.attempt}


def changes_for(e: RecordedEvent) -> list[Change]:
    k = e.kind
    d = e.data
    if k == ev.ATTEMPT_STARTED:
        return [
            Change(
                "attempt_state",
                _attempt_key(e),
                {
                    "status": "live",
                    "parent_attempt": d.get("parent_attempt"),
                    "restored_from": d.get("restored_from"),
                    "origin_position": d.get("origin_position"),
                    "started_position": e.position,
                },
            ),
            Change("rollout_state", {"rollout_id": e.rollout_id}, {"latest_attempt": e.attempt}),
        ]
    if k == ev.ATTEMPT_FENCED:
        return [Change("attempt_state", _attempt_key(e), {"status": "fenced", "ended_position": e.position})]
    if k == ev.ATTEMPT_FINISHED:
        return [
            Change(
                "attempt_state",
                _attempt_key(e),
                {"status": "finished", "ended_position": e.position, "reward": d.get("reward")},
            )
        ]
    if k == ev.ROLLOUT_RETIRED:
        # A retired attempt has ended: it must leave `live`, or later cuts would include (and fence) it.
        return [
            Change("rollout_state", {"rollout_id": e.rollout_id}, {"retired_through": d["through"]}),
            Change("attempt_state", {"rollout_id": e.rollout_id, "attempt": d["through"]},
                   {"status": "retired", "ended_position": e.position}, guard="live_through"),
        ]
    if k == ev.ROLLOUT_FORGOTTEN:
        return [Change("rollout_state", {"rollout_id": e.rollout_id}, {"retired_through": -1})]
    if k.startswith("episode_"):
        values: dict[str, Any] = {"status": d.get("status", k.removeprefix("episode_")), "updated_position": e.position}
        for col in ("env", "task_id", "step", "reward"):
            if col in d:
                values[col] = d[col]
        if k == ev.EPISODE_STARTED:
            values["started_position"] = e.position
        return [Change("episode_state", _attempt_key(e), values)]
    if k.startswith("session_") or k == ev.MUTATION_APPLIED:
        values = {"updated_position": e.position, "stream_version": e.stream_version}
        if k == ev.SESSION_OPENED:
            values.update(status="open", env=d.get("env"), revision=d.get("revision", 0))
        elif k == ev.MUTATION_APPLIED:
            values["revision"] = d["revision"]
        else:
            values["status"] = k.removeprefix("session_")
        return [Change("session_state", _attempt_key(e), values)]
    if k.startswith("call_"):
        # Every custody event names the rollout: a call refused before it was accepted has a row too.
        values = {"status": k.removeprefix("call_"), "updated_position": e.position,
                  "rollout_id": e.rollout_id, "attempt": e.attempt}
        if k == ev.CALL_ACCEPTED:
            values.update(
                parent_call_id=d.get("parent_call_id"),
                policy_version=d.get("policy_version"),
                accepted_position=e.position,
            )
        for col in ("receipt", "tokens", "disposition"):
            if col in d:
                values[col] = d[col]
        if k == ev.CALL_COMPLETED and d.get("parent_call_id"):
            # A captured call's parent is known only when its record lands (it was resolved after acceptance).
            values["parent_call_id"] = d["parent_call_id"]
        return [Change("model_call_state", {"call_id": d["call_id"]}, values)]
    if k.startswith("checkpoint_"):
        values = {"phase": k.removeprefix("checkpoint_"), "updated_position": e.position}
        if k == ev.CHECKPOINT_STARTED:
            values["started_position"] = e.position
        if k == ev.CHECKPOINT_COMMITTED:
            values.update(position=d["position"], scope_size=len(d["scope"]), digest=d["digest"])
        if k == ev.CHECKPOINT_PUBLISHED:
            values["published_position"] = e.position
        return [Change("checkpoint_state", {"checkpoint_id": d["checkpoint_id"]}, values)]
    return []
