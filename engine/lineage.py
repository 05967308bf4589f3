"""An attempt's lineage: where the attempt it continues left off, and its history as its participants
replay it (the origin's events up to the origin's boundary, recursively, then its own).

A restore or a recovery continues an attempt of the same rollout; a fork continues an attempt of
another rollout (engine/forks.py). Attempt 0 and a fresh dispatch have no origin: they start from input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine import catalog as ev
from engine.events import RecordedEvent


class RolloutReader(Protocol):
    async def read_rollout(self, rollout_id: str, attempt: int | None = None, to: int | None = None,
                           kinds: Sequence[str] | None = None) -> list[RecordedEvent]: ...


async def effective_history(store: RolloutReader, rollout_id: str, attempt: int, to: int | None = None,
                            kinds: Sequence[str] | None = None) -> list[RecordedEvent]:
    """An attempt's history as its participants replay it: its origin's events up to the origin
    boundary (recursively), then its own. A fresh dispatch has no origin and starts from input; a
    fork's origin is an attempt of another rollout (engine/forks.py). `kinds`: only events of those
    kinds (and each attempt's start, which names its origin), for a reader that needs no other."""
    own = await store.read_rollout(rollout_id, attempt, to, None if kinds is None else [*kinds, ev.ATTEMPT_STARTED])
    origin = lineage_origin(rollout_id, own)
    return own if origin is None else await effective_history(store, *origin, kinds) + own


def origin_of(own: Sequence[RecordedEvent]) -> tuple[int, int | None] | None:
    """Where an attempt's lineage continues: (origin attempt, its boundary position; None: all of it)
    from the attempt's own `attempt_started`; None for attempt 0 and a fresh dispatch, which start
    from input."""
    start = next((e for e in own if e.kind == ev.ATTEMPT_STARTED), None)
    if start is None or start.data.get("origin_attempt") is None:
        return None
    return start.data["origin_attempt"], start.data.get("origin_position")


def lineage_origin(rollout_id: str, own: Sequence[RecordedEvent]) -> tuple[str, int, int | None] | None:
    """origin_of with the origin's rollout: the attempt's own for a restore or a recovery, another
    rollout's for a fork (its `attempt_started` names it as `origin_rollout_id`)."""
    origin = origin_of(own)
    if origin is None:
        return None
    start = next(e for e in own if e.kind == ev.ATTEMPT_STARTED)
    return str(start.data.get("origin_rollout_id") or rollout_id), origin[0], origin[1]
