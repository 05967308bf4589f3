"""The environment server: drives each episode as steps (seed, agent, verify, close), one event each.

An episode's steps run in order and each is recorded as an `episode_step` event when it is done,
so the log alone says where an episode stands: a restored episode continues from its next step
under its new attempt, and nothing recorded before its boundary is done twice. While a checkpoint is
open an episode parks before its next step, and an episode that finishes holds its reply until
resume, so the framework sees nothing change during the pause. Prepare does not wait for a step in
progress: the cut takes the episode's latest boundary at or below P, and a restore does the step
again on the state rebuilt there. Only a `wait` verification is waited for, since its answer may
not be asked for twice. An episode that finishes while a checkpoint is open has its
`attempt_finished` in the log and is never continued.

After a crash, dispatching a rollout again picks up its live attempt where the log leaves it: the
steps it recorded are not run again, and the agent, model and resources servers each go on from
their own part of the log. A server that does not answer (restarting) or a database outage is
waited for. When another server says a part of the attempt is gone for good (`attempt_lost`: a
sandbox process, a model call whose reply was never recorded), this server classifies the attempt
(engine.recovery.classify), records that and restarts this rollout alone under attempt N+1:
continuing from N's latest boundary, or from its input when its state cannot be rebuilt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, Field

from adapters.http_client import CONTROL, JsonClient, as_attempt, data_url
from engine import catalog as ev
from engine import recovery
from engine.admission import drain
from engine.capability import capability
from engine.checkpoint import Cut, ParticipantStore, read_cut, restored_attempt
from engine.errors import (
    AdmissionClosed,
    AttemptLost,
    DatabaseUnavailable,
    Forbidden,
    GymServerFailed,
    InvalidIdentifier,
    InvalidJson,
    InvalidRequest,
    NotABoundary,
    NotFound,
    ParticipantUnavailable,
    RequestConflict,
    RestartOnlyBoundary,
    RollbookError,
    StaleAttempt,
    ToolCallRefused,
    UnknownRollout,
    VersionConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.forks import MAX_FORKS, ForkPlan, Origin, fork_seed, plan_forks
from engine.identity import Key, episode_stream, rollout_stream, validate_id
from engine.lineage import effective_history
from engine.ownership import claim
from engine.patience import RETRY_FIRST_S, Patience
from participants.base.guard import Body, Identifier, Int64, Route
from participants.base.keyed_locks import KeyedLocks
from participants.base.owners import CLAIM_TRIES, FIRST_POLL_S, LAST_POLL_S, owner_verdict
from participants.base.participant import Participant, PrepareReport
from participants.base.routing import EPISODE_ATTEMPT, Peers
from participants.base.wire import ACTIVATION_HEADER, TaskBody
from participants.environments import ENVIRONMENTS, Task, enabled_environments, get_environment

STEPS = ev.EPISODE_STEPS
MAX_RECOVERIES = 3  # restarts of one rollout under a new attempt within one drive, before it fails

# Failures that are the rollout's own, which asking again would only repeat (a NeMo Gym server that
# cannot start or refused its seed or verify, an environment that refused a step): the attempt ends
# failed with them. Anything else (a peer away, a restore) leaves it to its recovery.
ENDS_THE_ATTEMPT = (GymServerFailed, ToolCallRefused)
FAILURE_SHOWN = 1000


class EpisodeRequest(Body):
    rollout_id: Identifier
    task: TaskBody
    seed: Int64 = 0
    max_steps: int = Field(default=16, ge=1, le=1000)


class ForkRequest(Body):
    rollout_id: Identifier
    attempt: int = Field(ge=0, le=2**31 - 1)
    position: int = Field(ge=1, le=2**63 - 1, description="the log position of the boundary to fork from")
    count: int = Field(ge=1, le=MAX_FORKS, description="how many rollouts to start")
    group: Identifier | None = Field(default=None, description=(
        "the fork group; fork i is rollout GROUP.i (default ROLLOUT.fPOSITION: asking again names the same forks)"))
    seed: Int64 | None = Field(default=None, description="fork i samples with seed + i (default: one from its id)")


class ForkedRollout(BaseModel):
    rollout_id: str
    index: int
    seed: int


class ForkReply(BaseModel):
    origin_rollout_id: str
    origin_attempt: int
    origin_position: int
    group: str
    existing: bool = Field(description="true: the group already held these forks and nothing was written")
    forks: list[ForkedRollout]
    launched: int = Field(description="forks this server started driving now (the others run or have finished)")


class EpisodeResult(BaseModel):
    rollout_id: str
    attempt: int
    reward: float | None
    steps: list[str]


class EpisodeStatus(BaseModel):
    status: str
    attempt: int
    reward: float | None
    step: str | None = None
    steps: list[str] | None = None
    error: str | None = None
    capability: str | None = Field(default=None, description=(
        "the current attempt's capability (engine.capability): it opens that attempt's data routes and "
        "nothing else, so a client that drives this rollout alone (an OpenAI SDK on the model server's "
        "/rollouts/{rollout_id}/attempts/{attempt}/v1) need not hold the data credential"))


@dataclass
class Episode:
    rollout_id: str
    attempt: int
    task: Task
    seed: int
    max_steps: int
    done: list[dict[str, Any]] = field(default_factory=list)  # the data of each recorded step, in order
    status: str = "running"  # running | parked | finished | failed
    step: str | None = None  # the step in progress
    error: str | None = None
    closed_by_verify: int | None = None  # the attempt whose session a passed verify closed

    def recorded(self, step: str) -> dict[str, Any] | None:
        return next((d for d in self.done if d["step"] == step), None)

    @property
    def reward(self) -> float | None:
        verified = self.recorded("verify")
        return None if verified is None else verified.get("reward")

    def result(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt, "reward": self.reward,
                "steps": [d["step"] for d in self.done]}

    def status_json(self) -> dict[str, Any]:
        return {"status": self.status, "attempt": self.attempt, "reward": self.reward, "step": self.step,
                "steps": [d["step"] for d in self.done], "error": self.error}


def episode_from_history(rollout_id: str, attempt: int, inputs: list[RecordedEvent],
                         upto: list[RecordedEvent]) -> Episode | None:
    """An episode as the log has it: its input from `inputs`, its recorded steps from `upto`.

    The input never changes, so it may come from past the boundary (attempt_started is a boundary
    and episode_started lands right after it); the steps come only from up to the boundary."""
    started = next((e for e in inputs if e.kind == ev.EPISODE_STARTED), None)
    if started is None:
        return None
    d = started.data
    ep = Episode(rollout_id, attempt, Task.from_json(d["task"]), int(d.get("seed", 0)), int(d.get("max_steps", 16)))
    ep.done = [dict(e.data) for e in upto if e.kind == ev.EPISODE_STEP]
    own_seed = fork_seed(inputs, rollout_id)  # a fork samples with its own seed, not its origin's
    if own_seed is not None:
        ep.seed = own_seed
    return ep


class EnvironmentParticipant(Participant):
    kind: ClassVar[str] = "environment"
    concurrency: ClassVar[str] = "steps serialized per episode; control operations serialized"

    def __init__(self, store: ParticipantStore, instance: str, data_token: str | None, agent_url: str,
                 resources_url: str, environments: frozenset[str] = enabled_environments(sandbox=False)) -> None:
        super().__init__(store, instance)
        # The data credential goes only to the agent and resources servers of the configuration.
        self.client = JsonClient(data_token)
        self.secret = data_token  # each step's request carries its attempt's capability, not this
        self.agent_url, self.resources_url = agent_url, resources_url
        # Each step's request goes where participants/base/routing.py says for its attempt, read from the log.
        self.agent_peers, self.resources_peers = Peers(agent_url, "agent"), Peers(resources_url, "resources")
        self.environments = environments
        self.episodes: dict[str, Episode] = {}
        self.tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.locks: KeyedLocks[str] = KeyedLocks()
        self.staged: dict[str, Episode] = {}
        self.staged_from: str | None = None

    # ---- data plane ---------------------------------------------------------------------------

    def _check_task(self, body: TaskBody) -> Task:
        """Everything about the task that can be refused is refused here, before any event."""
        return self.admit_task(Task.from_json(body.model_dump()))

    def admit_task(self, task: Task) -> Task:
        """The task's environment is known and served here, and its params fit it; else refused."""
        if task.env not in ENVIRONMENTS:
            raise InvalidRequest(f"no environment named {task.env!r}; known: {sorted(ENVIRONMENTS)}")
        if task.env not in self.environments:
            raise Forbidden(f"the {task.env} environment is not enabled in this deployment's configuration")
        try:
            get_environment(task.env).initial_state(task)  # pure for every environment: it reads the params
        except Exception as exc:
            raise InvalidRequest(f"the task's params do not fit {task.env}: {type(exc).__name__}: {exc}"[:300]) from None
        return task

    async def start_episode(self, request: web.Request, req: EpisodeRequest) -> web.Response:
        rid = req.rollout_id
        requested = self._check_task(req.task)
        async with self.locks(rid):
            task = self.tasks.get(rid)
            running = self.episodes.get(rid)
            if task is not None and not task.done() and running is not None and running.task != requested:
                raise RequestConflict(f"rollout {rid} is running another task; a rollout id names one task")
            tries = 0
            while task is None or task.done():
                rows = await self._held_elsewhere(rid)  # the rollout's attempts, read once for the questions below
                done = await self._from_log(rid, requested, rows)
                if done is not None:
                    return web.json_response(done)  # already finished: its result, never a second run
                self.admission.require_open("a new episode")
                try:
                    task = self._launch(await self._open_episode(rid, requested, req.seed, req.max_steps, rows))
                except VersionConflict:
                    tries += 1  # another instance claimed it first: wait for its result instead
                    if tries == CLAIM_TRIES:
                        raise
        return web.json_response(await asyncio.shield(task))

    async def _held_elsewhere(self, rid: str) -> dict[Key, dict[str, Any]]:
        """Wait while another live instance drives the rollout's live episode (engine/ownership.py); its
        outcome or death ends the wait, and the log then says what is left to run here. Its last read."""
        delay = FIRST_POLL_S
        while True:
            rows = await self.store.attempt_rows([rid])
            if not rows or rows[(rid, attempt := max(a for _, a in rows))]["status"] != "live":
                return rows
            if not await self._claimed_elsewhere(await self.store.read_stream(episode_stream(rid, attempt))):
                return rows
            await asyncio.sleep(delay)
            delay = min(delay * 2, LAST_POLL_S)

    async def _claimed_elsewhere(self, events: Sequence[RecordedEvent]) -> bool:
        owner = _episode_holder(events)
        return owner not in (None, self.instance) and await owner_verdict(self, owner, held_here=False) == "held"

    async def _from_log(self, rid: str, requested: Task, rows: dict[Key, dict[str, Any]]) -> dict[str, Any] | None:
        if not rows:
            return None
        attempt = max(a for _, a in rows)
        if rows[(rid, attempt)]["status"] != "finished":
            return None
        history = await effective_history(self.store, rid, attempt)
        ep = episode_from_history(rid, attempt, history, history)
        _same_task(rid, ep, requested)
        steps = [d["step"] for d in ep.done] if ep else []
        return {"rollout_id": rid, "attempt": attempt, "reward": rows[(rid, attempt)]["reward"], "steps": steps}

    async def _open_episode(self, rid: str, task: Task, seed: int, max_steps: int,
                            rows: dict[Key, dict[str, Any]] | None = None) -> Episode:
        """Start attempt 0, or pick up the rollout's live attempt where its log leaves it (`rows`: its
        attempts, when just read), claimed for this instance (engine/ownership.py) or VersionConflict."""
        rows = rows if rows is not None else await self.store.attempt_rows([rid])
        started = {"env": task.env, "task_id": task.task_id, "task": task.to_json(), "seed": seed, "max_steps": max_steps, "status": "running", "instance": self.instance}
        if not rows:  # one append: the attempt never exists without its episode's input; of two instances, one lands
            await self._claim(rollout_stream(rid), (
                NewEvent(rollout_stream(rid), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
                NewEvent(episode_stream(rid, 0), ev.EPISODE_STARTED, started, rid, 0)))
            return Episode(rid, 0, task, seed, max_steps)
        attempt = max(a for _, a in rows)
        if rows[(rid, attempt)]["status"] == "fenced":
            again = await self._after_failure(rid, attempt, started)
            if again is not None:
                return Episode(rid, again, task, seed, max_steps)
        if rows[(rid, attempt)]["status"] != "live":
            raise StaleAttempt(f"rollout {rid} attempt {attempt} is {rows[(rid, attempt)]['status']}",
                               rollout_id=rid, attempt=attempt)
        history = await effective_history(self.store, rid, attempt)
        ep = episode_from_history(rid, attempt, history, history)
        _same_task(rid, ep, task)
        stream = episode_stream(rid, attempt)
        if ep is None:  # a fresh dispatch: the attempt exists, its episode starts from input
            await self._claim(stream, (NewEvent(stream, ev.EPISODE_STARTED, started, rid, attempt),))
            return Episode(rid, attempt, task, seed, max_steps)
        nxt = next((s for s in STEPS if ep.recorded(s) is None), None)  # its owner is gone: taken over, once
        await self._claim(stream, (NewEvent(stream, ev.EPISODE_CONTINUED, {"env": task.env, "task_id": task.task_id,
            "next_step": nxt, "recovered": True, "status": "running", "instance": self.instance}, rid, attempt),))
        return ep

    async def _after_failure(self, rid: str, attempt: int, started: dict[str, Any]) -> int | None:
        """A rollout dispatched again after its latest attempt failed (`_failed`; its server fixed, say)
        runs again from its input as attempt N+1; None when that attempt ended otherwise."""
        stream = rollout_stream(rid)
        seen = await self.store.read_stream(stream)
        last = seen[-1] if seen else None
        if last is None or last.kind != ev.ATTEMPT_FENCED or last.attempt != attempt or last.data.get("reason") != "failed":
            return None
        nxt = attempt + 1
        await self.store.append(claim((
            NewEvent(stream, ev.ATTEMPT_STARTED, {"parent_attempt": attempt, "origin_attempt": None,
                                                  "disposition": "fresh_dispatch",
                                                  "reason": "dispatched again after it failed"}, rid, nxt),
            NewEvent(episode_stream(rid, nxt), ev.EPISODE_STARTED, started, rid, nxt)), stream, last.stream_version))
        return nxt

    async def _claim(self, stream: str, events: tuple[NewEvent, ...]) -> None:
        """Append `events` at `stream`'s version if it is as the decision found it (no attempt, no live claim)."""
        seen = await self.store.read_stream(stream)
        if any(e.kind == ev.ATTEMPT_STARTED for e in seen) or await self._claimed_elsewhere(seen):
            raise VersionConflict(f"{stream} was claimed by another instance meanwhile")
        await self.store.append(claim(events, stream, seen[-1].stream_version if seen else 0))

    def _launch(self, ep: Episode) -> asyncio.Task[dict[str, Any]]:
        self.episodes[ep.rollout_id] = ep
        task = asyncio.get_running_loop().create_task(self._drive(ep))
        self.tasks[ep.rollout_id] = task
        # A resumed episode has no caller waiting on it: its failure is kept on the episode, not lost as a warning.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        task.add_done_callback(lambda t: self._settled(ep.rollout_id, t))
        return task

    def _settled(self, rid: str, task: asyncio.Task[dict[str, Any]]) -> None:
        """A finished episode is the log's from here: start_episode and episode_status answer it from
        there. So a server that runs rollouts for days holds the ones it is running, not every one it
        ever ran (prepare walks them: at 27,000 rollouts its p50 had grown from 4 to 20 ms). One that
        failed stays, with its error, until the framework forgets it."""
        if self.tasks.get(rid) is not task or task.cancelled() or task.exception() is not None:
            return
        del self.episodes[rid], self.tasks[rid]

    async def _drive(self, ep: Episode) -> dict[str, Any]:
        try:
            for recoveries in range(MAX_RECOVERIES + 1):
                try:
                    await self._steps(ep)
                    break
                except AttemptLost as exc:
                    if recoveries == MAX_RECOVERIES:
                        raise
                    await self._restart(ep, exc)
            await self._park(ep)  # its result reaches the framework after the checkpoint, not during it
            ep.status = "finished"
            return ep.result()
        except asyncio.CancelledError:
            ep.status = "failed"
            ep.error = "cancelled"
            raise
        except Exception as exc:
            ep.status, ep.error = "failed", f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ENDS_THE_ATTEMPT):
                await self._failed(ep, exc)
            raise

    async def _failed(self, ep: Episode, exc: RollbookError) -> None:
        """The attempt ends failed, its reason in its fence (a NeMo Gym server's status and body among
        it): left live, it would hold up every checkpoint's cut and say nothing of why."""
        data = {"reason": "failed", "code": exc.code, "detail": exc.detail[:FAILURE_SHOWN],
                "context": {k: v[:FAILURE_SHOWN] if isinstance(v, str) else v for k, v in exc.context.items()
                            if isinstance(v, str | int | float | bool)}}
        try:
            await self.store.append(AppendRequest((NewEvent(rollout_stream(ep.rollout_id), ev.ATTEMPT_FENCED, data,
                                                            ep.rollout_id, ep.attempt),)))
        except RollbookError:
            pass  # fenced already (a restore, a retire): the attempt has ended either way

    async def _restart(self, ep: Episode, exc: AttemptLost) -> None:
        """This rollout alone goes on under attempt N+1, as engine.recovery classifies it."""
        rid = ep.rollout_id
        cause = exc.context.get("lost")
        lost: recovery.Lost = cause if cause in ("session", "divergence") else "call"
        history = await effective_history(self.store, rid, ep.attempt)
        decision = recovery.classify(rid, ep.attempt, history, lost)
        await self.store.append(recovery.recovery_request(decision))  # stale_attempt if a restore or retire came first
        ep.attempt += 1
        if decision.disposition == "fresh_dispatch":
            ep.done = []
            await self.store.append(AppendRequest((NewEvent(episode_stream(rid, ep.attempt), ev.EPISODE_STARTED, {
                "env": ep.task.env, "task_id": ep.task.task_id, "task": ep.task.to_json(), "seed": ep.seed,
                "max_steps": ep.max_steps, "status": "running", "instance": self.instance}, rid, ep.attempt),)))
        else:
            inherited = await effective_history(self.store, rid, ep.attempt)
            ep.done = [dict(e.data) for e in inherited if e.kind == ev.EPISODE_STEP]
            nxt = next((s for s in STEPS if ep.recorded(s) is None), None)
            await self.store.append(AppendRequest((NewEvent(episode_stream(rid, ep.attempt), ev.EPISODE_CONTINUED, {
                "env": ep.task.env, "task_id": ep.task.task_id, "origin_attempt": decision.attempt, "next_step": nxt,
                "recovered": True, "status": "running", "instance": self.instance}, rid, ep.attempt),)))

    async def _steps(self, ep: Episode) -> None:
        for step in STEPS:
            if ep.recorded(step) is not None:
                continue
            await self._park(ep)
            ep.step = step
            data = {"step": step, **await getattr(self, f"_{step}")(ep)}
            data["status"] = "finished" if step == "close" else "running"
            events = [NewEvent(episode_stream(ep.rollout_id, ep.attempt), ev.EPISODE_STEP, data, ep.rollout_id, ep.attempt)]
            if step == "close":
                # Atomic with the close step: the result is accepted exactly when the episode is done.
                events.append(NewEvent(rollout_stream(ep.rollout_id), ev.ATTEMPT_FINISHED, {"reward": ep.reward},
                                       ep.rollout_id, ep.attempt))
            await self.store.append(AppendRequest(tuple(events)))
            ep.done.append(data)
            ep.step = None

    async def _park(self, ep: Episode) -> None:
        if self.admission.is_open:
            return
        ep.status = "parked"
        await self.admission.wait_open()
        ep.status = "running"

    async def _post(self, ep: Episode, peers: Peers, suffix: str, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> Any:
        headers = {**(headers or {}), **as_attempt(self.secret, ep.rollout_id, ep.attempt)}
        url = data_url(peers.configured, ep.rollout_id, ep.attempt, suffix)
        # A peer's checkpoint ends by its own lease, and asking often costs it nothing but a refusal.
        closed = Patience(f"POST {url}", limit_s=None, max_delay_s=RETRY_FIRST_S)
        unavailable = Patience(f"POST {url}")  # restarting: every step's request is idempotent
        while True:
            try:
                # Asked again, a request goes where the live set says now: a dead worker's part is taken over.
                return await self.client.post(data_url(await peers.url(ep.rollout_id, ep.attempt), ep.rollout_id,
                                                       ep.attempt, suffix), body, headers)
            except AdmissionClosed as exc:  # the refused request changed nothing there
                await asyncio.sleep(closed.next_delay(exc, soon=self.admission.callee_resuming(exc)))
            except (ParticipantUnavailable, DatabaseUnavailable) as exc:
                await asyncio.sleep(unavailable.next_delay(exc))

    async def _seed(self, ep: Episode) -> dict[str, Any]:
        out = await self._post(ep, self.resources_peers, "/session",
                               {"env": ep.task.env, "task": ep.task.to_json()})
        return {"state_mode": out.get("state_mode"), "verification": out.get("verification"),
                "revision": out.get("revision", 0), "tools": out.get("tools")}

    async def _agent(self, ep: Episode) -> dict[str, Any]:
        # The next activation index: earlier attempts' completed activations are in the effective history.
        index = sum(1 for d in ep.done if d["step"] == "agent")
        seeded = ep.recorded("seed") or {}
        body = {"task": ep.task.to_json(), "max_steps": ep.max_steps, "seed": ep.seed, "tools": seeded.get("tools")}
        out = await self._post(ep, self.agent_peers, "/run", body,
                               {ACTIVATION_HEADER: str(index)})
        return {"activation": index, "final_answer": out.get("final_answer"), "turns": out.get("turns"),
                "usage": out.get("usage")}

    async def _verify(self, ep: Episode) -> dict[str, Any]:
        # The resources server reads the answer and the conversation from the log itself.
        out = await self._post(ep, self.resources_peers, "/verify", {})
        ep.closed_by_verify = ep.attempt if out.get("closed") else None
        return {"reward": float(out["reward"])}

    async def _close(self, ep: Episode) -> dict[str, Any]:
        if ep.closed_by_verify != ep.attempt:  # a passed verify closed this attempt's session in its own append
            await self._post(ep, self.resources_peers, "/close", {})
        return {"reward": ep.reward}

    async def episode_status(self, request: web.Request, _body: None) -> web.Response:
        rid = validate_id(request.match_info["rollout_id"], "rollout id")
        ep = self.episodes.get(rid)
        if ep is not None:
            return web.json_response({**ep.status_json(), **self._capability(rid, ep.attempt)})
        rows = await self.store.attempt_rows([rid])
        if not rows:
            raise NotFound(f"no episode for rollout {rid}")
        attempt = max(a for _, a in rows)
        row = rows[(rid, attempt)]
        status = {"finished": "finished", "live": "not_running"}.get(row["status"], row["status"])
        body = {"status": status, "attempt": attempt, "reward": row["reward"]}
        if status == "finished":  # as the episode said it in memory, the steps it ran included
            history = await effective_history(self.store, rid, attempt)
            ep = episode_from_history(rid, attempt, history, history)
            body = {**(ep.status_json() if ep is not None else {}), **body}
        return web.json_response({**body, **self._capability(rid, attempt)})

    def _capability(self, rollout_id: str, attempt: int) -> dict[str, str]:
        return {"capability": capability(self.secret, rollout_id, attempt)} if self.secret else {}

    def in_flight(self) -> int:
        return sum(1 for task in self.tasks.values() if not task.done())

    # ---- forks (engine/forks.py) ----------------------------------------------------------------

    async def fork(self, request: web.Request, req: ForkRequest) -> web.Response:
        """Record the forks (one append, or nothing when any is refused) and drive each like a dispatched
        rollout. Asked again with the same group, it writes nothing and drives the forks that are
        neither finished nor running here (after this server restarted, say)."""
        self.admission.require_open("a fork")
        async with self.locks(f"fork:{req.rollout_id}"):
            plan = await self._fork_plan(req)
            if not plan.existing:
                await self.store.append(plan.request())
            launched = 0
            for f in plan.forks:
                launched += await self._drive_fork(f.rollout_id)
        return web.json_response({**plan.to_json(), "launched": launched})

    async def _fork_plan(self, req: ForkRequest) -> ForkPlan:
        origin = Origin(req.rollout_id, req.attempt, req.position)
        started = await self.store.attempt_rows([req.rollout_id])
        known = (req.rollout_id, req.attempt) in started
        own = await self.store.read_rollout(req.rollout_id, req.attempt) if known else []
        prefix = await effective_history(self.store, req.rollout_id, req.attempt, to=req.position) if known else []
        kw: dict[str, Any] = {"started": started, "own": own, "prefix": prefix, "group": req.group, "seed": req.seed}
        plan = plan_forks(origin, req.count, **kw)
        rows = await self.store.attempt_rows([f.rollout_id for f in plan.forks])
        if not rows:
            return plan
        taken: dict[str, dict[str, Any] | None] = {}
        for rid in sorted({r for r, _ in rows}):
            forked = [e for e in await self.store.read_stream(rollout_stream(rid)) if e.kind == ev.ROLLOUT_FORKED]
            taken[rid] = dict(forked[0].data) if forked else None
        return plan_forks(origin, req.count, taken=taken, **kw)

    async def _drive_fork(self, rid: str) -> int:
        """Drive fork `rid` here unless it has finished or is running; 1 when it was launched."""
        async with self.locks(rid):
            task = self.tasks.get(rid)
            if task is not None and not task.done():
                return 0
            rows = await self.store.attempt_rows([rid])
            attempt = max(a for _, a in rows)
            if rows[(rid, attempt)]["status"] != "live":
                return 0
            history = await effective_history(self.store, rid, attempt)
            ep = episode_from_history(rid, attempt, history, history)
            if ep is None:
                raise InvalidRequest(f"fork {rid} has no episode input in its lineage")
            self._launch(ep)
            return 1

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/episodes", self.start_episode, EpisodeRequest, EpisodeResult,
                  (Forbidden, RequestConflict, AdmissionClosed, StaleAttempt, ToolCallRefused, ParticipantUnavailable)),
            Route("GET", "/episodes/{rollout_id}", self.episode_status, None, EpisodeStatus, (NotFound,)),
            Route("POST", f"{CONTROL}/fork", self.fork, ForkRequest, ForkReply,
                  (InvalidRequest, InvalidJson, InvalidIdentifier, UnknownRollout, NotABoundary, RestartOnlyBoundary, RequestConflict, AdmissionClosed, StaleAttempt), "control"),
        ]

    # ---- control plane hooks --------------------------------------------------------------------

    def _live(self) -> list[Episode]:
        return [ep for rid, ep in self.episodes.items() if ep.status not in ("finished", "failed")
                and rid in self.tasks and not self.tasks[rid].done()]

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        await super().prepare(checkpoint_id, deadline)
        # A step in progress is no blocker: what it does lands in the log after the episode's latest
        # boundary, and a restore of the cut does it again from there. A `wait` verification is the
        # exception: its environment says its answer may not be asked for twice.
        blockers = await drain(lambda: [ep for ep in self._live() if ep.status != "parked" and ep.step == "verify"
                                        and not replayable_verify(ep)], deadline)
        live = self._live()
        return PrepareReport(
            ready=not blockers,
            blockers=[f"{ep.rollout_id}:{ep.attempt} in step {ep.step}" for ep in blockers],
            counts={"episodes": len(live), "parked": sum(1 for ep in live if ep.status == "parked"),
                    "in_agent": sum(1 for ep in live if ep.status != "parked" and ep.step == "agent"),
                    "in_step": sum(1 for ep in live if ep.status != "parked" and ep.step not in (None, "agent"))},
        )

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Stage every scoped episode at its boundary; it runs again only at resume."""
        staged: dict[str, Episode] = {}
        # One read for the whole scope; past P too, since an episode's input may land after its first boundary.
        read = await read_cut(self.store, cut, rehash=False, beyond_cut=True)
        for entry in cut.scope:
            upto = read.effective(entry.rollout_id, entry.attempt, to=entry.boundary)
            inputs = read.effective(entry.rollout_id, entry.attempt)
            ep = episode_from_history(entry.rollout_id, entry.attempt, inputs, upto)
            if ep is not None and ep.recorded("close") is None:
                staged[entry.rollout_id] = ep
        self.staged, self.staged_from = staged, cut.checkpoint_id
        return {"staged": len(staged)}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        continued = 0
        if restored and self.staged_from == checkpoint_id and self.staged:
            rows = await self.store.attempt_rows(sorted(self.staged))
            for rid, ep in self.staged.items():
                target = restored_attempt(rows, rid, ep.attempt, checkpoint_id)
                # Every live environment worker staged the cut; only the one the rollout's dispatch routes to
                # continues it, so it runs once.
                if target is None or not await self.routed_here(rid, EPISODE_ATTEMPT):
                    continue
                origin, ep.attempt = ep.attempt, target
                nxt = next((s for s in STEPS if ep.recorded(s) is None), None)
                stream = episode_stream(rid, ep.attempt)
                seen = await self.store.read_stream(stream)
                if await self._claimed_elsewhere(seen):
                    continue
                try:  # every instance of this kind staged the cut: the one whose claim lands continues it
                    await self.store.append(claim((NewEvent(stream, ev.EPISODE_CONTINUED, {
                        "env": ep.task.env, "task_id": ep.task.task_id, "origin_attempt": origin, "next_step": nxt,
                        "restored_from": checkpoint_id, "status": "running", "instance": self.instance}, rid, ep.attempt),),
                        stream, seen[-1].stream_version if seen else 0))
                except VersionConflict:
                    continue
                self._launch(ep)
                continued += 1
            self.staged, self.staged_from = {}, None
        await super().resume(checkpoint_id, restored)
        return {"continued": continued}

    async def retire(self, rollout_id: str, through: int) -> None:
        ep, task = self.episodes.get(rollout_id), self.tasks.get(rollout_id)
        if ep is not None and ep.attempt <= through and task is not None and not task.done():
            task.cancel()
        staged = self.staged.get(rollout_id)
        if staged is not None and staged.attempt <= through:
            del self.staged[rollout_id]

    async def forget(self, rollout_id: str) -> None:
        task = self.tasks.get(rollout_id)
        if task is None or task.done():
            self.episodes.pop(rollout_id, None)
            self.tasks.pop(rollout_id, None)

    async def close(self) -> None:
        await self.client.close()

    async def stop(self) -> None:
        running = [t for t in self.tasks.values() if not t.done()]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def replayable_verify(ep: Episode) -> bool:
    """The episode's session said at seed that its verification is `replay`: asked again after a
    restore, it gives the same answer, so a checkpoint need not wait for it."""
    return (ep.recorded("seed") or {}).get("verification") == "replay"


def _same_task(rid: str, ep: Episode | None, requested: Task) -> None:
    """A rollout id names one task: asking for it with another is a conflict, answered before any write."""
    if ep is not None and ep.task != requested:
        raise RequestConflict(f"rollout {rid} was started with another task; a rollout id names one task")


def _episode_holder(events: Sequence[RecordedEvent]) -> str | None:
    """The instance that claimed an unfinished episode: its latest start or continuation names it."""
    if any(e.data.get("status") in ("finished", "failed") for e in events):
        return None
    claims = [e for e in events if e.kind in (ev.EPISODE_STARTED, ev.EPISODE_CONTINUED)]
    return str(claims[-1].data["instance"]) if claims and claims[-1].data.get("instance") else None


__all__ = ["EnvironmentParticipant", "Episode", "EpisodeRequest", "STEPS"]

