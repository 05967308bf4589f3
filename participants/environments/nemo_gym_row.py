"""A NeMo Gym data row as NeMo Gym's own agent puts it to the model: its messages, tools and sampling.

`responses_create_params` is a Responses-API request. NeMo Gym's `simple_agent` sends it to
`vllm_model`, which turns it into a chat-completions request; rollbook's agent sends chat
completions, so the same turning happens here, once, for every relayed environment:

- `input` (a string is one user message) as vllm_model turns it into chat messages, with the one
  conversion `/v1/responses` uses too (adapters.openai_wire.responses_messages): `instructions` and
  the leading system and developer messages become one system message; earlier function calls and
  their outputs become assistant tool calls and tool messages; a reasoning item opens the model's
  turn in think tags; a message's text parts are joined, a user message's images and videos kept as
  chat parts; a part of any other kind (a file) is refused, not dropped.
- the function tools, as chat-completions tools;
- `temperature`, `top_p`, `max_output_tokens` (as `max_tokens`), `tool_choice` and
  `parallel_tool_calls`, sent with every model call of the rollout and recorded with each.
"""

from __future__ import annotations

from typing import Any

from adapters.openai_wire import responses_messages
from engine.errors import UnsupportedParameter
from participants.environments.base import ToolError


def chat_tools(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's Responses-API function tools as the chat-completions tools the agent offers."""
    out = []
    for t in row["responses_create_params"].get("tools") or []:
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str):
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            out.append({"type": "function", "function": fn})
    return out


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a rollout of `row` opens with, as NeMo Gym's vllm_model turns its input into chat
    messages (adapters.openai_wire.responses_messages). ToolError ("bad_row") for what no chat message holds."""
    params = row["responses_create_params"]
    instructions = params.get("instructions") if isinstance(params.get("instructions"), str) else None
    try:
        messages = responses_messages(params.get("input") or [], instructions)
    except UnsupportedParameter as exc:
        raise ToolError("bad_row", f"responses_create_params.{exc.detail}") from None
    if not messages:  # scicode's rows: its own agent writes the prompt from the row's other fields
        raise ToolError("bad_row", "responses_create_params.input is empty: the row holds no message to send the "
                                   "model (a server whose own agent writes the prompt needs that agent)")
    return messages


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
