"""The event log's contract and the pure planning of an append.

Storage (adapters.postgres) holds one lock while it reads the heads this module needs, asks
`plan_batch` what to write, writes it and commits. Everything that decides *whether* an event
may land, and with which version, position and hash, lives here and runs without a database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine import catalog
from engine.attempts import RolloutState, admit
from engine.errors import RollbookError, VersionConflict
from engine.events import (
    DEFAULT_PAYLOAD_LIMIT,
    GENESIS_HASH,
    AppendRequest,
    NewEvent,
    RecordedEvent,
    chain_hash,
    encode_payload,
)


@dataclass(frozen=True)
class StreamHead:
    version: int
    hash: bytes


NEW_STREAM = StreamHead(0, GENESIS_HASH)


@dataclass
class LogState:
    """The part of the log's state an append depends on, as read under the append lock."""

    position: int
    streams: dict[str, StreamHead] = field(default_factory=dict)
    rollouts: dict[str, RolloutState] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedEvent:
    event: RecordedEvent
    payload: str  # canonical JSON of event.data, validated


def plan_request(request: AppendRequest, state: LogState, writer: str, limit: int) -> list[PlannedEvent]:
    """Assign versions, positions and hashes to one atomic request, or raise and change nothing."""
    if not request.events:
        return []
    streams: dict[str, StreamHead] = {}
    rollouts: dict[str, RolloutState | None] = {}
    for stream, expected in request.expected_versions.items():
        current = state.streams.get(stream, NEW_STREAM).version
        if expected is not None and expected != current:
            raise VersionConflict(
                f"stream {stream} is at version {current}, the writer expected {expected}",
                stream=stream,
                expected=expected,
                actual=current,
            )
    planned: list[PlannedEvent] = []
    position = state.position
    for event in request.events:
        catalog.check(event)  # a cataloged kind goes to its stream with the fields it must carry
        payload = encode_payload(event.data, limit)
        if event.rollout_id is not None or event.attempt is not None:
            key = event.rollout_id or ""
            before = rollouts[key] if key in rollouts else state.rollouts.get(key)
            rollouts[key] = admit(event, before)
        head = streams.get(event.stream) or state.streams.get(event.stream, NEW_STREAM)
        version = head.version + 1
        digest = chain_hash(head.hash, event.stream, version, event, payload)
        streams[event.stream] = StreamHead(version, digest)
        position += 1
        planned.append(
            PlannedEvent(
                RecordedEvent(
                    position=position,
                    stream=event.stream,
                    stream_version=version,
                    kind=event.kind,
                    data=event.data,
                    rollout_id=event.rollout_id,
                    attempt=event.attempt,
                    schema_version=event.schema_version,
                    writer=writer,
                    hash=digest,
                ),
                payload,
            )
        )
    state.position = position
    state.streams.update(streams)
    state.rollouts.update({k: v for k, v in rollouts.items() if v is not None})
    return planned


def plan_batch(
    requests: Sequence[AppendRequest], state: LogState, writer: str, limit: int = DEFAULT_PAYLOAD_LIMIT
) -> Iterator[list[PlannedEvent] | RollbookError]:
    """Plan several independent requests in order; one refused request does not sink the others.
    Lazy, so storage can send one request's rows to the server while it plans the next."""
    for request in requests:
        try:
            yield plan_request(request, state, writer, limit)
        except RollbookError as exc:
            yield exc


class EventStore(Protocol):
    """What the engine needs of storage. adapters.postgres.PostgresEventStore is the implementation."""

    async def append(self, request: AppendRequest) -> list[RecordedEvent]: ...

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]: ...

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]: ...

    async def head(self) -> int: ...

    def subscribe(self, after: int = 0) -> AsyncIterator[RecordedEvent]: ...


async def append_one(store: EventStore, event: NewEvent, expected_version: int | None = None) -> RecordedEvent:
    expected: dict[str, int | None] = {event.stream: expected_version} if expected_version is not None else {}
    (recorded,) = await store.append(AppendRequest((event,), expected))
    return recorded
