"""Token arrays to PostgreSQL as binary array parameters: packed in C here, copied in by PostgreSQL.

A model call stores its prompt's token ids (thousands: a NeMo Gym prompt with its tool schemas
holds 13,000) and its reply's ids and logprobs. Sent as JSON, PostgreSQL parsed each array into
jsonb, cast every element from text and sorted them back into order: 3.5 ms of its CPU for 13,000
ids, a third of its time per model call (benchmarks/nemo_gym_cost.py). As a text array literal it
still parses every element (1.7 ms). In PostgreSQL's binary array format (what `array_recv`
reads: a header, then each element as its length and its big-endian value) it reads them as they
are, and the packing is a few C loops over `array`s.

`Int4s` and `Float4s` wrap the packed bytes; their dumpers, registered on psycopg's global adapters
at import, send them as `integer[]` and `real[]` parameters in the binary format.

An append's own arrays (its events' columns, the heads and keys it reads and writes: a score of short
arrays a statement) go the same way, NULLs among them (`int8s`, `int4s_or_null`, `int2s`, `texts`,
`byteas`). psycopg's own list dumper found each array's element type and built its bytes one element
at a time in Python: a quarter of an append's client CPU (0.18 of 0.77 ms). Packed here, each array
also has one type whatever its values, where psycopg sent an integer as int2, int4 or int8 by its size
and an empty list untyped: every such mix was a statement of its own to prepare and plan.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

from engine.tokens import id_words

INT4, FLOAT4, INT2, INT8, TEXT, BYTEA = 23, 700, 21, 20, 25, 17  # pg_type oids of the elements
INT4_ARRAY, FLOAT4_ARRAY, INT2_ARRAY, INT8_ARRAY, TEXT_ARRAY, BYTEA_ARRAY = 1007, 1021, 1005, 1016, 1009, 1001
_NULL = struct.pack(">i", -1)  # an element's length: -1 is NULL

assert array("i").itemsize == array("I").itemsize == array("f").itemsize == 4, "32-bit C int and float"


class Int4s(bytes):
    """A one-dimensional integer[] in PostgreSQL's binary format."""


class Float4s(bytes):
    """A one-dimensional real[] in PostgreSQL's binary format."""


def _header(element_oid: int, n: int, has_null: bool) -> bytes:
    """A one-dimensional array's header (none for an empty one's dimension)."""
    return struct.pack(">iiiii", 1, has_null, element_oid, n, 1) if n else struct.pack(">iii", 0, 0, element_oid)


def _packed(element_oid: int, words: array) -> bytes:  # type: ignore[type-arg]
    """The array of 32-bit `words` (each already an element's four bytes, in this machine's order)."""
    out = array("i", [4]) * (2 * len(words))  # each element: its length, 4, then its value
    out[1::2] = words
    if sys.byteorder == "little":
        out.byteswap()
    return _header(element_oid, len(words), False) + out.tobytes()


def int4s(values: Sequence[int]) -> Int4s:
    """`values` (each from 0 to 2**31 - 1: OverflowError otherwise) as an integer[] parameter."""
    words = array("i")
    words.frombytes(id_words(values).tobytes())
    return Int4s(_packed(INT4, words))


def float4s(values: Sequence[float]) -> Float4s:
    """`values`, rounded to float32 as PostgreSQL's real would round them, as a real[] parameter."""
    words = array("i")
    words.frombytes(array("f", values).tobytes())
    return Float4s(_packed(FLOAT4, words))


class Int8s(bytes):
    """A one-dimensional bigint[] in PostgreSQL's binary format."""


class Int2s(bytes):
    """A one-dimensional smallint[] in PostgreSQL's binary format."""


class Texts(bytes):
    """A one-dimensional text[] in PostgreSQL's binary format."""


class Byteas(bytes):
    """A one-dimensional bytea[] in PostgreSQL's binary format."""


def _integers(element_oid: int, code: str, size: int, values: Sequence[int | None]) -> bytes:
    """Integers of struct `code` (`size` bytes each), None as NULL: struct.error for one out of range."""
    if None not in values:  # the common case: one pack, in C
        args: list[int | None] = [size, 0] * len(values)
        args[1::2] = values
        return _header(element_oid, len(values), False) + struct.pack(">" + ("i" + code) * len(values), *args)
    element = struct.Struct(">i" + code)
    return _header(element_oid, len(values), True) + b"".join(
        _NULL if v is None else element.pack(size, v) for v in values)


def _variable(element_oid: int, values: Sequence[bytes | None]) -> bytes:
    parts: list[bytes] = []
    for v in values:
        parts += (_NULL,) if v is None else (len(v).to_bytes(4, "big"), v)
    return _header(element_oid, len(values), None in values) + b"".join(parts)


def int8s(values: Sequence[int | None]) -> Int8s:
    return Int8s(_integers(INT8, "q", 8, values))


def int4s_or_null(values: Sequence[int | None]) -> Int4s:
    """An integer[] of any int32 values, NULLs among them (`int4s` holds token ids alone)."""
    return Int4s(_integers(INT4, "i", 4, values))


def int2s(values: Sequence[int | None]) -> Int2s:
    return Int2s(_integers(INT2, "h", 2, values))


def texts(values: Sequence[str | None]) -> Texts:
    """UTF-8, as psycopg encodes text: a lone surrogate is a UnicodeEncodeError, a NUL refused by PostgreSQL."""
    return Texts(_variable(TEXT, [None if v is None else v.encode() for v in values]))


def byteas(values: Sequence[bytes | None]) -> Byteas:
    return Byteas(_variable(BYTEA, values))


class _PackedDumper(Dumper):
    format = Format.BINARY
    oid = 0  # each packed type's array oid, below

    def dump(self, obj: bytes) -> bytes:
        return obj


for _packed_type, _oid in ((Int4s, INT4_ARRAY), (Float4s, FLOAT4_ARRAY), (Int8s, INT8_ARRAY), (Int2s, INT2_ARRAY),
                           (Texts, TEXT_ARRAY), (Byteas, BYTEA_ARRAY)):
    psycopg.adapters.register_dumper(_packed_type, type(f"_{_packed_type.__name__}Dumper", (_PackedDumper,), {"oid": _oid}))
