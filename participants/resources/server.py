"""The resources server: per-session environment state, every change an event as it happens.

A session is keyed by (rollout_id, attempt) and holds its environment, task, JSON state and revision.
Mutations of one session are serialized by its lock; each one that has an effect is one
`mutation_applied` event on the session's stream, appended before the new state is installed and before
the reply leaves, so no caller ever sees a revision the log lacks. Restore rebuilds every scoped session
from the log alone (initial state, then each effect in order), validates the whole set, stages it, and
installs it under the rollout's new attempt only at resume. A verify that passes closes its session,
and so does one that fails where the caller asks it to close (`session_verified` and `session_closed`
in one append; the reply says `closed`).

After a crash of this server, a session of a live attempt is rebuilt from the log the first time the
attempt asks for it (engine.recovery): its own mutations replayed, or, for an attempt that continues
another one's boundary, the inherited session reopened under the new attempt. A tool call whose mutation
is in the log under its key (the caller's, or the number the server gave: engine.agent_replay) gets its
recorded answer and changes nothing. A restart-only session whose live process died: `attempt_lost`. A
session relayed to NeMo Gym (nemo_gym_relay) keeps its calls as its state; its live session, gone, is
rebuilt by replaying them (engine.tool_replay).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

from aiohttp import web

from engine import catalog as ev
from engine.admission import retired, wait_for_all
from engine.agent_replay import next_tool_numbers, replayed_tool, tool_diverged
from engine.boundaries import completed_activations
from engine.checkpoint import Cut, ParticipantStore
from engine.errors import (
    AdmissionClosed,
    AgentDiverged,
    AttemptLost,
    Forbidden,
    GymServerFailed,
    InvalidIdentifier,
    InvalidRequest,
    NotFound,
    ParticipantUnavailable,
    PayloadTooLarge,
    RequestConflict,
    RestartInScope,
    RollbookError,
    RolloutIdRequired,
    StaleAttempt,
    ToolCallRefused,
    VersionConflict,
)
from engine.events import AppendRequest, RecordedEvent
from engine.identity import (
    TOOL_CALL_KEY_PATTERN,
    Key,
    is_session_stream,
    session_stream,
    validate_tool_call_key,
)
from engine.install import restored_targets
from engine.lineage import effective_history
from engine.recovery import tool_call_outcomes
from engine.sessions import open_session_mode
from engine.snapshot_reads import lineage_rows, read_scope
from engine.snapshots import SessionSnapshot, lineage_bounds, store_snapshots
from participants.base.guard import Empty, Header, Route
from participants.base.http_errors import json_reply
from participants.base.owners import orphaned_sessions
from participants.base.participant import Participant, PrepareReport
from participants.base.wire import (
    NUMBERED_IN,
    TOOL_CALL_HEADER,
    Execution,
    activation_of,
    capture_id,
    data_path,
    identity,
)
from participants.environments import Environment, ToolError, get_environment
from participants.environments.base import Trajectory
from participants.environments.gym_http import close_all
from participants.environments.nemo_gym_relay import LiveGone, live_id, relay, relayed, relayed_verify
from participants.environments.sandbox import SandboxEnvironment, SandboxLimits
from participants.resources.session import Session, Staged, live, rebuild, refused, restart_only, run_live
from participants.resources.wire import (
    OpenRequest,
    SessionReply,
    StateReply,
    ToolReply,
    ToolRequest,
    VerifyReply,
    VerifyRequest,
)

# How many closed sessions a server remembers (see ResourcesParticipant._closed).
MAX_CLOSED_REMEMBERED = 65_536
# How often the live sessions' attempts are checked: a fence (a failed attempt's, a restore's) or a
# retire mark written by any server ends its live shell within this.
LIVE_CHECK_S = 0.5


class ResourcesParticipant(Participant):
    kind: ClassVar[str] = "resources"
    concurrency: ClassVar[str] = "mutations serialized per (rollout_id, attempt) session; control operations serialized"

    def __init__(self, store: ParticipantStore, instance: str = "resources-0", sandbox: SandboxLimits | None = None) -> None:
        super().__init__(store, instance)
        self.sandbox = sandbox  # None: the sandbox environment is off (the default)
        self.sessions: dict[Key, Session] = {}
        self.staged: dict[Key, Staged] = {}
        self.staged_from: str | None = None
        self._recovering: dict[Key, asyncio.Lock] = {}
        # Sessions closed here (`session_closed` durable): a close asked again is answered without the log.
        self._closed: dict[Key, None] = {}
        self._live_watch: asyncio.Task[None] | None = None

    # ---- data plane -------------------------------------------------------------------------

    async def _enter(self, request: web.Request) -> Key:
        """Called once the request has been parsed and checked: only then does the attempt matter."""
        key = identity(request)
        await self.check_attempt(*key)
        self.served_sessions = True
        return key

    def _environment(self, name: str) -> Environment:
        if name == SandboxEnvironment.name and self.sandbox is None:
            raise Forbidden("the sandbox environment is off; the configuration's [sandbox] table turns it on")
        try:
            return self._logged_environment(name)
        except ToolError as exc:
            raise InvalidRequest(exc.message) from exc

    def _logged_environment(self, name: str) -> Environment:
        """A logged session's environment, with this server's sandbox limits (a sandbox session on a
        server whose sandbox is off is refused at its first command)."""
        return SandboxEnvironment(self.sandbox) if name == SandboxEnvironment.name else get_environment(name)

    async def _session(self, key: Key) -> Session:
        s = self.sessions.get(key) or await self._recover(key)
        if s is None or not s.opened:
            raise NotFound(f"no open session for rollout {key[0]} attempt {key[1]}", rollout_id=key[0], attempt=key[1])
        return s

    async def _recover(self, key: Key) -> Session | None:
        """The session of a live attempt this process never held, rebuilt from the log (None: the
        log has no open session for it). Raises AttemptLost for a restart-only session."""
        lock = self._recovering.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self.sessions:
                return self.sessions[key]
            if any(r == key[0] for r, _ in self.staged):
                raise AdmissionClosed(f"the session of {key[0]} is restored and waits for resume")
            history = await effective_history(self.store, *key)
            mode = open_session_mode(history)
            if mode is None:
                return None
            if mode == "restart_only":
                raise AttemptLost(f"rollout {key[0]} attempt {key[1]}: its restart-only session lost its live process "
                                  "with a server restart; the rollout starts over under a new attempt",
                                  rollout_id=key[0], attempt=key[1], lost="session")
            try:
                snapshots = await self.store.session_snapshots(lineage_bounds(history))
                staged, new = rebuild(key[0], key[1], -1, history, snapshots)
                await store_snapshots(self.store, [new])
            except RestartInScope as exc:  # a session logged before sessions named their state mode
                raise AttemptLost(f"rollout {key[0]} attempt {key[1]}: {exc.detail}", rollout_id=key[0], attempt=key[1],
                                  lost="session") from exc
            if staged is None:
                return None
            stream = session_stream(*key)
            own = [e for e in history if e.stream == stream]
            s = Session(key[0], key[1], self._logged_environment(staged.env_name), staged.task, staged.state, staged.revision,
                        stream_version=own[-1].stream_version if own else 0, opened=True)
            s.tool_calls, s.numbers = tool_call_outcomes(history), next_tool_numbers(own)
            verified = [e for e in own if e.kind == ev.SESSION_VERIFIED]
            s.verify_status = verified[-1].data.get("status") if verified else None
            if not own:  # inherited from the boundary this attempt continues: reopen it under this attempt
                origin = next((e.attempt for e in reversed(history) if is_session_stream(e.stream)), None)
                await self._append(s, ev.SESSION_OPENED, {
                    "env": s.env.name, "task": s.task.to_json(), "state_mode": s.env.state_mode, "revision": s.revision,
                    "origin_attempt": origin, "recovered": True, "instance": self.instance})
            self.sessions[key] = s
        self._recovering.pop(key, None)
        return s

    async def _append(self, s: Session, kind: str, data: dict[str, Any],
                      then: tuple[str, dict[str, Any]] | None = None) -> RecordedEvent:
        """`kind`'s event, and `then`'s after it in the same append; the first is returned."""
        events = (s.event(kind, data), *((s.event(*then),) if then else ()))
        # Expecting the stream version we last wrote makes a second writer of this session a conflict.
        try:
            recorded = await self.store.append(AppendRequest(events, {s.stream: s.stream_version}))
        except VersionConflict:
            # Another instance wrote the session since this copy was made (a takeover, or a restore this
            # one also staged): the copy is stale; refused once, the next request rebuilds it from the log.
            if self.sessions.get((s.rollout_id, s.attempt)) is s:
                del self.sessions[(s.rollout_id, s.attempt)]
            raise
        s.stream_version = recorded[-1].stream_version
        return recorded[0]

    async def open_session(self, request: web.Request, body: OpenRequest) -> web.Response:
        identity(request)
        if body.task.env != body.env:
            raise InvalidRequest(f"the task is for environment {body.task.env!r}, not {body.env!r}")
        env = self._environment(body.env)
        task = body.task.task()
        try:
            state = env.initial_state(task)
        except ToolError as exc:
            raise refused(exc) from exc
        except Exception as exc:  # a reducer that cannot start from these params: the request is wrong
            raise InvalidRequest(f"the task's params do not fit {env.name}: {type(exc).__name__}: {exc}"[:300]) from None
        key = await self._enter(request)
        existing = self.sessions.get(key) or await self._recover(key)
        if existing is not None:
            if existing.env.name != env.name or existing.task != task:
                raise ToolCallRefused(f"rollout {key[0]} attempt {key[1]} already has a different session",
                                      tool_error="session_exists")
            async with existing.lock:  # a repeated open is answered once the first is durable
                return json_reply(self._describe(await self._session(key)))
        self.admission.require_open("opening a session")
        s = Session(key[0], key[1], env, task, state)
        async with s.lock:  # free, so no yield: prepare and repeats see the session from here on
            self.sessions[key] = s
            try:
                if live(env):
                    try:
                        s.live = await run_live(env.open_live, task)  # type: ignore[attr-defined]
                    except ToolError as exc:  # the jail did not come up: nothing ran, the session never opened
                        raise refused(exc) from exc
                    except LiveGone as exc:
                        raise ParticipantUnavailable(f"{env.name}: its NeMo Gym server cannot be reached: {exc}") from exc
                opened = {"env": env.name, "task": task.to_json(), "state_mode": env.state_mode}
                await self._append(s, ev.SESSION_OPENED, {**opened, **live_id(s), "instance": self.instance})
            except BaseException:
                self.sessions.pop(key, None)
                await self._close_live(s)
                raise
            s.opened = True
        if s.live is not None:
            self._watch()
        # A rollout's new attempt exists only once its older ones are fenced: their live shells can never
        # be used again, and nothing else would end them (a failed rollout restarts without closing).
        for older in [k for k, o in self.sessions.items() if k[0] == key[0] and k[1] < key[1] and o.live is not None]:
            await self._close_live(self.sessions.pop(older))
        return json_reply(self._describe(s))

    @staticmethod
    def _describe(s: Session) -> dict[str, Any]:
        tools = s.env.task_tools(s.task) if relayed(s.env) else s.env.tools()  # type: ignore[attr-defined]
        return {"state_mode": s.env.state_mode, "verification": s.env.verification, "revision": s.revision,
                "tools": tools}

    async def call_tool(self, request: web.Request, body: ToolRequest) -> web.Response:
        key = await self._enter(request)
        name = request.match_info["name"]
        named = validate_tool_call_key(h) if (h := request.headers.get(TOOL_CALL_HEADER)) else None
        s = await self._session(key)
        # Taken right before the lock: work admitted here and queued on the lock is in flight, and
        # prepare, queued behind it, waits for it.
        admitted = self.admission_open
        async with s.lock:
            if self.sessions.get(key) is not s:
                raise NotFound(f"the session of rollout {key[0]} attempt {key[1]} was closed")
            call_key = s.key_for(named, activation := activation_of(request))  # numbered in arrival order if not named
            recorded = s.tool_calls.get(call_key)
            if recorded is not None:  # applied before (a caller that restarted asks again): the same answer
                if (diverged := replayed_tool(recorded, name, body.arguments, call_key, s.env.as_recorded)) is not None:
                    await self._append(s, ev.TOOL_CALL_DIVERGED, diverged)
                    raise tool_diverged(diverged)
                return json_reply({"output": recorded.get("output"), "revision": recorded["revision"],
                                   "done": bool(recorded.get("done")), "repeated": True})
            if relayed(s.env):  # every relayed call is a mutation: the record is its state
                if not admitted:
                    raise s.refused(named, activation, f"tool {name} is relayed and a checkpoint is in progress")
                try:
                    outcome = await relay(s, self._append, lambda live: s.env.call_live(  # type: ignore[attr-defined]
                        live, name, body.arguments, call_key, capture_id(*key, activation)))
                except ToolError as exc:
                    raise refused(exc) from exc
                new_state = s.env.apply(s.state, outcome.effect)
            elif live(s.env):
                if not admitted:
                    raise s.refused(named, activation, "tool calls on a live shell are refused while a checkpoint is in progress")
                try:
                    outcome = await run_live(s.env.call_live, await self._live(s), name, body.arguments)  # type: ignore[attr-defined]
                except ToolError as exc:
                    raise refused(exc) from exc
                await self.store.put_blobs(outcome.blobs)  # before the effect that names them
                new_state = s.state if s.env.state_mode == "restart_only" else s.env.apply(s.state, outcome.effect)
            else:
                try:
                    outcome = s.env.call_tool(s.state, name, body.arguments)
                    if outcome.effect is None:  # read-only: allowed even while admission is closed
                        return json_reply({"output": outcome.output, "revision": s.revision, "done": outcome.done})
                    if not admitted:
                        raise s.refused(named, activation, f"tool {name} changes the session and a checkpoint is in progress")
                    new_state = s.env.apply(s.state, outcome.effect)
                except ToolError as exc:
                    raise refused(exc) from exc
            if outcome.effect is None:
                return json_reply({"output": outcome.output, "revision": s.revision, "done": outcome.done})
            revision = s.revision + 1
            # The event first: a crash after it replays this change, a crash before it never happened.
            data = {"revision": revision, "tool": name, "arguments": body.arguments, "effect": outcome.effect,
                    "tool_call": call_key, "output": outcome.output, "done": outcome.done, **live_id(s),
                    **({"unrestorable": outcome.unrestorable} if outcome.unrestorable else {})}
            try:
                await self._append(s, ev.MUTATION_APPLIED, data)
            except PayloadTooLarge as exc:
                # Arguments, effect and output together past the event limit: the model chose their
                # size (a long note echoed back), so it sees a tool error and the episode goes on to
                # its verify. Nothing is installed; a live shell did run the command, unrecorded.
                raise ToolCallRefused(f"the call's record would be {exc.context.get('size')} bytes, over the "
                                      f"{exc.context.get('limit')}-byte event limit; send smaller arguments",
                                      tool_error="bad_arguments") from None
            s.state, s.revision = new_state, revision
            s.tool_calls[call_key] = data
            return json_reply({"output": outcome.output, "revision": revision, "done": outcome.done})

    async def verify(self, request: web.Request, body: VerifyRequest) -> web.Response:
        """Verify against the answer the log holds: the attempt's last completed agent activation (its
        lineage included), never an answer a request brings, which any data-credential holder could forge."""
        key = await self._enter(request)
        s = self.sessions.get(key) or await self._recover(key)
        history = await effective_history(self.store, *key, kinds=(ev.SESSION_VERIFIED, ev.AGENT_BOUNDARY,
                                                                   ev.ACTIVATION_COMPLETED))
        if s is None:
            # A passed verify retires its session; a caller that crashed before it heard the answer
            # asks again and gets the recorded verification, not a second one.
            verified = [e for e in history if e.kind == ev.SESSION_VERIFIED and e.stream == session_stream(*key)]
            if verified:  # and no session is open: it was closed
                d = verified[-1].data
                return json_reply({"reward": d["reward"], "status": d["status"], "revision": d["revision"],
                                   "closed": True, "repeated": True})
            s = await self._session(key)  # raises not_found
        replies = completed_activations(history)
        if not replies:
            raise RequestConflict(f"no agent activation of rollout {key[0]} attempt {key[1]} has completed: "
                                  "there is no answer to verify yet")
        answer = replies[max(replies)]
        self.admission.require_open("verify")
        s.verifying += 1
        s.verify_idle.clear()
        try:
            state, revision = s.state, s.revision  # states are replaced, never edited: a consistent snapshot
            error: str | None = None
            try:
                # A verifier may be slow (a judge, a subprocess); a thread keeps the loop serving.
                trajectory = Trajectory(list(answer.get("messages") or []), answer.get("final_answer"))
                if relayed(s.env):
                    reward = await relayed_verify(s, self._append, trajectory, capture_id(*key, max(replies)))
                else:
                    reward = float(await asyncio.to_thread(s.env.verify, s.task, state, trajectory))
                status = "passed" if reward > 0 else "failed"
            except (AttemptLost, ParticipantUnavailable, GymServerFailed):
                raise  # the attempt or its server is gone, or a NeMo Gym server refused: nothing was verified
            except Exception as exc:  # any verifier failure is recorded, then reported
                reward, status, error = 0.0, "error", f"{type(exc).__name__}: {exc}"
            data: dict[str, Any] = {"reward": reward, "status": status, "revision": revision,
                                    "final_answer": answer.get("final_answer"), **({"error": error} if error else {})}
            closes = status == "passed" or body.close and status == "failed"
            await self._record_verify(s, key, data, closes)
        finally:
            s.verifying -= 1
            if s.verifying == 0:
                s.verify_idle.set()
        if error is not None:
            raise ToolCallRefused(f"verification failed: {error}", tool_error="verify_error")
        return json_reply({"reward": reward, "status": status, "revision": revision,
                           **({"closed": True} if closes else {})})

    async def _record_verify(self, s: Session, key: Key, data: dict[str, Any], closes: bool) -> None:
        """The verification; with `closes` (a passed one, or a failed one whose caller is done with the
        session) the session is retired, its close in the verify's own append. Otherwise it keeps its
        state to inspect, go on or verify again."""
        async with s.lock:
            if self.sessions.get(key) is not s:
                raise NotFound(f"the session of rollout {key[0]} attempt {key[1]} was closed during verify")
            closing = {"status": data["status"], "reason": "verified", "revision": s.revision}
            await self._append(s, ev.SESSION_VERIFIED, data, (ev.SESSION_CLOSED, closing) if closes else None)
            s.verify_status = data["status"]
            if closes:
                await self._forget_session(s)

    async def close_session(self, request: web.Request, _body: None) -> web.Response:
        key = await self._enter(request)
        if key in self._closed and key not in self.sessions:
            return json_reply({})  # closed by this process: its close is in the log
        s = self.sessions.get(key) or await self._recover(key)
        if s is None:
            # Closing twice, or after a passed verify retired the session, is fine if the log agrees:
            # the session's own stream or, for a restored attempt, its origin's up to the boundary.
            history = [e for e in await effective_history(self.store, *key) if is_session_stream(e.stream)]
            if history and history[-1].kind == ev.SESSION_CLOSED:
                return json_reply({})
            raise NotFound(f"no session for rollout {key[0]} attempt {key[1]}")
        self.admission.require_open("closing a session")
        async with s.lock:
            if self.sessions.get(key) is s:
                await self._retire_session(s, {"status": s.verify_status or "unverified", "reason": "closed"})
        return json_reply({})

    async def _retire_session(self, s: Session, data: dict[str, Any]) -> None:
        """Under the session's lock: record the close, then free the session."""
        await self._append(s, ev.SESSION_CLOSED, {**data, "revision": s.revision})
        await self._forget_session(s)

    async def _forget_session(self, s: Session) -> None:  # its `session_closed` is durable
        key = (s.rollout_id, s.attempt)
        self.sessions.pop(key, None)
        if len(self._closed) >= MAX_CLOSED_REMEMBERED:
            del self._closed[next(iter(self._closed))]  # the oldest: a repeat of its close reads the log
        self._closed[key] = None
        await self._close_live(s)

    async def get_state(self, request: web.Request, _body: None) -> web.Response:
        s = await self._session(await self._enter(request))
        return json_reply({"state": s.state, "revision": s.revision})

    async def _watch_live(self) -> None:
        """Ends the live shell of every attempt that has ended without closing its session: fenced
        (failed, by a restore or a newer attempt) or retired, by whichever server wrote it. A shell
        left to `idle_s` would keep its processes, memory and uid for half an hour."""
        while any(s.live is not None for s in self.sessions.values()):
            await asyncio.sleep(LIVE_CHECK_S)
            for key, s in list(self.sessions.items()):
                if s.live is None:
                    continue
                try:
                    await self.check_attempt(*key)
                except StaleAttempt:
                    if self.sessions.get(key) is s:
                        del self.sessions[key]
                    await self._close_live(s)
                except Exception:  # the log unreachable for a moment: the next round asks again
                    continue

    async def stop(self) -> None:
        """At shutdown every live shell ends with the server, not with its process: a server stopped
        inside a longer-lived process must not leave its jails behind."""
        if self._live_watch is not None:
            self._live_watch.cancel()
        held = [s for s in self.sessions.values() if s.live is not None]
        await asyncio.gather(*(self._close_live(s) for s in held))
        await close_all()  # the relay's clients, their connections to NeMo Gym's servers
        await super().stop()

    async def _live(self, s: Session) -> Any:
        """The session's live process; a session restored or recovered has none until its first call,
        which starts a fresh one from the snapshot its state names (AttemptLost, with why, where that
        cannot be done: the rollout restarts from its input)."""
        if s.live is None:
            loop = asyncio.get_running_loop()

            def load(digests: Sequence[str]) -> dict[str, bytes]:
                return asyncio.run_coroutine_threadsafe(self.store.get_blobs(digests), loop).result()

            try:
                s.live = await run_live(s.env.open_live, s.task, s.state, load)  # type: ignore[attr-defined]
            except ToolError as exc:
                if exc.code != "snapshot_unusable":
                    raise
                raise AttemptLost(f"rollout {s.rollout_id} attempt {s.attempt}: its {s.env.name} session cannot be "
                                  f"rebuilt ({exc.message}); it starts over from its input",
                                  rollout_id=s.rollout_id, attempt=s.attempt, lost="session") from None
            self._watch()
        return s.live

    def _watch(self) -> None:
        if self._live_watch is None or self._live_watch.done():
            self._live_watch = asyncio.get_running_loop().create_task(self._watch_live())

    @staticmethod
    async def _close_live(s: Session) -> None:
        if s.live is not None:
            handle, s.live = s.live, None
            await run_live(s.env.close_live, handle)  # type: ignore[attr-defined]

    async def no_identity(self, request: web.Request, _body: Any) -> web.Response:
        raise RolloutIdRequired("data routes live under /rollouts/{rollout_id}/attempts/{attempt}/")

    def in_flight(self) -> int:
        return len(self.sessions)  # open sessions: their rollouts are under way

    def routes(self) -> list[Route]:
        session: tuple[type[RollbookError], ...] = (StaleAttempt, InvalidIdentifier, NotFound, AdmissionClosed, ToolCallRefused)
        routes = [
            Route("POST", data_path("/session"), self.open_session, OpenRequest, SessionReply, session),
            Route("POST", data_path("/tools/{name}"), self.call_tool, ToolRequest, ToolReply, (*session, AgentDiverged),
                  headers=(Header(TOOL_CALL_HEADER, TOOL_CALL_KEY_PATTERN, required=False,
                                  description="the call's key: a repeat gets the recorded outcome; without it the "
                                              "server numbers the call (engine.agent_replay)"), NUMBERED_IN)),
            Route("POST", data_path("/verify"), self.verify, VerifyRequest, VerifyReply, (*session, RequestConflict, GymServerFailed)),
            Route("POST", data_path("/close"), self.close_session, None, Empty, session),
            Route("GET", data_path("/state"), self.get_state, None, StateReply, session),
        ]
        bare = [Route("POST", p, self.no_identity, None, None, (RolloutIdRequired,), name=f"{n}_without_identity")
                for n, p in (("session", "/session"), ("tool", "/tools/{name}"), ("verify", "/verify"), ("close", "/close"))]
        return [*routes, *bare, Route("GET", "/state", self.no_identity, None, None, (RolloutIdRequired,),
                                      name="state_without_identity")]

    # ---- control plane hooks ----------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        await super().prepare(checkpoint_id, deadline)
        sessions = list(self.sessions.values())
        # A mutation in flight is not waited for: it lands after its rollout's latest boundary, and a
        # restore rebuilds the session at that boundary and the rollout applies it again (waiting for
        # each session's lock was most of this prepare: p50 31 ms at 80 rollouts in flight).
        # `wait` verification must finish before a checkpoint; `replay` may simply run again after a crash.
        waiting = [s for s in sessions if s.env.verification == "wait" and s.verifying]
        await wait_for_all([s.verify_idle for s in waiting], deadline)
        sessions = list(self.sessions.values())
        blockers = [f"{s.rollout_id}:{s.attempt} verify in progress" for s in sessions
                    if s.env.verification == "wait" and s.verifying]
        counts = {"sessions": len(sessions), "stateless": 0, "exported": 0, "restart_only": 0, "replay": 0, "snapshot": 0}
        for s in sessions:
            counts[s.env.state_mode] += 1
        # A restart-only session a dead instance held is in the log, not in memory: its live process
        # died with it, so it is reported too, or the framework would scope it and its restore would be
        # refused (`restart_in_scope`). One another live instance holds is that instance's to report.
        lost = await orphaned_sessions(self, [key for key, env in (await self.store.open_sessions()).items()
                                              if key not in self.sessions and restart_only(env)])
        # So is a live session whose last command left no snapshot (a process still in the background).
        restarts = [Execution(rollout_id=r, attempt=a) for r, a in sorted(
            lost | {(s.rollout_id, s.attempt) for s in sessions
                    if s.env.state_mode == "restart_only" or (isinstance(s.state, dict) and s.state.get("unrestorable"))})]
        return PrepareReport(ready=not blockers, blockers=blockers, counts=counts, restarts=restarts)

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Rebuild every scoped session and validate the whole set before staging any of it."""
        # One read of every scoped rollout, checked against the cut (gap-free streams, recorded heads
        # giving the digest, lineage); the coordinator has re-derived every payload hash before asking.
        history, starts = await read_scope(self.store, cut)  # past each scoped session's snapshot, if one agrees
        staged: dict[Key, Staged] = {}
        effective = {(e.rollout_id, e.attempt): history.effective(e.rollout_id, e.attempt, to=e.boundary) for e in cut.scope}
        snapshots = await lineage_rows(self.store, cut, effective, starts)  # the folds leave theirs in one insert
        written: list[SessionSnapshot | None] = []
        for entry in cut.scope:
            one, new = rebuild(entry.rollout_id, entry.attempt, entry.boundary, effective[(entry.rollout_id, entry.attempt)],
                               snapshots, starts.get(entry.rollout_id))
            written.append(new)
            if one is not None:
                staged[(entry.rollout_id, entry.attempt)] = one
        await store_snapshots(self.store, written)
        self.staged, self.staged_from = staged, cut.checkpoint_id
        self.admission.close(checkpoint_id=cut.checkpoint_id)  # a restored process stays paused until resume installs the sessions
        return {"staged": len(staged), "scope": len(cut.scope)}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        installed = await self._install(checkpoint_id) if restored and self.staged_from == checkpoint_id else None
        await super().resume(checkpoint_id, restored)
        return {} if installed is None else {"installed": installed}

    async def _install(self, checkpoint_id: str) -> int:
        """Each staged session under its rollout's new attempt, all in one atomic append."""
        rows = await self.store.attempt_rows(sorted({r for r, _ in self.staged}))
        targets = restored_targets(rows, self.staged, checkpoint_id)  # a rollout retired since is dropped
        # Every live resources worker staged the cut; each installs the sessions that route to it, so
        # each session is opened once, where its requests will come (participants/base/routing.py).
        self.staged = {k: v for k, v in self.staged.items() if k in targets and await self.routed_here(k[0], targets[k])}
        fresh: list[tuple[int, Session]] = []
        for (rid, old), st in self.staged.items():
            env = self._logged_environment(st.env_name)
            fresh.append((old, Session(rid, targets[(rid, old)], env, st.task, st.state, st.revision, opened=True)))
        opened = [(s, {"env": s.env.name, "task": s.task.to_json(), "restored_from": checkpoint_id, "revision": s.revision,
                       "origin_attempt": old, "instance": self.instance}) for old, s in fresh]
        events = tuple(s.event(ev.SESSION_OPENED, data) for s, data in opened)
        # Expecting version 0: the new attempt's stream must be empty, or someone opened it already.
        try:
            recorded = [] if not events else await self.store.append(AppendRequest(events, {s.stream: 0 for _, s in fresh}))
        except VersionConflict:
            # Another instance of this kind staged the same cut and installed it first: those sessions
            # are its (engine/ownership.py), and a request for one reaches it or takes it over from the log.
            self.staged, self.staged_from = {}, None
            return 0
        for (_, s), e in zip(fresh, recorded, strict=True):
            s.stream_version = e.stream_version
            # Sessions of older attempts of the same rollout are fenced: nothing may use them again.
            for key in [k for k in self.sessions if k[0] == s.rollout_id and k[1] < s.attempt]:
                await self._close_live(self.sessions.pop(key))
            self.sessions[(s.rollout_id, s.attempt)] = s
        self.staged, self.staged_from = {}, None
        return len(fresh)

    async def retire(self, rollout_id: str, through: int) -> None:
        for key in retired(self.sessions, rollout_id, through):
            s = self.sessions[key]
            async with s.lock:  # let an accepted mutation finish (its append now fails: the attempt is retired)
                self.sessions.pop(key, None)
                await self._close_live(s)
        for key in retired(self.staged, rollout_id, through):
            del self.staged[key]


__all__ = ["ResourcesParticipant", "rebuild"]
