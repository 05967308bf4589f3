"""A model call's custody and the rules of its identity and replacement, which the model server applies.

Custody: a call's stream (engine.identity.call_stream) holds `call_accepted`, then one outcome
(`call_completed`, `call_cut`, `call_failed`) or `call_excluded`; `call_records` folds a stream into
each call's last state (`CallState`) and the acceptance before it. The rules:

- A call id belongs to the rollout attempt that first used it: asked again from another attempt it
  is refused (the caller must name a new call and replace the old one).
- A call id names one request: asked again with a different request it is a conflict.
- A call may be replaced (continued after a cut, or linked to its stored reply) only from its own
  rollout and from its attempt or a later one: a restored agent continues its origin's calls.
- One call per attempt may replace a given call: a restored agent continues a cut call once, and a
  second replacement under another id is refused, whichever server accepted the first.
- A call whose caller names no id (an agent rollbook did not write) is numbered by the server, per
  (rollout, attempt, activation) in arrival order (engine.identity.server_call_id). The same request
  again, while the call numbered last has not been delivered (cut by a checkpoint, or its caller lost
  the connection), is that call again (`CallNumbering`): it continues from its cut or gets its stored
  reply, never a second generation. Once delivered, the same request again is a new call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine import catalog as ev
from engine.errors import InvalidIdentifier, InvalidPhase, RequestConflict
from engine.events import RecordedEvent

CUSTODY = ev.CUSTODY_KINDS


class CallState(StrEnum):
    """Where a call stands in its custody: the kind of its last custody event, less `call_`."""

    ACCEPTED = "accepted"
    COMPLETED = "completed"
    CUT = "cut"
    FAILED = "failed"
    EXCLUDED = "excluded"

    @property
    def durable_reply(self) -> bool:
        """A completed call's reply, or a cut call's prefix, is in the log: a replacement starts from it."""
        return self in (CallState.COMPLETED, CallState.CUT)


@dataclass
class CallRecord:
    """A call as the log tells it: its last custody event and the acceptance before it."""

    call_id: str
    rollout_id: str | None
    attempt: int | None
    status: CallState
    data: dict[str, Any]
    accepted: dict[str, Any] = field(default_factory=dict)


def call_records(events: Iterable[RecordedEvent]) -> dict[str, CallRecord]:
    """Each call's custody as of the end of `events` (a call stream or a rollout's events, in log order)."""
    out: dict[str, CallRecord] = {}
    for e in events:
        if e.kind not in CUSTODY:
            continue
        cid = e.data["call_id"]
        prior = out.get(cid)
        if e.kind == ev.CALL_EXCLUDED and prior is not None and prior.status.durable_reply:
            continue  # a retry refused while admission was closed changes nothing: the cut prefix still stands
        accepted = e.data if e.kind == ev.CALL_ACCEPTED else (prior.accepted if prior else {})
        out[cid] = CallRecord(cid, e.rollout_id, e.attempt, CallState(e.kind.removeprefix("call_")), e.data, accepted)
    return out


def check_owner(call_id: str, have_rollout: str | None, have_attempt: int | None, rollout_id: str, attempt: int) -> None:
    if (have_rollout, have_attempt) != (rollout_id, attempt):
        raise InvalidIdentifier(
            f"call id {call_id} belongs to rollout {have_rollout} attempt {have_attempt}, "
            f"not rollout {rollout_id} attempt {attempt}; name the new call anew and replace the old one",
        )


def check_same_request(call_id: str, recorded: object, digest: str) -> None:
    """`recorded` is the digest the call was accepted with (None: an acceptance that predates digests)."""
    if recorded is not None and recorded != digest:
        raise RequestConflict(f"call id {call_id} was already used for a different request; name a new call")


def check_replaceable(old_id: str, old_rollout: str | None, old_attempt: int | None, rollout_id: str, attempt: int) -> None:
    if old_rollout != rollout_id or (old_attempt or 0) > attempt:
        raise InvalidIdentifier(
            f"call {old_id} belongs to rollout {old_rollout} attempt {old_attempt}; "
            f"it cannot be replaced from rollout {rollout_id} attempt {attempt}"
        )


Claim = tuple[str, int]  # (the replaced call, the attempt replacing it)


class Replacements:
    """Which call of each attempt replaced a given call: this server's claims, and what the log says.

    `claim` takes no await between its check and its record, so two concurrent replacements in one
    process cannot both win; the log (`learn`) tells of replacements other processes accepted."""

    def __init__(self) -> None:
        self._holders: dict[Claim, str] = {}

    def needs_log(self, replaces: str, attempt: int, call_id: str) -> bool:
        """Whether the log must be read before `claim`: nothing here says another call holds it."""
        return self._holders.get((replaces, attempt), call_id) == call_id

    def learn(self, replaces: str, attempt: int, call_id: str, history: Iterable[RecordedEvent]) -> None:
        """Record the replacement of `replaces` the attempt's history holds under another id, if any."""
        for e in history:
            if e.kind == ev.CALL_ACCEPTED and e.data.get("replaces") == replaces and e.data["call_id"] != call_id:
                self._holders.setdefault((replaces, attempt), e.data["call_id"])

    def claim(self, replaces: str, attempt: int, call_id: str) -> Claim:
        key = (replaces, attempt)
        holder = self._holders.setdefault(key, call_id)
        if holder != call_id:
            raise InvalidPhase(f"call {replaces} was already linked to call {holder} of attempt {attempt}",
                               replaces=replaces, linked_to=holder)
        return key

    def release(self, claim: Claim, call_id: str) -> None:
        """The claiming call was never accepted (its append failed): another may replace the call."""
        if self._holders.get(claim) == call_id:
            del self._holders[claim]


@dataclass
class CallNumbering:
    """The numbering of one (rollout, attempt, activation)'s calls that named no id: `next` is the
    number the next new call gets; `last_digest` the request the call numbered last was made with."""

    next: int = 0
    last_digest: str | None = None

    def number(self, digest: str, last_delivered: bool) -> int:
        if self.next and digest == self.last_digest and not last_delivered:
            return self.next - 1  # the same call asked again
        self.next, self.last_digest = self.next + 1, digest
        return self.next - 1
