"""What an agent leaves in the log when its activation completes, for tests that drive the resources
server's verify without an agent: the resources server verifies the answer the log holds."""

from __future__ import annotations

from typing import Any

from engine.catalog import ACTIVATION_COMPLETED, AGENT_BOUNDARY
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream
from engine.log import EventStore


async def answered(store: EventStore, rollout_id: str, final_answer: str | None, attempt: int = 0,
                   messages: list[dict[str, Any]] | None = None) -> None:
    """The agent's last boundary (with the conversation) and its activation's completion."""
    stream = agent_stream(rollout_id, attempt)
    conversation = messages if messages is not None else [{"role": "assistant", "content": final_answer}]
    await store.append(AppendRequest((
        NewEvent(stream, AGENT_BOUNDARY, {"turn": 1, "messages": conversation, "state": "after_turn"}, rollout_id, attempt),
        NewEvent(stream, ACTIVATION_COMPLETED, {"index": 0, "reply": {"final_answer": final_answer, "turns": 1}},
                 rollout_id, attempt),
    )))
