"""What a server tells an operator: Prometheus metrics and OpenTelemetry spans.

One `Telemetry` per server (per aiohttp app): its own `CollectorRegistry`, so several servers in one
process (the tests, the demo) never share a series, and its own `TracerProvider`, not the global
one, for the same reason. Nothing here speaks HTTP: `participants.base.observability` mounts `/metrics`
and wraps the routes; the event store reports appends and database faults to the observers it is
given (adapters.postgres `StoreObserver`), which a `Telemetry` is.

Spans are off until `configure_tracing` installs an exporter: with none, no span is even created
(the tracer is None), so an unconfigured server pays for metrics only. The OTLP endpoint comes
from the configuration (`[telemetry] otlp_endpoint`), never from a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.errors import RollbookError

if TYPE_CHECKING:
    # Imported where spans are turned on: the SDK costs 0.15 s of CPU at every server start, and a
    # server without an exporter never creates a span.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

# Seconds. Phases: NeMo Gym reports a prepare of a few ms; a drain can take a generation's length.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 20.0)
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Category = Literal["phase", "model_call", "tool_call"]
_CALL_HELP = {"model_call": "model calls (chat completions)", "tool_call": "tool calls on a resources session"}


@dataclass(frozen=True)
class _CallMetrics:
    in_flight: Gauge
    seconds: Histogram


class Telemetry:
    """One server's metrics and spans. Also the `StoreObserver` of its event store."""

    def __init__(self, kind: str, instance: str) -> None:
        self.kind, self.instance = kind, instance
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("rollbook_server_info", "this server: its kind and instance (always 1)", ["kind", "instance"],
              registry=r).labels(kind, instance).set(1)
        self.phase_seconds = Histogram(
            "rollbook_checkpoint_phase_seconds", "how long each checkpoint phase operation took on this server "
            "(prepare: until its work is parked and reported)", ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.operations = Counter("rollbook_operations", "checkpoint phases, model calls and tool calls served, "
                                  "by outcome: ok or the error code", ["operation", "outcome"], registry=r)
        self.appends = Counter("rollbook_appends", "append requests committed to the log", registry=r)
        self.appended_events = Counter("rollbook_appended_events", "events committed to the log", registry=r)
        self.append_seconds = Histogram("rollbook_append_seconds", "from an append request to its commit "
                                        "(queueing for a group included)", buckets=APPEND_BUCKETS, registry=r)
        self.append_failures = Counter("rollbook_append_failures", "append requests refused or failed, by error code",
                                       ["code"], registry=r)
        self.replans = Counter(
            "rollbook_append_replans", "append groups planned again after the log's lock: another writer "
            "changed one of their streams or rollouts between their read and the lock, or they had to read "
            "after it (a retry that may have committed, a retire)", registry=r)
        self.database_errors = Counter(
            "rollbook_database_errors", "database faults: connection_lost (each retry of an operation whose "
            "connection failed) and database_unavailable (an operation that gave up)", ["error"], registry=r)
        for error in ("connection_lost", "database_unavailable"):
            self.database_errors.labels(error)  # present at 0 from the first scrape, so rate() works
        self._calls: dict[str, _CallMetrics] = {}
        self._counters: dict[tuple[str, str], Any] = {}
        self._phases: dict[str, Any] = {}
        self.provider: TracerProvider | None = None
        self.tracer: Tracer | None = None  # None: spans are off (no exporter configured)

    # ---- the event store's observer (adapters.postgres.StoreObserver) -------------------------

    def appended(self, events: int, seconds: float) -> None:
        self.appends.inc()
        self.appended_events.inc(events)
        self.append_seconds.observe(seconds)

    def append_failed(self, code: str) -> None:
        self.append_failures.labels(code).inc()

    def replanned(self) -> None:
        self.replans.inc()

    def connection_lost(self, what: str) -> None:
        self.database_errors.labels("connection_lost").inc()

    def database_unavailable(self, what: str) -> None:
        self.database_errors.labels("database_unavailable").inc()

    # ---- operations: checkpoint phases, model calls, tool calls -------------------------------

    def track(self, category: Category, operation: str | None = None) -> None:
        """Register the metrics of an operation this server serves (a model server has no tool calls), so
        they are scraped at 0 before the first one (a dashboard's rate() needs the series to exist)."""
        if operation is not None:
            self._counters.setdefault((operation, "ok"), self.operations.labels(operation, "ok"))
            if category == "phase":
                self._phases.setdefault(operation, self.phase_seconds.labels(operation))
        if category != "phase" and category not in self._calls:
            name, what = category.removesuffix("_call"), _CALL_HELP[category]
            self._calls[category] = _CallMetrics(
                Gauge(f"rollbook_{name}_calls_in_flight", f"{what} being served now", registry=self.registry),
                Histogram(f"rollbook_{name}_call_seconds", f"how long {what} took to answer",
                          buckets=CALL_BUCKETS, registry=self.registry))

    @contextlib.contextmanager
    def operation(self, category: Category, operation: str, attributes: Mapping[str, Any]) -> Iterator[Span | None]:
        """Time one operation into its histogram, count its outcome, and wrap it in a span (when spans are on)."""
        if category != "phase" and category not in self._calls:
            self.track(category)
        calls = self._calls.get(category)
        if calls is not None:
            calls.in_flight.inc()
        started = time.perf_counter()
        outcome = "ok"
        try:
            if self.tracer is None:  # the common case: no span, nothing to set up
                yield None
                return
            from opentelemetry.trace import SpanKind, Status, StatusCode

            name = f"rollbook.checkpoint.{operation}" if category == "phase" else f"rollbook.{category}"
            with self.tracer.start_as_current_span(
                    name, kind=SpanKind.SERVER, attributes={"rollbook.server.kind": self.kind, **attributes},
                    record_exception=False, set_status_on_exception=False) as span:
                try:
                    yield span
                except BaseException as exc:
                    outcome = _outcome(exc)
                    raise
                finally:
                    span.set_attribute("rollbook.outcome", outcome)
                    if outcome != "ok":
                        span.set_status(Status(StatusCode.ERROR, outcome))
        except BaseException as exc:
            outcome = _outcome(exc)
            raise
        finally:
            elapsed = time.perf_counter() - started
            # Children cached: labels() takes a lock and a lookup, a few microseconds on every call.
            counter = self._counters.get((operation, outcome))
            if counter is None:
                counter = self._counters[(operation, outcome)] = self.operations.labels(operation, outcome)
            counter.inc()
            if calls is not None:
                calls.in_flight.dec()
                calls.seconds.observe(elapsed)
            else:
                histogram = self._phases.get(operation)
                if histogram is None:
                    histogram = self._phases[operation] = self.phase_seconds.labels(operation)
                histogram.observe(elapsed)

    # ---- spans -------------------------------------------------------------------------------

    def export_spans(self, exporter: SpanExporter, batch: bool = True) -> None:
        """Turn spans on, sent to `exporter` (in batches from a background thread, or one by one)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if self.provider is None:
            self.provider = TracerProvider(resource=Resource.create({
                "service.name": f"rollbook-{self.kind}", "service.instance.id": self.instance}))
            self.tracer = self.provider.get_tracer("rollbook")
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))

    def shutdown(self) -> None:
        """Flush and stop the exporters (at the server's cleanup)."""
        if self.provider is not None:
            self.provider.shutdown()


def _outcome(exc: BaseException) -> str:
    """An operation's outcome label: the error code, `cancelled`, an HTTP status, or the exception's type."""
    if isinstance(exc, RollbookError):
        return exc.code
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    status = getattr(exc, "status", None)  # an aiohttp HTTPException
    return f"http_{status}" if isinstance(status, int) else type(exc).__name__


def configure_tracing(telemetry: Telemetry, otlp_endpoint: str | None, exporter: SpanExporter | None = None) -> bool:
    """The one place spans are turned on: OTLP over HTTP to the configured endpoint, else `exporter`
    (a test's in-memory one, sent span by span), else nothing at all. Says whether spans are on."""
    if exporter is not None:
        telemetry.export_spans(exporter, batch=False)
        return True
    if otlp_endpoint:
        # Imported here: a server without an endpoint never loads the exporter (nor requests, protobuf).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        telemetry.export_spans(OTLPSpanExporter(endpoint=otlp_endpoint))
        return True
    return False
