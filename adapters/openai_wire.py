"""The OpenAI wire, in one module: chat completions as the model server speaks them (requests,
replies, streamed chunks), streamed deltas assembled into a message as a client assembles them (the
model server and the upstream backend both do), and a trajectory as a Responses-API object (what
NeMo Gym's verifiers read). rollbook's custody facts go under a `rollbook` key beside the standard
fields (clients that do not know it ignore it).

Streaming sends a role chunk, then one chunk per generated step with its real delta (content text
or a piece of a tool call) as it is generated, then a chunk with the finish reason, then (with
`stream_options.include_usage`) a usage chunk, then `[DONE]`. Logprobs, when asked for, are in
OpenAI's shape (`choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs}`) with each
token written as vLLM writes it under `return_tokens_as_token_ids`: "token_id:N".

A stream cut by a checkpoint ends with an `error` event ({"error": {"message", "type", "code"}}),
which the OpenAI SDK raises, and no `[DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import RollbookError, UnsupportedParameter

SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "logprobs", "top_logprobs",
            "response_format", "presence_penalty", "frequency_penalty")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


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
    """The OpenAI body. Sampling parameters pass through to the backend; unknown fields too (an
    upstream may know them); a parameter that cannot be honoured is refused (400)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _honourable(self) -> ChatRequest:
        if self.n not in (None, 1):
            raise UnsupportedParameter(f"n={self.n} is not supported: the model server generates one choice per call "
                                       "(one custody record per call); send n separate calls", param="n")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options is only allowed when stream is true", param="stream_options")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameter("top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def backend_request(self) -> dict[str, Any]:
        """What the backend gets: everything but the transport options, which the server owns."""
        return self.model_dump(exclude_none=True, exclude={"stream", "stream_options", "n"})

    def sampling(self) -> dict[str, Any]:
        # Only these keys serialized: a dump of the whole body (its messages and tool schemas) cost more.
        return self.model_dump(include=set(SAMPLING), exclude_none=True)


class ChatCompletion(BaseModel):
    """The reply of a non-streaming call (a streaming one is text/event-stream)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


def sse(value: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(value)}\n\n".encode()


def logprob_entries(ids: list[int], logprobs: list[float], tops: list[Any] | None = None) -> list[dict[str, Any]]:
    tops = tops or []
    return [
        {"token": f"token_id:{i}", "logprob": lp, "bytes": None,
         "top_logprobs": [{"token": f"token_id:{a}", "logprob": x, "bytes": None} for a, x in (tops[k] if k < len(tops) else ())]}
        for k, (i, lp) in enumerate(zip(ids, logprobs, strict=True))
    ]


def rollbook_info(call_id: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"call_id": call_id, "disposition": result.get("disposition"), "receipt": result.get("receipt"),
            "prompt_receipt": result.get("prompt_receipt"), "policy_version": result.get("policy_version"),
            "continuation": result.get("continuation")}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_body(call_id: str, model: str, result: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The OpenAI chat.completion object for a completed call, with our custody facts beside it."""
    choice: dict[str, Any] = {"index": 0, "message": result["reply"], "finish_reason": result.get("finish_reason") or "stop",
                              "logprobs": None if logprobs is None else {"content": logprobs}}
    return {
        "id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [choice], "usage": result.get("usage") or usage(0, int(result.get("tokens") or 0)),
        "rollbook": rollbook_info(call_id, result),
    }


def chunk(call_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
          logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                              "logprobs": None if logprobs is None else {"content": logprobs}}
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def whole_delta(message: dict[str, Any]) -> dict[str, Any]:
    """A stored reply sent as one delta (a repeat or a linked call: it was generated before)."""
    delta: dict[str, Any] = {"content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
    return delta


def usage_chunk(call_id: str, model: str, created: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": result.get("usage")}


def error_event(error: RollbookError, **rollbook: Any) -> dict[str, Any]:
    """An SSE error event in OpenAI's shape; the SDK raises it (openai.APIError) mid-iteration."""
    body = {"error": {"message": error.detail, "type": error.code, "code": error.code, "param": None}}
    if rollbook:
        body["rollbook"] = rollbook
    return body


def models_body(model: str, policy_version: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rollbook",
                                        "rollbook": {"policy_version": policy_version}}]}


# ---- a streamed reply assembled, as an OpenAI client assembles it ---------------------------


def merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    """Fold one chat-completions delta into an assistant message (content concatenated, tool calls
    merged by index), the way an OpenAI client assembles a stream."""
    if delta.get("content"):
        message["content"] = (message.get("content") or "") + delta["content"]
    for tc in delta.get("tool_calls") or []:
        calls = message.setdefault("tool_calls", [])
        index = int(tc.get("index", 0))
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        slot = calls[index]
        slot["id"] = tc.get("id") or slot["id"]
        slot["type"] = tc.get("type") or slot["type"]
        fn = tc.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        slot["function"]["arguments"] += fn.get("arguments") or ""


def final_message(partial: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": partial.get("content") or None}
    if partial.get("tool_calls"):
        out["tool_calls"] = [dict(c) for c in partial["tool_calls"]]
    return out


def partial_message(partial: dict[str, Any]) -> dict[str, Any]:
    """The cut reply as the final assistant message of a continuation request: its text so far and,
    when the cut fell inside a tool call, that call as far as it got (an upstream that renders the
    message needs both to know where it stands). The text a chat template would render for a partial
    tool call is not something rollbook can know, so exactness rests on `required_prefix_token_ids`
    and the check of the upstream's prompt ids, never on this rendering."""
    out: dict[str, Any] = {"role": "assistant", "content": partial.get("content") or ""}
    if partial.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": dict(c.get("function") or {})} for c in partial["tool_calls"]]
    return out


# ---- the trajectory as the Responses API shows it ------------------------------------------


def responses_output(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's turns after its input, as Responses-API output items (what NeMo Gym verifiers read)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                out.append({"type": "function_call", "id": f"fc_{tc.get('id')}", "call_id": tc.get("id"),
                            "name": fn.get("name"), "arguments": fn.get("arguments") or "{}", "status": "completed"})
            if m.get("content"):
                out.append({"type": "message", "id": f"msg_{i}", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": m["content"], "annotations": []}]})
        elif role == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id"), "output": m.get("content")})
    return out


def responses_object(rollout_id: str, messages: list[dict[str, Any]], usage: dict[str, Any],
                     created_at: float) -> dict[str, Any]:
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion_tokens = int(usage.get("completion_tokens") or 0)
    return {
        "id": f"resp_{rollout_id}", "object": "response", "created_at": int(created_at), "model": "rollbook",
        "status": "completed", "output": responses_output(messages), "parallel_tool_calls": False,
        "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
