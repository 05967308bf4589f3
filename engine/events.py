"""What the log holds: events as small frozen values with the identity of what they happened to."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from engine.errors import InvalidPayload, PayloadTooLarge

# Documented in docs/sql.md ("The log"): one event's data, as canonical JSON, may not exceed this.
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
    """One spelling per value, so hashes agree between writer and any later reader: json's, with sorted
    keys and no spaces. Written by orjson (a quarter of the time on a NeMo Gym row) wherever its text is
    that same spelling, and by json elsewhere. orjson writes NaN and the infinities as null, where json
    refuses them: text with null in it is read back and compared. A UUID or an Enum, which json refuses,
    orjson writes as its text; no payload holds one (they are parsed JSON and plain values)."""
    try:
        raw = orjson.dumps(value, option=_ORJSON_CANONICAL)
    except TypeError:  # not JSON to orjson: an integer past 64 bits, a key that is not text, a lone surrogate
        return _CANONICAL.encode(value)
    if _floats_spelt_alike(raw) and (b"null" not in raw or orjson.loads(raw) == value):
        return raw.decode()
    return _CANONICAL.encode(value)


_ORJSON_CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


_EXPONENT_SIGN = re.compile(rb"e[-+]")


def _floats_spelt_alike(raw: bytes) -> bool:
    """Whether json spells every float in orjson's text as orjson did. They differ only where one of
    them takes an exponent (orjson 0.00001 and 1e-7, json 1e-05 and 1e-07; 1e+16 both), and orjson's
    exponent is always e+ or e-: text with a digit before an e+ or e-, or with 0.0000, gets no. A
    string holding either gets no too, and json writes that value: slower, never different. (A search
    that begins at each digit cost more than orjson's whole write on 13,000 ids; one for the letter e
    does not.)"""
    if b"0.0000" in raw:
        return False
    return not any(0x30 <= raw[m.start() - 1] <= 0x39 for m in _EXPONENT_SIGN.finditer(raw))


# PostgreSQL's JSONB holds neither U+0000 nor a lone surrogate, and a tool or a model produces both
# (`printf '\0'`, an upstream's "\ud800"). A string holding one is stored with each of them, and the
# escape character itself, spelt as STORE_ESCAPE and a code; every reader of the store decodes it
# (`load_stored_json`), so what comes back is exactly what was produced. STORE_ESCAPE is a
# private-use character, so ordinary text is stored as it is and reads the same in SQL.
STORE_ESCAPE = "\ue000"
_STORE_ESCAPE_UTF8 = STORE_ESCAPE.encode()
_ESCAPED = re.compile("[\x00\ue000\ud800-\udfff]")
_CODED = re.compile("\ue000(e|0|s[0-9a-f]{4})")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return STORE_ESCAPE + ("e" if c == STORE_ESCAPE else "0" if c == "\x00" else f"s{ord(c):04x}")


def _unescape_code(m: re.Match[str]) -> str:
    code = m.group(1)
    return STORE_ESCAPE if code == "e" else "\x00" if code == "0" else chr(int(code[1:], 16))


def escape_strings(value: Any) -> Any:
    """`value` with every string (keys too) in its stored spelling."""
    if isinstance(value, str):
        return _ESCAPED.sub(_escape_char, value)
    if isinstance(value, dict):
        return {escape_strings(k): escape_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_strings(v) for v in value]
    return value


def unescape_strings(value: Any) -> Any:
    """The inverse of escape_strings."""
    if isinstance(value, str):
        return _CODED.sub(_unescape_code, value) if STORE_ESCAPE in value else value
    if isinstance(value, dict):
        return {unescape_strings(k): unescape_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unescape_strings(v) for v in value]
    return value


# A run of this many digits may be an integer past 64 bits, which orjson would hand back as a float.
# It is found as a substring of the text with every ASCII digit spelt 0 and every other byte a space:
# on a prompt of 13,000 token ids that took a ninth of the time of the regular expression [0-9]{19},
# which had cost more than json.loads itself.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 19


def _has_long_number(text: str | bytes) -> bool:
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    return _LONG_NUMBER in raw.translate(_DIGITS_AS_ZEROS)


def orjson_value(text: str | bytes) -> tuple[bool, Any]:
    """(True, the value) where orjson reads `text` as json.loads would, else (False, None): orjson refuses
    what json.loads alone reads (NaN, Infinity, a number past a double, a lone surrogate), and reads an
    integer past 64 bits as a float, so text with a run of 19 digits is not given to it."""
    if not _has_long_number(text):
        try:
            return True, orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return False, None


def loads(text: str | bytes) -> Any:
    """json.loads, through orjson (several times faster) wherever that gives the same value."""
    fast, value = orjson_value(text)
    return value if fast else json.loads(text)


# orjson's own ways of writing what json.dumps refuses: these fall back to json.dumps, which refuses them.
_LIKE_JSON_DUMPS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def dumps(value: Any) -> str:
    """json.dumps(value), written by orjson (on a NeMo Gym row, seventeen times faster) wherever that
    reads back as the same value. orjson writes a NaN or an infinity as null where json.dumps writes
    NaN or Infinity (a logprob of -inf stays one): a text with null in it is read back and compared,
    and is json.dumps' own unless it equals the value (a NaN equals nothing read back). What orjson
    refuses (an integer past 64 bits, a key that is not a string, a lone surrogate) is json.dumps' too."""
    try:
        text = orjson.dumps(value, option=_LIKE_JSON_DUMPS)
    except TypeError:
        return json.dumps(value)
    if b"null" in text and orjson.loads(text) != value:
        return json.dumps(value)
    return text.decode()


def load_stored_json(raw: str | bytes) -> Any:
    """How the store's reads turn JSONB text into values: only text that holds the escape is walked."""
    value = loads(raw)
    escaped = _STORE_ESCAPE_UTF8 in raw if isinstance(raw, bytes) else STORE_ESCAPE in raw
    return unescape_strings(value) if escaped else value


def stored_text(data: Any, text: str | None = None) -> str:
    """The canonical JSON text PostgreSQL is given for `data` (and that the chain hash covers):
    canonical_json, with strings escaped where they must be. `text` is canonical_json(data) if known."""
    return _stored(data, canonical_json(data) if text is None else text)[0]


def _stored(data: Any, text: str) -> tuple[str, int]:
    """stored_text and its size in UTF-8 bytes, encoding the text at most once on the usual path."""
    if text.isascii():
        if "\\u0000" not in text:
            return text, len(text)
    elif STORE_ESCAPE not in text and "\\u0000" not in text:
        try:
            return text, len(text.encode())
        except UnicodeEncodeError:  # a lone surrogate
            pass
    text = canonical_json(escape_strings(data))
    return text, len(text.encode())


def encode_payload(data: Any, limit: int = DEFAULT_PAYLOAD_LIMIT) -> str:
    """Validate that data is plain JSON within the size limit; return its stored text (stored_text)."""
    if not isinstance(data, dict):
        raise InvalidPayload(f"event data must be a JSON object, got {type(data).__name__}")
    try:
        text = canonical_json(data)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidPayload(f"event data is not plain JSON: {exc}") from exc
    if "e+" in text and has_large_float(data):  # only large floats are spelt with a positive exponent
        data = _as_postgres_reads(data)
        text = canonical_json(data)
    text, size = _stored(data, text)
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
