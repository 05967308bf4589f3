"""Events a participant's prepare hands to the checkpoint instead of appending them itself.

A paused prepare must leave what it decided durable below P (the model server's cut of each
generation it stops). Appended by the participant, that one append was nearly all a prepare cost:
at 80 rollouts in flight it waited 60-170 ms in the model process's queue behind the run's own
appends. So the participant returns the events in its prepare reply, and the coordinator appends
them in the same group as `checkpoint_prepared` (engine.coordinator.Coordinator.prepare), before any
commit can fix P. A checkpoint that never gets that far (a prepare that failed elsewhere, a lease
that ran out) leaves the participant to append them itself when it resumes.

Each event goes under a key of its own (engine.events.AppendRequest.key), the same whoever appends
it, so the log holds one copy even when the coordinator and the participant both try; and each is
its own request, so an attempt fenced meanwhile costs only its own event (refused `stale_attempt`),
never another rollout's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.events import AppendRequest, NewEvent


@dataclass(frozen=True)
class PrepareRecord:
    event: NewEvent
    key: str

    @classmethod
    def of(cls, checkpoint_id: str, event: NewEvent) -> PrepareRecord:
        """One record per stream per checkpoint: its key names both."""
        return cls(event, f"prepare:{checkpoint_id}:{event.stream}")

    def request(self) -> AppendRequest:
        return AppendRequest((self.event,), key=self.key)

    def to_json(self) -> dict[str, Any]:
        e = self.event
        return {"key": self.key, "stream": e.stream, "kind": e.kind, "data": e.data,
                "rollout_id": e.rollout_id, "attempt": e.attempt}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrepareRecord:
        return cls(NewEvent(d["stream"], d["kind"], d["data"], d.get("rollout_id"), d.get("attempt")), d["key"])


__all__ = ["PrepareRecord"]
