"""What the log holds: events as small frozen values with the identity of what they happened to."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine.errors import InvalidPayload, PayloadTooLarge

# Documented in the README: one event's data, as canonical JSON, may not exceed this.
DEFAULT_PAYLOAD_LIMIT = 1024 * 1024
SCHEMA_VERSION = 1
GENESIS_HASH = b"\x00" * 32


@dataclass(frozen=True)
class NewEvent:
    """An event a writer wants to append. `attempt` is None only for events outside any rollout."""

    stream: str
    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    rollout_id: str | None = None
    attempt: int | None = None
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class RecordedEvent:
    position: int
    stream: str
    stream_version: int
    kind: str
    data: dict[str, Any]
    rollout_id: str | None
    attempt: int | None
    schema_version: int
    writer: str
    hash: bytes
    recorded_at: datetime | None = None


@dataclass(frozen=True)
class AppendRequest:
    """Events appended atomically. `expected_version` is the stream version the writer has seen
    (0 = the stream must be new); None appends at whatever the head is."""

    events: tuple[NewEvent, ...]
    expected_versions: dict[str, int | None] = field(default_factory=dict)
    # Idempotency: a request retried after its commit outcome was lost (the connection dropped at
    # commit) carries the same key, and the store returns what the first try wrote instead of
    # writing it again. The store assigns one when the writer gives none.
    key: str | None = None


# One encoder, built once: json.dumps with options builds a new one per call, a measurable share
# of a large append (benchmarks/README.md).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> str:
    """One spelling per value, so hashes agree between writer and any later reader."""
    return _CANONICAL.encode(value)


def encode_payload(data: Any, limit: int = DEFAULT_PAYLOAD_LIMIT) -> str:
    """Validate that data is plain JSON a JSONB column can hold, within the size limit."""
    if not isinstance(data, dict):
        raise InvalidPayload(f"event data must be a JSON object, got {type(data).__name__}")
    try:
        text = canonical_json(data)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"event data is not plain JSON: {exc}") from exc
    if "e+" in text and has_large_float(data):  # only large floats are spelt with a positive exponent
        text = canonical_json(_as_postgres_reads(data))
    if "\\u0000" in text:
        raise InvalidPayload("event data contains a NUL character, which PostgreSQL JSONB cannot store")
    size = len(text) if text.isascii() else len(text.encode())
    if size > limit:
        raise PayloadTooLarge(
            f"event data is {size} bytes, over the {limit}-byte limit; store large blobs in a token or blob "
            "store and put a reference in the event",
            size=size,
            limit=limit,
        )
    return text


def has_large_float(value: Any) -> bool:
    """Whether `value` holds a float JSONB would hand back as an int (see _as_postgres_reads). Asked
    only when the JSON text has "e+" in it, which a string (base64, say) often has too: walking the
    value is far cheaper than encoding a large payload two more times."""
    if isinstance(value, float):
        return abs(value) >= 1e16
    if isinstance(value, dict):
        return any(has_large_float(v) for v in value.values())
    if isinstance(value, list):
        return any(has_large_float(v) for v in value)
    return False


def _as_postgres_reads(value: Any) -> Any:
    """JSONB stores numbers as numeric and hands 1e+16 back as 10000000000000000, an int. Hash what
    a reader will get back: a float that large is an integer, so the int is the same value."""
    if isinstance(value, float) and abs(value) >= 1e16:
        return int(value)
    if isinstance(value, dict):
        return {k: _as_postgres_reads(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_postgres_reads(v) for v in value]
    return value


def chain_hash(previous: bytes, stream: str, version: int, event: NewEvent | RecordedEvent, payload: str) -> bytes:
    """Each event's hash covers its stream predecessor, so a stream head vouches for the whole stream."""
    h = hashlib.sha256(previous)
    h.update(
        canonical_json(
            [stream, version, event.kind, event.rollout_id, event.attempt, event.schema_version]
        ).encode()
    )
    h.update(payload.encode())
    return h.digest()
