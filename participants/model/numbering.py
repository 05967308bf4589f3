"""Ids for the calls an agent makes without naming them (engine.calls.CallNumbering), and the
recorded call each replays when the agent is continued by replay (engine.agent_replay).

An agent rollbook did not write sends no X-Rollbook-Call-Id: the model server numbers its calls on
each (rollout, attempt, activation) in the order they arrive. The numbering lives in memory; after a
restart, or when an attempt moves here from an instance that is gone, it is read back from the log:
the calls are numbered without gaps, so the first number whose stream is empty is the next one, and
the call before it gives the request it was made with. That call is taken as not delivered (this
process cannot know), so the same request again gets its stored reply rather than a new generation.
"""

from __future__ import annotations

from engine import catalog as ev
from engine.agent_replay import DIVERGENCE_REASON, recorded_calls, replayed_call
from engine.calls import CallNumbering, CallRecord
from engine.checkpoint import ParticipantStore
from engine.errors import AgentDiverged
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, server_call_id
from engine.lineage import effective_history
from participants.base.keyed_locks import KeyedLocks
from participants.model.calls import LiveCall

Activation = tuple[str, int, int]  # (rollout_id, attempt, activation)


class ServerCallIds:
    def __init__(self, store: ParticipantStore) -> None:
        self.store = store
        self._numbering: dict[Activation, CallNumbering] = {}
        self._last: dict[Activation, LiveCall] = {}  # the call numbered last, while this process serves it
        self._recorded: dict[Activation, dict[int, CallRecord]] = {}  # what the attempt's lineage recorded
        self._locks: KeyedLocks[Activation] = KeyedLocks()

    async def call_id(self, rollout_id: str, attempt: int, activation: int, digest: str) -> tuple[str, str | None]:
        """The call's id, and the recorded call it replays (engine.agent_replay; None: it goes live)."""
        key = (rollout_id, attempt, activation)
        async with self._locks(key):
            numbering = self._numbering.get(key) or await self._read_back(key)
            self._numbering[key] = numbering
            last = self._last.get(key)
            number = numbering.number(digest, last is not None and last.delivered)
            call_id = server_call_id(*key, number)
            if last is not None and last.call_id != call_id:
                del self._last[key]  # a new number: until it is served here, its delivery is unknown
            if key not in self._recorded:
                history = await effective_history(self.store, rollout_id, attempt)
                self._recorded[key] = recorded_calls(history, rollout_id, attempt, activation)
            try:
                return call_id, replayed_call(self._recorded[key].get(number), digest, call_id)
            except AgentDiverged as exc:
                self._recorded[key] = {}  # nothing after a divergence is answered from the log
                diverged = {"call_id": call_id, "reason": DIVERGENCE_REASON, "diverges_from": exc.context["diverges_from"]}
                await self.store.append(AppendRequest((
                    NewEvent(call_stream(call_id), ev.CALL_EXCLUDED, diverged, rollout_id, attempt),)))
                raise

    def numbered(self, activation: Activation, call: LiveCall) -> None:
        """`call` is the one the activation's last number named: its delivery decides what a repeat is."""
        self._last[activation] = call

    def forget(self, rollout_id: str, through: int) -> None:
        for key in [k for k in self._numbering if k[0] == rollout_id and k[1] <= through]:
            self._numbering.pop(key, None)
            self._last.pop(key, None)
            self._recorded.pop(key, None)

    async def _exists(self, key: Activation, number: int) -> bool:
        return bool(await self.store.read_stream(call_stream(server_call_id(*key, number))))

    async def _read_back(self, key: Activation) -> CallNumbering:
        if not await self._exists(key, 0):
            return CallNumbering()
        low, high = 0, 1  # low exists; find a high that does not, doubling, then halve the gap
        while await self._exists(key, high):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if await self._exists(key, mid) else (low, mid)
        events = await self.store.read_stream(call_stream(server_call_id(*key, low)))
        accepted = [e for e in events if e.data.get("request_digest")]
        digest = accepted[-1].data["request_digest"] if accepted else None
        return CallNumbering(next=low + 1, last_digest=digest)


__all__ = ["ServerCallIds"]
