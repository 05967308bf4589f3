"""Agents rollbook runs unchanged for the tasks that name them: a NeMo Gym agent
(`[nemo_gym_agent.<name>]`, here) or a third-party harness in a sandbox session (`[harness.<name>]`,
participants/agent/harness.py). Each is a `Driver`; claiming an activation, continuing it after a
crash and recording its reply are the same for both, and live here.

The agent server starts the agent the way the resources server starts a NeMo Gym resources server
(participants/environments/nemo_gym_launcher.py), its model server and resources server being
rollbook's. An activation of a task whose `agent` names it is forwarded to the agent's own
`/ng-rollout/<capture>/v1/responses`, the capture naming (rollout, attempt, activation) and riding in
a cookie too: NeMo Gym agents carry that path to their model calls and the cookie to their tool
calls, so rollbook numbers and records every call on the attempt's routes (engine.agent_replay)
without the agent saying anything. Its output becomes the activation's reply: the conversation as
chat messages, the last message's text as the final answer, in the log as rollbook's own agent
records its completion.

Such an agent cannot say where it stands, so it is never resumed in the middle (engine.agent_replay):
- an activation asked again that was already claimed under this attempt (its run was cut off by a
  crash of this server or of the agent, whether or not it had made calls) is `attempt_lost`: declared
  `replay`, the rollout goes on under a new attempt continuing from all of this one, where the agent
  runs from the start, answered from the log; declared `restart_only` (the default), it starts over
  from its input;
- a run that fails after one of its calls diverged from the recorded one is `attempt_lost` with
  reason `agent_divergence`: that rollout alone starts over from its input.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp

from adapters.http_client import PeerTimeouts
from adapters.openai_wire import responses_messages
from engine.agent_replay import DIVERGENCE_REASON, calls_made, divergence
from engine.boundaries import completed_activations
from engine.catalog import ACTIVATION_CLAIMED, AGENT_BOUNDARY, SESSION_REPLAY_FAILED
from engine.errors import AttemptLost, GymServerFailed, ParticipantUnavailable, RollbookError, VersionConflict
from engine.events import AppendRequest, NewEvent
from engine.identity import Key, agent_stream
from engine.ownership import claim
from participants.agent.session import RunRequest, activation_holder, fresh_session
from participants.base.keyed_locks import KeyedLocks
from participants.base.owners import CLAIM_TRIES, settled_in_history
from participants.base.participant import Participant
from participants.base.wire import CAPTURE_COOKIE, capture_id
from participants.environments import gymnasium
from participants.environments.nemo_gym_relay import GymProcess, GymServer, LiveGone

# The names the agent's config gives rollbook's model and resources servers (apps/config.py).
MODEL_SERVER = "rollbook_model"
RESOURCES_SERVER = "rollbook_resources"
SHOWN = 1000  # how much of a failed run's reply its error carries
CONVERSATION_ITEMS = ("message", "function_call", "function_call_output")


class DriveFailed(Exception):
    """An agent's run ended without a reply: `detail` says how (its status or exit code, and output)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Driver(Protocol):
    """How one configured agent runs an activation; `drive` answers a Responses object (its `output`
    items are the conversation, the last message's text the final answer)."""

    table: str  # the configuration table that declares it, named in every error about it
    continuation: Literal["replay", "restart_only"]

    def start(self, say: Callable[[str], None]) -> None: ...

    def stop(self) -> None: ...

    async def drive(self, p: Participant, key: Key, index: int, opening: list[dict[str, Any]],
                    tools: list[dict[str, Any]], req: RunRequest) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GymAgent:
    server: GymServer
    continuation: Literal["replay", "restart_only"] = "restart_only"
    # responses: sent the activation on its `/v1/responses`; run: sent the task's row on its `/run`,
    # where it drives its resources server itself (participants.environments.gymnasium)
    drive: Literal["responses", "run"] = "responses"


class GymDriver:
    """A NeMo Gym agent, started by rollbook, sent the activation on its own `/v1/responses`."""

    table = "nemo_gym_agent"

    def __init__(self, name: str, agent: GymAgent, timeouts: PeerTimeouts) -> None:
        self.name, self.continuation, self.timeouts, self.drives = name, agent.continuation, timeouts, agent.drive
        self.process = GymProcess(agent.server)

    def start(self, say: Callable[[str], None]) -> None:
        if self.process.server.url is None:
            def start() -> None:
                why = self.process.check()
                if why is not None:
                    say(f"{self.table}.{self.name}: {self.process.server.module} cannot start: {why}")
            threading.Thread(target=start, name=f"start-{self.name}", daemon=True).start()

    def stop(self) -> None:
        self.process.stop()

    async def drive(self, p: Participant, key: Key, index: int, opening: list[dict[str, Any]],
                    tools: list[dict[str, Any]], req: RunRequest) -> dict[str, Any]:
        capture = capture_id(key[0], key[1], index)
        functions = [{"type": "function", "strict": False, **t["function"]} for t in tools if isinstance(t.get("function"), dict)]
        try:
            base = await asyncio.to_thread(self.process.base_url)  # started on first use, again if it died
        except LiveGone as exc:
            raise ParticipantUnavailable(f"{self.table}.{self.name}: {exc}") from exc
        if self.drives == "run":
            row = req.task.params.get("row")
            if not isinstance(row, dict):
                raise DriveFailed("it is driven through its /run, which takes a NeMo Gym data row: the task has no "
                                  "params.row (make the tasks with `rollbook tasks from-gym`)")
            route, path, body = "/run", "/run", gymnasium.run_body(row, capture)
        else:
            route, path = "/v1/responses", f"/ng-rollout/{capture}/v1/responses"
            body = {"input": opening, "tools": functions}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s, sock_read=self.timeouts.work_s)
        try:
            async with aiohttp.ClientSession(cookies={CAPTURE_COOKIE: capture}, timeout=timeout) as http, \
                    http.post(base + path, json=body) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, OSError) as exc:
            # The agent died under this activation: asked again, the log decides how it goes on.
            raise ParticipantUnavailable(f"{self.table}.{self.name} at {base}: {exc}") from exc
        if status != 200:
            raise DriveFailed(f"its {route} answered {status}: {text[:SHOWN]}")
        try:
            out = json.loads(text)
        except ValueError:
            out = None
        if self.drives == "run":
            output = gymnasium.run_output(body, out)
            if output is None:
                raise DriveFailed(f"its /run answered 200 without a run response (responses_create_params and a "
                                  f"response): {text[:SHOWN]}")
            return {**out["response"], "output": output}
        if not isinstance(out, dict) or not isinstance(out.get("output"), list):
            raise DriveFailed(f"its /v1/responses answered 200 without a Responses object: {text[:SHOWN]}")
        return out


def gym_drivers(agents: dict[str, GymAgent], timeouts: PeerTimeouts | None = None) -> dict[str, Driver]:
    return {name: GymDriver(name, a, timeouts or PeerTimeouts()) for name, a in agents.items()}


class ExternalAgents:
    """The configured agents rollbook runs unchanged (NeMo Gym's, and harnesses in a sandbox) of one
    agent server, and their activations running here."""

    def __init__(self, drivers: dict[str, Driver]) -> None:
        self.drivers = drivers
        self.running: dict[tuple[str, int, int], asyncio.Task[dict[str, Any]]] = {}
        self.locks: KeyedLocks[tuple[str, int, int]] = KeyedLocks()

    def start_all(self, say: Callable[[str], None]) -> None:
        """Start (or install) each agent, in a thread of its own (`rollbook serve agent` does), so that
        one that cannot start says why there, in one line, not only at a rollout's first activation."""
        for driver in self.drivers.values():
            driver.start(say)

    def stop(self) -> None:
        for driver in self.drivers.values():
            driver.stop()

    def serves(self, name: str | None) -> bool:
        return name is not None and name in self.drivers

    async def activate(self, p: Participant, key: Key, index: int, req: RunRequest) -> dict[str, Any]:
        """The activation's reply: from the log once it completed, else from this run of the agent."""
        place = (*key, index)
        async with self.locks(place):
            task = self.running.get(place)
            for tries in range(1, CLAIM_TRIES + 1):
                if task is not None:
                    break
                try:
                    started = await self._start(p, key, index, req)
                except VersionConflict:
                    if tries == CLAIM_TRIES:
                        raise
                    continue  # another instance claimed it first: read again, now seeing its owner
                if isinstance(started, dict):
                    return started
                task = self.running[place] = started
                task.add_done_callback(lambda _t: self.running.pop(place, None))
        assert task is not None
        return await asyncio.shield(task)

    async def _start(self, p: Participant, key: Key, index: int,
                     req: RunRequest) -> dict[str, Any] | asyncio.Task[dict[str, Any]]:
        # Another live instance running it is waited for: two runs of one activation would number
        # their calls in one sequence, and apply a change of each.
        own, history = await settled_in_history(p, key, agent_stream(*key), activation_holder(index))
        completed = completed_activations(history)
        if index in completed:
            return completed[index]
        name = str(req.task.agent)
        # Claimed under this attempt and not completed: a run of it was cut off. Its calls took numbers
        # (a tool call answered from the record takes one too, in the resources server that gave it),
        # so a second run under this attempt would number its calls after the first run's.
        if any(e.kind == ACTIVATION_CLAIMED and e.data.get("index") == index for e in own) \
                or calls_made(history, *key, index):  # the lineage's calls carry other attempts' numbers
            raise self._interrupted(name, key, index)
        p.admission.require_open("a new activation")
        # Claimed at the version read: of two instances asked at once, one runs it.
        await p.store.append(claim((NewEvent(agent_stream(*key), ACTIVATION_CLAIMED, {"index": index, "instance": p.instance},
                                             *key),), agent_stream(*key), own[-1].stream_version if own else 0))
        return asyncio.get_running_loop().create_task(self._run(p, name, key, index, req))

    def _interrupted(self, name: str, key: Key, index: int) -> AttemptLost:
        driver = self.drivers[name]
        said = f"activation {index} of {key[0]} attempt {key[1]} by {driver.table}.{name} was cut off after it started"
        if driver.continuation == "replay":
            return AttemptLost(f"{said}; it runs again from its start under a new attempt, answered from the log",
                               lost="agent")
        return AttemptLost(f"{said}, and the agent is restart_only: the rollout starts over from its input",
                           lost="session")

    async def _run(self, p: Participant, name: str, key: Key, index: int, req: RunRequest) -> dict[str, Any]:
        s = fresh_session(key, index, req)
        opening = [{"role": m["role"], "content": m["content"]} for m in s.messages]
        driver = self.drivers[name]
        try:
            out = await driver.drive(p, key, index, opening, s.tools, req)
        except DriveFailed as exc:
            diverged = divergence(await p.store.read_rollout(*key), *key, index)
            if diverged is not None and diverged.kind == SESSION_REPLAY_FAILED:
                raise AttemptLost(f"{driver.table}.{name} failed after its session could not be rebuilt "
                                  f"({diverged.data.get('detail')}): the rollout starts over from its input",
                                  lost="divergence", reason=diverged.data.get("reason")) from None
            if diverged is not None:
                at = diverged.data.get("call_id") or diverged.data.get("tool_call")  # a model call's, or a tool call's key
                raise AttemptLost(f"{driver.table}.{name} diverged from its lineage at {at}: the "
                                  "rollout starts over from its input", lost="divergence", reason=DIVERGENCE_REASON) from None
            raise GymServerFailed(f"{driver.table}.{name}: {exc.detail}", server=name, stage="agent") from None
        # What the conversation has a chat form for: a reasoning item, say, is the agent's, not the record's.
        output = [o for o in out["output"] if isinstance(o, dict) and o.get("type") in CONVERSATION_ITEMS]
        try:
            s.messages = responses_messages(opening + output)
        except RollbookError as exc:  # a part with no chat form (an image it produced, say)
            raise GymServerFailed(f"{driver.table}.{name}: its output has no conversation rollbook can record: "
                                  f"{exc.detail}", server=name, stage="agent") from exc
        s.final_answer = final_text(output)
        usage = out.get("usage")
        s.usage = {k: v for k, v in usage.items() if isinstance(v, int)} if isinstance(usage, dict) else {}
        s.turn = calls_made(await p.store.read_rollout(*key), *key, index)
        s.finished = s.done = True
        # The conversation in a boundary, the reply in the completion, as rollbook's own agent ends one.
        boundary = NewEvent(agent_stream(*key), AGENT_BOUNDARY, s.boundary_data("after_turn", s.turn, None), *key)
        await p.store.append(AppendRequest((boundary, s.completed())))
        return s.reply()


def final_text(output: list[dict[str, Any]]) -> str | None:
    """The text of the last message of a Responses output (None when it ended on anything else)."""
    last = output[-1] if output else None
    if last is None or last.get("type") != "message":
        return None
    return "".join(str(c.get("text", "")) for c in last.get("content") or [] if isinstance(c, dict))


__all__ = ["MODEL_SERVER", "RESOURCES_SERVER", "DriveFailed", "Driver", "ExternalAgents", "GymAgent", "GymDriver", "final_text", "gym_drivers"]
