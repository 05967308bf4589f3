"""The OpenAI chat-completions wire format the model server speaks, with rollbook's custody
facts under a `rollbook` key beside the standard fields (clients that do not know it ignore it).

Streaming sends one chunk per generated token with the token under `rollbook.token` and an
empty delta, then one final chunk whose delta is the whole message: tokens are pieces of the
serialized message, so only the finished message is a well-formed delta.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from adapters.scripted_policy import scripted_tokens


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """An OpenAI function tool: `{"type": "function", "function": {"name", ...}}`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    """The OpenAI body; fields we do not read (temperature, max_tokens...) pass through to the backend."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)

    def payload(self) -> dict[str, Any]:
        """The body as the backend sees it: messages and tools exactly as the client sent them."""
        out = self.model_dump()
        out["messages"] = [m.model_dump(exclude_unset=True) for m in self.messages]
        out["tools"] = [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools is not None else None
        return out


class ChatCompletion(BaseModel):
    """The reply of a non-streaming call (a streaming one is text/event-stream)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


def count_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A count of token-like pieces; the scripted tokenizer is the only one this server knows."""
    total = 0
    for m in messages:
        content = m.get("content")
        total += len(scripted_tokens(content if isinstance(content, str) else json.dumps(content)))
    return total


def finish_reason(message: dict[str, Any]) -> str:
    return "tool_calls" if message.get("tool_calls") else "stop"


def _rollbook_info(call_id: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"call_id": call_id, "disposition": result.get("disposition"), "receipt": result.get("receipt"),
            "policy_version": result.get("policy_version")}


def _chunk(call_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def sse(value: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(value)}\n\n".encode()


def completion_body(call_id: str, model: str, result: dict[str, Any], prompt_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI chat.completion object for a completed call, with our custody facts beside it."""
    message = result["reply"]
    completion = int(result.get("tokens") or result["receipt"]["tokens"])
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(message)}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion},
        "rollbook": _rollbook_info(call_id, result),
    }


def token_chunk(call_id: str, model: str, created: int, token: str, index: int) -> dict[str, Any]:
    chunk = _chunk(call_id, model, created, {}, None)
    chunk["rollbook"] = {"token": token, "index": index}
    return chunk


def final_chunk(call_id: str, model: str, created: int, result: dict[str, Any]) -> dict[str, Any]:
    message = result["reply"]
    delta = (
        {**message, "tool_calls": [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]}
        if message.get("tool_calls")
        else dict(message)
    )
    chunk = _chunk(call_id, model, created, delta, finish_reason(message))
    chunk["rollbook"] = _rollbook_info(call_id, result)
    return chunk
