"""The mark that a finished attempt's result was written out (`rollout_exported`), once per attempt.

Retention (adapters/retention.py) drops a finished rollout's events only once they are marked
exported, so the mark must be exact: one event per exported attempt however many times (or from how
many processes at once) it is exported. The mark goes to the rollout's stream with the version the
writer read as the expected version: of two exporters racing, one lands, the other's append is
refused with a version conflict, and it reads the stream again and finds the mark. The append's own
admission check (engine.attempts.admit) refuses the mark of an attempt that has not finished
(`rollout_not_finished`).
"""

from __future__ import annotations

from engine import catalog as ev
from engine.errors import VersionConflict
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream
from engine.log import EventStore

# A writer that loses this many races in a row to other writers of the same rollout stream gives up
# with the last conflict; each lost race means another event landed on the stream meanwhile.
MARK_TRIES = 20


async def mark_exported(store: EventStore, rollout_id: str, attempt: int, run_id: str, fmt: str) -> bool:
    """Append `rollout_exported` for this attempt unless it is there; True when this call appended it.
    Raises RolloutNotFinished for an attempt that has not finished."""
    stream = rollout_stream(rollout_id)
    for tries in range(1, MARK_TRIES + 1):
        events = await store.read_stream(stream)
        if any(e.kind == ev.ROLLOUT_EXPORTED and e.attempt == attempt for e in events):
            return False
        version = events[-1].stream_version if events else 0
        mark = NewEvent(stream, ev.ROLLOUT_EXPORTED, {"run_id": run_id, "format": fmt}, rollout_id, attempt)
        try:
            await store.append(AppendRequest((mark,), {stream: version}))
            return True
        except VersionConflict:
            if tries == MARK_TRIES:
                raise
    raise AssertionError("unreachable")  # the loop returns or raises
