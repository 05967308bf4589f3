"""The control plane over real HTTP, on a log in memory, and the coordinator driving it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from adapters.database import code_revision
from adapters.memory_store import MemoryEventStore
from adapters.participant_client import HttpParticipant
from engine.coordinator import Coordinator
from engine.errors import STATUS, CheckpointConflict, DatabaseUnavailable, InvalidPhase, StaleCheckpoint
from participants.base.app import build_app
from participants.base.guard import Credentials
from participants.base.participant import Participant, PrepareReport
from participants.base.wire import CONTROL, OPENAPI_PATH
from tests.waiting import eventually

CREDS = Credentials(control="s3cret-control", data="s3cret-data")
TOKEN = CREDS.control
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    """This module's rules promise no durability: its log is in memory (docs/testing.md)."""
    return memory_store


class Recorder(Participant):
    """A participant whose hooks only record that they ran, in one list shared by all of them."""

    def __init__(self, store: MemoryEventStore, kind: str, calls: list[str], ready: bool = True, delay: float = 0.0,
                 hold: asyncio.Event | None = None) -> None:
        super().__init__(store, f"{kind}-0")
        self.kind = kind  # type: ignore[misc]
        self.calls = calls
        self.ready = ready
        self.delay = delay
        self.hold = hold  # prepare answers only once it is set

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        self.calls.append(f"prepare:{self.kind}")
        self.admission.close()
        await asyncio.sleep(self.delay)
        if self.hold is not None:
            await self.hold.wait()
        return PrepareReport(ready=self.ready, blockers=[] if self.ready else ["x"] * 30)

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        self.calls.append(f"resume:{self.kind}")
        self.admission.open()
        return {}


async def serve(store: MemoryEventStore, kind: str, calls: list[str], **kw: Any) -> tuple[TestServer, Recorder]:
    participant = Recorder(store, kind, calls, **kw)
    server = TestServer(build_app(participant, CREDS, grace=0.1), host="127.0.0.1")
    await server.start_server()
    return server, participant


def body(ck: str = "ck-1", deadline: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": ck, "deadline": deadline or time.time() + 30, **extra}


@pytest.fixture
async def one(store: MemoryEventStore):
    calls: list[str] = []
    server, participant = await serve(store, "model", calls)
    async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as http:
        yield http, participant, calls
    await server.close()


async def post(http: aiohttp.ClientSession, op: str, payload: dict[str, Any], auth: bool = True) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{CONTROL}/{op}", json=payload, headers=AUTH if auth else {}) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
async def test_calls_without_the_bearer_token_are_refused(one, headers) -> None:
    http, participant, calls = one
    async with http.get(f"{CONTROL}/status", headers=headers) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    async with http.post(f"{CONTROL}/prepare", json=body(), headers=headers) as resp:
        assert resp.status == 401
    assert calls == [] and participant.admission_open


async def test_the_data_credential_does_not_open_the_control_plane(one) -> None:
    http, participant, calls = one
    data = {"Authorization": f"Bearer {CREDS.data}"}
    async with http.post(f"{CONTROL}/prepare", json=body(), headers=data) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
    assert calls == [] and participant.admission_open


@pytest.mark.parametrize(
    "payload, what",
    [
        ({**body(), "surprise": 1}, "an unknown field"),
        (body(ck="bad id!"), "a checkpoint id outside [A-Za-z0-9._-]"),
        (body(ck="x" * 129), "a checkpoint id over 128 characters"),
        ({"checkpoint_id": "ck-1"}, "no deadline"),
    ],
)
async def test_malformed_control_bodies_are_400_and_change_nothing(one, payload, what) -> None:
    http, participant, calls = one
    status, reply = await post(http, "prepare", payload)
    assert status == 400, what
    assert reply["error"]["code"] == "invalid_request"
    assert calls == [] and participant.admission_open


async def test_prepare_commit_resume_with_idempotent_repeats_conflicts_and_stale_ids(one, store) -> None:
    http, _, calls = one
    first = await post(http, "prepare", body())
    assert first[0] == 200 and first[1]["ready"] and first[1]["phase"] == "prepared"
    assert await post(http, "prepare", body()) == first  # a repeat gets the same reply
    assert calls == ["prepare:model"]  # ...and does not prepare twice
    status, reply = await post(http, "prepare", body(ck="ck-2"))
    assert (status, reply["error"]["code"]) == (409, "checkpoint_conflict")
    commit = await post(http, "commit", body(scope=[]))
    assert commit[0] == 200 and commit[1]["phase"] == "committed"
    assert await post(http, "commit", body(scope=[])) == commit
    resume = await post(http, "resume", body())
    assert resume[0] == 200 and resume[1]["phase"] == "idle"
    assert await post(http, "resume", body()) == resume
    status, reply = await post(http, "prepare", body())
    assert (status, reply["error"]["code"]) == (409, "stale_checkpoint")
    kinds = [e.kind for e in await store.read_stream("participant:model:model-0")]
    assert kinds == ["participant_prepare", "participant_prepared", "participant_commit", "participant_resume"]


async def test_resume_reopens_without_waiting_for_its_append_which_lands_after_the_reply(
        one, store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing waits for `participant_resume` (engine.coordinator: resume waits for nothing): the
    database refusing it does not fail or hold the resume, and the event lands once it answers,
    before any later transition of the participant."""
    http, participant, _ = one
    assert (await post(http, "prepare", body()))[0] == 200
    append, refused = store.append, []

    async def away_for_the_resume(request: Any) -> Any:
        if any(e.kind == "participant_resume" for e in request.events) and not refused:
            refused.append(request)
            raise DatabaseUnavailable("the database does not answer")
        return await append(request)

    monkeypatch.setattr(store, "append", away_for_the_resume)
    status, reply = await post(http, "resume", body())
    assert (status, reply["phase"]) == (200, "idle") and participant.admission_open
    assert refused  # the append was tried and refused
    await eventually("the resume to be recorded", lambda: _kinds(store)[-1:] == ["participant_resume"])
    assert (await post(http, "prepare", body(ck="ck-2")))[0] == 200
    # A prepare appends nothing of its own: its two transitions go out with the next one.
    assert _kinds(store) == ["participant_prepare", "participant_prepared", "participant_resume"]
    assert (await post(http, "resume", body(ck="ck-2")))[0] == 200
    await eventually("the second resume to be recorded", lambda: len(_kinds(store)) == 6)
    assert _kinds(store) == ["participant_prepare", "participant_prepared", "participant_resume"] * 2


def _kinds(store: MemoryEventStore) -> list[str]:
    return [e.kind for e in store.log.events if e.stream == "participant:model:model-0"]


@pytest.mark.parametrize("op", ["commit", "resume"])
async def test_illegal_transitions_are_409_invalid_phase(one, op) -> None:
    http, _, _ = one
    status, reply = await post(http, op, body(scope=[]) if op == "commit" else body())
    assert (status, reply["error"]["code"]) == (409, "invalid_phase")


async def test_commit_before_prepared_is_invalid_phase(store) -> None:
    calls: list[str] = []
    hold = asyncio.Event()
    server, _ = await serve(store, "agent", calls, hold=hold)
    async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as http:
        preparing = asyncio.create_task(post(http, "prepare", body()))
        await eventually("the prepare hook to run", lambda: calls == ["prepare:agent"])  # preparing, not prepared
        status, reply = await post(http, "commit", body(scope=[]))
        assert (status, reply["error"]["code"]) == (409, "invalid_phase")
        hold.set()
        assert (await preparing)[0] == 200
    await server.close()


async def test_a_passed_deadline_is_408(one) -> None:
    http, _, calls = one
    status, reply = await post(http, "prepare", body(deadline=time.time() - 1))
    assert (status, reply["error"]["code"]) == (408, "deadline_exceeded")
    assert calls == []


async def test_an_expired_lease_resumes_by_itself_recorded_as_an_abort(one, store) -> None:
    http, participant, calls = one
    # A deadline the prepare surely meets, even on a loaded machine; the lease then runs out (+0.1 s grace).
    status, reply = await post(http, "prepare", body(deadline=time.time() + 1.0))
    assert status == 200 and reply["ready"], reply
    await eventually("the expired lease to reopen admission", lambda: participant.admission_open)
    assert calls == ["prepare:model", "resume:model"]
    async with http.get(f"{CONTROL}/status", headers=AUTH) as resp:
        assert (await resp.json())["phase"] == "idle"
    kinds = [e.kind for e in await store.read_stream("participant:model:model-0")]
    assert kinds[-1] == "participant_abort"


async def test_status_reports_capabilities(one) -> None:
    http, _, _ = one
    async with http.get(f"{CONTROL}/status", headers=AUTH) as resp:
        status = await resp.json()
    assert status["kind"] == "model" and status["phase"] == "idle" and status["checkpoint_mode"] == "native"
    assert status["schema_version"] == code_revision() and status["concurrency"]


async def test_openapi_document_lists_every_route_and_error_status(one) -> None:
    http, _, _ = one
    async with http.get(OPENAPI_PATH) as resp:
        assert resp.status == 401  # the document too needs a credential
    async with http.get(OPENAPI_PATH, headers={"Authorization": f"Bearer {CREDS.data}"}) as resp:
        doc = await resp.json()
    from openapi_spec_validator import validate

    validate(doc)
    app = build_app(Participant(None, "x"), CREDS)  # type: ignore[arg-type]
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD"  # aiohttp adds HEAD to each GET
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    statuses = {s for ops in doc["paths"].values() for op in ops.values() for s in op["responses"]}
    for code in ["unauthorized", "invalid_request", "checkpoint_conflict", "stale_checkpoint", "invalid_phase",
                 "deadline_exceeded", "invalid_checkpoint_state", "restart_in_scope", "unknown_checkpoint"]:
        assert str(STATUS[code]) in statuses, code


async def _cluster(store, calls, not_ready: str | None = None):
    servers, clients = [], []
    session = aiohttp.ClientSession()
    for kind in ["resources", "agent", "model", "environment"]:  # deliberately not in protocol order
        server, _ = await serve(store, kind, calls, ready=kind != not_ready)
        servers.append(server)
        clients.append(HttpParticipant(kind, kind, str(server.make_url("")), TOKEN, session))
    return servers, clients, session


async def test_coordinator_prepares_in_protocol_order_and_resumes_in_reverse(store) -> None:
    calls: list[str] = []
    servers, clients, session = await _cluster(store, calls)
    coordinator = Coordinator(store, clients)
    result = await coordinator.prepare("ck-o", time.time() + 30)
    assert result["ready"]
    await coordinator.commit("ck-o", time.time() + 30, scope=[])
    await coordinator.resume("ck-o")
    # engine.coordinator.PREPARE_STAGES: environment, model and agent at once, then resources;
    # RESUME_STAGES: callees first (model and resources at once), then the agent, then the environment
    assert sorted(calls[:3]) == ["prepare:agent", "prepare:environment", "prepare:model"]
    assert calls[3] == "prepare:resources"
    assert sorted(calls[4:6]) == ["resume:model", "resume:resources"]
    assert calls[6:] == ["resume:agent", "resume:environment"]
    phases = [e.kind for e in await store.read_stream("checkpoint:ck-o")]
    assert phases == ["checkpoint_started", "checkpoint_prepared", "checkpoint_committed"]
    await session.close()
    for s in servers:
        await s.close()


async def test_prepare_stops_at_the_first_participant_not_ready_and_leaves_all_resumable(store) -> None:
    calls: list[str] = []
    servers, clients, session = await _cluster(store, calls, not_ready="model")
    result = await Coordinator(store, clients).prepare("ck-n", time.time() + 30)
    assert not result["ready"] and result["failed"] == "model"
    assert result["reports"]["model"]["blocker_count"] == 30 and len(result["reports"]["model"]["blockers"]) == 20
    # its stage (environment, model, agent) prepared at once and resumes, callees first; resources were never told
    assert sorted(calls[:3]) == ["prepare:agent", "prepare:environment", "prepare:model"]
    assert calls[3:] == ["resume:model", "resume:agent", "resume:environment"]
    assert (await store.read_stream("checkpoint:ck-n"))[-1].kind == "checkpoint_aborted"
    await session.close()
    for s in servers:
        await s.close()


async def test_a_missing_participant_fails_prepare_and_the_others_resume(store) -> None:
    calls: list[str] = []
    servers, clients, session = await _cluster(store, calls)
    await servers[1].close()  # the agent is gone
    result = await Coordinator(store, clients).prepare("ck-m", time.time() + 30)
    assert not result["ready"] and result["failed"] == "agent"
    assert result["reports"]["agent"]["error"]["code"] == "participant_unavailable"
    # the agent's stage prepared at once (the agent never answered) and resumes callees first; resources were never told
    assert sorted(calls[:2]) == ["prepare:environment", "prepare:model"]
    assert calls[2:] == ["resume:model", "resume:environment"]
    await session.close()
    for s in servers:
        await s.close()


async def test_client_maps_error_codes_back_to_engine_exceptions(one) -> None:
    http, _, _ = one
    async with aiohttp.ClientSession() as session:
        client = HttpParticipant("m", "model", str(http._base_url), TOKEN, session)
        await client.call("prepare", body())
        with pytest.raises(CheckpointConflict):
            await client.call("prepare", body(ck="other"))
        await client.call("resume", body())
        with pytest.raises(StaleCheckpoint):
            await client.call("commit", body(scope=[]))
        with pytest.raises(InvalidPhase):
            await client.call("resume", body(ck="never"))
