"""Publish only after the framework's state reference and the token-store snapshot validate under the
same checkpoint id; a published checkpoint can still be restored."""

from __future__ import annotations

import pytest

from adapters.memory_store import MemoryEventStore
from adapters.token_store import MemoryTokenStore
from engine.checkpoint import committed_event, make_cut
from engine.coordinator import Coordinator
from engine.errors import InvalidCheckpointState, InvalidPhase
from engine.events import AppendRequest
from engine.phases import CheckpointPhases, checkpoint_started


@pytest.fixture
def store(memory_store: MemoryEventStore) -> MemoryEventStore:
    """This module's rules promise no durability: its log is in memory (docs/testing.md)."""
    return memory_store


async def committed(store: MemoryEventStore, ck: str) -> None:
    phases = CheckpointPhases(ck)
    await store.append(AppendRequest((checkpoint_started(ck), phases.fire("prepared"))))
    cut = await make_cut(store, ck, scope=[], restarts=[])
    await store.append(AppendRequest((committed_event(cut),)))


@pytest.fixture
def tokens(memory_tokens: MemoryTokenStore) -> MemoryTokenStore:
    return memory_tokens


async def test_publish_records_both_references_when_they_validate(store, tokens) -> None:
    await committed(store, "ck-p")
    receipt = await tokens.put([72, 101], [-0.5, -0.25])
    ref = await tokens.snapshot("ck-p", [receipt.blob_id])
    await Coordinator(store, []).publish("ck-p", {"checkpoint_id": "ck-p", "uri": "s3://run/ck-p"}, ref, tokens)
    last = (await store.read_stream("checkpoint:ck-p"))[-1]
    assert last.kind == "checkpoint_published"
    assert last.data["framework_ref"]["uri"] == "s3://run/ck-p" and last.data["token_snapshot_ref"] == ref


@pytest.mark.parametrize("bad", ["framework ref of another checkpoint", "token snapshot of another checkpoint",
                                 "token snapshot with a forged digest", "no token snapshot"])
async def test_publish_refuses_references_that_do_not_validate_and_writes_nothing(store, tokens, bad) -> None:
    await committed(store, "ck-q")
    await committed(store, "ck-other")
    receipt = await tokens.put([97, 98])
    framework = {"checkpoint_id": "ck-q"}
    token_ref = await tokens.snapshot("ck-q", [receipt.blob_id])
    if bad == "framework ref of another checkpoint":
        framework = {"checkpoint_id": "ck-other"}
    elif bad == "token snapshot of another checkpoint":
        token_ref = await tokens.snapshot("ck-other", [receipt.blob_id])
    elif bad == "token snapshot with a forged digest":
        token_ref = {**token_ref, "digest": "0" * 64}
    else:
        token_ref = {}
    head = await store.head()
    with pytest.raises(InvalidCheckpointState):
        await Coordinator(store, []).publish("ck-q", framework, token_ref, tokens)
    assert await store.head() == head
    assert (await store.read_stream("checkpoint:ck-q"))[-1].kind == "checkpoint_committed"


async def test_a_checkpoint_that_was_never_committed_cannot_be_published(store, tokens) -> None:
    await store.append(AppendRequest((checkpoint_started("ck-r"),)))
    ref = await tokens.snapshot("ck-r", [])
    with pytest.raises(InvalidPhase):
        await Coordinator(store, []).publish("ck-r", {"checkpoint_id": "ck-r"}, ref, tokens)
