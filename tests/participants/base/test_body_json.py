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
