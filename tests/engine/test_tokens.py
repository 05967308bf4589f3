"""engine.tokens' values on their own: a token array's shape rule, a receipt's JSON both ways, and
a call's record in NeMo Gym's TokenEntry fields."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.events import canonical_json
from engine.tokens import CallTokens, Receipt, TokenArray, f32, token_digest


def test_a_logprob_is_kept_as_the_nearest_float32() -> None:
    assert f32(0.1) == 0.10000000149011612
    assert f32(-1.5) == -1.5


def test_a_token_array_has_one_logprob_per_id_or_none() -> None:
    assert TokenArray((1, 2), (-0.5, -1.0)).logprobs == (-0.5, -1.0)
    assert TokenArray((1, 2)).logprobs is None
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        TokenArray((1, 2), (-0.5,))


def test_a_receipt_reads_back_from_its_json() -> None:
    receipt = Receipt("b1", "sha256:ab", 7)
    assert receipt.to_json() == {"blob_id": "b1", "digest": "sha256:ab", "tokens": 7}
    assert Receipt.from_json({"blob_id": "b1", "digest": "sha256:ab", "tokens": "7"}) == receipt


def test_a_calls_tokens_are_a_token_entry_of_schema_version_one() -> None:
    call = CallTokens("c1", "r", 0, (1, 2, 3), (4, 5), (-0.1, -0.2), "v1", "stop", "c0")
    assert call.to_token_entry("m") == {
        "schema_version": 1, "rollout_id": "r", "model_call_id": "c1", "model": "m", "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5], "generation_log_probs": [-0.1, -0.2], "parent_call_id": "c0", "cum_len": 5}
    assert call.to_token_entry()["model"] == ""


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 2**31 - 1), max_size=50),
       logprobs=st.one_of(st.none(), st.lists(st.floats(-1e30, 0.0, allow_nan=False), max_size=50)),
       wide=st.booleans())
def test_a_token_digest_is_the_sha256_of_the_canonical_json_it_always_was(
        ids: list[int], logprobs: list[float] | None, wide: bool) -> None:
    """Input: any int32 ids (and, `wide`, an id past 64 bits, which orjson cannot spell), with no
    logprobs or with any, tiny ones (1e-07, spelt with an exponent) among them."""
    if wide:
        ids = [*ids, 2**70]
    expected = hashlib.sha256(canonical_json({"ids": ids, "logprobs": logprobs}).encode()).hexdigest()
    assert token_digest(tuple(ids), None if logprobs is None else tuple(logprobs)) == expected
