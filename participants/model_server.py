"""The policy model server: an OpenAI-compatible front to a generation backend, with custody.

Every call leaves events on its stream (engine.identity.call_stream): `call_accepted`, then one
of `call_completed` (token receipt + reply), `call_cut` (receipt of the durable prefix),
`call_failed`; a call refused because admission is closed leaves `call_excluded`. A call of a
fenced attempt leaves nothing: check_attempt and the append itself refuse it.

Checkpoint behaviour:
- prepare closes admission, lets non-streaming calls finish and cuts streaming calls at a token
  boundary (prefix stored, `call_cut` recorded, the client's stream ends with a rollbook cut
  event). A reply that becomes ready while admission is closed is HELD: the HTTP response waits
  for resume, so no agent can move past the boundary the checkpoint is recording.
- restore stages the calls of the rollouts in the cut (as of the cut's position); a call that
  names one of them in X-Rollbook-Replaces-Call-Id gets its stored reply (`linked`, once per
  attempt) or continues its cut prefix, so the result equals an uninterrupted generation.

After a crash: a call asked for again whose reply the log holds gets that reply, never a second
generation. A call the log says was accepted that no process here is serving was lost with the
server that accepted it (engine.recovery.call_lost): it is recorded `call_failed` (`call_lost`)
and refused with `attempt_lost`, and the environment server continues the rollout under a new
attempt from the boundary before that call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from adapters.generation import (
    End,
    GenerationBackend,
    Prefix,
    Start,
    Step,
    final_message,
    merge_delta,
)
from engine import catalog as ev
from engine.calls import Replacements, check_owner, check_replaceable, check_same_request
from engine.catalog import POLICY_VERSION_CHANGED
from engine.checkpoint import Cut, ParticipantStore, read_cut
from engine.errors import (
    AdmissionClosed,
    AttemptLost,
    DatabaseUnavailable,
    GenerationFailed,
    RollbookError,
    RolloutIdRequired,
    StaleAttempt,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent, canonical_json
from engine.identity import ID_PATTERN, call_stream, policy_stream, validate_id
from engine.recovery import call_lost
from engine.tokens import Receipt, TokenSink, TokenSource
from participants.control_plane import (
    CONTROL,
    PARTICIPANT,
    Participant,
    PrepareReport,
    build_app,
    data_path,
    identity,
)
from participants.guard import Credentials, Header, Route
from participants.openai_wire import (
    ChatCompletion,
    ChatRequest,
    chunk,
    completion_body,
    error_event,
    logprob_entries,
    models_body,
    rollbook_info,
    sse,
    usage,
    usage_chunk,
    whole_delta,
)

log = logging.getLogger(__name__)

CALL_ID_HEADER = "X-Rollbook-Call-Id"
PARENT_HEADER = "X-Rollbook-Parent-Call-Id"
REPLACES_HEADER = "X-Rollbook-Replaces-Call-Id"
COMPLETIONS = "/v1/chat/completions"
MODELS = "/v1/models"
POLICY_VERSION = f"{CONTROL}/policy_version"
POLICY_STREAM = policy_stream()
# prepare must answer before the control plane's own deadline timer fires, so it stops waiting a bit early
PREPARE_MARGIN_S = 0.05
REPLACES_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*( *, *[A-Za-z0-9][A-Za-z0-9._-]*)*$"
CUSTODY = (ev.CALL_ACCEPTED, ev.CALL_COMPLETED, ev.CALL_CUT, ev.CALL_FAILED, ev.CALL_EXCLUDED)


class TokenStore(TokenSink, TokenSource, Protocol):
    """What the model server needs of adapters.token_store: put a call's tokens, get a prefix back."""


@dataclass
class _Record:
    """A call as the log tells it: its last custody event and the acceptance before it."""

    call_id: str
    rollout_id: str | None
    attempt: int | None
    status: str  # accepted | completed | cut | failed | excluded
    data: dict[str, Any]
    accepted: dict[str, Any] = field(default_factory=dict)


def _records(events: list[RecordedEvent]) -> dict[str, _Record]:
    out: dict[str, _Record] = {}
    for e in events:
        if e.kind not in CUSTODY:
            continue
        cid = e.data["call_id"]
        prior = out.get(cid)
        if e.kind == ev.CALL_EXCLUDED and prior is not None and prior.status in ("cut", "completed"):
            continue  # a retry refused while admission was closed changes nothing: the cut prefix still stands
        accepted = e.data if e.kind == ev.CALL_ACCEPTED else (prior.accepted if prior else {})
        out[cid] = _Record(cid, e.rollout_id, e.attempt, e.kind.removeprefix("call_"), e.data, accepted)
    return out


@dataclass(eq=False)
class _Call:
    """A call this process is serving. Mutable on purpose: it is live state, never logged as such."""

    call_id: str
    rollout_id: str
    attempt: int
    stream: bool
    request: dict[str, Any] = field(default_factory=dict)
    policy_version: str | None = None
    prefix: Prefix | None = None
    prefix_segments: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # merged into call_completed
    digest: str = ""  # request_digest of the body it was accepted with
    state: str = "accepting"  # accepting -> generating -> completed | cut | failed | stale
    prompt_ids: tuple[int, ...] = ()
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # what a streaming client is sent, in order
    message: dict[str, Any] = field(default_factory=dict)  # the deltas so far, merged
    finish_reason: str | None = None
    upstream_usage: dict[str, Any] | None = None
    continuation: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: RollbookError | None = None
    delivered: bool = False
    cut_requested: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None

    @classmethod
    def stored(cls, record: _Record, stream: bool) -> _Call:
        call = cls(record.call_id, record.rollout_id or "", record.attempt or 0, stream, state="completed", result=record.data)
        call.done.set()
        return call

    def restart_from(self, prefix: Prefix | None) -> None:
        """The tokens start over from `prefix` (none: from nothing)."""
        self.prefix = prefix if prefix is not None and prefix.ids else None
        p = self.prefix
        self.ids = list(p.ids) if p else []
        self.logprobs = list(p.logprobs) if p else []
        self.tops = [()] * len(self.ids)
        self.message = {k: (list(v) if isinstance(v, list) else v) for k, v in (p.message if p else {}).items()}
        if p and p.message.get("tool_calls"):
            self.message["tool_calls"] = [{**c, "function": dict(c["function"])} for c in p.message["tool_calls"]]
        self.steps = []  # the prefix joins them once the backend says it continues it (see _pump)
        if not p:
            self.prefix_segments = []

    def segments(self) -> list[dict[str, Any]]:
        """Which policy version produced which tokens: a call cut under one version and continued under
        another records both, so staleness is known per token."""
        prefix = self.prefix_segments if self.prefix else []
        new = len(self.ids) - (len(self.prefix.ids) if self.prefix else 0)
        out = [dict(x) for x in prefix]
        if new or not out:
            if out and out[-1]["policy_version"] == self.policy_version:
                out[-1]["tokens"] += new
            else:
                out.append({"policy_version": self.policy_version, "tokens": new})
        return out


class ModelParticipant(Participant):
    kind = "model"
    concurrency = "calls run concurrently; one call id is accepted once; control operations serialized"

    def __init__(self, store: ParticipantStore, backend: GenerationBackend, token_store: TokenStore, instance: str) -> None:
        self._open = asyncio.Event()
        super().__init__(store, instance)  # sets admission_open = True through the property below
        self.backend = backend
        self.token_store = token_store
        self.calls: dict[str, _Call] = {}  # in flight here, not yet finished
        self.consumers: Counter[_Call] = Counter()  # calls a handler is waiting to deliver
        self.staged: dict[str, _Record] = {}
        self.staged_rollouts: set[str] = set()
        self.replacements = Replacements()  # (replaced call, attempt) -> the call that replaced it (engine.calls)
        self._locks: dict[str, list[Any]] = {}  # call id -> [lock, holders and waiters]
        self._adopted = False
        self._adopt_lock = asyncio.Lock()

    @property
    def admission_open(self) -> bool:  # type: ignore[override]
        return self._open.is_set()

    @admission_open.setter
    def admission_open(self, value: bool) -> None:
        # An event, not a flag: held replies wait on it and go out the moment resume sets it.
        if value:
            self._open.set()
        else:
            self._open.clear()

    # ---- control plane hooks ---------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        self.admission_open = False
        inflight = [c for c in self.calls.values() if not c.done.is_set()]
        for c in inflight:
            # Every generation is cut, streamed to its client or not: prepare waits for the cut to be
            # durable (a token-store put and an append), never for a generation to finish.
            c.cut_requested.set()
        budget = deadline - time.time() - PREPARE_MARGIN_S
        if inflight and budget > 0:
            waiters = [asyncio.ensure_future(c.done.wait()) for c in inflight]
            await asyncio.wait(waiters, timeout=budget)
            for w in waiters:
                w.cancel()
        blockers = [c.call_id for c in inflight if not c.done.is_set()]
        counts = {
            "accepted": len(inflight),
            "completed": sum(c.state == "completed" for c in inflight),
            "cut": sum(c.state == "cut" for c in inflight),
            "held": self.held(),
        }
        return PrepareReport(ready=not blockers, blockers=blockers, counts=counts)

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        held = self.held()
        self.admission_open = True
        return {"released": held}

    async def restore(self, cut: Cut) -> dict[str, Any]:
        staged: dict[str, _Record] = {}
        read = await read_cut(self.store, cut, rehash=False)  # one read for the whole scope, up to P
        for rollout_id in sorted({entry.rollout_id for entry in cut.scope}):
            # As of the cut: a call completed after P is not part of this checkpoint's history.
            staged.update(_records(list(read.events[rollout_id])))
        for record in staged.values():
            if record.status == "cut":  # the prefix must be there and intact before anything resumes from it
                await self.token_store.get(Receipt.from_json(record.data["receipt"]).blob_id)
                if record.data.get("prompt_receipt"):
                    await self.token_store.get(Receipt.from_json(record.data["prompt_receipt"]).blob_id)
        self.staged = staged
        self.staged_rollouts = {s.rollout_id for s in cut.scope}
        self.admission_open = False  # paused until resume
        return {"calls": len(staged), "cut_calls": sum(r.status == "cut" for r in staged.values())}

    async def stop(self) -> None:
        tasks = [c.task for c in list(self.calls.values()) if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def retire(self, rollout_id: str, through: int) -> None:
        for c in list(self.calls.values()):
            if c.rollout_id == rollout_id and c.attempt <= through and c.task is not None:
                c.task.cancel()  # its appends would be refused anyway; stop spending the accelerator on it

    def held(self) -> int:
        return sum(1 for c in self.consumers if c.state == "completed" and not c.delivered)

    def in_flight(self) -> int:
        return len({(c.rollout_id, c.attempt) for c in self.calls.values() if not c.done.is_set()})

    def routes(self) -> list[Route]:
        headers = (
            Header(CALL_ID_HEADER, ID_PATTERN, description="the call's id: a repeat with the same body gets the same reply"),
            Header(PARENT_HEADER, ID_PATTERN, required=False, description="the call before this one in the rollout"),
            Header(REPLACES_HEADER, REPLACES_PATTERN, required=False,
                   description="comma-separated call ids this call continues, newest first"),
        )
        return [
            Route("POST", data_path(COMPLETIONS), self.chat_completions, ChatRequest, ChatCompletion,
                  ("invalid_identifier", "stale_attempt", "admission_closed", "conflict", "invalid_phase"),
                  headers=headers, stream=True),
            Route("POST", COMPLETIONS, self._no_identity, None, None, ("rollout_id_required",), name="completions_without_identity"),
            Route("GET", MODELS, self.models, None, None, (), name="list_models"),
            Route("GET", data_path(MODELS), self.models, None, None, (), name="list_models_of_attempt"),
            Route("POST", POLICY_VERSION, self.set_policy_version, PolicyVersionRequest, None,
                  ("invalid_request", "invalid_json"), "control"),
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
        return web.json_response({"policy_version": body.policy_version, "previous": previous})

    async def get_policy_version(self, request: web.Request, _body: None) -> web.Response:
        return web.json_response({"policy_version": self.policy_version})

    async def models(self, request: web.Request, _body: None) -> web.Response:
        return web.json_response(models_body(str(getattr(self.backend, "model", "rollbook")), self.policy_version))

    # ---- the data route ---------------------------------------------------------------------

    async def _no_identity(self, request: web.Request, _body: None) -> web.Response:
        raise RolloutIdRequired(f"call {data_path(COMPLETIONS)}: every model call belongs to a rollout attempt")

    async def chat_completions(self, request: web.Request, body: ChatRequest) -> web.StreamResponse:
        rollout_id, attempt = identity(request)
        self.backend.check(body.backend_request())
        await self.check_attempt(rollout_id, attempt)
        self.served_sessions = True
        call_id = validate_id(request.headers.get(CALL_ID_HEADER), f"call id ({CALL_ID_HEADER})")
        parent = _optional_id(request, PARENT_HEADER)
        # A comma-separated chain, newest first: the call this one continues, then the call that one continued.
        replaces = ",".join(validate_id(c.strip(), f"{REPLACES_HEADER} header") for c in raw.split(",")) if (
            raw := request.headers.get(REPLACES_HEADER)) else None
        call = await self._admit(call_id, rollout_id, attempt, parent, replaces, body, body.stream)
        model = body.model or str(getattr(self.backend, "model", "rollbook"))
        self.consumers[call] += 1
        try:
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream_reply(request, call, model, bool(body.logprobs), include_usage)
            return await self._json_reply(call, model, bool(body.logprobs))
        finally:
            self.consumers[call] -= 1
            if self.consumers[call] <= 0:
                del self.consumers[call]

    @contextlib.asynccontextmanager
    async def _locked(self, key: str) -> AsyncIterator[None]:
        """One decision at a time per call id; the lock is dropped once nobody holds or awaits it."""
        entry = self._locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[key]

    async def _admit(
        self, call_id: str, rollout_id: str, attempt: int, parent: str | None, replaces: str | None,
        payload: ChatRequest, stream: bool,
    ) -> _Call:
        """Attach to the call if it is running or done; else accept it (or refuse it, recorded)."""
        async with self._locked(call_id):
            digest = request_digest(payload.backend_request())
            live = self.calls.get(call_id)
            if live is not None:
                check_owner(call_id, live.rollout_id, live.attempt, rollout_id, attempt)
                check_same_request(call_id, live.digest or None, digest)
                return live
            record = _records(await self.store.read_stream(call_stream(call_id))).get(call_id)
            if record is not None:
                check_owner(call_id, record.rollout_id, record.attempt, rollout_id, attempt)
                check_same_request(call_id, record.accepted.get("request_digest"), digest)
                if record.status == "completed":
                    return _Call.stored(record, stream)  # a repeat: the stored reply, no generation
                if call_lost(record.status, served_here=False):
                    failed = {"call_id": call_id, "error": {"code": "call_lost", "detail": "accepted by a model server "
                              "that is gone; its reply was never recorded"}, "tokens": 0, "lost": True}
                    await self._append(NewEvent(call_stream(call_id), ev.CALL_FAILED, failed, rollout_id, attempt))
                    raise AttemptLost(f"call {call_id} was accepted by a model server that is gone and its reply was "
                                      f"never recorded; the rollout continues under a new attempt",
                                      rollout_id=rollout_id, attempt=attempt, lost="call", call_id=call_id)
            return await self._accept(call_id, rollout_id, attempt, parent, replaces, payload, stream, record)

    async def _accept(
        self, call_id: str, rollout_id: str, attempt: int, parent: str | None, replaces: str | None,
        payload: ChatRequest, stream: bool, own: _Record | None,
    ) -> _Call:
        stream_name = call_stream(call_id)
        if not self._adopted:  # before the admission check: nothing may await between it and the registration
            await self.adopt_policy_version()
        if not self.admission_open:
            excluded = {"call_id": call_id, "parent_call_id": parent, "reason": "admission_closed"}
            await self._append(NewEvent(stream_name, ev.CALL_EXCLUDED, excluded, rollout_id, attempt))
            raise AdmissionClosed(f"call {call_id} refused: admission is closed for a checkpoint; retry after resume")
        # Registered before any await, so a prepare that starts now sees (and waits for or cuts) this call.
        call = _Call(call_id, rollout_id, attempt, stream, request=payload.backend_request(), policy_version=self.policy_version)
        call.digest = request_digest(call.request)
        self.calls[call_id] = call
        reserved: tuple[str, int] | None = None
        try:
            accepted: dict[str, Any] = {"call_id": call_id, "parent_call_id": parent, "policy_version": call.policy_version,
                                        "stream": stream, "sampling": payload.sampling(), "request_digest": call.digest}
            source: _Record | None = own if own is not None and own.status == "cut" else None
            if replaces is not None:
                chain = replaces.split(",")
                reserved = await self._reserve_replacement(chain[0], call_id, rollout_id, attempt)
                accepted["replaces"] = call.extra["replaces"] = chain[0]
                # The newest call of the chain that left something durable: a reply or a cut prefix.
                old = None
                for candidate in chain:
                    old = await self._replaced(candidate, rollout_id, attempt)
                    if old is not None and old.status in ("completed", "cut"):
                        break
                if old is not None and old.status == "completed":
                    return await self._link(call, accepted, old)
                if old is not None and old.status == "cut" and source is None:  # its own later cut is longer
                    source = old
            if source is not None:
                receipt = Receipt.from_json(source.data["receipt"])
                generated = await self.token_store.get(receipt.blob_id)
                prompt = source.data.get("prompt_receipt")
                prompt_ids = (await self.token_store.get(Receipt.from_json(prompt).blob_id)).ids if prompt else ()
                call.restart_from(Prefix(prompt_ids, generated.ids, generated.logprobs or (), source.data.get("partial") or {}))
                call.prefix_segments = [dict(x) for x in source.data.get("segments") or []]
                accepted["continues"] = {"call_id": source.call_id, "receipt": receipt.to_json()}
                call.extra["prefix_tokens"] = len(generated.ids)
            await self._append(NewEvent(stream_name, ev.CALL_ACCEPTED, accepted, rollout_id, attempt))
        except BaseException as exc:
            if reserved is not None:
                self.replacements.release(reserved, call_id)
            await self._finish(call, "stale" if isinstance(exc, StaleAttempt) else "failed",
                               error=exc if isinstance(exc, RollbookError) else None)
            raise
        call.state = "generating"
        call.task = asyncio.get_running_loop().create_task(self._run(call))
        return call

    async def _reserve_replacement(self, replaces: str, call_id: str, rollout_id: str, attempt: int) -> tuple[str, int]:
        """One call per attempt may replace a given call (engine.calls.Replacements)."""
        if self.replacements.needs_log(replaces, attempt, call_id):
            self.replacements.learn(replaces, attempt, call_id, await self.store.read_rollout(rollout_id, attempt))
        return self.replacements.claim(replaces, attempt, call_id)  # no await between the learning and the claim

    async def _replaced(self, old_id: str, rollout_id: str, attempt: int) -> _Record | None:
        if rollout_id in self.staged_rollouts:
            old = self.staged.get(old_id)  # restored: only what the checkpoint holds
        else:
            old = _records(await self.store.read_stream(call_stream(old_id))).get(old_id)
        if old is not None:
            check_replaceable(old_id, old.rollout_id, old.attempt, rollout_id, attempt)
        return old

    async def _link(self, call: _Call, accepted: dict[str, Any], old: _Record) -> _Call:
        """Deliver the replaced call's stored reply under the new id; both custody events in one append."""
        accepted["policy_version"] = old.accepted.get("policy_version", accepted["policy_version"])  # who served it
        completed = {**old.data, "call_id": call.call_id, "disposition": "linked", "replaces": old.call_id,
                     "tokens": old.data["receipt"]["tokens"], "policy_version": accepted["policy_version"]}
        stream = call_stream(call.call_id)
        await self.store.append(AppendRequest((
            NewEvent(stream, ev.CALL_ACCEPTED, accepted, call.rollout_id, call.attempt),
            NewEvent(stream, ev.CALL_COMPLETED, completed, call.rollout_id, call.attempt),
        )))
        await self._finish(call, "completed", result=completed)
        return call

    # ---- generation -------------------------------------------------------------------------

    async def _run(self, call: _Call) -> None:
        try:
            if await self._pump(call):
                await self._record_outcome(call, ev.CALL_CUT, {"tokens": len(call.ids), "partial": call.message})
            else:
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

    async def _pump(self, call: _Call) -> bool:
        """Move steps from the backend into the call until it ends (False) or a cut lands (True).

        A cut never splits a token: the pending step is cancelled, so the prefix is exactly the
        tokens already received."""
        if call.prefix is None:
            call.restart_from(None)
        gen = self.backend.generate(call.request, call.prefix)
        cut_wait = asyncio.ensure_future(call.cut_requested.wait())
        step: asyncio.Future[Any] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(gen))
                await asyncio.wait({step, cut_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return True
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return False
                if isinstance(event, Start):
                    call.prompt_ids = event.prompt_token_ids
                    if event.continuation is not None:
                        call.continuation = call.extra["continuation"] = event.continuation
                        if event.continuation.get("mode") != "continued":  # the prefix is dropped, and why is recorded
                            call.restart_from(None)
                        elif call.prefix is not None:
                            # A streaming client gets one ordinary completion: the prefix as one delta, then the rest.
                            p = call.prefix
                            call.steps.append(Step(p.ids, p.logprobs, whole_delta(p.message) if p.message else {}))
                    continue
                if isinstance(event, End):
                    call.finish_reason, call.upstream_usage = event.finish_reason, event.usage
                    continue
                call.ids.extend(event.ids)
                call.logprobs.extend(event.logprobs)
                call.tops.extend(event.top_logprobs or [()] * len(event.ids))
                merge_delta(call.message, event.delta)
                call.steps.append(event)
                async with call.changed:
                    call.changed.notify_all()
        finally:
            cut_wait.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.wait({step})  # the generator must settle before it can be closed
            await gen.aclose()

    async def _record_outcome(self, call: _Call, kind: str, data: dict[str, Any]) -> None:
        receipt, prompt = await asyncio.gather(self.token_store.put(call.ids, call.logprobs),
                                               self.token_store.put(list(call.prompt_ids)))
        full = {"call_id": call.call_id, "receipt": receipt.to_json(), "prompt_receipt": prompt.to_json(),
                "policy_version": call.policy_version, "segments": call.segments(), **data}
        await self._append(NewEvent(call_stream(call.call_id), kind, full, call.rollout_id, call.attempt))
        await self._finish(call, kind.removeprefix("call_"), result=full)

    async def _finish(self, call: _Call, state: str, result: dict[str, Any] | None = None,
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

    # ---- replies ------------------------------------------------------------------------------

    async def _logprobs(self, call: _Call, result: dict[str, Any]) -> list[dict[str, Any]]:
        if call.ids and len(call.ids) == int(result.get("tokens") or 0):
            return logprob_entries(call.ids, call.logprobs, call.tops)
        stored = await self.token_store.get(Receipt.from_json(result["receipt"]).blob_id)  # a stored or linked reply
        return logprob_entries(list(stored.ids), list(stored.logprobs or [0.0] * len(stored.ids)))

    async def _json_reply(self, call: _Call, model: str, logprobs: bool) -> web.Response:
        await call.done.wait()
        if call.error is not None:
            raise call.error
        if call.state != "completed" or call.result is None:
            raise AdmissionClosed(f"call {call.call_id} was cut at a token boundary for a checkpoint; repeat it after "
                                  "resume and it continues from the cut")
        await self._open.wait()  # held while a checkpoint is being taken
        call.delivered = True
        entries = await self._logprobs(call, call.result) if logprobs else None
        return web.json_response(completion_body(call.call_id, model, call.result, entries))

    async def _stream_reply(self, request: web.Request, call: _Call, model: str, logprobs: bool,
                            include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, call, model, logprobs, include_usage)
        except ConnectionResetError:
            pass  # the client left; the call goes on and its outcome is in the log for a repeat
        return resp

    async def _stream_events(self, resp: web.StreamResponse, call: _Call, model: str, logprobs: bool,
                             include_usage: bool) -> None:
        created, sent = int(time.time()), 0
        cid = call.call_id
        await resp.write(sse(chunk(cid, model, created, {"role": "assistant", "content": ""})))
        if call.result is not None and call.state == "completed" and not call.steps:
            # A stored reply (a repeat, or linked to the call it replaces): it goes out whole.
            entries = await self._logprobs(call, call.result) if logprobs else None
            await resp.write(sse(chunk(cid, model, created, whole_delta(call.result["reply"]), None, entries)))
        else:
            while True:
                async with call.changed:
                    await call.changed.wait_for(lambda n=sent: len(call.steps) > n or call.done.is_set())
                batch = call.steps[sent:]
                for step in batch:
                    if step.delta or logprobs:
                        entries = logprob_entries(list(step.ids), list(step.logprobs), list(step.top_logprobs)) if logprobs else None
                        await resp.write(sse(chunk(cid, model, created, step.delta, None, entries)))
                sent += len(batch)
                if call.done.is_set() and sent >= len(call.steps):
                    break
        if call.error is not None:
            await resp.write(sse(error_event(call.error, call_id=cid)))
        elif call.state == "cut" and call.result is not None:
            cut = AdmissionClosed(f"call {cid} was cut after {call.result['tokens']} tokens for a checkpoint; repeat it "
                                  "after resume and it continues from the cut")
            await resp.write(sse(error_event(cut, cut=True, call_id=cid, tokens=call.result["tokens"],
                                             receipt=call.result["receipt"])))
        elif call.result is not None:
            await self._open.wait()  # held: the client has the tokens but not the end of the reply
            call.delivered = True
            last = chunk(cid, model, created, {}, call.result.get("finish_reason") or "stop")
            last["rollbook"] = rollbook_info(cid, call.result)
            await resp.write(sse(last))
            if include_usage:
                await resp.write(sse(usage_chunk(cid, model, created, call.result)))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


# Options that choose how the reply is shown, not what is generated: a call cut by a checkpoint may be
# asked again with them changed (streamed this time, with logprobs) and is still the same call.
PRESENTATION = ("stream", "stream_options", "logprobs", "top_logprobs")


def request_digest(payload: dict[str, Any]) -> str:
    """What makes two requests under one call id the same request: the body but its presentation options."""
    same = {k: v for k, v in payload.items() if k not in PRESENTATION}
    return hashlib.sha256(canonical_json(same).encode()).hexdigest()


def _optional_id(request: web.Request, header: str) -> str | None:
    value = request.headers.get(header)
    return validate_id(value, f"{header} header") if value else None


class PolicyVersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$")
    source: str = Field(default="weight_sync", max_length=64)


def build_model_app(
    store: ParticipantStore, backend: GenerationBackend, token_store: TokenStore, credentials: Credentials,
    instance: str = "model-0",
) -> web.Application:
    participant = ModelParticipant(store, backend, token_store, instance)
    return build_app(participant, credentials)


__all__ = ["PARTICIPANT", "ModelParticipant", "build_model_app"]
