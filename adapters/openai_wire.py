"""The OpenAI wire, in one module: chat completions as the model server speaks them (requests,
replies, streamed chunks), streamed deltas assembled into a message as a client assembles them (the
model server and the upstream backend both do), and a trajectory as a Responses-API object (what
NeMo Gym's verifiers read), and NeMo Gym's Responses-API requests as one chat call each, with their
replies as Responses objects. rollbook's custody facts go under a `rollbook` key beside the standard
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

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

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
    _backend_request: dict[str, Any] | None = PrivateAttr(default=None)

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
        """What the backend gets: everything but the transport options, which the server owns. Dumped
        once per body: the model server reads it for its check, its digest and the call, and none of
        them changes it (a dump of the messages and 27 tool schemas was 7 % of that server's CPU)."""
        if self._backend_request is None:
            self._backend_request = self.model_dump(exclude_none=True, exclude={"stream", "stream_options", "n"})
        return self._backend_request

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


# ---- NeMo Gym's Responses-API subset, as its vllm_model serves it over chat completions ---------

RESPONSES_IGNORED = frozenset({"metadata", "store", "user", "service_tier", "include_obfuscation"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_image", "input_video"})


class ResponsesRequest(BaseModel):
    """A `POST /v1/responses` body. It becomes one chat-completions call (`chat_request`), so a
    Responses call has a chat call's custody; what has no chat form is refused (400
    `unsupported_parameter`), never dropped, except the bookkeeping fields in RESPONSES_IGNORED."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    reasoning: dict[str, Any] | None = None
    stream: bool = False

    def chat_request(self) -> ChatRequest:
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None and k not in RESPONSES_IGNORED}
        if extra:
            raise UnsupportedParameter(f"{sorted(extra)} have no chat-completions form on this server", param=sorted(extra)[0])
        if self.stream:
            raise UnsupportedParameter("stream: /v1/responses answers with the whole response; stream "
                                       "/v1/chat/completions instead", param="stream")
        body: dict[str, Any] = {"messages": responses_messages(self.input, self.instructions)}
        body.update({k: v for k, v in (("model", self.model), ("temperature", self.temperature), ("top_p", self.top_p),
                                       ("max_tokens", self.max_output_tokens), ("seed", self.seed)) if v is not None})
        reasoning = {k: v for k, v in (self.reasoning or {}).items() if v is not None}
        if set(reasoning) - {"effort"}:  # as NeMo Gym's converter: only the effort has a chat form
            raise UnsupportedParameter(f"reasoning {sorted(set(reasoning) - {'effort'})} have no chat-completions form",
                                       param="reasoning")
        if "effort" in reasoning:
            body["reasoning_effort"] = reasoning["effort"]
        if self.tools:  # an empty list is no tools: vLLM refuses `"tools": []`
            body["tools"] = [_chat_tool(t) for t in self.tools]
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        choice = _chat_tool_choice(self.tool_choice)
        if choice is not None and self.tools:
            body["tool_choice"] = choice
        elif choice not in (None, "auto", "none"):
            raise UnsupportedParameter(f"tool_choice {self.tool_choice!r} needs at least one tool", param="tool_choice")
        return ChatRequest.model_validate(body)


class ResponsesReply(BaseModel):
    """The reply of a `/v1/responses` call (OpenAPI's view of `response_body`)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    status: Literal["completed", "incomplete"]
    output: list[dict[str, Any]]
    usage: dict[str, Any]


def responses_messages(items: str | list[dict[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """Responses input items as chat messages, as NeMo Gym's converter makes them: one turn of the
    model (its assistant messages and function calls, in a row) becomes one assistant message, its
    texts concatenated and its calls in order; a function call's output becomes a tool message; the
    instructions and the leading system or developer messages become one system message (chat
    templates take one, first); a reasoning item's summary opens the model's turn inside `<think>`
    tags. A user message's text parts are joined by a newline, as vLLM joins them for a chat template
    that takes text; one that holds an image or a video keeps its parts, as chat parts (`image_url`,
    `video_url`). Parts of any other kind, and images anywhere else, are refused."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the model's turn being gathered

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append({"role": "assistant", "content": turn["content"] or None,
                             **({"tool_calls": turn["tool_calls"]} if turn["tool_calls"] else {})})
        turn = None

    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise UnsupportedParameter(f"input[{n}]: an item must be an object, not {type(item).__name__}", param="input")
        kind = item.get("type") or ("message" if item.get("role") else None)
        role = item.get("role")
        if kind in ("function_call", "reasoning") or (kind == "message" and role == "assistant"):
            turn = turn or {"content": "", "tool_calls": []}
            if kind == "reasoning":
                turn["content"] += _thoughts(item, n)
            elif kind == "message":
                turn["content"] += "".join(_texts(item.get("content"), n)) if item.get("content") is not None else ""
            else:
                turn["tool_calls"].append({"id": item.get("call_id"), "type": "function",
                                           "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "message" and role == "user":
            flush()
            messages.append({"role": role, "content": _user_content(item.get("content"), n)})
        elif kind == "message" and role in ("system", "developer"):
            flush()
            messages.append({"role": role, "content": _texts(item.get("content"), n)})
        elif kind == "function_call_output":
            flush()
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _texts(item.get("output"), n)})
        elif kind == "message":
            raise UnsupportedParameter(f"input[{n}]: a message of role {role!r} has no chat form", param="input")
        else:
            raise UnsupportedParameter(f"input[{n}]: an item of type {kind!r} has no chat form on this server", param="input")
    flush()
    if instructions:  # a folded message's parts are concatenated, as NeMo Gym folds them
        leading = [instructions]
        while messages and messages[0]["role"] in ("system", "developer"):
            leading.append("".join(messages.pop(0)["content"]))
        messages.insert(0, {"role": "system", "content": "\n\n".join(leading)})
    for m in messages:
        if isinstance(m["content"], list) and all(isinstance(t, str) for t in m["content"]):
            m["content"] = "\n".join(m["content"])
    return messages


def _thoughts(item: dict[str, Any], n: int) -> str:
    """A reasoning item's summary texts, each in `<think>` tags, as NeMo Gym's converter hands a
    model's earlier reasoning back to it."""
    summary = item.get("summary") or []
    if not isinstance(summary, list) or not all(isinstance(s, dict) and isinstance(s.get("text"), str) for s in summary):
        raise UnsupportedParameter(f"input[{n}]: a reasoning item's summary must be a list of text parts", param="input")
    return "".join(f"<think>{s['text']}</think>" for s in summary if s["text"])


def _user_content(content: Any, n: int) -> str | list[Any]:
    """A user message's content: its texts (`_texts`), or, when it holds an image or a video, its
    parts as chat-completions parts (NeMo Gym's converter's `image_url` with its `detail`, `video_url`)."""
    parts = content if isinstance(content, list) else None
    if parts is None or not any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in parts):
        return _texts(content, n)
    out: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            field = "image_url" if kind == "input_image" else "video_url"
            url = part.get(field, part.get("video")) if kind == "input_video" else part.get(field)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise UnsupportedParameter(f"input[{n}]: an {kind} part needs a non-empty {field} (a file_id has "
                                           "no chat form)", param="input")
            if kind == "input_video":
                out.append({"type": "video_url", "video_url": {"url": url}})
            elif part.get("detail") == "original":
                raise UnsupportedParameter(f"input[{n}]: image detail 'original' has no chat form", param="input")
            else:
                out.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
        else:
            out.extend({"type": "text", "text": t} for t in _texts([part], n))
    return out


def _texts(content: Any, n: int) -> str | list[str]:
    """A content's text: a string as it is, a list of text parts as their texts."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content if isinstance(content, list) else [content]:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedParameter(f"input[{n}]: a content part of type {kind!r} cannot be sent as chat text "
                                       "(only input_text, output_text and text parts can, and images and "
                                       "videos in a user message)", param="input")
        texts.append(part["text"])
    return texts


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise UnsupportedParameter(f"a tool of type {tool.get('type')!r} has no chat form on this server", param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise UnsupportedParameter(f"tool_choice {choice!r} has no chat form on this server", param="tool_choice")


def response_body(call_id: str, model: str, request: ResponsesRequest, result: dict[str, Any],
                  tokens: tuple[list[int], list[int], list[float]]) -> dict[str, Any]:
    """A completed call as a Responses object: the reply's text as a message item, then one
    function_call item per tool call; the prompt's token ids, the generated ones and their logprobs
    on the last item, where NeMo Gym's vllm_model puts them (`prompt_token_ids`,
    `generation_token_ids`, `generation_log_probs`: NeMo Gym takes all three or none)."""
    reply = result["reply"]
    output: list[dict[str, Any]] = []
    calls = reply.get("tool_calls") or []
    if reply.get("content") or not calls:
        output.append({"type": "message", "id": f"msg_{call_id}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": reply.get("content") or "", "annotations": []}]})
    for tc in calls:
        fn = tc.get("function") or {}
        output.append({"type": "function_call", "id": tc.get("id"), "call_id": tc.get("id"), "name": fn.get("name"),
                       "arguments": fn.get("arguments") or "", "status": "completed"})
    output[-1].update(prompt_token_ids=tokens[0], generation_token_ids=tokens[1], generation_log_probs=tokens[2])
    used = result.get("usage") or usage(0, int(result.get("tokens") or 0))
    length = (result.get("finish_reason") or "stop") == "length"
    return {
        "id": f"resp_{call_id}", "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if length else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if length else None,
        "output": output, "instructions": request.instructions, "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": bool(request.parallel_tool_calls),
        "temperature": request.temperature, "top_p": request.top_p, "max_output_tokens": request.max_output_tokens,
        "usage": {"input_tokens": used["prompt_tokens"], "output_tokens": used["completion_tokens"],
                  "total_tokens": used["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "rollbook": rollbook_info(call_id, result),
    }
