"""`GET /metrics` and the spans of every server: the HTTP side of adapters.telemetry.

`observe` gives an app its `Telemetry` (its own Prometheus registry and tracer provider), wraps the
routes that are checkpoint phases, model calls and tool calls so each is timed, counted and traced,
adds a collector that reads the participant's live state at each scrape (admission, phase, rollouts
in flight), and hands the telemetry to the event store as its observer (appends, database faults).

`/metrics` needs the control credential, like the control plane: Prometheus sends it with
`authorization: {credentials: ...}` in its scrape config. It is declared in the server's OpenAPI
document like every other route.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from prometheus_client.registry import Collector

from adapters.telemetry import Category, Telemetry
from engine.errors import RollbookError
from engine.identity import parse_attempt, validate_id
from engine.phases import PARTICIPANT_PHASES, ParticipantPhases
from participants.base.guard import Route
from participants.base.wire import CALL_ID_HEADER, TOOL_CALL_HEADER

METRICS_PATH = "/metrics"
TEXT_FORMAT = "text/plain"  # Prometheus' text exposition format; OpenMetrics when the scraper asks for it
TELEMETRY: web.AppKey[Telemetry] = web.AppKey("telemetry", Telemetry)

# The control operations that are checkpoint phases, and the data routes that are calls, by operation
# id (participants.base.guard.Route.operation_id), with the header that names the call.
PHASES = ("prepare", "commit", "restore", "resume")
CALLS: dict[str, tuple[Category, str, str]] = {
    "chat_completions": ("model_call", CALL_ID_HEADER, "rollbook.call_id"),
    "call_tool": ("tool_call", TOOL_CALL_HEADER, "rollbook.tool_call"),
}


def _attributes(request: web.Request, body: Any) -> dict[str, Any]:
    """The span attributes of a request: its rollout attempt (from the path), checkpoint and call ids.
    The handler has not checked the path yet: an identifier that does not parse is left out."""
    attrs: dict[str, Any] = {}
    checkpoint_id = getattr(body, "checkpoint_id", None)
    if isinstance(checkpoint_id, str):
        attrs["rollbook.checkpoint_id"] = checkpoint_id
    if "rollout_id" in request.match_info:
        try:
            attrs["rollbook.rollout_id"] = validate_id(request.match_info["rollout_id"], "rollout id")
            attrs["rollbook.attempt"] = parse_attempt(request.match_info.get("attempt"))
        except RollbookError:
            pass
    if "name" in request.match_info:
        attrs["rollbook.tool"] = request.match_info["name"][:200]
    return attrs


def _instrument(route: Route, telemetry: Telemetry) -> Route:
    op = route.operation_id
    if op in PHASES:
        category: Category = "phase"
        header = attribute = ""
    elif op in CALLS:
        category, header, attribute = CALLS[op]
    else:
        return route
    telemetry.track(category, op)
    handler = route.handler

    async def observed(request: web.Request, body: Any) -> web.StreamResponse:
        attrs: dict[str, Any] = {}
        if telemetry.tracer is not None:  # attributes only for a span: metrics carry no per-rollout labels
            attrs = _attributes(request, body)
            if header and (value := request.headers.get(header)):
                attrs[attribute] = value[:200]
        with telemetry.operation(category, op, attrs):
            return await handler(request, body)

    return dataclasses.replace(route, handler=observed, name=op)  # the operation id stays the handler's name


class _ServerState(Collector):
    """Read at each scrape, so the numbers are the server's own state, never a copy that can drift."""

    def __init__(self, participant: Any, phases: ParticipantPhases) -> None:
        self.participant, self.phases = participant, phases

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("rollbook_admission_open", "1 while this server admits new work, 0 while a "
                                "checkpoint (or a restore waiting for its resume) holds admission closed",
                                value=1.0 if self.participant.admission_open else 0.0)
        phase = GaugeMetricFamily("rollbook_checkpoint_phase", "this server's checkpoint phase: 1 for the current one",
                                  labels=["phase"])
        for name in PARTICIPANT_PHASES:
            phase.add_metric([name], 1.0 if name == self.phases.phase else 0.0)
        yield phase
        yield GaugeMetricFamily("rollbook_rollouts_in_flight", "rollout attempts with work in progress on this server",
                                value=float(self.participant.in_flight()))
        if hasattr(self.participant, "cuttable"):
            yield GaugeMetricFamily("rollbook_model_calls_cuttable", "model calls in flight with tokens of their own "
                                    "saved: what a paused checkpoint now would cut and keep",
                                    value=float(len(self.participant.cuttable())))


def observe(app: web.Application, routes: list[Route], participant: Any, phases: ParticipantPhases) -> list[Route]:
    """Give `app` its telemetry; return `routes` instrumented, with `GET /metrics` added."""
    telemetry = Telemetry(participant.kind, participant.instance)
    app[TELEMETRY] = telemetry
    telemetry.registry.register(_ServerState(participant, phases))
    # The stores that report appends and database faults (adapters.postgres); a store without
    # `observers` (an in-memory one) simply reports nothing.
    for store in (participant.store, getattr(participant, "token_store", None)):
        observers = getattr(store, "observers", None)
        if isinstance(observers, list):
            observers.append(telemetry)

    async def metrics(request: web.Request, _body: None) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(telemetry.registry), headers={"Content-Type": content_type})

    async def shutdown(app: web.Application) -> None:
        # In a thread: flushing to a collector that does not answer blocks for the exporter's timeout.
        await asyncio.to_thread(telemetry.shutdown)

    app.on_cleanup.append(shutdown)
    return [*(_instrument(r, telemetry) for r in routes),
            Route("GET", METRICS_PATH, metrics, None, None, (), "control", name="metrics",
                  media=(TEXT_FORMAT, OPENMETRICS.split(";")[0]))]
