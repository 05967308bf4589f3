"""The policy model server: an OpenAI-compatible front to a generation backend, with custody.

Every call leaves events on its stream (engine.identity.call_stream): `call_accepted`, then one of
`call_completed` (token receipt + reply), `call_cut` (receipt of the durable prefix), `call_failed`; a
call refused because admission is closed leaves `call_excluded`. A call of a fenced attempt leaves
nothing: check_attempt and the append itself refuse it.

Checkpoint behaviour:
- prepare closes admission and cuts every generation that has made tokens of its own, at its
  durable prefix (participants.model.progress) or with the tokens not saved yet, streamed or not
  (recorded in `call_cut`, the client's stream ending with a rollbook cut event); the other calls
  run on, and prepare waits for none of them. A reply that becomes ready while admission is closed
  is HELD: the HTTP response waits for resume, so no agent moves past the boundary being recorded.
  A call numbered here (its agent names none, and cannot wait a checkpoint out) is held too, new
  or cut, never refused: it goes on at resume.
- restore stages the calls of the rollouts in the cut (as of the cut's position); a call that
  names one of them in X-Rollbook-Replaces-Call-Id gets its stored reply (`linked`, once per
  attempt) or continues its cut prefix, so the result equals an uninterrupted generation.

After a crash: a call asked for again whose reply the log holds gets that reply, never a second generation.
A call is owned by the instance that accepted it (engine.ownership: the acceptance is appended at the
version read, so two model servers never both accept it); asked of another instance while its owner is
live, the call's outcome is awaited in the log, never generated again. A call the log says was accepted
whose owner is gone (engine.recovery.call_lost) is recorded `call_failed` (`call_lost`) and refused with
`attempt_lost`: the environment server goes on under a new attempt from the boundary before that call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from adapters.openai_wire import (
    ChatCompletion,
    ChatRequest,
    ResponsesReply,
    ResponsesRequest,
    final_message,
    models_body,
    usage,
)
from engine import catalog as ev
from engine.attempts import check_current
from engine.calls import (
    CallRecord,
    CallState,
    Replacements,
    call_records,
    check_owner,
    check_replaceable,
    check_same_request,
)
from engine.catalog import POLICY_VERSION_CHANGED
from engine.checkpoint import Cut, ParticipantStore, read_cut
from engine.errors import (
    AdmissionClosed,
    AgentDiverged,
    AttemptLost,
    DatabaseUnavailable,
    GenerationFailed,
    InvalidIdentifier,
    InvalidJson,
    InvalidPhase,
    InvalidRequest,
    RequestConflict,
    RollbookError,
    RolloutIdRequired,
    StaleAttempt,
    UnknownAttempt,
    UnsupportedParameter,
    VersionConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import ID_PATTERN, call_stream, policy_stream, server_call_number, validate_id
from engine.ownership import claim
from engine.prepare_records import PrepareRecord
from engine.recovery import call_lost
from engine.tokens import Receipt
from participants.base.guard import Header, Route
from participants.base.http_errors import json_reply
from participants.base.keyed_locks import KeyedLocks
from participants.base.owners import owner_verdict, settled
from participants.base.participant import Participant, PrepareReport
from participants.base.wire import (
    CALL_ID_HEADER,
    CONTROL,
    NG_ROLLOUT,
    NUMBERED_IN,
    PARENT_HEADER,
    REPLACES_HEADER,
    Execution,
    PolicyVersionRequest,
    activation_of,
    data_path,
    identity,
)
from participants.model.backends import GenerationBackend, Prefix
from participants.model.calls import DurablePrefix, LiveCall, TokenStore, request_digest
from participants.model.numbering import ServerCallIds
from participants.model.progress import PROGRESS_S, ProgressSaver
from participants.model.replies import CallReplies

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MODELS = "/v1/models"
POLICY_VERSION = f"{CONTROL}/policy_version"
POLICY_STREAM = policy_stream()
CLAIM_TRIES = 8  # each conflict means another instance appended to the call: it cannot go on for long
REPLACES_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*( *, *[A-Za-z0-9][A-Za-z0-9._-]*)*$"

class ModelParticipant(Participant):
    kind = "model"
    concurrency = "calls run concurrently; one call id is accepted once; control operations serialized"

    def __init__(self, store: ParticipantStore, backend: GenerationBackend, token_store: TokenStore, instance: str,
                 progress_s: float = PROGRESS_S) -> None:
        super().__init__(store, instance)
        self.backend = backend
        self.token_store = token_store
        self.replies = CallReplies(token_store, self.admission)
        self.calls: dict[str, LiveCall] = {}  # in flight here, not yet finished
        self.consumers: Counter[LiveCall] = Counter()  # calls a handler is waiting to deliver
        self.staged: dict[str, CallRecord] = {}
        self.staged_rollouts: set[str] = set()
        self.replacements = Replacements()  # (replaced call, attempt) -> the call that replaced it (engine.calls)
        self._locks: KeyedLocks[str] = KeyedLocks()  # one decision at a time per call id
        self.numbering = ServerCallIds(store)  # ids for the calls of agents that name none
        self._adopted = False
        self._adopt_lock = asyncio.Lock()
        self.progress = ProgressSaver(token_store, lambda: self.calls.values(), progress_s)
        self.cuts: list[tuple[LiveCall, PrepareRecord]] = []  # cut by the last prepare, finished at resume
        self.cuts_recorded = False  # its checkpoint was committed: they are in the log

    # ---- control plane hooks ---------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        await super().prepare(checkpoint_id, deadline)
        inflight = [c for c in self.calls.values() if not c.done.is_set()]
        # Cut where a cut keeps something: a generation with tokens of its own already in the token
        # store (participants.model.progress saves them off the request path). Every other call runs on
        # through the checkpoint, its reply held until resume: a cut of it would keep nothing and only
        # make its caller ask again (where checkpoints come faster than a loaded server gets continued
        # calls going, a call cut before its first token was cut again and again: one 12 times in 5
        # minutes at 500 in flight and a checkpoint every second). A restore of the cut asks for such a
        # call again from the boundary before it, as for any call in flight at P. Nothing here waits or
        # writes: the cuts go to the coordinator, which appends them with `checkpoint_prepared`
        # (engine.prepare_records); the tokens made since the last save are generated again.
        cutting = self.cuttable()
        for c in cutting:
            c.state = "cutting"  # no await since the check: its own task will not record an outcome now
            c.cut_requested.set()
        self.cuts = [(c, PrepareRecord.of(checkpoint_id, self._cut_event(c))) for c in cutting]
        counts = {"accepted": len(inflight), "cut": len(cutting), "running": len(inflight) - len(cutting), "held": self.held()}
        return PrepareReport(ready=True, counts=counts, records=[r for _, r in self.cuts])

    async def commit(self, checkpoint_id: str, scope: list[Execution]) -> dict[str, Any]:
        self.cuts_recorded = True  # a commit comes only once `checkpoint_prepared` is in the log, and the cuts with it
        return {}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        await self._settle_cuts()  # their replies go out now, like every reply held by the checkpoint
        held = self.held()
        await super().resume(checkpoint_id, restored)  # held replies wait on the admission: they go out now
        return {"released": held}

    async def restore(self, cut: Cut) -> dict[str, Any]:
        staged: dict[str, CallRecord] = {}
        read = await read_cut(self.store, cut, rehash=False)  # one read for the whole scope, up to P
        for rollout_id in sorted({entry.rollout_id for entry in cut.scope}):
            # As of the cut: a call completed after P is not part of this checkpoint's history.
            staged.update(call_records(list(read.events[rollout_id])))
        for record in staged.values():
            if record.status == CallState.CUT:  # the prefix must be there and intact before anything resumes from it
                await self.token_store.get(Receipt.from_json(record.data["receipt"]).blob_id)
                if record.data.get("prompt_receipt"):
                    await self.token_store.get(Receipt.from_json(record.data["prompt_receipt"]).blob_id)
        self.staged = staged
        self.staged_rollouts = {s.rollout_id for s in cut.scope}
        self.admission.close(checkpoint_id=cut.checkpoint_id)  # paused until resume
        return {"calls": len(staged), "cut_calls": sum(r.status == CallState.CUT for r in staged.values())}

    async def stop(self) -> None:
        await self.progress.stop()
        tasks = [c.task for c in list(self.calls.values()) if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def retire(self, rollout_id: str, through: int) -> None:
        self.numbering.forget(rollout_id, through)
        for c in list(self.calls.values()):
            if c.rollout_id == rollout_id and c.attempt <= through and c.task is not None:
                c.task.cancel()  # its appends would be refused anyway; stop spending the accelerator on it

    def cuttable(self) -> list[LiveCall]:
        """The calls a prepare would cut now: generating, with tokens of their own saved."""
        return [c for c in self.calls.values() if c.state == "generating" and not c.done.is_set() and c.saved_here() is not None]

    def held(self) -> int:
        return sum(1 for c in self.consumers if c.state == "completed" and not c.delivered)

    def in_flight(self) -> int:
        return len({(c.rollout_id, c.attempt) for c in self.calls.values() if not c.done.is_set()})

    def routes(self) -> list[Route]:
        headers = (
            Header(CALL_ID_HEADER, ID_PATTERN, required=False,
                   description="the call's id: a repeat with the same body gets the same reply. Without it the server "
                               "numbers the call (the same body again before its reply was delivered is the same call)"),
            NUMBERED_IN,
            Header(PARENT_HEADER, ID_PATTERN, required=False, description="the call before this one in the rollout"),
            Header(REPLACES_HEADER, REPLACES_PATTERN, required=False,
                   description="comma-separated call ids this call continues, newest first"),
        )
        refused = (InvalidIdentifier, StaleAttempt, AdmissionClosed, RequestConflict, InvalidPhase, AgentDiverged)
        return [
            Route("POST", data_path(COMPLETIONS), self.chat_completions, ChatRequest, ChatCompletion, refused,
                  headers=headers, stream=True),
            Route("POST", data_path(RESPONSES), self.responses, ResponsesRequest, ResponsesReply,
                  (*refused, UnsupportedParameter), headers=headers),
            # A NeMo Gym agent's model calls: the activation in the path it was called on (participants.base.wire).
            *(Route("POST", NG_ROLLOUT + path, handler, body, reply, (*refused, UnsupportedParameter), basic=True,
                    name=f"nemo_gym_{name}") for path, handler, body, reply, name in (
                (RESPONSES, self.responses, ResponsesRequest, ResponsesReply, "responses"),
                (COMPLETIONS, self.chat_completions, ChatRequest, ChatCompletion, "chat_completions"))),
            # Basic too: a NeMo Gym client's call that names no rollout (a judge's) learns why, not 401.
            *(Route("POST", path, self._no_identity, None, None, (RolloutIdRequired,), basic=True,
                    name=f"{name}_without_identity") for path, name in ((COMPLETIONS, "completions"), (RESPONSES, "responses"))),
            Route("GET", MODELS, self.models, None, None, (), name="list_models"),
            Route("GET", data_path(MODELS), self.models, None, None, (), name="list_models_of_attempt"),
            Route("POST", POLICY_VERSION, self.set_policy_version, PolicyVersionRequest, None,
                  (InvalidRequest, InvalidJson), "control"),
            Route("GET", POLICY_VERSION, self.get_policy_version, None, None, (), "control"),
        ]

    # ---- the policy version --------------------------------------------------------------------

    @property
    def policy_version(self) -> str:
        return str(self.backend.policy_version)

    async def adopt_policy_version(self) -> None:
        """The configured version, recorded if it is not the one the log last saw. Done once, before the
        first call or version operation, not at startup: a server that cannot bind its port writes nothing."""
        async with self._adopt_lock:
            if self._adopted:
                return
            events = await self.store.read_stream(POLICY_STREAM)
            last = events[-1].data["policy_version"] if events else None
            if last != self.policy_version:
                await self._record_policy_version(self.policy_version, last, "config")
            self._adopted = True

    async def _record_policy_version(self, version: str, previous: str | None, source: str) -> None:
        data = {"policy_version": version, "previous": previous, "source": source, "instance": self.instance}
        await self._append(NewEvent(POLICY_STREAM, POLICY_VERSION_CHANGED, data))

    async def set_policy_version(self, request: web.Request, body: PolicyVersionRequest) -> web.Response:
        """The framework's call after a weight sync: calls accepted from now on carry the new version;
        calls in flight keep the version they started under (their later tokens are the new policy's
        only if they are cut and continued, which records a new segment)."""
        await self.adopt_policy_version()
        previous = self.policy_version
        if body.policy_version != previous:
            await self._record_policy_version(body.policy_version, previous, body.source)
            self.backend.policy_version = body.policy_version
        return json_reply({"policy_version": body.policy_version, "previous": previous})

    async def get_policy_version(self, request: web.Request, _body: None) -> web.Response:
        return json_reply({"policy_version": self.policy_version})

    async def models(self, request: web.Request, _body: None) -> web.Response:
        return json_reply(models_body(str(getattr(self.backend, "model", "rollbook")), self.policy_version))

    # ---- the data route ---------------------------------------------------------------------

    async def _no_identity(self, request: web.Request, _body: None) -> web.Response:
        raise RolloutIdRequired(f"{request.path}: a model call belongs to a rollout attempt ({data_path(request.path)}; from NeMo "
                                "Gym /ng-rollout/<capture>/...): a judge calling outside any rollout needs [nemo_gym.X] models")

    async def chat_completions(self, request: web.Request, body: ChatRequest) -> web.StreamResponse:
        model = body.model or str(getattr(self.backend, "model", "rollbook"))
        if not body.stream:
            return await self._answered(request, body, lambda call: self.replies.json(call, model, bool(body.logprobs)))
        call = await self._call(request, body)
        try:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self.replies.stream(request, call, model, bool(body.logprobs), include_usage)
        finally:
            self._release(call)

    async def responses(self, request: web.Request, body: ResponsesRequest) -> web.StreamResponse:
        """NeMo Gym's `/v1/responses`: the same call as a chat completion, answered as a Responses object."""
        chat = body.chat_request()
        model = chat.model or str(getattr(self.backend, "model", "rollbook"))
        return await self._answered(request, chat, lambda call: self.replies.response(call, model, body))

    async def _answered(self, request: web.Request, body: ChatRequest,
                        reply: Callable[[LiveCall], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """The call's reply. One numbered here that a checkpoint cuts is asked again after resume and goes
        on from its cut, as rollbook's own agent asks again: an agent that names no call cannot."""
        while True:
            call = await self._call(request, body)
            try:
                return await reply(call)
            except AdmissionClosed:
                if server_call_number(call.call_id, call.rollout_id) is None:
                    raise
            finally:
                self._release(call)
            await self.admission.wait_open()

    async def _call(self, request: web.Request, body: ChatRequest) -> LiveCall:
        """The call a data request asks for, running or done, with one more handler waiting to deliver it."""
        rollout_id, attempt = identity(request)
        backend_request = body.backend_request()
        self.backend.check(backend_request)
        self.served_sessions = True
        digest = request_digest(backend_request)
        named = request.headers.get(CALL_ID_HEADER)
        activation = activation_of(request)
        parent = validate_id(sent, f"{PARENT_HEADER} header") if (sent := request.headers.get(PARENT_HEADER)) else None
        # A comma-separated chain, newest first: the call this one continues, then the call that one continued.
        replaces = ",".join(validate_id(c.strip(), f"{REPLACES_HEADER} header") for c in raw.split(",")) if (
            raw := request.headers.get(REPLACES_HEADER)) else None
        if named:
            call_id = validate_id(named, f"call id ({CALL_ID_HEADER})")
        else:
            call_id, replays = await self.numbering.call_id(rollout_id, attempt, activation, digest)
            replaces = replaces or replays
        call = await self._admit(call_id, rollout_id, attempt, parent, replaces, body, body.stream, digest)
        if not named:
            self.numbering.numbered((rollout_id, attempt, activation), call)
        self.consumers[call] += 1
        return call

    def _release(self, call: LiveCall) -> None:
        self.consumers[call] -= 1
        if self.consumers[call] <= 0:
            del self.consumers[call]

    async def _admit(
        self, call_id: str, rollout_id: str, attempt: int, parent: str | None, replaces: str | None,
        payload: ChatRequest, stream: bool, digest: str,
    ) -> LiveCall:
        """Attach to the call if it is running or done; else accept it (or refuse it, recorded)."""
        async with self._locks(call_id):
            live = self.calls.get(call_id)
            if live is not None:
                await self.check_attempt(rollout_id, attempt)
                check_owner(call_id, live.rollout_id, live.attempt, rollout_id, attempt)
                check_same_request(call_id, live.digest or None, digest)
                return live
            # A call id is almost always new: the first try claims it unread, expecting its stream empty (a
            # repeat, a call cut or held elsewhere refuses that append; the tries after it read the log first).
            if not self._adopted:
                await self.adopt_policy_version()
            # Admission closed: a new call is recorded as excluded, a known one is answered from the log, so
            # read. Open: nothing awaits between here and the accept's admission check, so it is still open there.
            read = not self.admission.is_open
            for tries in range(1, CLAIM_TRIES + 2):  # the last try's conflict is the caller's
                # Unread and replacing nothing, the claim's `call_accepted` refuses a stale attempt itself before
                # any generation; any other path may answer from the log without appending: the gate first.
                if read or replaces is not None:
                    await self.check_attempt(rollout_id, attempt)
                try:
                    return await self._claim(call_id, rollout_id, attempt, parent, replaces, payload, stream, digest, read)
                except VersionConflict:
                    if tries > CLAIM_TRIES:
                        raise
                    read = True  # the stream was not empty, or another instance claimed the call meanwhile: read again
                except UnknownAttempt:  # refused as the gate refuses an attempt never started: one request, one code
                    check_current(rollout_id, attempt, None, -1)
                    raise

    async def _claim(
        self, call_id: str, rollout_id: str, attempt: int, parent: str | None, replaces: str | None,
        payload: ChatRequest, stream: bool, digest: str, read: bool = True,
    ) -> LiveCall:
        """Decide from the log, once no other live instance holds the call (engine.ownership); `read`
        False: as if its stream were empty, which the accepting append then requires."""
        events = await settled(self, call_stream(call_id), _holder(call_id)) if read else []
        seen = events[-1].stream_version if events else 0
        record = call_records(events).get(call_id)
        if record is not None:
            check_owner(call_id, record.rollout_id, record.attempt, rollout_id, attempt)
            check_same_request(call_id, record.accepted.get("request_digest"), digest)
            if record.status == CallState.COMPLETED:
                return LiveCall.stored(record, stream)  # a repeat: the stored reply, no generation
            if call_lost(record.status, await owner_verdict(self, record.accepted.get("instance"), held_here=False)):
                failed = {"call_id": call_id, "error": {"code": "call_lost", "detail": "accepted by a model server "
                          "that is gone; its reply was never recorded"}, "tokens": 0, "lost": True}
                await self.store.append(claim((NewEvent(call_stream(call_id), ev.CALL_FAILED, failed, rollout_id, attempt),),
                                              call_stream(call_id), seen))
                raise AttemptLost(f"call {call_id} was accepted by a model server that is gone and its reply was "
                                  f"never recorded; the rollout continues under a new attempt",
                                  rollout_id=rollout_id, attempt=attempt, lost="call", call_id=call_id)
        return await self._accept(call_id, rollout_id, attempt, parent, replaces, payload, stream, record, seen, digest)

    async def _accept(
        self, call_id: str, rollout_id: str, attempt: int, parent: str | None, replaces: str | None,
        payload: ChatRequest, stream: bool, own: CallRecord | None, seen: int, digest: str,
    ) -> LiveCall:
        stream_name = call_stream(call_id)
        if not self._adopted:  # before the admission check: nothing may await between it and the registration
            await self.adopt_policy_version()
        if not self.admission.is_open and server_call_number(call_id, rollout_id) is not None:
            await self.admission.wait_open()  # numbered here: held, unrecorded, until resume (module docstring)
        if not self.admission.is_open:
            excluded = {"call_id": call_id, "parent_call_id": parent, "reason": "admission_closed"}
            await self._append(NewEvent(stream_name, ev.CALL_EXCLUDED, excluded, rollout_id, attempt))
            raise AdmissionClosed(f"call {call_id} refused: admission is closed for a checkpoint; retry after resume")
        # Registered before any await, so a prepare that starts now sees this call.
        call = LiveCall(call_id, rollout_id, attempt, stream, request=payload.backend_request(), policy_version=self.policy_version)
        call.digest = digest  # of the same body, computed once when the call came in
        self.calls[call_id] = call
        reserved: tuple[str, int] | None = None
        try:
            accepted: dict[str, Any] = {"call_id": call_id, "parent_call_id": parent, "policy_version": call.policy_version,
                                        "stream": stream, "sampling": payload.sampling(), "request_digest": call.digest,
                                        "instance": self.instance}
            source: CallRecord | None = own if own is not None and own.status == CallState.CUT else None
            if replaces is not None:
                chain = replaces.split(",")
                reserved = await self._reserve_replacement(chain[0], call_id, rollout_id, attempt)
                accepted["replaces"] = call.extra["replaces"] = chain[0]
                old = await self._newest_durable(chain, rollout_id, attempt)
                if old is not None and old.status == CallState.COMPLETED:
                    return await self._link(call, accepted, old, seen)
                if old is not None and old.status == CallState.CUT and source is None:  # its own later cut is longer
                    source = old
            if source is not None:
                accepted["continues"] = await self._continue_from(call, source)
            # Taken at the version decided on: of two instances that decided alike, one appends, one re-reads.
            await self.store.append(claim((NewEvent(stream_name, ev.CALL_ACCEPTED, accepted, rollout_id, attempt),),
                                          stream_name, seen))
        except BaseException as exc:
            if reserved is not None:
                self.replacements.release(reserved, call_id)
            await self._finish(call, "stale" if isinstance(exc, StaleAttempt) else "failed",
                               error=exc if isinstance(exc, RollbookError) else None)
            raise
        call.state = "generating"
        call.task = asyncio.get_running_loop().create_task(self._run(call))
        self.progress.start()
        return call

    async def _newest_durable(self, chain: list[str], rollout_id: str, attempt: int) -> CallRecord | None:
        """The newest call of a replacement chain that left something durable: a reply or a cut prefix."""
        old = None
        for candidate in chain:
            old = await self._replaced(candidate, rollout_id, attempt)
            if old is not None and old.status.durable_reply:
                break
        return old

    async def _continue_from(self, call: LiveCall, source: CallRecord) -> dict[str, Any]:
        """Start `call` from the durable prefix `source` cut; what `call_accepted` records of it."""
        receipt = Receipt.from_json(source.data["receipt"])
        generated = await self.token_store.get(receipt.blob_id)
        prompt = source.data.get("prompt_receipt")
        prompt_ids = (await self.token_store.get(Receipt.from_json(prompt).blob_id)).ids if prompt else ()
        call.restart_from(Prefix(prompt_ids, generated.ids, generated.logprobs or (), source.data.get("partial") or {}))
        call.prefix_segments = [dict(x) for x in source.data.get("segments") or []]
        call.extra["prefix_tokens"] = call.floor = len(generated.ids)
        if prompt:  # the prefix is durable already: a cut before any new token is saved records it again
            call.durable = DurablePrefix(len(generated.ids), receipt, Receipt.from_json(prompt),
                                         source.data.get("partial") or {}, call.prefix_segments)
        return {"call_id": source.call_id, "receipt": receipt.to_json()}

    async def _reserve_replacement(self, replaces: str, call_id: str, rollout_id: str, attempt: int) -> tuple[str, int]:
        """One call per attempt may replace a given call (engine.calls.Replacements)."""
        if self.replacements.needs_log(replaces, attempt, call_id):
            self.replacements.learn(replaces, attempt, call_id, await self.store.read_rollout(rollout_id, attempt))
        return self.replacements.claim(replaces, attempt, call_id)  # no await between the learning and the claim

    async def _replaced(self, old_id: str, rollout_id: str, attempt: int) -> CallRecord | None:
        if rollout_id in self.staged_rollouts:
            old = self.staged.get(old_id)  # restored: only what the checkpoint holds
        else:
            old = call_records(await self.store.read_stream(call_stream(old_id))).get(old_id)
        if old is not None:
            check_replaceable(old_id, old.rollout_id, old.attempt, rollout_id, attempt)
        return old

    async def _link(self, call: LiveCall, accepted: dict[str, Any], old: CallRecord, seen: int) -> LiveCall:
        """Deliver the replaced call's stored reply under the new id; both custody events in one append."""
        accepted["policy_version"] = old.accepted.get("policy_version", accepted["policy_version"])  # who served it
        completed = {**old.data, "call_id": call.call_id, "disposition": "linked", "replaces": old.call_id,
                     "tokens": old.data["receipt"]["tokens"], "policy_version": accepted["policy_version"]}
        stream = call_stream(call.call_id)
        await self.store.append(claim((
            NewEvent(stream, ev.CALL_ACCEPTED, accepted, call.rollout_id, call.attempt),
            NewEvent(stream, ev.CALL_COMPLETED, completed, call.rollout_id, call.attempt),
        ), stream, seen))
        await self._finish(call, "completed", result=completed)
        return call

    # ---- generation -------------------------------------------------------------------------

    async def _run(self, call: LiveCall) -> None:
        try:
            await call.pump(self.backend)
            if call.state != "generating":
                return  # prepare cut it, at its durable prefix: it is finished at resume (_settle_cuts)
            call.state = "recording"  # no await since the check: a prepare from now on leaves it be
            await self._record_outcome(call, ev.CALL_COMPLETED, {
                "reply": final_message(call.message), "disposition": "generated", "tokens": len(call.ids),
                "finish_reason": call.finish_reason, "usage": usage(len(call.prompt_ids), len(call.ids)),
                "upstream_usage": call.upstream_usage, **call.extra})
        except StaleAttempt as exc:  # fenced while generating: nothing of it may land, and nothing did
            await self._finish(call, "stale", error=exc)
        except asyncio.CancelledError:
            await self._finish(call, "stale", error=StaleAttempt(
                f"call {call.call_id} was stopped: attempt {call.attempt} of {call.rollout_id} was retired or the server stopped"))
            raise
        except Exception as exc:
            error = exc if isinstance(exc, RollbookError) else GenerationFailed(f"{type(exc).__name__}: {exc}")
            failed = {"call_id": call.call_id, "error": {"code": error.code, "detail": error.detail}, "tokens": len(call.ids)}
            try:
                await self._append(NewEvent(call_stream(call.call_id), ev.CALL_FAILED, failed, call.rollout_id, call.attempt))
            except StaleAttempt as stale:
                error = stale
            except DatabaseUnavailable as lost:
                # Neither the outcome nor the failure could be written. The log holds the call as accepted
                # with no outcome, which is what a crash here would leave, and what recovery and a retry expect.
                log.warning("call %s: could not record its outcome: %s", call.call_id, lost.detail)
                error = lost
            finally:
                await self._finish(call, "failed" if not isinstance(error, StaleAttempt) else "stale", error=error)

    async def _settle_cuts(self) -> None:
        """Finish the calls the last prepare cut. Unless its checkpoint was committed (which it is only
        with them in the log), their cuts are appended first, under the keys the coordinator uses: one
        copy in the log whoever appended first. A call whose attempt was fenced meanwhile is stale; a
        refusal of one never costs another call its cut."""
        cuts, recorded, self.cuts, self.cuts_recorded = self.cuts, self.cuts_recorded, [], False
        outcomes: list[Any] = [None] * len(cuts)
        if not recorded:
            outcomes = await asyncio.gather(*(self.store.append(r.request()) for _, r in cuts), return_exceptions=True)
        for (call, record), outcome in zip(cuts, outcomes, strict=True):
            if outcome is None or isinstance(outcome, list):
                await self._finish(call, "cut", result=record.event.data)
            elif isinstance(outcome, RollbookError):
                await self._finish(call, "stale" if isinstance(outcome, StaleAttempt) else "failed", error=outcome)
            else:
                raise outcome

    @staticmethod
    def _cut_event(call: LiveCall) -> NewEvent:
        """The cut of `call` at its durable prefix (LiveCall.saved_here)."""
        d = call.saved_here()
        assert d is not None, "only a call with a durable prefix of its own is cut"
        data = {"call_id": call.call_id, "receipt": d.receipt.to_json(), "prompt_receipt": d.prompt_receipt.to_json(),
                "policy_version": call.policy_version, "segments": d.segments, "tokens": d.tokens, "partial": d.partial,
                "unsaved": max(0, len(call.ids) - d.tokens)}
        return NewEvent(call_stream(call.call_id), ev.CALL_CUT, data, call.rollout_id, call.attempt)

    async def _record_outcome(self, call: LiveCall, kind: str, data: dict[str, Any]) -> None:
        # Staged, not put: the blobs are written in the transaction that appends the outcome naming them.
        receipt = await self.token_store.stage(call.ids, call.logprobs)
        prompt = await self.token_store.stage(list(call.prompt_ids))
        full = {"call_id": call.call_id, "receipt": receipt.to_json(), "prompt_receipt": prompt.to_json(),
                "policy_version": call.policy_version, "segments": call.segments(), **data}
        await self._append(NewEvent(call_stream(call.call_id), kind, full, call.rollout_id, call.attempt))
        await self._finish(call, kind.removeprefix("call_"), result=full)

    async def _finish(self, call: LiveCall, state: str, result: dict[str, Any] | None = None,
                      error: RollbookError | None = None) -> None:
        if state == "failed" and error is None:
            error = GenerationFailed(f"call {call.call_id} failed before it could be generated")
        call.state, call.result, call.error = state, result, error
        call.done.set()
        if self.calls.get(call.call_id) is call:
            del self.calls[call.call_id]  # from now on a repeat reads the log
        async with call.changed:
            call.changed.notify_all()

    async def _append(self, event: NewEvent) -> None:
        await self.store.append(AppendRequest((event,)))


def _holder(call_id: str) -> Callable[[Sequence[RecordedEvent]], str | None]:
    """The instance that accepted the call while it has no outcome (participants.base.owners.settled)."""
    def holder(events: Sequence[RecordedEvent]) -> str | None:
        record = call_records(list(events)).get(call_id)
        return record.accepted.get("instance") if record is not None and record.status == CallState.ACCEPTED else None
    return holder


__all__ = ["ModelParticipant", "PolicyVersionRequest"]
