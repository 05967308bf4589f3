"""The crash suite's harness: four server processes on a fresh database, SIGKILL, and the invariants.

A `Cluster` is the four servers of apps.processes (each its own process group, so a crash is a
real SIGKILL of everything a server started) on the `dsn` fixture's database, plus the driver's
own event store and HTTP session. Crash points are picked by a seeded random.Random per test: the
seed is printed, and ROLLBOOK_E2E_SEED=<seed> replays the same choices.

Every invariant is read back through the public views (rollbook.episode_history, attempts,
checkpoints, model_calls) by the helpers at the bottom; `assert_invariants` runs them all.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlalchemy import text

from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from apps.processes import ServerProcesses, free_port
from engine.coordinator import Coordinator
from participants.environments.base import Task
from testkit.log_queries import REPEATED_CALLS, RESTORED_REPEATED_MUTATIONS
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]

SEED_VARIABLE = "ROLLBOOK_E2E_SEED"
POLL_CAP_S = 0.02  # short enough to catch a model call of a few tokens in flight
PROGRESS_E2E_S = 0.1  # the model server saves tokens in flight this often (the default, 1 s, is for long replies)


# ---- seeds -------------------------------------------------------------------------------------


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A per-test random.Random whose seed is printed (pytest shows it with a failure)."""
    seed = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(1 << 31))
    print(f"\n{request.node.name}: seed {seed}  (replay with {SEED_VARIABLE}={seed})")
    return random.Random(seed)


# ---- gates: hold one control call of the coordinator so a crash lands at an exact step -----------


class Gate:
    """A participant client whose `operation` waits for `opened` before it is sent.

    The crash then lands at a known point of the protocol: the coordinator has reached this
    participant, and this participant has (held) or has not (open) been told."""

    def __init__(self, inner: HttpParticipant, operation: str) -> None:
        self.inner, self.operation = inner, operation
        self.name, self.kind = inner.name, inner.kind
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()
        self.answered = asyncio.Event()

    async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        if operation != self.operation:
            return await self.inner.call(operation, body)
        self.reached.set()
        await self.opened.wait()
        try:
            return await self.inner.call(operation, body)
        finally:
            self.answered.set()


# ---- the cluster -------------------------------------------------------------------------------


@dataclass
class Cluster:
    config: cfg.Config
    procs: ServerProcesses
    store: PostgresEventStore
    session: aiohttp.ClientSession
    work: Path
    crashes: int = 0
    started: list[float] = field(default_factory=list)
    upstream: str | None = None  # the fake vLLM's base URL (testkit/fake_vllm.py) when the model server has one

    async def upstream_stall(self, stalled: bool) -> None:
        """Stall every stream of the upstream before its next step (no call can complete), or let them go."""
        assert self.upstream is not None, "a cluster made with upstream=True"
        async with self.session.post(f"{self.upstream}/fake/{'stall' if stalled else 'unstall'}") as resp:
            assert resp.status == 200, await resp.text()

    async def stalled_call(self) -> None:
        """Once a stream of the stalled upstream waits: a model call that cannot complete until unstalled."""
        async def stalled() -> bool:
            async with self.session.get(f"{self.upstream}/fake/requests") as resp:
                return int((await resp.json())["stalled"]) > 0
        await self.wait_for("a stream stalled at the upstream", stalled, 30)

    async def start(self) -> None:
        """Fresh processes of all four kinds (a restored process must never have served sessions)."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self.procs.start)
        self.started.append(time.perf_counter() - t0)

    async def kill(self, kinds: Iterable[str] = cfg.KINDS) -> None:
        await asyncio.to_thread(self.procs.kill, tuple(kinds))  # type: ignore[arg-type]

    async def crash(self, *driver: asyncio.Task[Any], kinds: Iterable[str] = cfg.KINDS) -> None:
        """The driver's own tasks (dispatch, a coordinator step) die first, so nothing of theirs reacts
        to the crash (a coordinator would abort a checkpoint); then SIGKILL the servers' process groups."""
        for task in driver:
            if not task.done():
                task.cancel()
        await self.kill(kinds)
        self.crashes += 1
        await asyncio.wait_for(asyncio.gather(*driver, return_exceptions=True), 30)

    def collection(self, run_id: str, tasks: list[Task], seed: int = 0, **kw: Any) -> Collection:
        return Collection(self.config, self.store, run_id, tasks, seed=seed, **kw)

    def participants(self) -> dict[str, HttpParticipant]:
        return {k: HttpParticipant(k, k, self.config.url(k), self.config.control_token, self.session) for k in cfg.KINDS}

    def gated(self, operation: str, held: Iterable[str]) -> tuple[Coordinator, dict[str, Gate]]:
        """A coordinator whose `operation` is held before it is sent to each kind in `held`."""
        gates = {k: Gate(p, operation) for k, p in self.participants().items()}
        for k, g in gates.items():
            if k not in set(held):
                g.opened.set()
        return Coordinator(self.store, list(gates.values())), gates

    async def control(self, kind: str, operation: str, checkpoint_id: str, deadline_s: float = 60.0) -> dict[str, Any]:
        """One control-plane call to one server (used to hold a server's admission closed)."""
        body = {"checkpoint_id": checkpoint_id, "deadline": time.time() + deadline_s}
        return await self.participants()[kind].call(operation, body)

    async def control_status(self, kind: str) -> dict[str, Any]:
        async with self.session.get(self.config.url(kind) + "/rollbook/v1/control/status",
                                    headers={"Authorization": f"Bearer {self.config.control_token}"}) as resp:
            return dict(await resp.json())

    async def episode(self, rollout_id: str) -> dict[str, Any]:
        async with self.session.get(self.config.url("environment") + f"/episodes/{rollout_id}",
                                    headers={"Authorization": f"Bearer {self.config.data_token}"}) as resp:
            return dict(await resp.json()) if resp.status == 200 else {"status": f"http_{resp.status}"}

    # ---- reading the public views ------------------------------------------------------------

    async def rows(self, sql: str, **params: Any) -> list[Any]:
        async with self.store.engine.connect() as conn:
            return list(await conn.execute(text(sql), params))

    async def scalar(self, sql: str, **params: Any) -> Any:
        async with self.store.engine.connect() as conn:
            return (await conn.execute(text(sql), params)).scalar()

    async def wait_for(self, what: str, probe: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
        """Poll until `probe` returns something truthy; TimeoutError naming `what` if it never does
        (not an AssertionError: a scenario that never set up is not an invariant that broke).
        tests/waiting.py's loop: at once, then backing off from 5 ms to POLL_CAP_S, so a long wait
        does not query the database 200 times a second beside the servers it waits on."""
        return await eventually(what, probe, timeout, cap=POLL_CAP_S)

    async def count(self, prefix: str, kind: str, after: int = 0, attempt: int | None = None) -> int:
        return int(await self.scalar(
            "SELECT count(*) FROM rollbook.episode_history WHERE rollout_id LIKE :p AND kind = :k AND position > :a "
            "AND (CAST(:n AS int) IS NULL OR attempt = :n)", p=f"{prefix}-%", k=kind, a=after, n=attempt))

    async def wait_count(self, prefix: str, kind: str, at_least: int, after: int = 0, attempt: int | None = None,
                         timeout: float = 30.0) -> int:
        async def probe() -> bool:
            return await self.count(prefix, kind, after, attempt) >= at_least
        await self.wait_for(f"{at_least} {kind} events of {prefix} after {after}", probe, timeout)
        return await self.count(prefix, kind, after, attempt)

    async def call_in_flight(self, prefix: str, after: int = 0, timeout: float = 30.0) -> str:
        """A model call accepted after `after` that has not ended: the model is generating it now."""
        async def probe() -> str | None:
            return await self.scalar(
                "SELECT call_id FROM rollbook.model_calls WHERE rollout_id LIKE :p AND status = 'accepted' "
                "AND accepted_position > :a ORDER BY accepted_position DESC LIMIT 1", p=f"{prefix}-%", a=after)
        return str(await self.wait_for(f"a model call of {prefix} in flight after {after}", probe, timeout))

    async def cuttable_calls(self) -> float:
        """The model calls a paused checkpoint would cut now: in flight, with tokens saved (its /metrics)."""
        async with self.session.get(self.config.url("model") + "/metrics",
                                    headers={"Authorization": f"Bearer {self.config.control_token}"}) as resp:
            assert resp.status == 200, await resp.text()
            lines = (await resp.text()).splitlines()
        return float(next(x for x in lines if x.startswith("rollbook_model_calls_cuttable ")).split()[1])

    async def phase(self, checkpoint_id: str) -> str | None:
        return await self.scalar("SELECT phase FROM rollbook.checkpoints WHERE checkpoint_id = :c", c=checkpoint_id)

    async def head(self) -> int:
        return int(await self.scalar("SELECT coalesce(max(position), 0) FROM rollbook.episode_history"))


async def finish(cluster: Cluster, coll: Collection, timeout: float = 120.0) -> dict[str, Any]:
    """What a framework does after a restore: dispatch every unfinished rollout until none is left."""
    results = await asyncio.wait_for(coll.dispatch(cluster.session), timeout)
    left = await coll.unfinished()
    assert not left, f"rollouts still unfinished after dispatch: {[coll.rollout_id(i) for i in left]}"
    return results


@pytest.fixture
async def cluster_factory(dsn: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """Build (and start) a cluster on the test's database; everything is stopped at teardown."""
    made: list[Cluster] = []

    upstreams: list[subprocess.Popen[bytes]] = []

    async def make(token_latency_s: float = 0.006, upstream: bool = False, continuation: str = "vllm",
                   derender: bool = True, nemo_gym: dict[str, cfg.NemoGymConfig] | None = None,
                   workers: dict[str, int] | None = None,
                   nemo_gym_agent: dict[str, cfg.NemoGymAgentConfig] | None = None,
                   harness: dict[str, cfg.HarnessConfig] | None = None) -> Cluster:
        """`upstream`: the model server in front of the fake vLLM in its own process, whose policy also
        plays NeMo Gym's servers when `nemo_gym` names any (as the in-process scripted model does)."""
        # The model saves its generations' tokens often, so that paused checkpoints cut calls mid-generation.
        servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=token_latency_s if k == "model" else 0.0,
                                       progress_s=PROGRESS_E2E_S, workers=(workers or {}).get(k, 1)) for k in cfg.KINDS}
        upstream_url = None
        if upstream:
            # The model server in front of a vLLM-style upstream (testkit/fake_vllm.py) in its own process,
            # which outlives the crashes as a real inference server would.
            port = free_port()
            upstreams.append(subprocess.Popen([sys.executable, "-m", "testkit.fake_vllm", "--port", str(port),
                                               "--token-latency-s", str(token_latency_s),
                                               "--continuation", continuation,
                                               *([] if derender else ["--no-derender"]),
                                               *(["--nemo-gym-players"] if nemo_gym else [])], cwd=ROOT))
            await _wait_listening(port)
            upstream_url = f"http://127.0.0.1:{port}"
            servers["model"] = cfg.ServerConfig(port=servers["model"].port, backend="openai_compatible",
                                                url=f"http://127.0.0.1:{port}/v1", model="fake-policy",
                                                policy_version="scripted-v1", progress_s=PROGRESS_E2E_S)
        config = cfg.Config(dsn=dsn, control_token=secrets.token_hex(12), data_token=secrets.token_hex(12), servers=servers,
                            sandbox=cfg.SandboxConfig(), nemo_gym=nemo_gym or {}, nemo_gym_agent=nemo_gym_agent or {},
                            harness=harness or {})
        work = tmp_path / f"cluster{len(made)}"
        work.mkdir()
        cfg.write(config, work / "rollbook.toml")
        cluster = Cluster(config, ServerProcesses(config, work / "rollbook.toml", work),
                          PostgresEventStore.connect(dsn, writer="e2e-driver"), aiohttp.ClientSession(), work,
                          upstream=upstream_url)
        made.append(cluster)
        print(f"server logs: {work}")
        await cluster.start()
        return cluster

    yield make
    for cluster in made:
        await asyncio.to_thread(cluster.procs.stop)
        await cluster.session.close()
        await cluster.store.close()
    for proc in upstreams:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)


async def _wait_listening(port: int, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.time() > end:
                raise
            await asyncio.sleep(0.05)


# ---- invariants, through the public views --------------------------------------------------------

# Any event of an attempt recorded after its fence.
AFTER_FENCE = """
SELECT e.rollout_id, e.attempt, e.kind, e.position, f.position AS fenced_at
FROM rollbook.episode_history f
JOIN rollbook.episode_history e ON e.rollout_id = f.rollout_id AND e.attempt = f.attempt AND e.position > f.position
WHERE f.kind = 'attempt_fenced' AND f.rollout_id LIKE :p
"""
# An attempt that had finished at or before the cut of the restore that fenced it: a finished rollout redone.
REDONE = """
SELECT f.rollout_id, f.attempt, f.data->>'checkpoint_id' AS checkpoint_id
FROM rollbook.episode_history f
JOIN rollbook.checkpoints c ON c.checkpoint_id = f.data->>'checkpoint_id'
JOIN rollbook.episode_history d ON d.rollout_id = f.rollout_id AND d.attempt = f.attempt AND d.kind = 'attempt_finished'
WHERE f.kind = 'attempt_fenced' AND f.rollout_id LIKE :p AND d.position <= c.log_position
"""
ENDINGS = """
SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS finished,
       count(*) FILTER (WHERE status = 'live') AS live,
       bool_or(status = 'finished' AND reward IS NULL) AS null_reward,
       max(attempt) AS latest, max(attempt) FILTER (WHERE status = 'finished') AS finished_attempt
FROM rollbook.attempts WHERE rollout_id LIKE :p GROUP BY rollout_id ORDER BY rollout_id
"""
# attempt_finished events of attempts that stand (not rolled back by a fence)
FINISH_EVENTS = """
SELECT e.rollout_id, count(*) AS n FROM rollbook.episode_history e
JOIN rollbook.attempts a ON a.rollout_id = e.rollout_id AND a.attempt = e.attempt
WHERE e.kind = 'attempt_finished' AND e.rollout_id LIKE :p AND a.status <> 'fenced' GROUP BY e.rollout_id
"""
TRAJECTORY_KINDS = ("attempt_started", "agent_boundary", "agent_activation_completed", "call_completed",
                    "session_opened", "mutation_applied")


async def repeated_calls(c: Cluster, prefix: str, upto: str = "boundary") -> list[Any]:
    """Generated calls of a continued attempt for a turn an ancestor completed at or before `upto`:
    'boundary' (the brief's invariant) or 'cut' (a reply the checkpoint held is never generated again)."""
    assert upto in ("boundary", "cut")
    return await c.rows(REPEATED_CALLS.format(upto=upto), p=f"{prefix}-%")


async def repeated_mutations(c: Cluster, prefix: str) -> list[Any]:
    return await c.rows(RESTORED_REPEATED_MUTATIONS, p=f"{prefix}-%")


@dataclass(frozen=True)
class Ev:
    rollout_id: str
    attempt: int
    position: int
    stream: str
    kind: str
    data: dict[str, Any]


async def history(c: Cluster, prefix: str) -> dict[str, list[Ev]]:
    rows = await c.rows("SELECT rollout_id, attempt, position, stream, kind, data FROM rollbook.episode_history "
                        "WHERE rollout_id LIKE :p AND kind = ANY(:k) ORDER BY position", p=f"{prefix}-%",
                        k=list(TRAJECTORY_KINDS))
    out: dict[str, list[Ev]] = {}
    for r in rows:
        out.setdefault(r.rollout_id, []).append(Ev(r.rollout_id, r.attempt, r.position, r.stream, r.kind, r.data))
    return out


def effective(events: list[Ev], attempt: int, upto: int | None = None) -> list[Ev]:
    """engine.lineage.effective_history, on rows of the public view."""
    own = [e for e in events if e.attempt == attempt and (upto is None or e.position <= upto)]
    start = next((e for e in own if e.kind == "attempt_started"), None)
    if start is None or start.data.get("origin_attempt") is None:
        return own
    return effective(events, start.data["origin_attempt"], start.data["origin_position"]) + own


def _turn(call_id: str) -> int:
    return int(call_id.rsplit(".t", 1)[1])


def _assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") == "assistant"]


def _replies_by_turn(events: list[Ev]) -> list[dict[str, Any]]:
    """The recorded replies of a history, one per turn (a later record of a turn wins), in turn order."""
    by_turn = {_turn(e.data["call_id"]): e.data["reply"] for e in events if e.kind == "call_completed"}
    return [by_turn[t] for t in sorted(by_turn)]


def trajectory_breaks(events: list[Ev], finished_attempt: int | None) -> list[str]:
    """Where a continued rollout's trajectory does not begin with its pre-crash calls.

    For each continued attempt: the agent boundary it continues from (the last one in its origin's
    effective history up to the origin boundary) must hold exactly the replies the log recorded for
    those turns, and the attempt's first agent record must start with the same messages and the same
    last call id. For the finished attempt: its final conversation is exactly its recorded replies."""
    problems: list[str] = []
    rid = events[0].rollout_id if events else "?"
    starts = [e for e in events if e.kind == "attempt_started" and e.data.get("origin_attempt") is not None]
    for s in starts:
        origin = effective(events, s.data["origin_attempt"], s.data["origin_position"])
        boundaries = [e for e in origin if e.kind == "agent_boundary"]
        if not boundaries:
            continue  # the agent had not started at the origin boundary: the attempt starts it from input
        ob = boundaries[-1]
        done = any(e.kind == "agent_activation_completed" and e.data.get("index") == ob.data.get("activation")
                   for e in origin)
        recorded = _replies_by_turn([e for e in origin])
        if _assistant(ob.data["messages"]) != recorded[:len(_assistant(ob.data["messages"]))] or \
                len(recorded) < len(_assistant(ob.data["messages"])):
            problems.append(f"{rid}: origin boundary @{ob.position} messages differ from the recorded replies")
        own = [e for e in events if e.attempt == s.attempt and e.kind in ("agent_boundary", "agent_activation_completed")]
        if done:
            if any(e.kind == "agent_boundary" and e.data.get("activation") == ob.data.get("activation") for e in own):
                problems.append(f"{rid} attempt {s.attempt}: re-ran activation {ob.data.get('activation')}, "
                                f"completed before its origin boundary")
            continue
        if not own:
            if s.attempt == finished_attempt:
                problems.append(f"{rid} attempt {s.attempt} finished without continuing its agent from @{ob.position}")
            continue
        first = own[0]
        # A completion stores no conversation (engine.boundaries.completed_activations): an attempt that
        # completed at once holds its origin boundary's.
        messages = first.data["messages"] if first.kind == "agent_boundary" else ob.data["messages"]
        if messages[:len(ob.data["messages"])] != ob.data["messages"]:
            problems.append(f"{rid} attempt {s.attempt}: does not begin with the messages of its origin boundary "
                            f"@{ob.position}")
        if first.kind == "agent_boundary":
            want_turn = ob.data["turn"] + (0 if ob.data["state"] == "before_model" else 1)
            if first.data.get("last_call_id") != ob.data.get("last_call_id") or first.data["turn"] != want_turn:
                problems.append(f"{rid} attempt {s.attempt}: continues at turn {first.data['turn']} after "
                                f"{first.data.get('last_call_id')}, the origin was at turn {want_turn} after "
                                f"{ob.data.get('last_call_id')}")
    if finished_attempt is not None:
        eff = effective(events, finished_attempt)
        final = [e for e in eff if e.kind == "agent_activation_completed"]
        if final:
            before = [e for e in eff if e.kind == "agent_boundary" and e.position < final[-1].position]
            said = _assistant(final[-1].data["reply"].get("messages") or before[-1].data["messages"])
            if said != _replies_by_turn(eff):
                problems.append(f"{rid}: the final conversation ({len(said)} replies) is not the recorded replies "
                                f"of its lineage ({len(_replies_by_turn(eff))})")
    return problems


def revision_breaks(events: list[Ev]) -> list[str]:
    """Each session's revisions run on from where it opened; a restored session opens at its origin's revision."""
    problems: list[str] = []
    streams: dict[str, list[Ev]] = {}
    for e in events:
        if e.kind in ("session_opened", "mutation_applied"):
            streams.setdefault(e.stream, []).append(e)
    for stream, evs in streams.items():
        rev = None
        for e in evs:
            if e.kind == "session_opened":
                rev = int(e.data.get("revision", 0))
                if e.data.get("restored_from") is not None:
                    s = next(x for x in events if x.kind == "attempt_started" and x.attempt == e.attempt)
                    origin = effective(events, s.data["origin_attempt"], s.data["origin_position"])
                    muts = [x.data["revision"] for x in origin if x.kind == "mutation_applied"]
                    if rev != (muts[-1] if muts else 0):
                        problems.append(f"{stream} reopened at revision {rev}, its origin was at "
                                        f"{muts[-1] if muts else 0}")
            elif rev is None or e.data["revision"] != rev + 1:
                problems.append(f"{stream}: revision {e.data['revision']} after {rev}")
                rev = e.data["revision"]
            else:
                rev += 1
    return problems


async def assert_invariants(c: Cluster, coll: Collection) -> dict[str, Any]:
    """Every rollout of `coll` ended once with a reward, nothing was done twice, every continued
    trajectory begins with its pre-crash calls, and no fenced attempt wrote after its fence."""
    p = f"{coll.run_id}-%"
    endings = await c.rows(ENDINGS, p=p)
    expected = {coll.rollout_id(i) for i in range(len(coll.tasks))}
    assert {r.rollout_id for r in endings} == expected, "some rollouts never started"
    bad = [(r.rollout_id, r.finished, r.live, r.latest, r.finished_attempt) for r in endings
           if r.finished != 1 or r.live != 0 or r.null_reward or r.finished_attempt != r.latest]
    assert not bad, f"rollouts not ended exactly once by their latest attempt (id, finished, live, latest, finished_at): {bad}"
    finishes = {r.rollout_id: r.n for r in await c.rows(FINISH_EVENTS, p=p)}
    assert finishes == dict.fromkeys(expected, 1), f"attempt_finished events of standing attempts: {finishes}"
    assert not (rows := await repeated_calls(c, coll.run_id)), f"model calls generated again: {rows}"
    assert not (rows := await repeated_calls(c, coll.run_id, upto="cut")), \
        f"model calls completed by a restored cut generated again: {rows}"
    assert not (rows := await repeated_mutations(c, coll.run_id)), f"mutations applied twice: {rows}"
    assert not (rows := await c.rows(AFTER_FENCE, p=p)), f"events after a fence: {rows}"
    assert not (rows := await c.rows(REDONE, p=p)), f"rollouts finished by a cut, redone after restoring it: {rows}"
    finished_at = {r.rollout_id: r.finished_attempt for r in endings}
    problems: list[str] = []
    for rid, events in (await history(c, coll.run_id)).items():
        problems += trajectory_breaks(events, finished_at.get(rid)) + revision_breaks(events)
    assert not problems, "\n".join(problems)
    attempts = await c.rows("SELECT rollout_id, attempt, origin_position FROM rollbook.attempts WHERE rollout_id LIKE :p",
                            p=p)
    return {"rollouts": len(expected), "attempts": len(attempts),
            "continued": sum(1 for a in attempts if a.origin_position is not None)}
