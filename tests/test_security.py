"""The data plane lets no one in and fails closed on any input, over real HTTP and a real PostgreSQL.

The two attacks that opened a deployment, then each bad input found by fuzzing, named. After every
refused request the log is read back through SQL: a refusal writes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from apps.stack import CREDS, Stack, start_stack
from engine.attempts import ATTEMPT_STARTED
from engine.capability import capability
from engine.events import AppendRequest, NewEvent
from engine.identity import call_stream, rollout_stream, session_stream
from participants.base.guard import MAX_BODY_BYTES
from participants.base.wire import CONTROL, OPENAPI_PATH
from participants.environment.app import build_environment_app
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend
from participants.resources.app import build_resources_app
from tests.answers import answered

DATA = {"Authorization": f"Bearer {CREDS.data}"}
CONTROL_AUTH = {"Authorization": f"Bearer {CREDS.control}"}
NO_CREDENTIALS: list[dict[str, str]] = [{}, {"Authorization": "Bearer guessed"}, {"Authorization": CREDS.data}]
MATH = make_task("math", 0)
SANDBOX = make_task("sandbox", 0)


@pytest.fixture
async def stack(dsn: str) -> AsyncIterator[Stack]:
    s = await start_stack(dsn, "sec", ScriptedBackend())
    yield s
    await s.close()


@pytest.fixture
async def attacker() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A server that records every request it gets, headers included: where a leaked credential would land."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), seen
    await server.close()


async def events(store: PostgresEventStore, kind: str | None = None) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM rollbook.events WHERE CAST(:k AS text) IS NULL OR kind = :k"),
                                       {"k": kind})).scalar())


async def send(s: Stack, kind: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, Any]:
    h = {**(headers if headers is not None else DATA)}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
        h.setdefault("Content-Type", "application/json")
    async with s.session.request(method, s.url(kind) + path, data=data, headers=h) as resp:
        return resp.status, await resp.json(content_type=None)


async def start(store: PostgresEventStore, rid: str) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream(rid), ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),)))


# ---- the two attacks ----------------------------------------------------------------------------


@pytest.mark.parametrize("headers", NO_CREDENTIALS, ids=["none", "guessed", "not-bearer"])
async def test_attack_model_url_to_an_attacker_is_refused_and_no_credential_leaves(stack: Stack, store: PostgresEventStore,
                                                                                   attacker, headers) -> None:
    """The attack: start an episode, then ask the agent to call the model at the attacker's address."""
    url, seen = attacker
    status, reply = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "atk-1", "task": MATH.to_json()},
                               headers)
    assert status == 401 and reply["error"]["code"] == "unauthorized"
    run = {"task": MATH.to_json(), "model_url": url, "resources_url": url}
    status, reply = await send(stack, "agent", "POST", "/rollouts/atk-1/attempts/0/run", run,
                               {**headers, "X-Rollbook-Activation": "0"})
    assert status == 401 and reply["error"]["code"] == "unauthorized"
    assert seen == [] and await events(store) == 0


async def test_a_run_request_cannot_name_an_outgoing_address_even_with_the_data_credential(stack: Stack, store, attacker) -> None:
    url, seen = attacker
    await start(store, "atk-2")
    run = {"task": MATH.to_json(), "model_url": url}
    status, reply = await send(stack, "agent", "POST", "/rollouts/atk-2/attempts/0/run", run,
                               {**DATA, "X-Rollbook-Activation": "0"})
    assert status == 400 and reply["error"]["code"] == "invalid_request" and "model_url" in reply["error"]["detail"]
    assert seen == [] and await events(store) == 1  # only the attempt this test started


async def test_the_control_credential_does_not_open_the_data_plane(stack: Stack, store) -> None:
    status, reply = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "atk-3", "task": MATH.to_json()},
                               CONTROL_AUTH)
    assert status == 403 and reply["error"]["code"] == "forbidden"
    assert await events(store) == 0


@pytest.mark.parametrize("headers", NO_CREDENTIALS, ids=["none", "guessed", "not-bearer"])
async def test_attack_sandbox_shell_through_an_unauthenticated_episode_is_refused(stack: Stack, store, headers) -> None:
    status, _ = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "sh-1", "task": SANDBOX.to_json()}, headers)
    assert status == 401
    status, _ = await send(stack, "resources", "POST", "/rollouts/sh-1/attempts/0/session",
                           {"env": "sandbox", "task": SANDBOX.to_json()}, headers)
    assert status == 401
    status, _ = await send(stack, "resources", "POST", "/rollouts/sh-1/attempts/0/tools/run", {"arguments": {"command": "id"}},
                           headers)
    assert status == 401
    assert await events(store) == 0


async def test_the_sandbox_is_off_unless_configured(dsn: str, store: PostgresEventStore) -> None:
    """Default servers, the right credential: the episode and the session are both refused, nothing written."""
    env_store, res_store = PostgresEventStore.connect(dsn, writer="e"), PostgresEventStore.connect(dsn, writer="r")
    env = TestServer(build_environment_app(env_store, CREDS, "http://127.0.0.1:9", "http://127.0.0.1:9"), host="127.0.0.1")
    res = TestServer(build_resources_app(res_store, CREDS), host="127.0.0.1")
    await env.start_server()
    await res.start_server()
    await start(store, "sh-2")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(env.make_url("/episodes"), json={"rollout_id": "sh-3", "task": SANDBOX.to_json()},
                                 headers=DATA) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
            async with http.post(res.make_url("/rollouts/sh-2/attempts/0/session"),
                                 json={"env": "sandbox", "task": SANDBOX.to_json()}, headers=DATA) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
            async with http.get(res.make_url(f"{CONTROL}/status"), headers=CONTROL_AUTH) as resp:
                assert (await resp.json())["served_sessions"] is False  # a refused request is not a served session
        assert await events(store) == 1  # the attempt this test started, nothing else
    finally:
        await env.close()
        await res.close()
        await env_store.close()
        await res_store.close()


# ---- bad input: 4xx with a stable code, nothing written ------------------------------------------

BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("a body that is not UTF-8", b'{"rollout_id": "\xff\xfe", "task": {}}', 400, "invalid_json"),
    ("JSON nested 100k deep", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("JSON nested 65 deep", b'{"rollout_id": "n", "task": ' + b"[" * 65 + b"]" * 65 + b"}", 400, "invalid_json"),
    ("an integer over 4300 digits", b'{"rollout_id": "i", "seed": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    ("an integer over 64 bits", b'{"rollout_id": "i", "seed": 18446744073709551616}', 400, "invalid_json"),
    ("an integer one past 63 bits", b'{"rollout_id": "i", "seed": 9223372036854775808}', 400, "invalid_json"),
    ("an integer one below -2**63", b'{"rollout_id": "i", "seed": -9223372036854775809}', 400, "invalid_json"),
    ("a number that is not finite", b'{"rollout_id": "f", "seed": 1e999}', 400, "invalid_json"),
    ("NaN", b'{"rollout_id": "f", "seed": NaN}', 400, "invalid_json"),
    ("malformed JSON", b'{"rollout_id": ', 400, "invalid_json"),
    ("an empty body", b"", 400, "invalid_json"),
    ("a rollout id outside the pattern", json.dumps({"rollout_id": "../x", "task": MATH.to_json()}).encode(), 400,
     "invalid_request"),
    ("a rollout id in Arabic-Indic digits", json.dumps({"rollout_id": "\u0660", "task": MATH.to_json()}).encode(), 400,
     "invalid_request"),
    ("a seed given as a string", json.dumps({"rollout_id": "q", "task": MATH.to_json(), "seed": "1"}).encode(), 400,
     "invalid_request"),
    ("an unknown environment", json.dumps({"rollout_id": "u", "task": {**MATH.to_json(), "env": "nope"}}).encode(), 400,
     "invalid_request"),
    ("params an environment cannot start from", json.dumps(
        {"rollout_id": "p", "task": {**make_task("workplace", 0).to_json(), "params": {"seed": "x"}}}).encode(), 400,
     "invalid_request"),
]


@pytest.mark.parametrize("what, raw, status, code", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_episode_bodies_are_refused_and_write_nothing(stack: Stack, store, what, raw, status, code) -> None:
    got, reply = await send(stack, "environment", "POST", "/episodes", raw=raw)
    assert (got, reply["error"]["code"]) == (status, code), (what, reply)
    assert await events(store) == 0, what


async def test_a_body_over_the_limit_is_413(stack: Stack, store) -> None:
    raw = b'{"rollout_id": "big", "task": {"env": "math", "task_id": "t", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}}'
    assert len(raw) > MAX_BODY_BYTES
    status, reply = await send(stack, "environment", "POST", "/episodes", raw=raw)
    assert status == 413 and reply["error"]["code"] == "payload_too_large"
    assert await events(store) == 0


@pytest.mark.parametrize("attempt", ["%D9%A0", "0_0", "%200", "+0", "00", "2147483648"],
                         ids=["arabic-indic zero", "0_0", "space 0", "+0", "00", "2^31"])
async def test_attempts_are_plain_ascii_decimal_only(stack: Stack, store, attempt) -> None:
    await start(store, "att")
    status, reply = await send(stack, "resources", "POST", f"/rollouts/att/attempts/{attempt}/session",
                               {"env": "math", "task": MATH.to_json()})
    assert (status, reply["error"]["code"]) == (400, "invalid_identifier"), attempt
    assert await events(store) == 1


async def test_retire_through_2_to_the_31_is_400_and_writes_nothing(stack: Stack, store) -> None:
    body = {"checkpoint_id": "ck", "deadline": time.time() + 30,
            "rollouts": [{"rollout_id": "ok-1", "through": 0}, {"rollout_id": "big-1", "through": 2**31}]}
    status, reply = await send(stack, "model", "POST", f"{CONTROL}/retire", body, CONTROL_AUTH)
    assert status == 400 and reply["error"]["code"] == "invalid_request"
    assert await events(store) == 0  # not even the valid first entry


async def test_a_repeated_retire_answers_the_same_and_appends_nothing(stack: Stack, store) -> None:
    body = {"checkpoint_id": "ck", "deadline": time.time() + 30,
            "rollouts": [{"rollout_id": "r-1", "through": 0}, {"rollout_id": "r-2", "through": 3}]}
    first = await send(stack, "model", "POST", f"{CONTROL}/retire", body, CONTROL_AUTH)
    assert first[0] == 200 and await events(store, "rollout_retired") == 2
    again = await send(stack, "model", "POST", f"{CONTROL}/retire", body, CONTROL_AUTH)
    assert again == first and await events(store, "rollout_retired") == 2


async def test_forget_with_one_bad_id_forgets_nothing(stack: Stack, store) -> None:
    retire = {"checkpoint_id": "ck", "deadline": time.time() + 30, "rollouts": [{"rollout_id": "ghost-1", "through": 0}]}
    assert (await send(stack, "model", "POST", f"{CONTROL}/retire", retire, CONTROL_AUTH))[0] == 200
    forget = {"checkpoint_id": "ck", "deadline": time.time() + 30, "rollout_ids": ["ghost-1", "../x"]}
    status, reply = await send(stack, "model", "POST", f"{CONTROL}/forget", forget, CONTROL_AUTH)
    assert status == 400 and reply["error"]["code"] == "invalid_request"
    assert await events(store, "rollout_forgotten") == 0
    assert await store.retired_through("ghost-1") == 0


async def test_an_unknown_environment_leaves_no_live_attempt(stack: Stack, store) -> None:
    status, _ = await send(stack, "environment", "POST", "/episodes",
                           {"rollout_id": "ghost-env", "task": {**MATH.to_json(), "env": "unknown"}})
    assert status == 400
    assert await store.attempt_rows(["ghost-env"]) == {}


CALL = {"X-Rollbook-Call-Id": "cc.0.t0", **DATA}


@pytest.mark.parametrize("what, body", [
    ("tools=[{'function': 'x'}]", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "x"}]}),
    ("a message without a role", {"messages": [{"content": "hi"}]}),
    ("no messages", {"messages": []}),
])
async def test_bad_chat_requests_are_400_in_openai_shape_and_write_nothing(stack: Stack, store, what, body) -> None:
    await start(store, "cc")
    status, reply = await send(stack, "model", "POST", "/rollouts/cc/attempts/0/v1/chat/completions", body, CALL)
    assert status == 400, what
    err = reply["error"]
    assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error" and err["message"] == err["detail"]
    assert await events(store) == 1


async def test_a_call_id_reused_with_a_different_body_is_a_conflict(stack: Stack, store) -> None:
    await start(store, "cc")
    first = {"messages": [{"role": "user", "content": MATH.prompt}]}
    assert (await send(stack, "model", "POST", "/rollouts/cc/attempts/0/v1/chat/completions", first, CALL))[0] == 200
    written = await events(store)
    same = await send(stack, "model", "POST", "/rollouts/cc/attempts/0/v1/chat/completions", first, CALL)
    assert same[0] == 200 and await events(store) == written  # a repeat: the stored reply, nothing appended
    other = {"messages": [{"role": "user", "content": "something else"}]}
    status, reply = await send(stack, "model", "POST", "/rollouts/cc/attempts/0/v1/chat/completions", other, CALL)
    assert status == 409 and reply["error"]["code"] == "conflict" and reply["error"]["type"] == "conflict_error"
    assert await events(store) == written


@pytest.mark.parametrize("kind", ["environment", "model", "agent", "resources"])
async def test_every_server_documents_every_route_it_serves(stack: Stack, kind: str) -> None:
    from openapi_spec_validator import validate

    status, doc = await send(stack, kind, "GET", OPENAPI_PATH)
    assert status == 200
    validate(doc)
    served = {(r.method.lower(), r.resource.canonical) for r in stack.servers[kind].app.router.routes() if r.method != "HEAD"}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented
    # Bearer everywhere; HTTP Basic (the data credential as password) on NeMo Gym's fronts alone.
    gym = {"environment": {("post", "/run"), ("post", "/aggregate_metrics")},
           "agent": {("post", "/run"), ("post", "/aggregate_metrics")},
           # and the refusals a NeMo Gym client's call that names no rollout gets (rollout_id_required, not 401)
           "model": {("post", "/ng-rollout/{capture}/v1/responses"), ("post", "/ng-rollout/{capture}/v1/chat/completions"),
                     ("post", "/v1/responses"), ("post", "/v1/chat/completions")},
           "resources": {("post", "/{name}"), ("post", "/ng-rollout/{capture}/{name}")}}[kind]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            want = [{"bearer": []}, {"basic": []}] if (method, path) in gym else [{"bearer": []}]
            assert op["security"] == want, (kind, method, path)


async def test_a_repeated_passed_verify_answers_the_same_and_appends_nothing(stack: Stack, store) -> None:
    task = make_task("string_match", 0)
    await start(store, "vv")
    assert (await send(stack, "resources", "POST", "/rollouts/vv/attempts/0/session", {"env": task.env, "task": task.to_json()}))[0] == 200
    await answered(store, "vv", task.params["expected"])
    first = await send(stack, "resources", "POST", "/rollouts/vv/attempts/0/verify", {})
    assert first[0] == 200 and first[1]["status"] == "passed"
    written = await events(store)
    again = await send(stack, "resources", "POST", "/rollouts/vv/attempts/0/verify", {})
    assert again == (200, {**first[1], "repeated": True})  # the recorded verification, marked as a repeat
    assert await events(store) == written


async def test_a_verify_takes_its_answer_from_the_log_never_from_the_request(stack: Stack, store) -> None:
    """The reward could be forged: verify took the final answer from its body, so anyone holding the
    data credential could verify a session with the expected answer. A body that brings an answer is
    refused; with no completed agent activation there is nothing to verify; the answer the agent gave
    is what is verified, and the log says so."""
    task = make_task("string_match", 0)
    await start(store, "vf")
    assert (await send(stack, "resources", "POST", "/rollouts/vf/attempts/0/session", {"env": task.env, "task": task.to_json()}))[0] == 200
    written = await events(store)
    forged = await send(stack, "resources", "POST", "/rollouts/vf/attempts/0/verify", {"final_answer": task.params["expected"]})
    assert (forged[0], forged[1]["error"]["code"]) == (400, "invalid_request")
    early = await send(stack, "resources", "POST", "/rollouts/vf/attempts/0/verify", {})
    assert (early[0], early[1]["error"]["code"]) == (409, "conflict")
    assert await events(store) == written
    await answered(store, "vf", "not what was asked")
    status, reply = await send(stack, "resources", "POST", "/rollouts/vf/attempts/0/verify", {})
    assert (status, reply["status"], reply["reward"]) == (200, "failed", 0.0)
    (verified,) = [e for e in await store.read_stream(session_stream("vf", 0)) if e.kind == "session_verified"]
    assert verified.data["final_answer"] == "not what was asked"


async def test_a_rollout_id_reused_for_another_task_is_a_conflict_and_a_repeat_appends_nothing(stack: Stack, store) -> None:
    first = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "one-task", "task": MATH.to_json(), "seed": 7})
    assert first[0] == 200 and first[1]["attempt"] == 0
    written = await events(store)
    again = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "one-task", "task": MATH.to_json(), "seed": 7})
    assert again == first and await events(store) == written
    other = {**MATH.to_json(), "prompt": "another question"}
    status, reply = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "one-task", "task": other})
    assert (status, reply["error"]["code"]) == (409, "conflict")
    assert await events(store) == written


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_capability_opens_its_own_attempt_and_nothing_else(stack: Stack, store: PostgresEventStore) -> None:
    """Nothing bound a request to the rollout it speaks for: any holder of the data credential could
    close or verify any session. The servers now act for an attempt with its capability
    (engine.capability), and a capability is refused (403) on another rollout's routes, on another
    attempt of its own rollout (a later attempt would fence it), on routes of no attempt and on the
    control plane; a forged or edited one is not a credential at all (401)."""
    task = make_task("string_match", 0)
    for rid in ("mine", "theirs"):
        await start(store, rid)
    mine = bearer(capability(CREDS.data, "mine", 0))
    body = {"env": task.env, "task": task.to_json()}
    status, _ = await send(stack, "resources", "POST", "/rollouts/mine/attempts/0/session", body, mine)
    assert status == 200
    written = await events(store)
    for what, path, headers, code in [
        ("another rollout", "/rollouts/theirs/attempts/0/session", mine, (403, "forbidden")),
        ("another attempt", "/rollouts/mine/attempts/1/session", mine, (403, "forbidden")),
        ("the attempt spelt another way", "/rollouts/mine/attempts/00/session", mine, (403, "forbidden")),
        ("a forged mac", "/rollouts/theirs/attempts/0/session", bearer(capability("not-the-secret", "theirs", 0)),
         (401, "unauthorized")),
        ("a capability renamed", "/rollouts/theirs/attempts/0/session",
         bearer(capability(CREDS.data, "mine", 0).replace("mine", "theirs")), (401, "unauthorized")),
    ]:
        status, reply = await send(stack, "resources", "POST", path, body, headers)
        assert (status, reply["error"]["code"]) == code, what
    status, reply = await send(stack, "environment", "POST", "/episodes", {"rollout_id": "x", "task": task.to_json()}, mine)
    assert (status, reply["error"]["code"]) == (403, "forbidden")
    status, reply = await send(stack, "resources", "GET", "/rollbook/v1/control/status", None, mine)
    assert (status, reply["error"]["code"]) == (403, "forbidden")
    assert await events(store) == written


async def test_the_framework_hands_a_rollouts_capability_to_an_openai_sdk_that_drives_it_alone(
    stack: Stack, store: PostgresEventStore
) -> None:
    """A client that drives one rollout need not hold the data credential: the episode's status gives
    its current attempt's capability, which the OpenAI SDK takes as its api_key on the model server's
    routes of that attempt, and which opens nothing of another rollout's."""
    for rid in ("sdk-own", "sdk-other"):
        await start(store, rid)
    status, reply = await send(stack, "environment", "GET", "/episodes/sdk-own")
    assert status == 200 and reply["capability"] == capability(CREDS.data, "sdk-own", 0)

    def client(rid: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{stack.url('model')}/rollouts/{rid}/attempts/0/v1",
                                  api_key=reply["capability"], max_retries=0)

    own, other = client("sdk-own"), client("sdk-other")
    try:
        answer = await own.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                                   extra_headers={"X-Rollbook-Call-Id": "sdk-own.0.t0"})
        assert answer.choices[0].message.content
        with pytest.raises(openai.PermissionDeniedError):
            await other.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                                extra_headers={"X-Rollbook-Call-Id": "sdk-other.0.t0"})
    finally:
        await own.close()
        await other.close()
    assert await store.read_stream(call_stream("sdk-other.0.t0")) == []
