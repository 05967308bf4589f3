"""Token capture for a trainer: one rollout attempt's captured model calls, frozen and retired on the log.

A trainer (NeMo Gym's `TokenSource`, or anything shaped like it) consumes, per rollout attempt, the
exact tokens of every model call. rollbook keeps them the way it keeps every model call: the token
arrays in the token store, and in the log the call's custody events (`call_accepted`,
`call_completed` with its receipts, or `call_failed`) plus the events below on one stream per
attempt, `capture:<rollout>:<attempt>` (engine.identity.capture_stream):

    capture_call_begun   a call is about to be dispatched (written before generation)
    capture_entry_put    a call's record is durable: its metadata, its receipts, its digest
    capture_incomplete   a call of the attempt failed to capture; a trainer must mask the sample
    capture_frozen       the trainer's snapshot: the cut of this stream at that event's position
    capture_retired      the trainer consumed exactly that snapshot (id and version) and let it go

Every write reads the stream, decides here, and appends naming the stream version it read, so two
writers (any processes) serialize on the stream: the log's optimistic concurrency is the
compare-and-swap a strict freeze fence needs. The stream version is the snapshot's `version`;
anything that changes what a trainer would read (an incomplete mark) moves it, and retirement
succeeds only at the version the trainer froze. This module decides; it does no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine import catalog as ev
from engine.catalog import (
    CAPTURE_CALL_BEGUN,
    CAPTURE_ENTRY_PUT,
    CAPTURE_FROZEN,
    CAPTURE_INCOMPLETE,
    CAPTURE_RETIRED,
)
from engine.errors import CaptureFrozen, CaptureRetired, InvalidIdentifier, TokenEntryConflict
from engine.events import RecordedEvent
from engine.identity import validate_id

CAPTURE_KINDS = (CAPTURE_CALL_BEGUN, CAPTURE_ENTRY_PUT, CAPTURE_INCOMPLETE, CAPTURE_FROZEN, CAPTURE_RETIRED)

# NeMo Gym names a re-dispatched attempt N >= 1 of rollout R "R-aN" (its EpisodeId.capture_key and
# rollout_correlation); attempt 0 is R itself. Gym forbids rollout ids ending in "-a<N>", so this
# mapping is one to one.
_ATTEMPT_SUFFIX = re.compile(r"^(?P<rollout>.+)-a(?P<attempt>[1-9][0-9]*)$")


def split_capture_key(key: object) -> tuple[str, int]:
    """A trainer's rollout key -> rollbook's (rollout id, attempt)."""
    if not isinstance(key, str) or not key:
        raise InvalidIdentifier("a token capture needs a rollout id")
    m = _ATTEMPT_SUFFIX.match(key)
    rollout_id, attempt = (m["rollout"], int(m["attempt"])) if m else (key, 0)
    return validate_id(rollout_id, "rollout id"), attempt


def capture_key(rollout_id: str, attempt: int) -> str:
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def captured_call_id(rollout_id: str, attempt: int, model_call_id: str) -> str:
    """rollbook's call id for a trainer's model call id: unique across rollouts and attempts, spelt
    like the model server's own (`<rollout>.<attempt>.<call>`)."""
    return f"{rollout_id}.{attempt}.{model_call_id}"


@dataclass(frozen=True)
class CapturedCall:
    model_call_id: str
    entry_digest: str
    data: dict[str, Any]  # the capture_entry_put event's data: metadata and receipts
    position: int


@dataclass
class CaptureState:
    """One attempt's capture as its stream tells it, through `version`."""

    version: int = 0
    entries: dict[str, CapturedCall] = field(default_factory=dict)
    intents: dict[str, int] = field(default_factory=dict)  # model call id -> position of its begin
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    frozen_position: int | None = None
    retired: dict[str, Any] | None = None  # {"snapshot_id", "version"} of the consumed snapshot

    @property
    def frozen(self) -> bool:
        return self.frozen_position is not None

    def dangling(self) -> list[str]:
        """Calls dispatched whose record never landed: the rollout lost a turn without a trace."""
        return sorted(c for c in self.intents if c not in self.entries)

    def is_incomplete(self) -> bool:
        return bool(self.incomplete) or bool(self.dangling())


def snapshot_id(rollout_id: str, attempt: int, frozen_position: int) -> str:
    """A snapshot is the cut of the attempt's capture stream at the freeze's log position."""
    return f"{capture_key(rollout_id, attempt)}@{frozen_position}"


def fold(events: list[RecordedEvent]) -> CaptureState:
    """The state of one capture stream, from its events in stream order."""
    state = CaptureState()
    for e in events:
        state.version = e.stream_version
        d = e.data
        if e.kind == CAPTURE_CALL_BEGUN:
            state.intents.setdefault(d["model_call_id"], e.position)
        elif e.kind == CAPTURE_ENTRY_PUT:
            state.entries[d["model_call_id"]] = CapturedCall(d["model_call_id"], d["entry_digest"], d, e.position)
        elif e.kind == CAPTURE_INCOMPLETE:
            state.incomplete.append({"model_call_id": d.get("model_call_id", ""), "reason": d.get("reason", "")})
        elif e.kind == CAPTURE_FROZEN:
            if state.frozen_position is None:
                state.frozen_position = e.position
        elif e.kind == CAPTURE_RETIRED:
            state.retired = {"snapshot_id": d["snapshot_id"], "version": d["version"]}
    return state


class Decision(Enum):
    APPEND = "append"
    NOTHING = "nothing"  # an identical retry, or already so: succeed without writing


def _refuse_retired(state: CaptureState, what: str, key: str) -> None:
    if state.retired is not None:
        raise CaptureRetired(
            f"token capture of {key} was retired (snapshot {state.retired['snapshot_id']}); {what} is refused",
            rollout_id=key,
        )


def decide_put(state: CaptureState, key: str, model_call_id: str, entry_digest: str) -> Decision:
    """A record joins the capture once. The same bytes again are a retry; anything else is refused,
    and after freeze nothing joins (the snapshot a trainer holds must stay what it read)."""
    _refuse_retired(state, f"a record for call {model_call_id}", key)
    existing = state.entries.get(model_call_id)
    if existing is not None and existing.entry_digest != entry_digest:
        raise TokenEntryConflict(
            f"call {model_call_id} of {key} is already captured with a different payload "
            f"(digest {existing.entry_digest[:12]}, this one {entry_digest[:12]}); the first record stands",
            rollout_id=key, model_call_id=model_call_id,
        )
    if state.frozen:
        if existing is not None:
            return Decision.NOTHING  # the identical record is in the snapshot already
        raise CaptureFrozen(
            f"token capture of {key} is frozen; the record of call {model_call_id} cannot join its snapshot",
            rollout_id=key, model_call_id=model_call_id,
        )
    return Decision.NOTHING if existing is not None else Decision.APPEND


def decide_begin(state: CaptureState, key: str, model_call_id: str) -> Decision:
    _refuse_retired(state, f"dispatching call {model_call_id}", key)
    if model_call_id in state.intents or model_call_id in state.entries:
        return Decision.NOTHING
    if state.frozen:
        raise CaptureFrozen(
            f"token capture of {key} is frozen; call {model_call_id} cannot be dispatched into it",
            rollout_id=key, model_call_id=model_call_id,
        )
    return Decision.APPEND


def decide_incomplete(state: CaptureState, key: str) -> Decision:
    """Always written, frozen or not: it is what moves the version under a stale retirement."""
    _refuse_retired(state, "marking it incomplete", key)
    return Decision.APPEND


def decide_freeze(state: CaptureState, key: str) -> Decision:
    _refuse_retired(state, "freezing it again", key)
    return Decision.NOTHING if state.frozen else Decision.APPEND


def decide_retire(
    state: CaptureState, rollout_id: str, attempt: int, sid: str, version: int, late: int = 0
) -> Decision | None:
    """Retire exactly the snapshot the trainer consumed: APPEND, NOTHING (retired already, by this
    very snapshot), or None (the state moved on, or that snapshot never was: refuse, keep evidence).
    `late` counts the served calls' custody events after the freeze (see `served_snapshot`)."""
    if state.retired is not None:
        same = state.retired == {"snapshot_id": sid, "version": version}
        return Decision.NOTHING if same else None
    if state.frozen_position is None or snapshot_id(rollout_id, attempt, state.frozen_position) != sid:
        return None
    return Decision.APPEND if state.version + late == version else None


# ---- calls served by rollbook's own model server ------------------------------------------------------
#
# A rollout rollbook runs has its model calls recorded by the model server (call_accepted, then
# call_completed with `receipt` = generated ids and logprobs and `prompt_receipt` = prompt ids), not
# put through a sink. A snapshot of such an attempt holds them too: the calls of its effective
# history (engine.lineage.effective_history: its origin's events up to the boundary it resumed
# from, then its own) whose custody ended `completed` at or below the freeze. A call accepted but not
# completed there (in flight, cut, failed) is a hole: the snapshot is incomplete. The model server is
# not fenced by a freeze, so a served call's custody event after it is a write that raced the freeze:
# it counts into the snapshot's version, and a retirement at the frozen version fails.

CALL_KINDS = (ev.CALL_ACCEPTED, ev.CALL_COMPLETED, ev.CALL_CUT, ev.CALL_FAILED)


@dataclass(frozen=True)
class ServedCall:
    call_id: str
    accepted: dict[str, Any]
    completed: dict[str, Any]
    position: int  # of the call_completed event
    attempt: int


@dataclass(frozen=True)
class ServedSnapshot:
    calls: tuple[ServedCall, ...]  # completed at or below the freeze, in log order
    missing: tuple[str, ...]  # accepted at or below the freeze, not completed there
    late: int  # custody events after the freeze


def served_snapshot(history: list[RecordedEvent], frozen_position: int, captured_source: str) -> ServedSnapshot:
    """The model server's calls as of the freeze. Events written by the capture path itself (their
    data's `source` is `captured_source`) are the sink's, already in the capture stream."""
    accepted: dict[str, dict[str, Any]] = {}
    last: dict[str, RecordedEvent] = {}
    late = 0
    for e in history:
        if e.kind not in CALL_KINDS or e.data.get("source") == captured_source:
            continue
        if e.position > frozen_position:
            late += 1
            continue
        if e.kind == ev.CALL_ACCEPTED:
            accepted.setdefault(e.data["call_id"], e.data)
        last[e.data["call_id"]] = e
    done = [e for e in last.values() if e.kind == ev.CALL_COMPLETED and "prompt_receipt" in e.data]
    calls = tuple(
        ServedCall(e.data["call_id"], accepted.get(e.data["call_id"], {}), e.data, e.position, e.attempt or 0)
        for e in sorted(done, key=lambda e: e.position)
    )
    # A completion without prompt ids (a record from before token-id custody) cannot be trained on either.
    missing = tuple(sorted(c for c, e in last.items() if e.kind != ev.CALL_COMPLETED or "prompt_receipt" not in e.data))
    return ServedSnapshot(calls, missing, late)
