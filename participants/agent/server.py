"""The agent server: a Simple Agent turn loop per (rollout, attempt), parked at its boundaries.

A session alternates model calls and tool rounds. Before each model call and after each completed
turn it appends an `agent_boundary` event holding everything needed to go on from there (the
conversation, usage, the call it is about to make, the resources revision it saw), so a restore
reads the session back from the log instead of from this process. The conversation is stored as
what changed since the previous boundary (engine.boundaries). A turn's end and the next turn's
start are one moment, so their two boundaries go in one append; so do the last turn's end and the
activation's completion. A session is `idle` (restored, waiting for its activation), `running`, or
`at_boundary` (parked, or waiting on the model, which counts as a boundary: the model server holds
a reply that comes while a checkpoint is open). Prepare does not wait for a tool round in progress:
its mutations land after the session's latest boundary, and a restore of the cut applies them again
to the state rebuilt there. Activations are idempotent by index: the completed index gets its stored
reply again (read from the log), any index but completed + 1 is refused. A task that names a NeMo
Gym agent is run by that agent instead (participants/agent/external.py).

After a crash of this server, the activation a caller asks for again goes on from its last
boundary in the log (engine.recovery.resume_point), under the same attempt: the turns and tool
calls before it are not redone, the pending model call is asked for again under its own id (the
model server delivers a recorded reply, or joins the generation it is still running), and each tool
call carries a key (X-Rollbook-Tool-Call) so the resources server answers a call it already applied
from the log. Another server that does not answer, or a database that is restarting, is waited
for (engine.patience); a part that is gone for good (`attempt_lost`) ends the activation, and the
environment server restarts that rollout under a new attempt.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

from aiohttp import web

from adapters.http_client import JsonClient, as_attempt, data_url
from engine.admission import retired
from engine.boundaries import completed_activations, full_boundary
from engine.catalog import ACTIVATION_CLAIMED, ACTIVATION_COMPLETED, AGENT, kinds_on
from engine.catalog import AGENT_BOUNDARY as BOUNDARY
from engine.checkpoint import Cut, ParticipantStore, read_cut
from engine.errors import (
    ActivationOutOfOrder,
    AdmissionClosed,
    AttemptLost,
    DatabaseUnavailable,
    GymServerFailed,
    InvalidIdentifier,
    InvalidJson,
    InvalidRequest,
    ParticipantUnavailable,
    RestartInScope,
    RollbookError,
    StaleAttempt,
    ToolCallRefused,
    VersionConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.forks import inherited_boundary
from engine.identity import ATTEMPT_PATTERN, Key, agent_stream, parse_attempt, session_stream
from engine.install import restored_attempt
from engine.ownership import claim
from engine.patience import Patience
from participants.agent.session import (
    RunReply,
    RunRequest,
    Session,
    SessionList,
    activation_holder,
    offered_tools,
    session_for,
    tool_call_key,
)
from participants.base.guard import Header, Route, tool_arguments
from participants.base.http_errors import json_reply
from participants.base.keyed_locks import KeyedLocks
from participants.base.owners import CLAIM_TRIES, settled_in_history
from participants.base.participant import Participant, PrepareReport
from participants.base.routing import Peers
from participants.base.wire import (
    ACTIVATION_HEADER,
    CALL_ID_HEADER,
    PARENT_HEADER,
    REPLACES_HEADER,
    TOOL_CALL_HEADER,
    Execution,
    data_path,
    identity,
)
from participants.environments import ENVIRONMENTS

if TYPE_CHECKING:
    from participants.agent.external import ExternalAgents

# What an activation's start reads of its attempt's history: its agent stream's kinds (and, through
# engine.lineage, each attempt's start).
AGENT_KINDS = kinds_on(AGENT)


def pending_boundary(history: list[RecordedEvent]) -> RecordedEvent | None:
    """The last agent boundary of an activation that had not completed by the end of `history`."""
    completed = {e.data["index"] for e in history if e.kind == ACTIVATION_COMPLETED}
    last = next((e for e in reversed(history) if e.kind == BOUNDARY), None)
    if last is None or last.data.get("activation", 0) in completed:
        return None
    return full_boundary(history, last)


def activation_index(request: web.Request) -> int:
    return parse_attempt(request.headers.get(ACTIVATION_HEADER), f"header {ACTIVATION_HEADER}")


class AgentParticipant(Participant):
    kind: ClassVar[str] = "agent"
    concurrency: ClassVar[str] = "one activation at a time per (rollout_id, attempt); control operations serialized"
    # An agent that cannot go on from a boundary sets this False: it is then honestly restart-only.
    supports_continuation: ClassVar[bool] = True
    environment_url: str | None = None  # where NeMo Gym rows received on POST /run are run as episodes
    external_agents: ExternalAgents | None = None  # the agents run unchanged for the tasks that name them

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.checkpoint_mode = "native" if cls.supports_continuation else "restart_only"

    def __init__(self, store: ParticipantStore, instance: str = "agent-0", data_token: str | None = None,
                 model_url: str = "", resources_url: str = "") -> None:
        super().__init__(store, instance)
        # The data credential goes only to the configured model and resources servers.
        self.client = JsonClient(data_token)
        self.secret = data_token  # each request for a session carries that attempt's capability, not this
        self.model_url, self.resources_url = model_url, resources_url
        self.model_peers = Peers(model_url, "model")  # any live model instance: a call is owned in the log, not by an address
        # A session's tool calls go to the resources worker that holds it (participants/base/routing.py).
        self.resources_peers = Peers(resources_url, "resources")
        self.sessions: dict[Key, Session] = {}
        self.running: dict[Key, tuple[int, asyncio.Task[dict[str, Any]]]] = {}
        self.locks: KeyedLocks[Key] = KeyedLocks()
        self.staged: dict[str, tuple[int, dict[str, Any]]] = {}  # rollout -> (origin attempt, boundary data)
        self.staged_from: str | None = None
        self.restored: dict[Key, dict[str, Any]] = {}  # new attempt -> the boundary it continues from

    # ---- data plane ---------------------------------------------------------------------------

    async def run(self, request: web.Request, req: RunRequest) -> web.Response:
        key = identity(request)
        index = activation_index(request)
        if req.tools is None and req.task.env not in ENVIRONMENTS:
            raise InvalidRequest(f"no environment named {req.task.env!r} to take the tools from; name the tools")
        await self.check_attempt(*key)
        self.served_sessions = True
        if self.external_agents is not None and self.external_agents.serves(req.task.agent):
            return json_reply(await self.external_agents.activate(self, key, index, req))
        async with self.locks(key):
            current = self.running.get(key)
            if current is not None and current[0] == index:
                task = current[1]  # a repeat of the running activation waits for the same result
            else:
                for tries in range(1, CLAIM_TRIES + 1):
                    try:
                        # A claim refused after a read of the agent's kinds alone is tried on a read of all.
                        started = await self._start(key, index, req, current, AGENT_KINDS if tries == 1 else None)
                        break
                    except VersionConflict:
                        if tries == CLAIM_TRIES:
                            raise  # otherwise another instance claimed it first: read again, now seeing its owner
                if isinstance(started, dict):
                    return json_reply(started)
                task = started
        return json_reply(await asyncio.shield(task))

    async def _start(self, key: Key, index: int, req: RunRequest, current: tuple[int, asyncio.Task[dict[str, Any]]] | None,
                     kinds: Sequence[str] | None) -> dict[str, Any] | asyncio.Task[dict[str, Any]]:
        """The activation's reply from the log, or its task here once this instance has claimed it
        (engine/ownership.py). While another live instance holds it, this waits for its outcome. `kinds`:
        the history read holds those alone (a NeMo Gym row's task, in the episode's and the session's
        first events, is most of an attempt's bytes, and an activation begins from its agent stream)."""
        own, history = await settled_in_history(self, key, agent_stream(*key), activation_holder(index), kinds)
        completed = completed_activations(history)
        last = max(completed, default=-1)
        if index == last and last >= 0:
            return completed[index]
        if current is not None or index != last + 1:
            raise ActivationOutOfOrder(
                f"activation {index} of {key[0]} attempt {key[1]}: completed is {last}"
                + (f", {current[0]} is running" if current else f", so only {last + 1} may start"),
                rollout_id=key[0], attempt=key[1], completed=last)
        self.admission.require_open("a new activation")
        session = session_for(key, index, req, history, self.restored.pop(key, None), self.supports_continuation)
        await self._claim(session, own[-1].stream_version if own else 0)
        task = asyncio.get_running_loop().create_task(self._drive(session))
        self.sessions[key] = session
        self.running[key] = (index, task)
        task.add_done_callback(lambda _t, k=key: self._finished(k))
        return task

    async def _claim(self, s: Session, seen: int) -> None:
        """Take the activation: its first boundary names this instance and lands only at the stream
        version read; the turn loop then parks at it instead of recording it. A takeover (the session
        goes on from a boundary in the log) appends a claim naming its new owner, at that version too."""
        if s.finished or s.turn >= s.request.max_steps:
            return  # nothing left to run but the completion, which says the same whoever appends it
        if s.resumed:  # its boundary is in the log: a takeover names its new owner beside it
            await self._record(s, self._event(s, ACTIVATION_CLAIMED, {"index": s.index, "instance": self.instance}), seen=seen)
            return
        data = {**s.boundary_data("before_model", s.turn, self._call_id(s, s.turn)), "instance": self.instance}
        await self._record(s, self._event(s, BOUNDARY, data), seen=seen)
        s.resumed = True

    def _finished(self, key: Key) -> None:
        self.running.pop(key, None)
        self.sessions.pop(key, None)

    async def _drive(self, s: Session) -> dict[str, Any]:
        while not s.finished and s.turn < s.request.max_steps:
            t = s.turn
            call_id = self._call_id(s, t)
            if s.resumed:
                s.resumed = False  # this boundary is in the log already (a restart, or the previous turn's append)
                await self._park(s)
            else:
                await self._boundary(s, "before_model", t, call_id)
            reply, usage = await self._model(s, call_id)
            await self._park(s)  # the reply is in hand; a checkpoint keeps it at the before_model boundary
            s.state = "running"
            s.replaces = None
            s.calls.append(call_id)
            s.last_call_id = call_id
            for k, v in usage.items():
                if isinstance(v, int):
                    s.usage[k] = s.usage.get(k, 0) + v
            s.messages.append(reply)
            tool_calls = reply.get("tool_calls") or []
            if not tool_calls or s.done:
                s.finished, s.final_answer = True, reply.get("content")
            else:
                for i, tc in enumerate(tool_calls):
                    tc = tc if isinstance(tc, dict) else {}
                    content, done = await self._tool(s, tc, tool_call_key(s.index, t, i))
                    s.messages.append({"role": "tool", "tool_call_id": tc.get("id"), "content": content})
                    s.done = s.done or done
            s.turn = t + 1
            after = self._event(s, BOUNDARY, s.boundary_data("after_turn", t, None))
            if s.finished or s.turn >= s.request.max_steps:
                body = s.reply()
                # The last turn's end is the activation's end: one append, so no boundary is left without it.
                await self._record(s, after, s.completed())
                return body
            # Nothing happens between this turn's end and the next turn's start: both boundaries in one
            # append, and the next turn parks at the second as it would at one it had just recorded.
            await self._record(s, after, self._event(s, BOUNDARY, s.boundary_data("before_model", s.turn,
                                                                                   self._call_id(s, s.turn))))
            s.resumed = True
        body = s.reply()
        await self._record(s, s.completed())
        return body

    @staticmethod
    def _call_id(s: Session, turn: int) -> str:
        """`<rollout>.<attempt>.t<turn>` for activation 0, with `.a<n>` before the turn for a later one,
        which starts at turn 0 again: without it, it got activation 0's stored replies."""
        activation = f".a{s.index}" if s.index else ""
        return f"{s.rollout_id}.{s.attempt}{activation}.t{turn}"

    @staticmethod
    def _event(s: Session, kind: str, data: dict[str, Any]) -> NewEvent:
        return NewEvent(agent_stream(*s.key), kind, data, *s.key)

    async def _record(self, s: Session, *events: NewEvent, seen: int | None = None) -> None:
        """Append `events`; with `seen`, only while the session's stream is at that version (a claim)."""
        if not self.supports_continuation:
            # An online checkpoint reads from the log which activations it must restart (engine.checkpoint).
            events = tuple(replace(e, data={**e.data, "continuable": False}) if e.kind == BOUNDARY else e
                           for e in events)
        await self.store.append(AppendRequest(events) if seen is None else claim(events, agent_stream(*s.key), seen))

    async def _boundary(self, s: Session, state: str, turn: int, pending: str | None) -> None:
        await self._record(s, self._event(s, BOUNDARY, s.boundary_data(state, turn, pending)))
        await self._park(s)

    async def _park(self, s: Session) -> None:
        """While a checkpoint is in progress a session waits here, at the boundary it just recorded."""
        if self.admission.is_open:
            return
        s.state = "at_boundary"
        await self.admission.wait_open()
        s.state = "running"

    async def _wait_closed(self, closed: Patience, exc: RollbookError, at_boundary: bool) -> None:
        # Another server refused new work for a checkpoint: the refused call changed nothing, so ask
        # again later (backing off: each refusal of a model call is a `call_excluded` event). A session
        # at its boundary may wait for this server's own resume instead; one inside a tool round asks
        # again, since the checkpoint that closed the callee may not be the one that closed this server.
        if self.admission.is_open or not at_boundary:
            await asyncio.sleep(closed.next_delay(exc, soon=self.admission.callee_resuming(exc)))
        else:
            await self.admission.wait_open()

    async def _model(self, s: Session, call_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        headers = {CALL_ID_HEADER: call_id, **as_attempt(self.secret, *s.key)}
        if s.last_call_id:
            headers[PARENT_HEADER] = s.last_call_id
        if s.replaces:
            headers[REPLACES_HEADER] = s.replaces
        # The task's sampling parameters ride on every call; the model server records them with the call.
        body = {"model": s.request.model, "messages": s.messages, "tools": s.tools, "seed": s.request.seed,
                **s.sampling, "stream": False}
        s.state = "at_boundary"  # waiting on the model counts as being at the boundary just recorded
        closed, unavailable = Patience(f"model call {call_id}", limit_s=None), Patience(f"model call {call_id}")
        try:
            while True:
                try:  # asked again where the live instances say now: a dead one's calls are taken over there
                    url = data_url(await self.model_peers.url(*s.key), *s.key, "/v1/chat/completions")
                    out = await self.client.post(url, body, headers)
                    break
                except AdmissionClosed as exc:
                    await self._wait_closed(closed, exc, at_boundary=True)
                except (ParticipantUnavailable, DatabaseUnavailable) as exc:
                    await asyncio.sleep(unavailable.next_delay(exc))
        finally:
            s.state = "running"
        message = dict(out["choices"][0]["message"])
        s.policy_version = (out.get("rollbook") or {}).get("policy_version") or s.policy_version
        return message, dict(out.get("usage") or {})

    async def _tool(self, s: Session, tc: dict[str, Any], call_key: str) -> tuple[str, bool]:
        # Everything in `tc` is the model's output, and the model is the adversary: the name is only
        # ever compared with the names offered, and only an offered name reaches a URL, as one escaped
        # segment (a name like "../../rollouts/<other>/..." once reached another rollout's shell).
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        name = fn.get("name")
        if not isinstance(name, str) or name not in offered_tools(s.tools):
            shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
            return json.dumps({"error": "unknown_tool", "message": f"no tool named {shown} was offered; the tools are "
                               f"{', '.join(sorted(offered_tools(s.tools)))}"}), False
        try:
            args = tool_arguments(fn.get("arguments"))
        except InvalidJson as exc:
            return json.dumps({"error": "bad_arguments", "message": exc.detail}), False
        path = "/tools/" + quote(name, safe="")
        closed, unavailable = Patience(f"tool call {call_key}", limit_s=None), Patience(f"tool call {call_key}")
        while True:
            try:
                # Where the live set says now: a dead worker's session is taken over by the one it moves to.
                url = data_url(await self.resources_peers.url(*s.key), *s.key, path)
                out = await self.client.post(url, {"arguments": args},
                                             {TOOL_CALL_HEADER: call_key, **as_attempt(self.secret, *s.key)})
                break
            except AdmissionClosed as exc:
                await self._wait_closed(closed, exc, at_boundary=False)
            except (ParticipantUnavailable, DatabaseUnavailable) as exc:
                await asyncio.sleep(unavailable.next_delay(exc))
            except RollbookError as exc:
                if exc.code != "tool_error":
                    raise
                # A refused call changed nothing; the model sees the refusal like any tool output.
                return json.dumps({"error": exc.context.get("tool_error", "tool_error"), "message": exc.detail},
                                  sort_keys=True), False
        revision = int(out.get("revision", s.revision_seen))
        if revision != s.revision_seen:
            # Only revisions this attempt changed: lineage compares them with this attempt's own mutations.
            s.revisions[session_stream(*s.key)] = revision
            s.revision_seen = revision
        return json.dumps(out.get("output"), sort_keys=True), bool(out.get("done"))

    def in_flight(self) -> int:
        return sum(1 for _, task in self.running.values() if not task.done())

    async def list_sessions(self, request: web.Request, _body: None) -> web.Response:
        rows = [{"rollout_id": s.rollout_id, "attempt": s.attempt, "activation": s.index, "state": s.state, "turn": s.turn}
                for s in self.sessions.values()]
        rows += [{"rollout_id": r, "attempt": a, "activation": b.get("activation", 0), "state": "idle", "turn": b["turn"]}
                 for (r, a), b in self.restored.items()]
        return json_reply({"sessions": rows})

    def routes(self) -> list[Route]:
        activation = Header(ACTIVATION_HEADER, ATTEMPT_PATTERN, description="the activation index: 0, then one more each time")
        return [
            Route("POST", data_path("/run"), self.run, RunRequest, RunReply,
                  (InvalidIdentifier, StaleAttempt, ActivationOutOfOrder, AdmissionClosed, ToolCallRefused, ParticipantUnavailable,
                   AttemptLost, GymServerFailed), headers=(activation,)),
            Route("GET", "/sessions", self.list_sessions, None, SessionList),
        ]

    # ---- control plane hooks --------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        await super().prepare(checkpoint_id, deadline)
        # Nothing to wait for: a session goes on to its next boundary and parks there (_park).
        restarts = [] if self.supports_continuation else [
            Execution(rollout_id=r, attempt=a) for r, a in [*self.sessions, *self.restored]]
        running = sum(1 for s in self.sessions.values() if s.state == "running")
        return PrepareReport(
            ready=True,
            counts={"sessions": len(self.sessions) + len(self.restored), "running": running},
            restarts=restarts,
        )

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Read each scoped execution's last boundary from the log and stage it; nothing runs yet."""
        staged: dict[str, tuple[int, dict[str, Any]]] = {}
        read = await read_cut(self.store, cut, rehash=False)  # one read for the whole scope
        for entry in cut.scope:
            last = pending_boundary(read.effective(entry.rollout_id, entry.attempt, to=entry.boundary))
            if last is None:
                continue  # the agent had not started, or its activation completed: nothing to continue here
            if not self.supports_continuation:
                raise RestartInScope(f"{entry.rollout_id} attempt {entry.attempt} is mid-activation on a restart-only agent",
                                     executions=[[entry.rollout_id, entry.attempt]])
            staged[entry.rollout_id] = (entry.attempt, inherited_boundary(last, entry.rollout_id))
        self.staged, self.staged_from = staged, cut.checkpoint_id
        return {"staged": len(staged)}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        attached = 0
        if restored and self.staged_from == checkpoint_id and self.staged:
            rows = await self.store.attempt_rows(sorted(self.staged))
            for rid, (origin, data) in self.staged.items():
                target = restored_attempt(rows, rid, origin, checkpoint_id)
                if target is not None:  # otherwise /run still finds the boundary in the log once the attempt is installed
                    self.restored[(rid, target)] = data
                    attached += 1
            self.staged, self.staged_from = {}, None
        await super().resume(checkpoint_id, restored)
        return {"attached": attached}

    async def retire(self, rollout_id: str, through: int) -> None:
        for key in retired(self.running, rollout_id, through):
            self.running[key][1].cancel()
        for key in retired(self.restored, rollout_id, through):
            del self.restored[key]

    async def close(self) -> None:
        await self.client.close()

    async def stop(self) -> None:
        for _, task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*(t for _, t in list(self.running.values())), return_exceptions=True)


__all__ = ["AgentParticipant", "RunRequest", "Session", "BOUNDARY", "ACTIVATION_COMPLETED"]
