"""A NeMo Gym data row as NeMo Gym's own agent puts it to the model: its messages, tools and sampling.

`responses_create_params` is a Responses-API request. NeMo Gym's `simple_agent` sends it to
`vllm_model`, which turns it into a chat-completions request; rollbook's agent sends chat
completions, so the same turning happens here, once, for every relayed environment:

- `instructions`, then every message item of `input` (a string `input` is one user message), each
  with its own role: system, developer, user and assistant messages stay apart, as they were written.
  A message's content is a string or a list of text parts (`input_text`, `output_text`, `text`),
  joined; a part of any other kind (an image, a file) is refused, not dropped. Items that are not
  messages (earlier function calls and their outputs) are not sent.
- the function tools, as chat-completions tools;
- `temperature`, `top_p`, `max_output_tokens` (as `max_tokens`), `tool_choice` and
  `parallel_tool_calls`, sent with every model call of the rollout and recorded with each.
"""

from __future__ import annotations

from typing import Any

from participants.environments.base import ToolError

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_tools(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's Responses-API function tools as the chat-completions tools the agent offers."""
    out = []
    for t in row["responses_create_params"].get("tools") or []:
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str):
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            out.append({"type": "function", "function": fn})
    return out


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a rollout of `row` opens with. ToolError ("bad_row") for content no chat message holds."""
    params = row["responses_create_params"]
    raw = params.get("input")
    out = [{"role": "system", "content": params["instructions"]}] if isinstance(params.get("instructions"), str) else []
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    for n, item in enumerate(raw or []):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
            continue
        out.append({"role": item["role"], "content": _text(item.get("content"), n)})
    return out


def _text(content: Any, n: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content if isinstance(content, list) else [content]:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ToolError("bad_row", f"responses_create_params.input[{n}]: a content part of type {kind!r} cannot be "
                                       "sent as chat text (only input_text, output_text and text parts can)")
        texts.append(part["text"])
    return "\n\n".join(texts)


def row_sampling(row: dict[str, Any]) -> dict[str, Any]:
    """The row's sampling parameters, as chat-completions names them."""
    params = row["responses_create_params"]
    out = {k: params[k] for k in ("temperature", "top_p", "parallel_tool_calls") if params.get(k) is not None}
    if params.get("max_output_tokens") is not None:
        out["max_tokens"] = params["max_output_tokens"]
    choice = params.get("tool_choice")
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    return out
