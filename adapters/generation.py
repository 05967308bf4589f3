"""Generation backends: what produces the tokens behind the policy model server.

A backend streams token strings; the model server decides when to stop (a cut at a token
boundary) and what to keep. Both backends here share one reversible mapping between a reply and
its tokens, so the server turns any token list back into the assistant message the same way:

    tokens  = pieces of json.dumps(message, sort_keys=True)
    message = json.loads("".join(tokens))

`ScriptedBackend` splits that text with adapters.scripted_policy.scripted_tokens; the
OpenAI-compatible backend emits the same text as the upstream streams it (each upstream content
delta, JSON-escaped, is one token), so a prefix of either is a prefix of the serialized reply and
generation can continue after it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp

from adapters.scripted_policy import scripted_reply, scripted_tokens
from engine.errors import ReplayDivergence, RollbookError


class GenerationFailed(RollbookError):
    """The backend could not produce a reply (upstream error, malformed stream, bad output)."""

    code = "generation_failed"


class GenerationBackend(Protocol):
    policy_version: str

    def generate(self, request: dict[str, Any], prefix_tokens: list[str]) -> AsyncIterator[str]:
        """Yield the tokens that follow `prefix_tokens` (all of them when the prefix is empty)."""
        ...


def serialize_message(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True)


def message_tokens(message: dict[str, Any]) -> list[str]:
    return scripted_tokens(serialize_message(message))


def message_from_tokens(tokens: list[str]) -> dict[str, Any]:
    try:
        message = json.loads("".join(tokens))
    except json.JSONDecodeError as exc:
        raise GenerationFailed(f"the generated tokens are not a whole reply: {exc}") from exc
    if not isinstance(message, dict):
        raise GenerationFailed("the generated tokens are not an assistant message")
    return message


def _remainder(full: list[str], prefix: list[str], what: str) -> list[str]:
    if full[: len(prefix)] != prefix:
        raise ReplayDivergence(f"{what}: the stored prefix of {len(prefix)} tokens is not a prefix of this generation")
    return full[len(prefix) :]


class ScriptedBackend:
    """Deterministic: the reply is scripted_reply(messages, tools, seed), streamed token by token.

    `latency_s` is paid once before the first token, `token_latency_s` before each token, so tests
    can hold a call in flight long enough to cut it."""

    def __init__(self, latency_s: float = 0.0, token_latency_s: float = 0.0, policy_version: str = "scripted-v1") -> None:
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        self.policy_version = policy_version
        self.model = "scripted"
        self.generations = 0  # generations started, so tests can see a stored reply was not regenerated
        self.tokens_generated = 0

    def reply(self, request: dict[str, Any]) -> dict[str, Any]:
        seed = request.get("seed")
        return scripted_reply(list(request.get("messages") or []), list(request.get("tools") or []), int(seed or 0))

    def full_tokens(self, request: dict[str, Any]) -> list[str]:
        return message_tokens(self.reply(request))

    async def generate(self, request: dict[str, Any], prefix_tokens: list[str]) -> AsyncIterator[str]:
        rest = _remainder(self.full_tokens(request), list(prefix_tokens), "scripted generation")
        self.generations += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        for tok in rest:
            if self.token_latency_s:
                await asyncio.sleep(self.token_latency_s)
            self.tokens_generated += 1
            yield tok


_CONTENT_OPEN = '{"content": "'


def _clean_upstream_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as the model server stores it: role, content and any tool calls."""
    out: dict[str, Any] = {"content": msg.get("content"), "role": "assistant"}
    calls = msg.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "function": {"arguments": c.get("function", {}).get("arguments") or "", "name": c.get("function", {}).get("name")},
                "id": c.get("id"),
                "type": c.get("type") or "function",
            }
            for c in calls
        ]
    return out


def _trailer(content_started: bool, tool_calls: list[dict[str, Any]]) -> str:
    """The end of the serialized message after the last content delta; keys sort content < role < tool_calls."""
    text = '", "role": "assistant"' if content_started else '{"content": null, "role": "assistant"'
    if tool_calls:
        text += ', "tool_calls": ' + json.dumps(tool_calls, sort_keys=True)
    return text + "}"


class OpenAICompatibleBackend:
    """Any server with POST {base_url}/chat/completions (vLLM, SGLang, a hosted API).

    Upstream streaming (the default) gives real token boundaries to cut at. Continuing after a cut
    sends the partial reply as a final assistant message with vLLM's `continue_final_message`;
    without upstream streaming a continuation regenerates and must reproduce the prefix
    (deterministic sampling), else it fails with replay_divergence rather than splice two replies."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str = "default",
        policy_version: str | None = None,
        stream_upstream: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.policy_version = policy_version or model
        self.stream_upstream = stream_upstream
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created lazily inside the running loop: a session is bound to the loop that made it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _body(self, request: dict[str, Any], stream: bool) -> dict[str, Any]:
        body = {k: v for k, v in request.items() if v is not None and k not in ("stream", "stream_options")}
        body["model"] = self.model
        body["stream"] = stream
        return body

    async def _post(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            resp = await self.session.post(f"{self.base_url}/chat/completions", json=body, headers=headers)
        except aiohttp.ClientError as exc:
            raise GenerationFailed(f"the upstream model server did not answer: {exc}") from exc
        if resp.status != 200:
            detail = (await resp.text())[:300]
            resp.release()
            raise GenerationFailed(f"the upstream model server answered HTTP {resp.status}: {detail}", status=resp.status)
        return resp

    async def generate(self, request: dict[str, Any], prefix_tokens: list[str]) -> AsyncIterator[str]:
        prefix = list(prefix_tokens)
        joined = "".join(prefix)
        partial = _partial_content(joined) if self.stream_upstream else None
        if prefix and partial is None:
            # The prefix is whole (nothing to add) or not in the streaming form: regenerate and check.
            full = await self._complete_tokens(request) if not _is_whole(joined) else prefix
            for tok in _remainder(full, prefix, "upstream generation"):
                yield tok
            return
        if not self.stream_upstream:
            for tok in await self._complete_tokens(request):
                yield tok
            return
        body = self._body(request, stream=True)
        if prefix:
            body["messages"] = [*body.get("messages", []), {"role": "assistant", "content": partial}]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        async for tok in self._stream(body, content_started=bool(prefix)):
            yield tok

    async def _complete_tokens(self, request: dict[str, Any]) -> list[str]:
        resp = await self._post(self._body(request, stream=False))
        async with resp:
            try:
                payload = await resp.json()
                message = payload["choices"][0]["message"]
            except (aiohttp.ContentTypeError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                raise GenerationFailed(f"the upstream reply is not a chat completion: {exc!r}") from exc
        return message_tokens(_clean_upstream_message(message))

    async def _stream(self, body: dict[str, Any], content_started: bool) -> AsyncIterator[str]:
        resp = await self._post(body)
        calls: dict[int, dict[str, Any]] = {}
        async with resp:
            async for delta in _sse_deltas(resp):
                piece = delta.get("content")
                if piece:
                    if not content_started:
                        content_started = True
                        yield _CONTENT_OPEN
                    yield json.dumps(piece)[1:-1]  # JSON-escaped; escaping is per character, so pieces concatenate
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(int(tc.get("index", 0)), {"id": None, "type": "function", "name": "", "arguments": ""})
                    slot["id"] = tc.get("id") or slot["id"]
                    slot["type"] = tc.get("type") or slot["type"]
                    fn = tc.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
        tool_calls = [
            {"function": {"arguments": s["arguments"], "name": s["name"]}, "id": s["id"], "type": s["type"]}
            for _, s in sorted(calls.items())
        ]
        yield _trailer(content_started, tool_calls)


def _is_whole(joined: str) -> bool:
    try:
        return isinstance(json.loads(joined), dict)
    except json.JSONDecodeError:
        return False


def _partial_content(joined: str) -> str | None:
    """The content text of a streaming-form prefix cut inside its content, else None."""
    if not joined.startswith(_CONTENT_OPEN) or _is_whole(joined):
        return None
    try:
        value = json.loads(joined + '"}')
    except json.JSONDecodeError:
        return None
    return value.get("content") if isinstance(value, dict) else None


async def _sse_deltas(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The `delta` of each chat.completion.chunk in a server-sent event stream, until [DONE]."""
    async for event in _sse_events(resp):
        if event.strip() == "[DONE]":
            return
        try:
            chunk = json.loads(event)
        except json.JSONDecodeError as exc:
            raise GenerationFailed(f"the upstream stream sent an event that is not JSON: {event[:100]!r}") from exc
        if not isinstance(chunk, dict):
            raise GenerationFailed("the upstream stream sent an event that is not a JSON object")
        if "error" in chunk:
            raise GenerationFailed(f"the upstream stream reported an error: {str(chunk['error'])[:300]}")
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                yield choice.get("delta") or {}


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The data of each server-sent event: `data:` lines up to a blank line (or the end of the body)."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)
