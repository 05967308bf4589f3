"""A deterministic stand-in for a model that plays the registered environments.

It is a pure function of (messages, tools, seed): tool-call ids and its occasional mistakes come
from hashes of the inputs, never from global random state, so a replayed or resumed rollout gets
byte-identical replies. It plays well but not perfectly, so rewards vary and mean something. It
recognises the environment from the tool names and the prompt text only, the way a model would:
each registered environment's `scripted` player (participants/environments/players.py) says whether
a request is its own and how to play it, so adding an environment needs no edit here.
"""

from __future__ import annotations

import hashlib
import json
import re

from participants.environments import ENVIRONMENTS
from participants.environments.players import STRING, Answer, Call, Player, _history

MAX_TOOL_CALLS = 12  # a scripted agent that is confused should stop, not loop
_TOKEN = re.compile(r"\s*(?:[A-Za-z]+|\d{1,3}|[^\sA-Za-z\d])|\s+")


def players() -> list[Player]:
    """Every registered environment's player, in the order they are asked (the string one last)."""
    found = {id(p): p for cls in ENVIRONMENTS.values() if (p := getattr(cls, "scripted", None)) is not None}
    return sorted([*found.values(), *([] if id(STRING) in found else [STRING])], key=lambda p: p.priority)


def scripted_reply(messages: list[dict], tools: list[dict], seed: int) -> dict:
    tool_names = {t.get("function", {}).get("name") for t in tools}
    prompt = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
    history = _history(messages)
    if len(history) >= MAX_TOOL_CALLS:
        action: Call | Answer = Answer("I have made too many tool calls and will stop here.")
    else:
        player = next(p for p in players() if p.recognizes(tool_names, prompt))
        action = player.move(prompt, history, tools, seed)
    if isinstance(action, Answer):
        return {"role": "assistant", "content": action.text}
    digest = hashlib.sha256(json.dumps([messages, tools, seed], sort_keys=True, default=str).encode()).hexdigest()
    call = {"id": f"call_{digest[:24]}", "type": "function",
            "function": {"name": action.name, "arguments": json.dumps(action.arguments, sort_keys=True)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def scripted_tokens(text: str | None) -> list[str]:
    """Token-like pieces (a word or up to 3 digits with its leading space); they join back to ``text``."""
    return _TOKEN.findall(text or "")
