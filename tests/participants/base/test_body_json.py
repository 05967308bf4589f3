"""A request body's JSON rule (participants.base.guard.parse_json): the fast parse gives what the
rule's own parse gives, value for value, and refuses what it refuses."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidJson
from participants.base.guard import parse_json, parse_json_text

NUMBERS = st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**18, 1e-7, 1e308, -0.0]))
# Any code point, lone surrogates and NUL among them: the rule keeps them.
TEXT = st.text(st.characters(codec=None, categories=None), max_size=20)
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
                      lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                      max_leaves=30)


def outcome(parse: Any, arg: Any) -> Any:
    try:
        return ("ok", json.dumps(parse(arg), allow_nan=True, sort_keys=True))
    except InvalidJson:
        return ("refused",)


@settings(max_examples=400, deadline=None)
@given(value=VALUES, nested=st.integers(0, 70))
def test_the_fast_parse_agrees_with_the_rule_on_any_value(value: Any, nested: int) -> None:
    """Input: any JSON value (integers past 64 bits, NaN, infinities, lone surrogates, NUL), as text
    (NaN and Infinity spelt as Python writes them), nested up to 70 lists deep."""
    text = "[" * nested + json.dumps(value, allow_nan=True) + "]" * nested
    raw = text.encode("utf-8", "surrogatepass")
    assert outcome(parse_json, raw) == outcome(parse_json_text, text)


def test_what_the_rule_refuses_the_fast_parse_refuses() -> None:
    """Input: integers just past 64-bit signed either way, a number past a double, NaN, 65 levels."""
    for raw in (b"[9223372036854775808]", b"[-9223372036854775809]", b"[1e999]", b"[NaN]", b"[" * 65 + b"]" * 65):
        assert outcome(parse_json, raw) == ("refused",), raw
    assert parse_json(b'["\\ud800", 9223372036854775807]') == ["\ud800", 2**63 - 1]
    assert math.isfinite(parse_json(b"[1e308]")[0])


def nesting(value: Any) -> int:
    """How many brackets deep a value goes (a scalar: 0), by walking it: the rule's reference."""
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


# Strings made of what could fool a reading of the bytes: brackets, quotes and backslashes.
TRICKY = st.text(st.sampled_from('[]{}"\\/ a\u00e9'), max_size=8)


@settings(max_examples=400, deadline=None)
@given(leaf=st.recursive(st.one_of(st.integers(-(2**63), 2**63 - 1), TRICKY),
                         lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TRICKY, inner, max_size=3)),
                         max_leaves=12),
       wrappers=st.lists(st.tuples(st.booleans(), TRICKY, TRICKY), min_size=55, max_size=70), ascii_only=st.booleans())
def test_a_body_is_refused_exactly_when_it_nests_deeper_than_the_limit(
        leaf: Any, wrappers: list[tuple[bool, str, str]], ascii_only: bool) -> None:
    """Input: a value wrapped in 55 to 70 lists and objects, its strings and keys made of brackets,
    quotes and backslashes (escaped, or not where JSON allows), read both ways. Refused exactly when
    the walk finds it more than MAX_DEPTH (64) deep."""
    value = leaf
    for as_object, key, sibling in wrappers:
        value = {key: value, key + "x": sibling} if as_object else [sibling, value]
    text = json.dumps(value, ensure_ascii=ascii_only)
    expected = ("refused",) if nesting(value) > 64 else ("ok", json.dumps(value, sort_keys=True))
    assert outcome(parse_json, text.encode()) == expected
    assert outcome(parse_json_text, text) == expected
