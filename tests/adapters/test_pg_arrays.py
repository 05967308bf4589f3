"""Token arrays sent packed (adapters.pg_arrays) are stored exactly as the JSON statement stored them.

The reference is the statement the PostgreSQL token store wrote blobs with before: one JSON
document, each element cast from text. Rows written both ways must hold the same `token_ids` and
`logprobs` to the bit, so blobs and digests written by either read back the same."""

from __future__ import annotations

import json

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.database import libpq_dsn
from adapters.pg_arrays import byteas, float4s, int2s, int4s, int4s_or_null, int8s, texts
from adapters.token_store import (
    MAX_TOKEN_ID,
    PostgresTokenStore,
    _blob_row,
    _write_blob_rows,
    normalize,
    token_digest,
)

JSON_WRITE = (
    "INSERT INTO rollbook.token_blobs (blob_id, token_ids, logprobs, digest) "
    "SELECT r->>'b', ARRAY(SELECT x::integer FROM jsonb_array_elements_text(r->'t') WITH ORDINALITY AS t(x, n) ORDER BY n), "
    "CASE WHEN jsonb_typeof(r->'l') = 'array' THEN ARRAY(SELECT x::real FROM jsonb_array_elements_text(r->'l') "
    "WITH ORDINALITY AS l(x, n) ORDER BY n) END, "
    "r->>'d' FROM jsonb_array_elements(CAST(%(rows)s AS jsonb)) AS r"
)
STORED = "SELECT token_ids, logprobs, digest FROM rollbook.token_blobs WHERE blob_id = %s"

ids = st.lists(st.one_of(st.integers(0, MAX_TOKEN_ID), st.sampled_from([0, 1, 255, 256, 65535, MAX_TOKEN_ID])), max_size=300)
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.sampled_from([0.0, -0.0, -1e-45, -3.4028234663852886e38, -2.0 / 3.0, -1e-7]))


@pytest.fixture
def conn(dsn: str):
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as c:
        yield c


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), prompt=ids, with_logprobs=st.booleans())
def test_packed_arrays_are_stored_as_the_json_statement_stored_them(conn: psycopg.Connection, data: st.DataObject,
                                                                    prompt: list[int], with_logprobs: bool) -> None:
    """Input: any int32 ids from 0 to 2**31 - 1 (none, one, hundreds) and any finite float32 logprobs,
    -0.0, the smallest subnormal and the most negative float32 among them."""
    lps = data.draw(st.lists(floats, min_size=len(prompt), max_size=len(prompt))) if with_logprobs else None
    arr = normalize(prompt, lps)
    digest = token_digest(arr)
    json_row = {"b": f"json-{digest}", "t": list(arr.ids), "l": None if arr.logprobs is None else list(arr.logprobs), "d": digest}
    conn.execute(JSON_WRITE + " ON CONFLICT (blob_id) DO NOTHING", {"rows": json.dumps([json_row])})
    conn.execute(*_write_blob_rows([_blob_row(f"packed-{digest}", arr, digest)], "c0"))
    by_json = conn.execute(STORED, (f"json-{digest}",)).fetchone()
    packed = conn.execute(STORED, (f"packed-{digest}",)).fetchone()
    assert packed == by_json
    assert packed is not None and list(packed[0]) == list(arr.ids)
    assert (packed[1] is None) == (arr.logprobs is None)


async def test_a_blob_written_packed_reads_back_whole_through_the_store(dsn: str) -> None:
    """Input: a 13,000-token prompt (a NeMo Gym prompt with its tool schemas) and a reply with logprobs,
    put through the store's batched write (`put`), read back by `get`, which re-hashes what it read."""
    store = PostgresTokenStore(dsn)
    try:
        prompt = [(i * 7919) % 50000 for i in range(13000)]
        receipt = await store.put(prompt)
        reply = await store.put([5, 6, 7], [-0.5, -1e-7, -2.0 / 3.0])
        assert list((await store.get(receipt.blob_id)).ids) == prompt
        got = await store.get(reply.blob_id)
        assert list(got.ids) == [5, 6, 7] and got.logprobs == normalize([5, 6, 7], [-0.5, -1e-7, -2.0 / 3.0]).logprobs
    finally:
        await store.close()


@pytest.mark.parametrize("ids", [[2**31], [2**32 - 1], [5, 2**31, 6], [-1], [2**32]])
def test_an_id_out_of_int32_is_refused_before_it_is_packed(ids: list[int]) -> None:
    """Input: 2**31 and 2**32 - 1 (held by an unsigned word, not by int32), one such among ids that fit,
    -1 and 2**32 (normalize refuses each before the store packs anything)."""
    with pytest.raises(OverflowError):
        int4s(ids)
    assert float4s([]) != int4s([])  # the element type is in the header, even of an empty array


@pytest.mark.parametrize(("ids", "logprobs", "digest"), [
    ([151644, 0, 7, 2**31 - 1, 42], None, "2ee37d280b286e90e6f205a246bf160286015cd6a898f88e1c49e6b8b40b99e8"),
    ([5, 6, 7], [-0.5, -1e-7, -2.0 / 3.0], "2580b9000b67c0e5d121a279b76b8f98f5109c19e2c929f61a8e5122a83df6db"),
    ([], None, "d9b44576d31a4dfb2e20aad44c19f070200d8877500b9d2547a2f771e6c98387"),
    ([1], [0.0], "37e241f1fd197ee7219db228a77d64d8ea7869f6f6ff895cb1e01dbdf49f204a"),
])
def test_digests_are_those_the_stores_have_written_all_along(ids: list[int], logprobs: list[float] | None, digest: str) -> None:
    """Input: arrays whose digests the token store wrote before ids and logprobs were digested as tuples
    (the values here were printed by that code): a blob stored then still reads back as untampered."""
    assert token_digest(normalize(ids, logprobs)) == digest


TYPED = {  # packer, the array type, the values it holds (None among them)
    "bigint[]": (int8s, st.integers(-(2**63), 2**63 - 1)),
    "integer[]": (int4s_or_null, st.integers(-(2**31), 2**31 - 1)),
    "smallint[]": (int2s, st.integers(-(2**15), 2**15 - 1)),
    # any code point PostgreSQL's text holds: no NUL, no lone surrogate
    "text[]": (texts, st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)),
    "bytea[]": (byteas, st.binary(max_size=40)),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(sorted(TYPED)))
def test_an_appends_packed_arrays_are_what_psycopg_sends_as_lists(conn: psycopg.Connection, data: st.DataObject,
                                                                   kind: str) -> None:
    """Input: arrays of each type an append sends (none, one, dozens of elements; NULLs, the type's
    extreme values, multi-byte text, empty strings and bytes). Packed, each reads back as the same
    list psycopg's own dumper sends, and compares equal to it in the server."""
    pack, element = TYPED[kind]
    values = data.draw(st.lists(st.one_of(st.none(), element), max_size=30))
    packed, back, same = conn.execute(f"SELECT %s, %s::{kind}, %s = %s::{kind}", (pack(values), values, pack(values), values)).fetchone()
    assert packed == back == values
    assert same is True


def test_a_packed_array_names_its_type_whatever_its_values(conn: psycopg.Connection) -> None:
    """Input: an empty list and a list of small integers, which psycopg sends untyped and as smallint[]:
    packed, each is the type its column is."""
    assert conn.execute("SELECT pg_typeof(%s)::text, pg_typeof(%s)::text, pg_typeof(%s)::text",
                        (int8s([]), int8s([1, 2]), texts([]))).fetchone() == ("bigint[]", "bigint[]", "text[]")
    with pytest.raises(UnicodeEncodeError):
        texts(["\ud800"])
