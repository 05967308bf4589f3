"""Metrics and spans of the four servers: what an operator scrapes and traces is what the log shows.

The four servers run for real (apps/stack.py: aiohttp on 127.0.0.1, one PostgreSQL); `/metrics` is
scraped over HTTP with the control credential and parsed with prometheus_client's own parser. Spans
go to an in-memory exporter installed through `configure_tracing`, the function `rollbook serve`
calls with the config's OTLP endpoint; one test sends them over OTLP/HTTP to a collector stand-in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from adapters.postgres import PostgresEventStore
from adapters.telemetry import Telemetry, configure_tracing
from apps import config as cfg
from apps import serve
from apps.processes import free_port
from apps.stack import CREDS, Stack, all_events, of, start_stack
from engine.boundaries import completed_activations
from engine.errors import ConfigError
from participants.base.observability import METRICS_PATH, TELEMETRY
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend
from participants.resources.app import build_resources_app
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

KINDS = ("model", "resources", "agent", "environment")
WORKPLACE = make_task("workplace", 3)  # 4 turns with the scripted policy: 2 look-ups, an email, the answer
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class HoldAt(ScriptedBackend):
    """Holds the n-th generation until released: its model call is then in flight, provably."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.reached, self.release = n, asyncio.Event(), asyncio.Event()

    async def generate(self, request: dict[str, Any], prefix: Any) -> AsyncIterator[Any]:
        if self.generations == self.n:
            self.reached.set()
            await self.release.wait()
        async for event in super().generate(request, prefix):
            yield event


async def scrape(url: str, token: str = CREDS.control) -> Samples:
    async with aiohttp.ClientSession() as http, http.get(url + METRICS_PATH, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/plain"
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(s: Stack, kind: str, name: str, expected: float, **labels: str) -> Samples:
    """Scrape until the sample reads `expected` (a handler's last lines run after its reply is sent)."""
    stop = time.monotonic() + 20
    while True:
        samples = await scrape(s.url(kind))
        if value(samples, name, **labels) == expected or time.monotonic() > stop:
            assert value(samples, name, **labels) == expected, (kind, name, labels, value(samples, name, **labels))
            return samples
        await asyncio.sleep(0.05)


async def checkpoint(s: Stack, store: PostgresEventStore, checkpoint_id: str) -> None:
    coordinator = s.coordinator(store)
    assert (await coordinator.prepare(checkpoint_id, time.time() + 20))["ready"]
    await coordinator.commit(checkpoint_id, time.time() + 20)
    await coordinator.resume(checkpoint_id)


def tool_calls(events: list[Any], rollout_id: str) -> int:
    """How many tool calls the agent made: one tool message each in its final reply."""
    replies = completed_activations([e for e in events if e.rollout_id == rollout_id])
    (reply,) = replies.values()
    return sum(1 for m in reply["messages"] if m.get("role") == "tool")


# ---- /metrics ---------------------------------------------------------------------------------


async def test_metrics_need_the_control_credential_on_every_server(dsn: str) -> None:
    s = await start_stack(dsn, "m-auth", ScriptedBackend())
    try:
        async with aiohttp.ClientSession() as http:
            for kind in KINDS:
                for headers, status in (({}, 401), ({"Authorization": "Bearer not-a-credential"}, 401),
                                        ({"Authorization": f"Bearer {CREDS.data}"}, 403)):
                    async with http.get(s.url(kind) + METRICS_PATH, headers=headers) as r:
                        assert (r.status, (await r.json())["error"]["code"]) == (
                            status, "unauthorized" if status == 401 else "forbidden"), (kind, headers)
                doc = await (await http.get(s.url(kind) + "/rollbook/v1/openapi.json",
                                            headers={"Authorization": f"Bearer {CREDS.data}"})).json()
                op = doc["paths"][METRICS_PATH]["get"]
                assert "control credential" in op["description"] and "text/plain" in op["responses"]["200"]["content"]
                assert value(await scrape(s.url(kind)), "rollbook_server_info", kind=kind, instance=f"{kind}-m-auth") == 1
    finally:
        await s.close()


async def _resumed(store: PostgresEventStore, participants: int) -> list[Any] | None:
    events = await all_events(store)
    return events if len(of(events, "participant_resume")) == participants else None


async def test_an_episode_and_a_checkpoint_move_the_counts_histograms_and_gauges(dsn: str, store: PostgresEventStore) -> None:
    s = await start_stack(dsn, "m-e2e", ScriptedBackend())
    try:
        before = {kind: await scrape(s.url(kind)) for kind in KINDS}
        for kind in KINDS:
            assert value(before[kind], "rollbook_admission_open") == 1
            assert value(before[kind], "rollbook_checkpoint_phase", phase="idle") == 1
            for phase in ("prepare", "commit", "restore", "resume"):  # scraped at 0 before the first one
                assert before[kind][("rollbook_checkpoint_phase_seconds_count", (("phase", phase),))] == 0
        result = await s.episode(WORKPLACE, "m-1")
        assert result["reward"] == 1.0
        events = await all_events(store)
        calls, tools = len(of(events, "call_accepted")), tool_calls(events, "m-1")
        assert calls == 4 and tools == 3
        model = await until(s, "model", "rollbook_model_calls_in_flight", 0)
        assert value(model, "rollbook_model_call_seconds_count") == calls
        assert value(model, "rollbook_operations_total", operation="chat_completions", outcome="ok") == calls
        resources = await until(s, "resources", "rollbook_tool_calls_in_flight", 0)
        assert value(resources, "rollbook_tool_call_seconds_count") == tools
        assert value(resources, "rollbook_operations_total", operation="call_tool", outcome="ok") == tools
        assert ("rollbook_tool_call_seconds_count", ()) not in model  # each server registers the calls it serves

        await checkpoint(s, store, "m-ck")
        # A participant records its resume right after its reply (participants/base/control_plane.py).
        events = await eventually("every participant's resume in the log",
                                  lambda: _resumed(store, len(KINDS)))
        for kind in KINDS:
            after = await until(s, kind, "rollbook_rollouts_in_flight", 0)
            for phase in ("prepare", "commit", "resume"):
                assert value(after, "rollbook_checkpoint_phase_seconds_count", phase=phase) == 1, (kind, phase)
                assert value(after, "rollbook_operations_total", operation=phase, outcome="ok") == 1
            assert value(after, "rollbook_checkpoint_phase_seconds_count", phase="restore") == 0
            assert value(after, "rollbook_admission_open") == 1
            assert value(after, "rollbook_checkpoint_phase", phase="idle") == 1
            # Appends: every event this server wrote is counted once, and each append has its latency.
            written = [e for e in events if e.writer == f"{kind}-m-e2e"]
            assert written and value(after, "rollbook_appended_events_total") == len(written), kind
            appends = value(after, "rollbook_appends_total")
            assert 0 < appends <= len(written) and value(after, "rollbook_append_seconds_count") == appends
            assert value(after, "rollbook_database_errors_total", error="connection_lost") == 0
            assert value(after, "rollbook_database_errors_total", error="database_unavailable") == 0
    finally:
        await s.close()


async def test_in_flight_and_admission_gauges_follow_a_held_call_and_a_prepare(dsn: str) -> None:
    backend = HoldAt(1)  # the second model call of the episode
    s = await start_stack(dsn, "m-hold", backend)
    try:
        running = asyncio.create_task(s.episode(WORKPLACE, "h-1"))
        await asyncio.wait_for(backend.reached.wait(), 30)  # the call is being generated: in flight everywhere
        model = await scrape(s.url("model"))
        assert value(model, "rollbook_model_calls_in_flight") == 1
        assert value(model, "rollbook_model_call_seconds_count") == 1  # the first call, answered
        for kind in KINDS:
            assert value(await scrape(s.url(kind)), "rollbook_rollouts_in_flight") == 1, kind
        backend.release.set()
        assert (await asyncio.wait_for(running, 60))["reward"] == 1.0
        for kind in KINDS:
            await until(s, kind, "rollbook_rollouts_in_flight", 0)
        await until(s, "model", "rollbook_model_calls_in_flight", 0)

        resources = s.participant("resources")
        control = {"checkpoint_id": "m-park", "deadline": time.time() + 20}
        await s.control_client.post(f"{s.url('resources')}/rollbook/v1/control/prepare", control)
        parked = await scrape(s.url("resources"))
        assert not resources.admission_open
        assert value(parked, "rollbook_admission_open") == 0
        assert value(parked, "rollbook_checkpoint_phase", phase="prepared") == 1
        assert value(parked, "rollbook_checkpoint_phase", phase="idle") == 0
        await s.control_client.post(f"{s.url('resources')}/rollbook/v1/control/resume", control)
        reopened = await scrape(s.url("resources"))
        assert value(reopened, "rollbook_admission_open") == 1
        assert value(reopened, "rollbook_checkpoint_phase", phase="idle") == 1
    finally:
        backend.release.set()
        await s.close()


async def test_a_database_that_does_not_answer_is_counted(dsn: str) -> None:
    """Lost connections (each retry) and `database_unavailable` (giving up), and the append that failed."""
    dead = f"postgresql://rollbook:x@127.0.0.1:{free_port()}/rollbook"  # nothing listens there
    store = PostgresEventStore.connect(dead, writer="resources-dead", patience_s=0.5)
    srv = TestServer(build_resources_app(store, CREDS, "resources-dead"), host="127.0.0.1")
    await srv.start_server()
    url = str(srv.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/rollbook/v1/control/prepare", headers={"Authorization": f"Bearer {CREDS.control}"},
                                 json={"checkpoint_id": "dead-ck", "deadline": time.time() + 20}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "database_unavailable"
        samples = await scrape(url)
    finally:
        await srv.close()
        await store.close()
    assert value(samples, "rollbook_database_errors_total", error="connection_lost") >= 1
    assert value(samples, "rollbook_database_errors_total", error="database_unavailable") >= 1
    assert value(samples, "rollbook_append_failures_total", code="database_unavailable") >= 1
    assert value(samples, "rollbook_appends_total") == 0
    assert value(samples, "rollbook_operations_total", operation="prepare", outcome="database_unavailable") == 1


# ---- spans ------------------------------------------------------------------------------------


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_spans_one_per_checkpoint_phase_and_per_model_and_tool_call(dsn: str, store: PostgresEventStore) -> None:
    s = await start_stack(dsn, "m-span", ScriptedBackend())
    exporters = {kind: InMemorySpanExporter() for kind in KINDS}
    try:
        for kind in KINDS:
            assert s.servers[kind].app[TELEMETRY].tracer is None  # no exporter configured: no spans at all
            assert configure_tracing(s.servers[kind].app[TELEMETRY], None, exporter=exporters[kind])
        await s.episode(WORKPLACE, "sp-1")
        await checkpoint(s, store, "sp-ck")
        events = await all_events(store)
    finally:
        await s.close()
    spans = {kind: exporters[kind].get_finished_spans() for kind in KINDS}
    calls = of(events, "call_accepted")
    model_calls = [sp for sp in spans["model"] if sp.name == "rollbook.model_call"]
    assert sorted(attrs(sp)["rollbook.call_id"] for sp in model_calls) == sorted(c.data["call_id"] for c in calls)
    tool_spans = [sp for sp in spans["resources"] if sp.name == "rollbook.tool_call"]
    assert len(tool_spans) == tool_calls(events, "sp-1") == 3
    for sp in model_calls + tool_spans:
        a = attrs(sp)
        assert (a["rollbook.rollout_id"], a["rollbook.attempt"], a["rollbook.outcome"]) == ("sp-1", 0, "ok"), a
    for kind in KINDS:
        phases = [sp for sp in spans[kind] if sp.name.startswith("rollbook.checkpoint.")]
        assert sorted(sp.name for sp in phases) == ["rollbook.checkpoint.commit", "rollbook.checkpoint.prepare",
                                                    "rollbook.checkpoint.resume"], kind
        assert all(attrs(sp)["rollbook.checkpoint_id"] == "sp-ck" and attrs(sp)["rollbook.server.kind"] == kind
                   for sp in phases)
        assert phases[0].resource.attributes["service.name"] == f"rollbook-{kind}"
        assert len(spans[kind]) == len(phases) + {"model": len(model_calls), "resources": len(tool_spans)}.get(kind, 0)


def test_no_exporter_is_installed_without_an_endpoint() -> None:
    t = Telemetry("model", "model-0")
    assert configure_tracing(t, None) is False
    assert (t.provider, t.tracer) == (None, None)
    with t.operation("model_call", "chat_completions", {"rollbook.rollout_id": "r", "rollbook.attempt": 0}) as span:
        assert span is None  # nothing recorded, nothing exported
    assert t.provider is None


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export request's spans."""

    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    # In a thread of its own: the exporter posts from its own thread and a server shutdown waits for it.
    received: list[ExportTraceServiceRequest] = []
    handler = type("Collector", (_Collector,), {"received": received})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces", received
    httpd.shutdown()
    httpd.server_close()


async def test_the_configured_otlp_endpoint_receives_the_spans_of_rollbook_serve(dsn: str, collector: Any, tmp_path: Path) -> None:
    endpoint, received = collector
    servers = {k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}
    base = cfg.Config(dsn=dsn, control_token=CREDS.control, data_token=CREDS.data, servers=servers)
    plain = TestServer(serve.build("resources", base, dsn), host="127.0.0.1")
    await plain.start_server()
    assert plain.app[TELEMETRY].tracer is None and plain.app[TELEMETRY].provider is None  # no [telemetry]: no spans
    await plain.close()
    config = cfg.Config(dsn=dsn, control_token=CREDS.control, data_token=CREDS.data, servers=servers,
                        telemetry=cfg.TelemetryConfig(otlp_endpoint=endpoint))
    cfg.write(config, tmp_path / "rollbook.toml")
    assert cfg.load(tmp_path / "rollbook.toml").telemetry == config.telemetry  # the file round-trips
    srv = TestServer(serve.build("resources", cfg.load(tmp_path / "rollbook.toml"), dsn), host="127.0.0.1")
    await srv.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            for op in ("prepare", "resume"):
                async with http.post(srv.make_url(f"/rollbook/v1/control/{op}"), headers={"Authorization": f"Bearer {CREDS.control}"},
                                     json={"checkpoint_id": "otlp-ck", "deadline": time.time() + 20}) as r:
                    assert r.status == 200, await r.text()
    finally:
        await srv.close()  # the server's cleanup flushes its spans to the collector
    spans = [(resource.resource, span) for req in received for resource in req.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert sorted(span.name for _, span in spans) == ["rollbook.checkpoint.prepare", "rollbook.checkpoint.resume"]
    for resource, span in spans:
        assert {a.key: a.value.string_value for a in span.attributes}["rollbook.checkpoint_id"] == "otlp-ck"
        assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "rollbook-resources"


def test_a_telemetry_endpoint_that_is_not_an_http_url_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rollbook.toml"
    path.write_text('control_token = "control-secret"\ndata_token = "data-secret!"\n[servers.model]\nport = 1\n'
                    '[telemetry]\notlp_endpoint = "file:///etc/passwd"\n')
    path.chmod(0o600)  # it holds credentials
    with pytest.raises(ConfigError, match="telemetry.otlp_endpoint"):
        cfg.load(path)
