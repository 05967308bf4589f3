"""Token store conformance: one suite, run on the PostgreSQL, the filesystem and the memory store."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from adapters.token_store import (
    FilesystemTokenStore,
    MemoryTokenStore,
    PostgresTokenStore,
    normalize,
    token_digest,
)
from engine.errors import InvalidCheckpointState, InvalidPayload
from engine.tokens import Receipt, TokenArray, f32

IDS = [151644, 0, 7, 2**31 - 1, 42]
LOGPROBS = [-0.1, -1e-7, 0.0, -23.456789, -2.0 / 3.0]


@pytest.fixture(params=["postgres", "filesystem", "memory"])
async def tokens(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "postgres":
        dsn = request.getfixturevalue("dsn")
        s = PostgresTokenStore(dsn)
    elif request.param == "memory":
        s = MemoryTokenStore()
    else:
        s = FilesystemTokenStore(tmp_path / "tokens")
    yield s
    await s.close()


async def tamper(store, blob_id: str, digest: str | None = None) -> None:
    """Change one token of a stored blob behind the store's back; its recorded digest is left as it
    was, or set to `digest` (a forger who also rewrites the digest)."""
    if isinstance(store, PostgresTokenStore):
        async with store.engine.begin() as conn:
            await conn.execute(
                text("UPDATE rollbook.token_blobs SET token_ids[1] = token_ids[1] + 1, "
                     "digest = COALESCE(:d, digest) WHERE blob_id = :b"), {"b": blob_id, "d": digest}
            )
    elif isinstance(store, MemoryTokenStore):
        arr, recorded = store.blobs[blob_id]
        store.blobs[blob_id] = (TokenArray((arr.ids[0] + 1, *arr.ids[1:]), arr.logprobs), digest or recorded)
    else:
        path = store.root / "blobs" / f"{blob_id}.json"
        row = json.loads(path.read_text())
        row["token_ids"][0] += 1
        row["digest"] = digest or row["digest"]
        path.write_text(json.dumps(row))


async def delete(store, blob_id: str) -> None:
    if isinstance(store, PostgresTokenStore):
        async with store.engine.begin() as conn:
            await conn.execute(text("DELETE FROM rollbook.token_blobs WHERE blob_id = :b"), {"b": blob_id})
    elif isinstance(store, MemoryTokenStore):
        del store.blobs[blob_id]
    else:
        (store.root / "blobs" / f"{blob_id}.json").unlink()


async def test_put_then_get_returns_the_same_ids_and_float32_logprobs_with_a_receipt(tokens) -> None:
    receipt = await tokens.put(IDS, LOGPROBS)
    assert isinstance(receipt, Receipt) and receipt.tokens == len(IDS)
    got = await tokens.get(receipt.blob_id)
    assert got == TokenArray(tuple(IDS), tuple(f32(x) for x in LOGPROBS))
    assert await tokens.put(IDS, LOGPROBS) == receipt  # content-addressed: a retried put is the same blob
    prompt = await tokens.put(IDS)  # a prompt: ids without logprobs is another blob
    assert (await tokens.get(prompt.blob_id)).logprobs is None and prompt.blob_id != receipt.blob_id
    empty = await tokens.put([], [])
    assert (await tokens.get(empty.blob_id)).ids == () and empty.blob_id != receipt.blob_id


@pytest.mark.parametrize("ids,logprobs", [([-1], None), ([2**31], None), ([2**32 - 1], None), ([2**32], None),
                                          ([7, 2**31 + 5, 9], None), (["7"], None), ([True], None), ([1.0], None),
                                          ([None], None), ([1, 2], [-0.5]), ([1], [float("nan")]), ([1], [float("-inf")]),
                                          ([1], [-1e300]), ([1], ["-0.5"]), ([1], [None])])
async def test_put_refuses_ids_that_are_not_int32_and_logprobs_that_do_not_fit(tokens, ids, logprobs) -> None:
    with pytest.raises(InvalidPayload):
        await tokens.put(ids, logprobs)


def reference_normalize(ids: list, logprobs: list | None) -> TokenArray | None:
    """The rule one value at a time (None: refused): what normalize must agree with at any length."""
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= 2**31 - 1 for i in ids):
        return None
    if logprobs is None:
        return TokenArray(tuple(ids), None)
    if len(logprobs) != len(ids) or any(isinstance(x, str) or x is None for x in logprobs):
        return None
    try:
        lps = tuple(f32(x) for x in logprobs)
    except OverflowError:  # too large for float32
        return None
    return TokenArray(tuple(ids), lps) if all(math.isfinite(x) for x in lps) else None


ANY_ID = st.one_of(st.integers(0, 2**31 - 1), st.integers(-2**40, 2**40), st.booleans(), st.floats(), st.text(max_size=2), st.none())
ANY_LOGPROB = st.one_of(st.floats(), st.floats(-100, 0, width=32), st.integers(-5, 0), st.text(max_size=2), st.none())


@given(ids=st.lists(ANY_ID, max_size=8), logprobs=st.none() | st.lists(ANY_LOGPROB, max_size=8), same_length=st.booleans())
@settings(max_examples=300, deadline=None)
def test_normalize_keeps_exactly_the_int32_ids_and_finite_float32_logprobs_the_one_value_rule_keeps(ids, logprobs, same_length) -> None:
    if logprobs is not None and same_length:
        logprobs = (logprobs * (len(ids) + 1))[:len(ids)] if logprobs else [0.0] * len(ids)
    expected = reference_normalize(ids, logprobs)
    if expected is None:
        with pytest.raises(InvalidPayload):
            normalize(ids, logprobs)
    else:
        assert normalize(ids, logprobs) == expected


async def test_get_refuses_a_blob_whose_logprob_was_replaced_by_something_that_is_not_a_number(tmp_path: Path) -> None:
    tokens = FilesystemTokenStore(tmp_path / "tokens")
    receipt = await tokens.put([1, 2], [-0.5, -0.25])
    path = tokens.root / "blobs" / f"{receipt.blob_id}.json"
    for hostile in ("-0.5", None, [1]):
        row = json.loads(path.read_text())
        row["logprobs"][0] = hostile
        path.write_text(json.dumps(row))
        with pytest.raises(InvalidCheckpointState, match="does not match its digest"):
            await tokens.get(receipt.blob_id)


async def test_get_refuses_a_tampered_or_missing_blob(tokens) -> None:
    receipt = await tokens.put(IDS, LOGPROBS)
    await tamper(tokens, receipt.blob_id)
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await tokens.get(receipt.blob_id)
    with pytest.raises(InvalidCheckpointState, match="missing"):
        await tokens.get("sha256-" + "0" * 64)


async def test_snapshot_validates_under_its_own_checkpoint(tokens) -> None:
    a, b = await tokens.put([1]), await tokens.put([2, 3], [-1.0, -2.0])
    ref = await tokens.snapshot("ck-1", [a.blob_id, b.blob_id, a.blob_id])
    assert set(ref) == {"checkpoint_id", "snapshot_id", "digest"} and ref["checkpoint_id"] == "ck-1"
    await tokens.validate(ref, "ck-1")
    assert await tokens.snapshot("ck-1", [b.blob_id, a.blob_id]) == ref  # order and repeats do not matter


async def test_validate_refuses_a_snapshot_of_another_checkpoint(tokens) -> None:
    a = await tokens.put([1])
    ref = await tokens.snapshot("ck-1", [a.blob_id])
    other = await tokens.snapshot("ck-2", [a.blob_id])
    with pytest.raises(InvalidCheckpointState, match="ck-1"):
        await tokens.validate(ref, "ck-2")
    # A forged ref that names ck-2 but points at ck-1's snapshot row is refused by the row itself.
    with pytest.raises(InvalidCheckpointState, match="belongs to checkpoint ck-1"):
        await tokens.validate({**other, "snapshot_id": ref["snapshot_id"]}, "ck-2")


async def test_validate_refuses_a_rewritten_digest_a_missing_blob_and_a_wrong_snapshot_digest(tokens) -> None:
    a, b = await tokens.put([1, 2]), await tokens.put([3], [-0.5])
    ref = await tokens.snapshot("ck-1", [a.blob_id, b.blob_id])
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await tokens.validate({**ref, "digest": "0" * 64}, "ck-1")
    await tamper(tokens, a.blob_id)  # the tokens only: publish reads digests, not tokens ...
    await tokens.validate(ref, "ck-1")
    for check in (tokens.get(a.blob_id), tokens.validate(ref, "ck-1", deep=True)):  # ... every read re-hashes
        with pytest.raises(InvalidCheckpointState, match=a.blob_id):
            await check
    await tamper(tokens, a.blob_id, digest=token_digest(TokenArray((9, 9))))  # tokens and digest rewritten
    with pytest.raises(InvalidCheckpointState, match=f"{a.blob_id} does not match its digest"):
        await tokens.validate(ref, "ck-1")
    only_b = await tokens.snapshot("ck-2", [b.blob_id])
    await delete(tokens, b.blob_id)
    with pytest.raises(InvalidCheckpointState, match="missing"):
        await tokens.validate(only_b, "ck-2")


async def test_snapshot_refuses_a_missing_blob(tokens) -> None:
    with pytest.raises(InvalidCheckpointState, match="missing"):
        await tokens.snapshot("ck-1", ["sha256-" + "1" * 64])


class CountingReads:
    """Counts the blobs a snapshot's validation reads, their digests or their tokens, around the
    store's own methods."""

    def __init__(self, store) -> None:
        self.count = 0
        for name in ("_load_blobs", "_blob_digests"):
            setattr(store, name, self._counted(getattr(store, name)))

    def _counted(self, inner):
        async def read(blob_ids: list[str]):
            self.count += len(blob_ids)
            return await inner(blob_ids)
        return read


async def test_the_tenth_chained_snapshot_validates_no_more_blobs_than_the_first(tokens) -> None:
    reads = CountingReads(tokens)
    parent, per_publish = None, []
    for k in range(1, 11):  # each checkpoint of a run adds two calls' blobs
        new = [(await tokens.put([k, 1])).blob_id, (await tokens.put([k, 2], [-0.5, -0.25])).blob_id]
        ref = await tokens.snapshot(f"ck-{k}", new, parent=parent)
        before = reads.count
        await tokens.validate(ref, f"ck-{k}")
        per_publish.append(reads.count - before)
        parent = ref
    assert per_publish == [2] * 10
    before = reads.count
    await tokens.validate(parent, "ck-10", deep=True)  # the audit still reaches every blob of the chain
    assert reads.count - before == 20


async def test_a_chained_snapshot_is_refused_when_its_parent_is_altered(tokens) -> None:
    a, b = await tokens.put([1]), await tokens.put([2])
    root = await tokens.snapshot("ck-1", [a.blob_id])
    child = await tokens.snapshot("ck-2", [b.blob_id], parent=root)
    assert child["digest"] != (await tokens.snapshot("ck-2", [b.blob_id]))["digest"]  # the parent is in the digest
    with pytest.raises(InvalidCheckpointState, match="does not match its digest"):
        await tokens.snapshot("ck-3", [], parent={**root, "digest": "0" * 64})  # a forged parent is not extended
    with pytest.raises(InvalidCheckpointState, match="same checkpoint"):
        await tokens.snapshot("ck-1", [], parent=root)
    await tamper(tokens, a.blob_id)  # a parent blob edited after the parent was published
    await tokens.validate(child, "ck-2")  # publish checks what this cut added ...
    with pytest.raises(InvalidCheckpointState, match=a.blob_id):
        await tokens.validate(child, "ck-2", deep=True)  # ... the audit walks the chain and finds it
