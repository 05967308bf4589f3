"""An episode's lifecycle on the environment server: how it begins, its steps, how it goes on.

An episode's steps (seed, agent, verify, close) run in order and each is recorded as an
`episode_step` event when it is done, so the log alone says where an episode stands: a restored
episode continues from its next step under its new attempt, and nothing recorded before its
boundary is done twice. While a checkpoint is open an episode parks before its next step, and an
episode that finishes holds its reply until resume, so the framework sees nothing change during the
pause. An episode that finishes while a checkpoint is open has its `attempt_finished` in the log and
is never continued.

Every caller runs an episode through the two public methods here: `run_episode` (the rollout's
episode: the one running here, attempt 0 from its input, or its live attempt picked up where the log
leaves it) and `continue_episode` (a newer try of the rollout supersedes its current attempt). The
participant's `POST /episodes` and NeMo Gym's `POST /run` (participants/environment/nemo_gym.py)
both do; every episode event's payload comes from engine.episodes.

After a crash, dispatching a rollout again picks up its live attempt where the log leaves it: the
steps it recorded are not run again, and the agent, model and resources servers each go on from
their own part of the log. A server that does not answer (restarting) or a database outage is
waited for. When another server says a part of the attempt is gone for good (`attempt_lost`: a
sandbox process, a model call whose reply was never recorded), the attempt is classified
(engine.recovery.classify), that is recorded, and this rollout alone restarts under attempt N+1:
continuing from N's latest boundary, or from its input when its state cannot be rebuilt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from adapters.http_client import JsonClient, as_attempt, data_url
from engine import catalog as ev
from engine import episodes, recovery, retry
from engine.checkpoint import ParticipantStore
from engine.errors import (
    AdmissionClosed,
    AttemptLost,
    DatabaseUnavailable,
    Forbidden,
    GymServerFailed,
    InvalidRequest,
    ParticipantUnavailable,
    RollbookError,
    StaleAttempt,
    ToolCallRefused,
    VersionConflict,
)
from engine.events import AppendRequest, NewEvent, RecordedEvent
from engine.identity import Key, episode_stream, rollout_stream
from engine.lineage import effective_history
from engine.ownership import claim
from engine.patience import RETRY_FIRST_S, Patience
from participants.base.keyed_locks import KeyedLocks
from participants.base.owners import owner_verdict
from participants.base.participant import Participant
from participants.base.routing import Peers
from participants.base.wire import ACTIVATION_HEADER
from participants.environment.episode import Episode, episode_from_history, episode_holder, same_task
from participants.environments import ENVIRONMENTS, Task, enabled_environments, get_environment

STEPS = episodes.STEPS
MAX_RECOVERIES = 3  # restarts of one rollout under a new attempt within one drive, before it fails

# Failures that are the rollout's own, which asking again would only repeat (a NeMo Gym server that
# cannot start or refused its seed or verify, an environment that refused a step): the attempt ends
# failed with them. Anything else (a peer away, a restore) leaves it to its recovery.
ENDS_THE_ATTEMPT = (GymServerFailed, ToolCallRefused)
FAILURE_SHOWN = 1000

Step = Callable[[Episode], Awaitable[dict[str, Any]]]


class EpisodeLifecycle(Participant):
    """The environment participant's episodes: begun, stepped, continued and restarted here alone."""

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
        self.steps: dict[str, Step] = {"seed": self._seed, "agent": self._agent, "verify": self._verify,
                                       "close": self._close}
        assert tuple(self.steps) == STEPS, "the step table runs the catalog's steps in the catalog's order"

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

    # ---- the lifecycle's public entries ------------------------------------------------------------

    async def run_episode(self, rid: str, task: Task, seed: int, max_steps: int, *,
                          rows: dict[Key, dict[str, Any]] | None = None,
                          gym: Mapping[str, Any] | None = None, unseen: bool = False) -> asyncio.Task[dict[str, Any]]:
        """The rollout's episode, running here: the one this process runs already; else attempt 0 from
        its input, or the rollout's live attempt picked up where its log leaves it, claimed for this
        process (engine/ownership.py) or VersionConflict. `rows`: its attempts, when just read; `gym`:
        NeMo Gym's caller identity, recorded on a start; `unseen`: the caller just read the rollout's
        whole log and found nothing, so neither its attempts nor its stream are read again (another
        instance's start meanwhile still makes the claim a VersionConflict). The caller holds
        `self.locks(rid)`."""
        running = self.tasks.get(rid)
        if running is not None and not running.done():
            return running
        return self._launch(await self._open(rid, task, seed, max_steps, rows, gym, unseen))

    async def continue_episode(self, rid: str, task: Task, seed: int, max_steps: int, *,
                               gym: Mapping[str, Any] | None, reason: str) -> asyncio.Task[dict[str, Any]]:
        """A newer try of the rollout (NeMo Gym's next caller attempt, engine/retry.py) supersedes its
        current attempt: the run here is cancelled, the attempt fenced, and the episode goes on under
        the next attempt from its latest boundary, or from its input when that cannot be rebuilt. The
        caller holds `self.locks(rid)`."""
        running = self.tasks.get(rid)
        if running is not None and not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        rows = await self.store.attempt_rows([rid])
        current = max(a for _, a in rows)
        t = retry.takeover(rid, current, await effective_history(self.store, rid, current))
        await self.store.append(retry.takeover_request(t, reason))
        ep = Episode(rid, t.new_attempt, task, seed, max_steps)
        await self._begin_attempt(ep, t.disposition == "fresh_dispatch", current, gym=gym)
        return self._launch(ep)

    # ---- how an attempt's episode begins ---------------------------------------------------------

    def _claimant(self, gym: Mapping[str, Any] | None) -> dict[str, Any]:
        # A NeMo Gym caller's episode is held by its caller's attempt numbering (engine/retry.py), not by an
        # instance: its retry may land on any instance, so its start names the caller and no owner.
        return {"gym": gym} if gym is not None else {"instance": self.instance}

    async def _open(self, rid: str, task: Task, seed: int, max_steps: int, rows: dict[Key, dict[str, Any]] | None,
                    gym: Mapping[str, Any] | None, unseen: bool = False) -> Episode:
        rows = {} if unseen else rows if rows is not None else await self.store.attempt_rows([rid])
        claimant = self._claimant(gym)
        started = episodes.started(task.to_json(), seed, max_steps, **claimant)
        if not rows:  # one append: the attempt never exists without its episode's input; of two instances, one lands
            await self._claim(rollout_stream(rid), (
                NewEvent(rollout_stream(rid), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
                NewEvent(episode_stream(rid, 0), ev.EPISODE_STARTED, started, rid, 0)), [] if unseen else None)
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
        same_task(rid, ep, task)
        stream = episode_stream(rid, attempt)
        if ep is None:  # a fresh dispatch: the attempt exists, its episode starts from input
            await self._claim(stream, (NewEvent(stream, ev.EPISODE_STARTED, started, rid, attempt),))
            return Episode(rid, attempt, task, seed, max_steps)
        # Its owner is gone: taken over, once.
        await self._claim(stream, (NewEvent(stream, ev.EPISODE_CONTINUED, episodes.continued(
            task.env, task.task_id, ep.next_step, recovered=True, **claimant), rid, attempt),))
        return ep

    async def _begin_attempt(self, ep: Episode, fresh: bool, origin_attempt: int, *, recovered: bool = False,
                             gym: Mapping[str, Any] | None = None) -> None:
        """Record how `ep`'s new attempt begins: from its input, or from `origin_attempt`'s steps."""
        rid, stream = ep.rollout_id, episode_stream(ep.rollout_id, ep.attempt)
        claimant = self._claimant(gym)
        if fresh:
            ep.done = []
            event = NewEvent(stream, ev.EPISODE_STARTED, episodes.started(
                ep.task.to_json(), ep.seed, ep.max_steps, **claimant), rid, ep.attempt)
        else:
            ep.done = episodes.recorded_steps(await effective_history(self.store, rid, ep.attempt))
            event = NewEvent(stream, ev.EPISODE_CONTINUED, episodes.continued(
                ep.task.env, ep.task.task_id, ep.next_step, origin_attempt=origin_attempt, recovered=recovered,
                **claimant), rid, ep.attempt)
        await self.store.append(AppendRequest((event,)))

    async def _continue_restored(self, ep: Episode, attempt: int, checkpoint_id: str) -> int:
        """Continue restored episode `ep` under `attempt` (the one its restore started) if this instance's
        claim lands: every instance of this kind staged the cut, and one of them runs it. 1 when it runs here."""
        origin, ep.attempt = ep.attempt, attempt
        stream = episode_stream(ep.rollout_id, attempt)
        seen = await self.store.read_stream(stream)
        if await self._claimed_elsewhere(seen):
            return 0
        data = episodes.continued(ep.task.env, ep.task.task_id, ep.next_step, origin_attempt=origin,
                                  restored_from=checkpoint_id, instance=self.instance)
        try:
            await self.store.append(claim((NewEvent(stream, ev.EPISODE_CONTINUED, data, ep.rollout_id, attempt),),
                                          stream, seen[-1].stream_version if seen else 0))
        except VersionConflict:
            return 0
        self._launch(ep)
        return 1

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

    async def _claim(self, stream: str, events: tuple[NewEvent, ...], seen: Sequence[RecordedEvent] | None = None) -> None:
        """Append `events` at `stream`'s version if it is as the decision found it (no attempt, no live
        claim); `seen`: the stream, when just read."""
        seen = await self.store.read_stream(stream) if seen is None else seen
        if any(e.kind == ev.ATTEMPT_STARTED for e in seen) or await self._claimed_elsewhere(seen):
            raise VersionConflict(f"{stream} was claimed by another instance meanwhile")
        await self.store.append(claim(events, stream, seen[-1].stream_version if seen else 0))

    async def _claimed_elsewhere(self, events: Sequence[RecordedEvent]) -> bool:
        owner = episode_holder(events)
        return owner not in (None, self.instance) and await owner_verdict(self, owner, held_here=False) == "held"

    # ---- driving it ------------------------------------------------------------------------------

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
                    await self._run_steps(ep)
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
        cause = exc.context.get("lost")
        lost: recovery.Lost = cause if cause in ("session", "divergence", "agent") else "call"
        why = exc.detail if lost == "session" else exc.context.get("reason")
        history = await effective_history(self.store, ep.rollout_id, ep.attempt)
        decision = recovery.classify(ep.rollout_id, ep.attempt, history, lost, why)
        await self.store.append(recovery.recovery_request(decision))  # stale_attempt if a restore or retire came first
        ep.attempt += 1
        await self._begin_attempt(ep, decision.disposition == "fresh_dispatch", decision.attempt, recovered=True)

    async def _run_steps(self, ep: Episode) -> None:
        for name, run in self.steps.items():
            if ep.recorded(name) is not None:
                continue
            await self._park(ep)
            ep.step = name
            done = [episodes.step(name, await run(ep))]
            if name == "verify" and ep.closed_by_verify == ep.attempt:
                # The verify closed its session (asked to): the close step asks no one, so it is the same
                # moment and lands in the same append (a repeat of the verify, after a crash, says it closed).
                done.append(episodes.step(STEPS[-1], episodes.finished(done)))
            events = [NewEvent(episode_stream(ep.rollout_id, ep.attempt), ev.EPISODE_STEP, d, ep.rollout_id, ep.attempt)
                      for d in done]
            if done[-1]["step"] == STEPS[-1]:
                # Atomic with the close step: the result is accepted exactly when the episode is done.
                events.append(NewEvent(rollout_stream(ep.rollout_id), ev.ATTEMPT_FINISHED,
                                       episodes.finished([*ep.done, *done]), ep.rollout_id, ep.attempt))
            await self.store.append(AppendRequest(tuple(events)))
            ep.done.extend(done)
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

    # ---- the steps (self.steps) --------------------------------------------------------------------

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
        # The resources server reads the answer and the conversation from the log itself. The reward is
        # recorded here alone; everything after derives it from this step (engine.episodes.reward).
        try:
            # The close step comes next and asks nothing else of the session: it closes with the verify.
            out = await self._post(ep, self.resources_peers, "/verify", {"close": True})
        except GymServerFailed as exc:
            # A judge's model call lost with the model server that held it is refused as lost (attempt_lost),
            # which the NeMo Gym server can only report as its own failure: the attempt was lost, not failed.
            lost = [e for e in await self.store.read_rollout(ep.rollout_id, ep.attempt)
                    if e.kind == ev.CALL_FAILED and e.data.get("lost")]
            if not lost:
                raise
            raise AttemptLost(f"the verify of rollout {ep.rollout_id} attempt {ep.attempt} failed after its model call "
                              f"{lost[-1].data.get('call_id')} was lost: {exc.detail}"[:600], rollout_id=ep.rollout_id,
                              attempt=ep.attempt, lost="call", call_id=lost[-1].data.get("call_id")) from exc
        ep.closed_by_verify = ep.attempt if out.get("closed") else None
        return {"reward": float(out["reward"])}

    async def _close(self, ep: Episode) -> dict[str, Any]:
        if ep.closed_by_verify != ep.attempt:  # its verify closed this attempt's session in its own append
            await self._post(ep, self.resources_peers, "/close", {})
        # Derived from the verify step, and still written: an attempt that inherited its verify step gets
        # its rollbook.episode_state reward from this event alone.
        return episodes.finished(ep.done)


__all__ = ["MAX_RECOVERIES", "STEPS", "EpisodeLifecycle"]
