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

INT4, FLOAT4 = 23, 700  # pg_type oids of the elements
INT4_ARRAY, FLOAT4_ARRAY = 1007, 1021

assert array("i").itemsize == array("I").itemsize == array("f").itemsize == 4, "32-bit C int and float"


class Int4s(bytes):
    """A one-dimensional integer[] in PostgreSQL's binary format."""


class Float4s(bytes):
    """A one-dimensional real[] in PostgreSQL's binary format."""


def _packed(element_oid: int, words: array) -> bytes:  # type: ignore[type-arg]
    """The array of 32-bit `words` (each already an element's four bytes, in this machine's order)."""
    n = len(words)
    if n == 0:
        return struct.pack(">iii", 0, 0, element_oid)
    out = array("i", [4]) * (2 * n)  # each element: its length, 4, then its value
    out[1::2] = words
    if sys.byteorder == "little":
        out.byteswap()
    return struct.pack(">iiiii", 1, 0, element_oid, n, 1) + out.tobytes()


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


class _Int4sDumper(Dumper):
    format = Format.BINARY
    oid = INT4_ARRAY

    def dump(self, obj: bytes) -> bytes:
        return obj


class _Float4sDumper(_Int4sDumper):
    oid = FLOAT4_ARRAY


psycopg.adapters.register_dumper(Int4s, _Int4sDumper)
psycopg.adapters.register_dumper(Float4s, _Float4sDumper)
