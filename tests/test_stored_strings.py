"""engine.events' stored spelling of strings, searched by hypothesis: any JSON value round-trips, and
what PostgreSQL is given holds no U+0000 and no lone surrogate."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from engine.events import STORE_ESCAPE, encode_payload, load_stored_json

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
