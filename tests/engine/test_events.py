"""engine.events at its edges: the payload limit to the byte, what is not plain JSON, the floats
JSONB reads back as integers, the stored spelling of the strings PostgreSQL refuses, and the fast
JSON reader and writer that must read and write as the stdlib's does.

engine.events' stored spelling of strings, searched by hypothesis: any JSON value round-trips, and
what PostgreSQL is given holds no U+0000 and no lone surrogate.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidPayload, PayloadTooLarge
from engine.events import (
    DEFAULT_PAYLOAD_LIMIT,
    GENESIS_HASH,
    SCHEMA_VERSION,
    STORE_ESCAPE,
    NewEvent,
    canonical_json,
    dumps,
    encode_payload,
    escape_strings,
    has_large_float,
    load_stored_json,
    loads,
    stored_text,
    unescape_strings,
)


def test_the_default_limit_is_one_mebibyte_and_the_genesis_hash_is_32_zero_bytes() -> None:
    assert DEFAULT_PAYLOAD_LIMIT == 1024 * 1024
    assert GENESIS_HASH == bytes(32)


def test_a_payload_of_exactly_the_limit_is_admitted_and_one_byte_more_is_not() -> None:
    data = {"x": "a" * 10}
    size = len(canonical_json(data))
    assert encode_payload(data, size) == canonical_json(data)
    with pytest.raises(PayloadTooLarge, match=f"event data is {size} bytes, over the {size - 1}-byte limit") as refused:
        encode_payload(data, size - 1)
    assert refused.value.context == {"size": size, "limit": size - 1}


def test_the_limit_counts_utf8_bytes_not_characters() -> None:
    data = {"x": "é" * 10}
    size = len(canonical_json(data).encode())
    assert size == len(canonical_json(data)) + 10
    encode_payload(data, size)
    with pytest.raises(PayloadTooLarge):
        encode_payload(data, size - 1)


def test_the_default_limit_applies_when_none_is_given() -> None:
    encode_payload({"x": "a" * (DEFAULT_PAYLOAD_LIMIT - 8)})
    with pytest.raises(PayloadTooLarge):
        encode_payload({"x": "a" * (DEFAULT_PAYLOAD_LIMIT - 7)})


@pytest.mark.parametrize("data, says", [
    ([1], "must be a JSON object, got list"), ({"x": float("nan")}, "not plain JSON"), ({"x": {1, 2}}, "not plain JSON"),
])
def test_what_is_not_a_plain_json_object_is_refused(data: object, says: str) -> None:
    with pytest.raises(InvalidPayload, match=says):
        encode_payload(data)


def test_canonical_json_is_one_spelling() -> None:
    assert canonical_json({"b": 1, "a": ["é", None]}) == '{"a":["é",null],"b":1}'


def test_a_float_of_1e16_or_more_is_stored_as_the_integer_jsonb_reads_back() -> None:
    assert json.loads(encode_payload({"x": 1e16, "y": [-2e16], "z": {"w": 1.5e300}})) == {
        "x": 10**16, "y": [-2 * 10**16], "z": {"w": int(1.5e300)}}
    assert json.loads(encode_payload({"x": 9.999e15, "s": "e+"})) == {"x": 9.999e15, "s": "e+"}
    assert encode_payload({"x": 1e16}) == '{"x":10000000000000000}'  # the text PostgreSQL hands back


def test_a_large_float_is_found_anywhere_in_a_value() -> None:
    assert has_large_float(1e16) and has_large_float(-1e16)
    assert not has_large_float(9.99e15)
    assert has_large_float({"a": [1, {"b": 2e16}]})
    assert not has_large_float({"a": [1, {"b": 2}], "c": "1e+20"})
    assert not has_large_float(10**20)


def test_strings_postgresql_refuses_are_escaped_keys_included_and_read_back() -> None:
    value = {"k\x00": ["a\x00b", STORE_ESCAPE, "\ud800", 1, None]}
    escaped = escape_strings(value)
    assert escaped == {f"k{STORE_ESCAPE}0": [f"a{STORE_ESCAPE}0b", f"{STORE_ESCAPE}e", f"{STORE_ESCAPE}sd800", 1, None]}
    assert unescape_strings(escaped) == value
    assert unescape_strings("plain") == "plain"


def test_stored_text_escapes_only_where_it_must() -> None:
    assert stored_text({"x": "é"}) == '{"x":"é"}'
    assert stored_text({"x": "a\x00"}) == '{"x":"a' + STORE_ESCAPE + '0"}'
    assert stored_text({"x": "\\u0000"}) == canonical_json({"x": "\\u0000"})
    assert stored_text({"x": "é" + STORE_ESCAPE}) == canonical_json({"x": "é" + STORE_ESCAPE + "e"})
    assert stored_text({"x": "\ud800é"}) == canonical_json({"x": STORE_ESCAPE + "sd800é"})
    assert stored_text({"x": "a"}, '{"x":"a"}') == '{"x":"a"}'


def test_stored_text_that_holds_no_escape_is_read_as_it_is() -> None:
    assert load_stored_json('{"x":"\\u0000"}') == {"x": "\x00"}
    assert load_stored_json(b'{"x":"' + f"{STORE_ESCAPE}0".encode() + b'"}') == {"x": "\x00"}


def test_events_are_written_at_schema_version_one() -> None:
    assert SCHEMA_VERSION == 1
    assert NewEvent("s", "k").schema_version == 1


def test_large_floats_in_a_list_are_stored_as_integers_and_the_rest_of_the_list_as_it_is() -> None:
    assert encode_payload({"y": [-2e16, "ab", 1.5, [3e16]]}) == '{"y":[-20000000000000000,"ab",1.5,[30000000000000000]]}'


# Every code point, surrogates and NUL included, with the escape and its codes drawn often.
# The six characters \u0000 (no NUL at all) come in whole too.
TEXT = st.lists(st.one_of(st.characters(codec=None), st.sampled_from(["\x00", STORE_ESCAPE, "e", "0", "s", "\ud800",
                                                                    "\\u0000"])), max_size=12).map("".join)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=20)


def strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [*value, *(s for v in value.values() for s in strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


@given(st.dictionaries(TEXT, JSON, max_size=5))
def test_any_payload_is_stored_without_nul_or_lone_surrogates_and_read_back_as_it_was(data: dict) -> None:
    text = encode_payload(data)
    text.encode("utf-8")  # strict: no lone surrogate reaches the database
    assert not any("\x00" in s for s in strings(json.loads(text)))  # JSONB refuses U+0000
    assert load_stored_json(text) == data
    assert load_stored_json(text.encode()) == data


_ANY_NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**19, 1e-7, 1e308, -0.0]))
_ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)  # NUL and lone surrogates among them
_ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), _ANY_NUMBER, _ANY_TEXT),
                         lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_ANY_TEXT, inner, max_size=4)),
                         max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(value=_ANY_JSON, ascii_only=st.booleans())
def test_loads_reads_any_text_as_json_loads_does(value: object, ascii_only: bool) -> None:
    """Input: any value as Python's json writes it (integers past 64 bits, NaN, infinities, NUL and lone
    surrogates, escaped or not), as text and as UTF-8 bytes where it has a UTF-8 spelling."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    expected = json.dumps(json.loads(text), sort_keys=True)
    assert json.dumps(loads(text), sort_keys=True) == expected
    try:
        raw = text.encode()
    except UnicodeEncodeError:  # a lone surrogate written as itself has no UTF-8 spelling
        return
    assert json.dumps(loads(raw), sort_keys=True) == expected


_ANY_KEY = st.one_of(_ANY_TEXT, st.integers(-5, 5), st.booleans(), st.none())  # json.dumps writes these keys as text


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.one_of(st.none(), st.booleans(), _ANY_NUMBER, _ANY_TEXT),
                          lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner),
                                                  st.dictionaries(_ANY_KEY, inner, max_size=4)), max_leaves=25))
def test_dumps_writes_any_value_as_json_dumps_does(value: object) -> None:
    """Input: any value json.dumps writes (integers past 64 bits, NaN and infinities, NUL and lone
    surrogates, keys that are numbers, booleans or None): read back, the same value as json.dumps' text."""
    assert json.dumps(json.loads(dumps(value)), sort_keys=True) == json.dumps(json.loads(json.dumps(value)), sort_keys=True)


def test_dumps_refuses_what_json_dumps_refuses() -> None:
    """Input: a date, a dataclass and a set, none of them JSON: refused as json.dumps refuses them."""
    for value in ({"at": datetime(2026, 12, 7)}, [NewEvent("s", "k", {})], {1, 2}):
        with pytest.raises(TypeError):
            dumps(value)


def _json_spelling(value: object) -> str:
    """The canonical spelling as json writes it, the spelling every stored digest was made from."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# Floats of every magnitude either writer spells with an exponent, and at the thresholds between.
_EVERY_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [1e-4, 1e-5, -1e-5, 0.00009999, 1e-7, 5e-324, 1e15, 9999999999999998.0, 1e16, -1e16, 1e300, 10.00001, -0.0]),
    st.floats(-30, 30).map(lambda x: 10.0 ** x))
# Strings that look like a float's exponent or a small float, which the fast path must not be fooled by.
_LIKE_NUMBERS = st.sampled_from(["1e-05", "2e+16", "0.00001", "3e-", "e-mail", "-", "+", "null", "NaN"])


@settings(max_examples=500, deadline=None)
@given(value=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), _EVERY_FLOAT, _ANY_TEXT,
                                    _LIKE_NUMBERS),
                          lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner),
                                                  st.dictionaries(st.one_of(_ANY_TEXT, _LIKE_NUMBERS), inner, max_size=4)),
                          max_leaves=25))
def test_canonical_json_spells_any_value_as_json_does_and_refuses_what_it_refuses(value: object) -> None:
    """Input: any JSON value with floats of every magnitude (NaN and the infinities among them), integers
    past 64 bits, NUL, lone surrogates and any other character, strings spelt like numbers, tuples: the
    same text as json's sorted, compact spelling (so digests written before are the same), or the same
    refusal."""
    try:
        expected: str | type[Exception] = _json_spelling(value)
    except (ValueError, TypeError) as exc:
        expected = type(exc)
    if isinstance(expected, str):
        assert canonical_json(value) == expected
    else:
        with pytest.raises(expected):
            canonical_json(value)


def test_canonical_json_writes_a_nemo_gym_row_without_json_and_a_small_float_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a NeMo Gym row (text, integers, a float that needs no exponent) is written by orjson alone;
    {"p": 1e-05}, which orjson spells 0.00001, by json, as 1e-05."""
    import engine.events as events

    row = {"id": 7, "responses_create_params": {"input": [{"role": "user", "content": "Email Carlos re: the Q3-plan."}],
                                                 "temperature": 0.7, "tools": [{"name": "send", "strict": True}]}}
    expected = _json_spelling(row)

    class Refuses:
        def encode(self, value: object) -> str:
            raise AssertionError(f"json wrote {value!r}")

    real = events._CANONICAL
    monkeypatch.setattr(events, "_CANONICAL", Refuses())
    assert canonical_json(row) == expected
    monkeypatch.setattr(events, "_CANONICAL", real)
    assert canonical_json({"p": 1e-05}) == '{"p":1e-05}'
