"""A deterministic stand-in for a model that plays the registered environments, and its backend.

It is a pure function of (messages, tools, seed): tool-call ids and its occasional mistakes come
from hashes of the inputs, never from global random state, so a replayed or resumed rollout gets
byte-identical replies. It plays well but not perfectly, so rewards vary and mean something. It
recognises the environment from the tool names and the prompt text only, the way a model would:
each registered environment's `scripted` player (participants/environments/players.py) says whether
a request is its own and how to play it, so adding an environment needs no edit here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from adapters import scripted_tokenizer as tok
from engine.errors import UnsupportedParameter
from engine.tokens import f32
from participants.environments import ENVIRONMENTS
from participants.environments.players import (
    PYTHON_TOOL,
    STRING,
    Answer,
    Call,
    Player,
    _history,
    _transcript,
    schema_value,
    tagged_answer,
    text_of,
)
from participants.model.backends import (
    BackendSettings,
    End,
    Event,
    Prefix,
    Start,
    Step,
    max_tokens,
)

MAX_TOOL_CALLS = 12  # a scripted agent that is confused should stop, not loop


def players() -> list[Player]:
    """Every registered environment's player, in the order they are asked (the string one last), and
    the player of a harness's own Python tool, whatever the environment."""
    found = {id(p): p for cls in ENVIRONMENTS.values() for p in _tuple(getattr(cls, "scripted", None))}
    always = [p for p in (STRING, PYTHON_TOOL) if id(p) not in found]
    return sorted([*found.values(), *always], key=lambda p: p.priority)


def _tuple(scripted: Player | tuple[Player, ...] | None) -> tuple[Player, ...]:
    return scripted if isinstance(scripted, tuple) else () if scripted is None else (scripted,)


def scripted_reply(messages: list[dict], tools: list[dict], seed: int) -> dict:
    tool_names = {t.get("function", {}).get("name") for t in tools}
    prompt = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    history = _history(messages) or _transcript(messages)
    if len(history) >= MAX_TOOL_CALLS:
        action: Call | Answer = Answer("I have made too many tool calls and will stop here.")
    else:
        player = next(p for p in players() if p.recognizes(tool_names, prompt))
        action = player.move(prompt, history, tools, seed)
        if player is STRING and not tool_names - {None}:
            action = tagged_answer(messages, seed) or action
    if isinstance(action, Answer):
        return {"role": "assistant", "content": action.text}
    digest = hashlib.sha256(json.dumps([messages, tools, seed], sort_keys=True, default=str).encode()).hexdigest()
    call = {"id": f"call_{digest[:24]}", "type": "function",
            "function": {"name": action.name, "arguments": json.dumps(action.arguments, sort_keys=True)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}



def _output_schema(request: dict[str, Any]) -> Any:
    """The JSON schema the reply must hold: False for free text, {} for any JSON object, None for a
    response_format the scripted model cannot honour."""
    fmt = request.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return False
    if kind == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return schema if isinstance(schema, dict) else None


def _stops(request: dict[str, Any]) -> list[str]:
    stop = request.get("stop")
    return [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]


class ScriptedBackend:
    """Deterministic: the reply is scripted_reply(messages, tools, seed), emitted token by token with
    the ids and logprobs of adapters.scripted_tokenizer. It is greedy: `temperature` and `top_p` do
    not change its choice (they are recorded with the call), `max_tokens` / `max_completion_tokens`
    and `stop` are honoured; a `response_format` json_schema is answered with a value of its schema
    (`players.schema_value`), json_object with an object, any other is refused.

    `latency_s` is paid once before the first token, `token_latency_s` before each step, so tests
    can hold a call in flight long enough to cut it."""

    def __init__(self, latency_s: float = 0.0, token_latency_s: float = 0.0, policy_version: str = "scripted-v1") -> None:
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        self.policy_version = policy_version
        self.model = "scripted"
        self.generations = 0  # generations started, so tests can see a stored reply was not regenerated
        self.tokens_generated = 0

    @classmethod
    def from_settings(cls, s: BackendSettings) -> ScriptedBackend:
        return cls(latency_s=s.latency_s, token_latency_s=s.token_latency_s, policy_version=s.policy_version or "scripted-v1")

    def check(self, request: dict[str, Any]) -> None:
        if _output_schema(request) is None:
            fmt = request.get("response_format")
            raise UnsupportedParameter(
                f"response_format {fmt!r} cannot be honoured by the scripted backend (it answers a json_schema with "
                "a schema and json_object); use the openai_compatible backend", param="response_format")

    def reply(self, request: dict[str, Any]) -> dict[str, Any]:
        seed = request.get("seed")
        messages = list(request.get("messages") or [])
        schema = _output_schema(request)
        if schema not in (False, None):  # structured output, as a judge asks for it: a value of its schema
            prompt = next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
            return {"role": "assistant", "content": json.dumps(schema_value(schema, prompt), sort_keys=True)}
        return scripted_reply(messages, list(request.get("tools") or []), int(seed or 0))

    def plan(self, request: dict[str, Any]) -> tuple[list[int], list[Step], str]:
        """The whole generation: prompt ids, the steps, the finish reason."""
        message = self.reply(request)
        prompt = tok.prompt_ids(list(request.get("messages") or []), list(request.get("tools") or []) or None)
        ctx = tok.prompt_digest(prompt)
        pieces = tok.reply_pieces(message)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not message.get("tool_calls"):
            pieces = _before_stop(pieces, message.get("content") or "", _stops(request))
        limit = max_tokens(request)
        if limit is not None and sum(len(p.ids) for p in pieces) > limit:
            pieces, finish = _within(pieces, limit), "length"
        top = int(request.get("top_logprobs") or 0)
        steps, pos = [], 0
        for p in pieces:
            scored = [tok.token_logprobs(ctx, pos + j, i, top) for j, i in enumerate(p.ids)]
            pos += len(p.ids)
            steps.append(Step(p.ids, tuple(f32(lp) for lp, _ in scored), p.delta,
                              tuple(tuple((a, f32(x)) for a, x in alts) for _, alts in scored)))
        return prompt, steps, finish

    async def generate(self, request: dict[str, Any], prefix: Prefix | None) -> AsyncIterator[Event]:
        prompt, steps, finish = self.plan(request)
        continuation = None
        if prefix is not None:
            continuation, steps = _continue(prompt, steps, prefix)
        self.generations += 1
        yield Start(tuple(prompt), continuation)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        for step in steps:
            if self.token_latency_s:
                await asyncio.sleep(self.token_latency_s)
            self.tokens_generated += len(step.ids)
            yield step
        yield End(finish, None)


def _before_stop(pieces: list[tok.Piece], content: str, stops: list[str]) -> list[tok.Piece]:
    """The pieces that end before the first stop sequence in the content (all of them if none)."""
    found = [content.find(s) for s in stops if s in content]
    if not found:
        return pieces
    cut_at, end, kept = min(found), 0, []
    for p in pieces:
        end += len(p.delta.get("content", ""))
        if end > cut_at or not p.delta:
            break
        kept.append(p)
    return kept


def _within(pieces: list[tok.Piece], limit: int) -> list[tok.Piece]:
    """The pieces that fit in `limit` tokens, the last one cut to fit."""
    kept: list[tok.Piece] = []
    n = 0
    for p in pieces:
        if n + len(p.ids) > limit:
            part = p.ids[: limit - n]
            if part:
                kept.append(tok.Piece(part, _partial_delta(p.delta, part)))
            break
        kept.append(p)
        n += len(p.ids)
    return kept


def _partial_delta(delta: dict[str, Any], ids: tuple[int, ...]) -> dict[str, Any]:
    text = tok.decode(ids)
    if "content" in delta:
        return {"content": text}
    if delta.get("tool_calls") and "arguments" in (delta["tool_calls"][0].get("function") or {}) and len(delta["tool_calls"][0]["function"]) == 1:
        return {"tool_calls": [{"index": delta["tool_calls"][0]["index"], "function": {"arguments": text}}]}
    return dict(delta)


def _continue(prompt: list[int], steps: list[Step], prefix: Prefix) -> tuple[dict[str, Any], list[Step]]:
    """A deterministic backend continues a prefix by regenerating and checking it is a prefix of the
    same generation at a step boundary; if it is not (another policy, another prompt), it regenerates."""
    n, covered, k = len(prefix.ids), 0, 0
    while k < len(steps) and covered < n:
        covered += len(steps[k].ids)
        k += 1
    flat = tuple(i for s in steps[:k] for i in s.ids)
    if tuple(prompt) != prefix.prompt_token_ids:
        reason = "the stored prefix was generated for another prompt"
    elif covered != n:
        reason = f"the stored prefix of {n} tokens ends inside a step (the step ends at {covered})"
    elif flat != prefix.ids:
        reason = "the stored prefix is not a prefix of this generation"
    else:
        return {"mode": "continued", "prefix_tokens": n}, steps[k:]
    return {"mode": "regenerated", "reason": reason}, steps
