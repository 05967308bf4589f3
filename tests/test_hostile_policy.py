"""The policy is untrusted: attacks a model can emit, each refused with nothing written for another rollout.

Each test runs a hostile rollout (tests/hostile_policy.py: the model's replies are the attack) beside
an ordinary one on the four servers in process, then checks through the log that the ordinary
rollout did exactly what it does alone, that the attacker saw the refusal as a tool error, and that
no server raised.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adapters.postgres import PostgresEventStore
from apps.stack import Stack, start_stack
from engine.boundaries import completed_activations
from engine.identity import session_stream
from engine.lineage import effective_history
from participants.environments.tasks import make_task
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from testkit.fake_vllm import MODEL, FakeVLLM
from tests.hostile_policy import HostileBackend, hostile_task, tool_call

VICTIM = make_task("workplace", 11)
ATTACKER = make_task("workplace", 12)


@pytest.fixture(params=["scripted", "vllm-upstream"])
async def stack(dsn: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """The hostile model behind the model server as a backend in process, and as a vLLM-style upstream
    over HTTP (testkit/fake_vllm.py, its replies the attack), read by the openai_compatible backend: the
    attack arrives in vLLM's wire format, "\\ud800" and "\\u0000" escapes included."""
    if request.param == "scripted":
        s = await start_stack(dsn, "hostile", HostileBackend())
        try:
            yield s
        finally:
            await s.close()
        return
    async with FakeVLLM() as upstream:
        upstream.model = HostileBackend()
        s = await start_stack(dsn, "hostile-up", OpenAICompatibleBackend(upstream.url, model=MODEL))  # type: ignore[arg-type]
        try:
            yield s
        finally:
            await s.close()


async def mutations(store: PostgresEventStore, rollout_id: str) -> list[tuple[str, Any]]:
    return [(e.data["tool"], e.data["arguments"]) for e in await store.read_stream(session_stream(rollout_id, 0))
            if e.kind == "mutation_applied"]


async def final_reply(store: PostgresEventStore, rollout_id: str) -> dict[str, Any]:
    replies = completed_activations(await effective_history(store, rollout_id, 0))
    return replies[max(replies)]


async def attack(stack: Stack, store: PostgresEventStore, name: str, replies: list[dict[str, Any]],
                 caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """Run the victim alone, then again beside the attack; return the attacker's tool replies."""
    await stack.episode(VICTIM, f"alone-{name}")
    with caplog.at_level(logging.ERROR):
        await asyncio.gather(stack.episode(VICTIM, f"victim-{name}"),
                             stack.episode(hostile_task(ATTACKER, replies), f"attacker-{name}"))
    for rid in (f"victim-{name}", f"attacker-{name}"):
        assert (status := await stack.wait_finished(rid))["status"] == "finished", (rid, status)
    assert await mutations(store, f"victim-{name}") == await mutations(store, f"alone-{name}")
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    messages = (await final_reply(store, f"attacker-{name}"))["messages"]
    return [json.loads(m["content"]) for m in messages if m.get("role") == "tool"]


@pytest.mark.parametrize("name,tool", [
    ("traversal-to-another-rollout", "../../../../../rollouts/victim-traversal-to-another-rollout/attempts/0/tools/send_email"),
    ("traversal-to-close", "../close"),
    ("dot-dot", ".."),
    ("encoded-traversal", "..%2F..%2Fclose"),
    ("not-offered", "drop_all_tables"),
    ("empty", ""),
])
async def test_a_tool_name_the_agent_did_not_offer_is_a_tool_error_and_reaches_no_server(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture, name: str, tool: str
) -> None:
    """A tool name is data: compared with the names offered, never put into a URL unless it is one.
    `../../../../../rollouts/<other>/attempts/0/tools/send_email` once wrote into another rollout's
    session, and `../close` closed sessions."""
    args = json.dumps({"to": "attacker@evil.example", "subject": "pwned", "body": "x"})
    replies = await attack(stack, store, name, [tool_call(tool, args)], caplog)
    assert [r["error"] for r in replies] == ["unknown_tool"]
    assert await mutations(store, f"attacker-{name}") == []


@pytest.mark.parametrize("name,call", [
    ("name-is-a-number", {"id": "c", "type": "function", "function": {"name": 7, "arguments": "{}"}}),
    ("name-is-null", {"id": "c", "type": "function", "function": {"name": None, "arguments": "{}"}}),
])
async def test_a_tool_call_of_the_wrong_shape_is_a_tool_error(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture, name: str, call: Any
) -> None:
    replies = await attack(stack, store, name, [{"role": "assistant", "content": None, "tool_calls": [call]}], caplog)
    assert [r["error"] for r in replies] == ["unknown_tool"]


@pytest.mark.parametrize("name,arguments", [
    ("nested-5000-deep", "[" * 5_000 + "]" * 5_000),  # past every parser's depth limit (Python's 1,000)
    ("not-json", "{'to': 1"),
    ("a-list", "[1, 2]"),
])
async def test_arguments_that_are_not_a_json_object_are_a_tool_error(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture, name: str, arguments: str
) -> None:
    """Arguments nested past the parser's depth limit (100,000 deep when found) once raised an uncaught
    RecursionError in the agent."""
    replies = await attack(stack, store, name, [tool_call("send_email", arguments)], caplog)
    assert [r["error"] for r in replies] == ["bad_arguments"]


@pytest.mark.parametrize("name,arguments", [
    ("nan", '{"deal_id": NaN}'),
    ("infinity", '{"deal_id": 1e999}'),
    ("thirty-digits", '{"deal_id": 123456789012345678901234567890}'),
    ("nested-100-deep", '{"a": ' * 100 + "1" + "}" * 100),
])
async def test_arguments_outside_the_servers_json_are_a_tool_error_and_the_rollout_is_still_scored(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture, name: str, arguments: str
) -> None:
    """Bad input tried: NaN, a number that is infinite as a float, a 30-digit integer, objects nested
    100 deep. The agent's parser took them and the resources server's refused them: the rollout
    failed `invalid_json` with no verify and no reward, so a policy expecting a low reward could choose
    not to be scored. Now the model sees `bad_arguments` and the episode goes on to its verify."""
    replies = await attack(stack, store, name, [tool_call("update_deal", arguments)], caplog)
    assert [r["error"] for r in replies] == ["bad_arguments"]
    rows = await store.attempt_rows([f"attacker-{name}"])
    assert rows[(f"attacker-{name}", 0)]["status"] == "finished"
    assert isinstance(rows[(f"attacker-{name}", 0)]["reward"], float)



async def test_arguments_whose_record_would_pass_the_event_limit_are_a_tool_error_and_the_episode_is_scored(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad input tried: a 600,000-character note, which `update_deal` records twice (its arguments and
    its effect), past the 1 MiB event limit: the resources server answered 413 and the rollout failed
    unverified. Now it is `bad_arguments`, and the reward is recorded."""
    args = json.dumps({"deal_id": "D-101", "notes": "word " * 120_000})
    replies = await attack(stack, store, "record-too-large", [tool_call("update_deal", args)], caplog)
    assert [r["error"] for r in replies] == ["bad_arguments"], replies
    assert isinstance((await stack.wait_finished("attacker-record-too-large"))["reward"], float)


ODD = "NUL \x00, lone \ud800, the six characters \\u0000, the store's escape \ue000 and \ue0000"


async def test_any_code_point_in_arguments_and_text_is_stored_and_given_back_exactly(
    stack: Stack, store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A NUL or a lone surrogate in a model's text or a tool's arguments used to be refused (the
    rollout failed, and its retry ran the command again) or to fail every append of its batch; the
    six characters `\\u0000` were mistaken for a NUL. Each is now one rollout's data, stored in an
    escaped spelling and read back exactly as produced."""
    args = json.dumps({"deal_id": "D-101", "notes": ODD})
    replies = await attack(stack, store, "odd-strings", [tool_call("update_deal", args),
                                                         {"role": "assistant", "content": ODD}], caplog)
    assert "error" not in replies[0], replies
    (applied,) = [e for e in await store.read_stream(session_stream("attacker-odd-strings", 0))
                  if e.kind == "mutation_applied"]
    assert applied.data["arguments"]["notes"] == ODD
    final = await stack.client.get(f"{stack.url('environment')}/episodes/attacker-odd-strings")
    assert final["status"] == "finished"
    assert (await final_reply(store, "attacker-odd-strings"))["final_answer"] == ODD


_ANY = itertools.count()
# What a model can emit in a field: any code point, lone surrogates included (a list joined: hypothesis's
# text strategies leave them out), with the pieces of JSON that break parsers drawn often.
EMITTED = st.lists(st.one_of(st.characters(codec=None), st.sampled_from(
    ["NaN", "1e999", "-Infinity", "1" * 30, "{", "}", "[", "]", '"', ":", ",", "\\ud800", "\ud800", "\x00", '{"deal_id": '])),
    max_size=30).map("".join)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.one_of(st.just("update_deal"), EMITTED), arguments=st.one_of(EMITTED, st.builds(
    lambda v: '{"deal_id": "D-101", "notes": ' + v + "}", EMITTED)), content=EMITTED)
# Found by this test: a lone surrogate the model put in a tool call's name is in the next call's
# messages, and the model server's request digest could not encode it (a 500 on every later turn).
@example(name="\ud800", arguments="{}", content="done")
@example(name="update_deal", arguments='{"deal_id": NaN}', content="\ud800")
async def test_whatever_the_model_emits_its_rollout_is_finished_and_scored(
    stack: Stack, store: PostgresEventStore, name: str, arguments: str, content: str
) -> None:
    """The property behind "no reward is only ever our failure": any string in a tool call's name, its
    arguments and the final answer leaves the rollout finished with a recorded reward."""
    rid = f"any-{next(_ANY)}"
    await stack.episode(hostile_task(ATTACKER, [tool_call(name, arguments), {"role": "assistant", "content": content}]),
                        rid)
    assert (status := await stack.wait_finished(rid))["status"] == "finished", (rid, status)
    row = (await store.attempt_rows([rid]))[(rid, 0)]
    assert row["status"] == "finished" and isinstance(row["reward"], float), row
