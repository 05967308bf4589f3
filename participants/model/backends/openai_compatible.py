"""The OpenAI-compatible backend: a vLLM (or any OpenAI-compatible) server upstream of the model
server, spoken to over its chat-completions route, streamed; the token ids and logprobs vLLM returns
are what the model server records.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import aiohttp

from adapters.http_client import unpooled_session
from adapters.openai_wire import partial_message
from engine.errors import ConfigError, GenerationFailed, UpstreamInvalid
from engine.events import loads
from engine.tokens import f32
from participants.model.backends import BackendSettings, End, Event, Prefix, Start, Step, max_tokens

# ---- an OpenAI-compatible upstream (vLLM) -------------------------------------------------------

# What a chat request holds that the completions route has no use for (or counts differently).
CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
                       "max_completion_tokens", "continue_final_message", "add_generation_prompt",
                       "chat_template", "chat_template_kwargs", "documents", "stream", "stream_options"})
VLLM_TOKEN_FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "return_token_ids")


def parse_token(value: Any) -> int:
    """vLLM's `return_tokens_as_token_ids` writes each logprob entry's token as "token_id:N"."""
    text = str(value)
    if not text.startswith("token_id:"):
        raise GenerationFailed(f"the upstream did not report token ids (token {text[:40]!r}); it must honour "
                               "return_tokens_as_token_ids (vLLM)")
    try:
        return int(text.removeprefix("token_id:"))
    except ValueError as exc:
        raise GenerationFailed(f"the upstream sent a malformed token id {text[:40]!r}") from exc


class OpenAICompatibleBackend:
    """A vLLM-style server with POST {base_url}/chat/completions, always streamed upstream.

    Every request asks, whatever the client asked, for `stream: true` with
    `stream_options.include_usage`, `logprobs: true` (and the client's `top_logprobs`, else 0),
    `return_tokens_as_token_ids: true` (each `choices[0].logprobs.content[].token` is "token_id:N")
    and `return_token_ids: true` (the first chunk carries `prompt_token_ids`, each chunk's choice
    carries its `token_ids`, which must agree with the logprob entries). The client's sampling
    parameters pass through unchanged.

    An empty `tools` list (and its `tool_choice`) is left out: vLLM refuses `"tools": []` with a 400.

    Continuing a cut call, exactly: vLLM's chat route re-tokenizes the text of a partial assistant
    message, and a real tokenizer does not always give back the ids it generated (SmolLM2 differed at
    cuts 16-39 of one probe). So a cut call whose request offers no tools goes to the completions
    route with the prompt and the generated prefix as token ids (`prompt: [ids]`), the same sampling
    parameters and `max_tokens` reduced by the prefix: nothing is re-tokenized, and under greedy
    decoding the continuation is token for token the uninterrupted generation. Its text is appended to
    the partial reply's content. A request that offers tools (or a cut inside a tool call) needs the
    upstream's tool-call parser: it is continued as token ids too, and its whole reply is then parsed
    by vLLM's derender route (served with `--enable-scale-out`), which runs the server's own parser on
    the ids. Where that route is missing it is continued on the chat route, the partial reply as a
    final assistant message with `continue_final_message: true, add_generation_prompt: false` and
    NeMo Gym's `required_prefix_token_ids` (which stock vLLM ignores), and accepted only if the
    upstream's `prompt_token_ids` equal the prompt plus the prefix. Otherwise (an upstream that
    refuses, re-tokenizes differently or reports no prompt ids) the call is regenerated from the start
    and the reason recorded."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str = "default",
        policy_version: str | None = None,
        connect_s: float = 10.0,
        silence_s: float = 900.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.policy_version = policy_version or model
        # A generation may stream for as long as it has tokens to give, so nothing bounds the whole
        # reply; an upstream that accepts the request and then says nothing for `silence_s` (before
        # its first chunk or between two) is failed with generation_failed.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=silence_s)
        self._session: aiohttp.ClientSession | None = None
        self._derender: bool | None = None  # whether the upstream parses token ids into a reply (_has_derender)

    @classmethod
    def from_settings(cls, s: BackendSettings) -> OpenAICompatibleBackend:
        if not s.url:
            raise ConfigError("the openai_compatible backend has no url",
                              "set url in [servers.model] to the upstream's base URL, e.g. http://vllm:8000/v1")
        return cls(s.url, api_key=s.api_key, model=s.model or "default", policy_version=s.policy_version,
                   connect_s=s.connect_s, silence_s=s.silence_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created lazily inside the running loop: a session is bound to the loop that made it.
        if self._session is None or self._session.closed:
            self._session = unpooled_session(timeout=self.timeout)  # one connection per call in flight
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def check(self, request: dict[str, Any]) -> None:
        return None  # everything else is the upstream's to accept or refuse

    def body(self, request: dict[str, Any]) -> dict[str, Any]:
        body = {k: v for k, v in request.items() if v is not None and k not in ("stream", "stream_options")}
        if not body.get("tools"):
            body.pop("tools", None)
            body.pop("tool_choice", None)
        body.update(model=self.model, stream=True, stream_options={"include_usage": True}, logprobs=True,
                    top_logprobs=int(request.get("top_logprobs") or 0), return_tokens_as_token_ids=True,
                    return_token_ids=True)
        return body

    def completion_body(self, request: dict[str, Any], prefix: Prefix) -> dict[str, Any]:
        """The completions-route request that continues `prefix`: prompt and prefix as token ids, the chat
        request's sampling parameters, logprobs as the completions route counts them."""
        body = {k: v for k, v in request.items() if v is not None and k not in CHAT_ONLY}
        limit = max_tokens(request)
        if limit is not None:
            body["max_tokens"] = max(1, limit - len(prefix.ids))
        body.update(model=self.model, prompt=[*prefix.prompt_token_ids, *prefix.ids], stream=True,
                    stream_options={"include_usage": True}, logprobs=int(request.get("top_logprobs") or 0),
                    return_tokens_as_token_ids=True, return_token_ids=True)
        return body

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _post(self, body: dict[str, Any], route: str = "chat/completions") -> aiohttp.ClientResponse:
        try:
            resp = await self.session.post(f"{self.base_url}/{route}", json=body, headers=self._headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GenerationFailed(f"the upstream model server did not answer: {exc or type(exc).__name__}") from exc
        if resp.status != 200:
            detail = (await resp.text())[:300]
            resp.release()
            raise GenerationFailed(f"the upstream model server answered HTTP {resp.status}: {detail}", status=resp.status)
        return resp

    async def generate(self, request: dict[str, Any], prefix: Prefix | None) -> AsyncIterator[Event]:
        if prefix is None or not prefix.ids:
            async for event in self._events(await self._post(self.body(request))):
                yield event
            return
        if request.get("tools") or prefix.message.get("tool_calls"):
            continued, via = await self._continue_parsed(request, prefix), "completions+derender"
            if isinstance(continued, str):
                continued, via = await self._continue_chat(request, prefix), "continue_final_message"
        else:
            continued, via = await self._continue_tokens(request, prefix), "completions"
        if not isinstance(continued, str):
            yield Start(prefix.prompt_token_ids, {"mode": "continued", "prefix_tokens": len(prefix.ids), "via": via})
            async for event in continued:
                yield event
            return
        async for event in self._events(await self._post(self.body(request))):
            yield Start(event.prompt_token_ids, {"mode": "regenerated", "reason": continued}) if isinstance(event, Start) else event

    async def _continue_tokens(self, request: dict[str, Any], prefix: Prefix) -> AsyncIterator[Event] | str:
        """The continuation's events past the prefix through the completions route, or why not."""
        try:
            resp = await self._post(self.completion_body(request, prefix), "completions")
        except GenerationFailed as exc:
            return f"the upstream refused the token-id continuation: {exc.detail[:200]}"

        async def events() -> AsyncIterator[Event]:
            async with resp:
                async for event in _streamed_reply(resp, _completion_step):
                    if not isinstance(event, Start):  # the call's prompt is its own, not prompt + prefix
                        yield event
        return events()

    async def _continue_parsed(self, request: dict[str, Any], prefix: Prefix) -> AsyncIterator[Event] | str:
        """A call that offers tools, continued as token ids like any other, its reply then parsed by the
        upstream's own tool-call parser through vLLM's derender route (served with `--enable-scale-out`):
        the whole generation's ids and the chat request in, the chat reply out. Nothing is re-tokenized.
        The parsed reply must extend the partial one the client was streamed; the continuation is
        received whole before any of it is passed on, so a reply that does not (or an upstream without
        the route) leaves nothing half-sent and falls back to the chat route."""
        if not await self._has_derender():
            return "the upstream has no derender route to parse a reply continued as token ids (vLLM: --enable-scale-out)"
        body = self.completion_body(request, prefix)
        body.pop("stream_options", None)
        try:
            async with await self._post({**body, "stream": False}, "completions") as resp:
                whole = await resp.json()
        except (GenerationFailed, aiohttp.ClientError, ValueError) as exc:
            return f"the upstream refused the token-id continuation: {str(exc)[:200]}"
        choice = next(iter(whole.get("choices") or []), None)
        if not isinstance(choice, dict) or not choice.get("finish_reason"):
            return "the upstream's token-id continuation has no choice with a finish_reason"
        step = _completion_step(choice) or Step((), (), {})  # a reply that ended at the cut adds no tokens
        ids = [*prefix.ids, *step.ids]
        chat_request = {k: v for k, v in self.body(request).items() if k not in ("stream", "stream_options")}
        derender = {"model": self.model, "prompt_tokens": len(prefix.prompt_token_ids),
                    "prompt_token_ids": list(prefix.prompt_token_ids), "chat_request": chat_request,
                    "generate_response": {"choices": [{"index": 0, "token_ids": ids,
                                                       "finish_reason": choice["finish_reason"]}]}}
        try:
            async with await self._post(derender, "chat/completions/derender") as resp:
                parsed = await resp.json()
        except (GenerationFailed, aiohttp.ClientError, ValueError) as exc:
            return f"the upstream could not parse the continued reply (its derender route): {str(exc)[:200]}"
        out = next(iter(parsed.get("choices") or []), None)
        message = out.get("message") if isinstance(out, dict) else None
        delta = extension(prefix.message, message) if isinstance(message, dict) else None
        if delta is None:
            return "the upstream's parse of the whole reply does not extend the partial reply it streamed"
        check_tool_calls(delta.get("tool_calls"))
        finish = str(out.get("finish_reason") or choice["finish_reason"]) if isinstance(out, dict) else choice["finish_reason"]

        async def events() -> AsyncIterator[Event]:
            yield dataclasses.replace(step, delta=delta)
            yield End(finish, whole.get("usage"))
        return events()

    async def _has_derender(self) -> bool:
        """Whether the upstream serves the derender route, asked once with an empty body before any
        token is generated for it: a server with the route refuses the body (400, 422), one without
        answers 403 (vLLM without --enable-scale-out), 404 or 405."""
        if self._derender is None:
            try:
                async with self.session.post(f"{self.base_url}/chat/completions/derender", json={},
                                             headers=self._headers) as resp:
                    self._derender = resp.status in (400, 422)
            except (aiohttp.ClientError, TimeoutError):
                return False  # asked again next time
        return self._derender

    async def _continue_chat(self, request: dict[str, Any], prefix: Prefix) -> AsyncIterator[Event] | str:
        """The continuation's events past the prefix through the chat route (the partial reply as the
        final message), or why not."""
        body = self.body(request)
        body["messages"] = [*body.get("messages", []), partial_message(prefix.message)]
        body.update(continue_final_message=True, add_generation_prompt=False,
                    required_prefix_token_ids=[*prefix.prompt_token_ids, *prefix.ids])
        limit = max_tokens(request)
        if limit is not None:
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = max(1, limit - len(prefix.ids))
        try:
            resp = await self._post(body)
        except GenerationFailed as exc:
            return f"the upstream refused the continuation: {exc.detail[:200]}"
        events = self._events(resp)
        first = await anext(events, None)
        want = (*prefix.prompt_token_ids, *prefix.ids)
        if isinstance(first, Start) and first.prompt_token_ids == want:
            return events
        await events.aclose()
        got = len(first.prompt_token_ids) if isinstance(first, Start) else 0
        return (f"the upstream's prompt_token_ids ({got} ids) are not the prompt plus the prefix "
                f"({len(want)} ids): it did not continue the exact prefix")

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[Event, None]:
        """Start, Steps, End from a vLLM chat.completion.chunk stream, or from a whole reply."""
        async with resp:
            # an upstream may answer whole, streamed or not
            events = _whole_reply(resp) if resp.content_type == "application/json" else _streamed_reply(resp)
            async for event in events:
                yield event


async def _whole_reply(resp: aiohttp.ClientResponse) -> AsyncIterator[Event]:
    try:
        body = await resp.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise GenerationFailed(f"the upstream's reply broke off: {exc or type(exc).__name__}") from exc
    choice = next((c for c in body.get("choices") or [] if c.get("index", 0) == 0), None)
    if not isinstance(choice, dict):
        raise GenerationFailed("the upstream's reply has no choice 0")
    yield Start(_prompt_ids(body, choice))
    step = _step(choice)
    if step is not None:
        yield step
    if not choice.get("finish_reason"):
        raise GenerationFailed("the upstream's reply has no finish_reason")
    yield End(str(choice["finish_reason"]), body.get("usage"))


async def _streamed_reply(resp: aiohttp.ClientResponse,
                          step_of: Callable[[dict[str, Any]], Step | None] | None = None) -> AsyncIterator[Event]:
    """The events of a streamed reply; `step_of` reads one choice (chat chunks by default)."""
    read = step_of or _step
    started, finish, usage = False, None, None
    try:
        async for chunk in _sse_chunks(resp):
            if not started:
                started = True
                yield Start(_prompt_ids(chunk, next(iter(chunk.get("choices") or []), {})))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                step = read(choice) if choice.get("index", 0) == 0 else None
                if step is not None:
                    yield step
                if choice.get("index", 0) == 0:
                    finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        # A silent upstream (sock_read) lands here too: the call fails, the server stays up.
        raise GenerationFailed(f"the upstream stream broke off: {exc or type(exc).__name__}") from exc
    if not started:
        raise GenerationFailed("the upstream stream ended before its first chunk")
    if finish is None:
        raise GenerationFailed("the upstream stream ended without a finish_reason")
    yield End(str(finish), usage)


def _prompt_ids(body: dict[str, Any], choice: dict[str, Any]) -> tuple[int, ...]:
    """vLLM puts `prompt_token_ids` on the reply (or the first chunk); NeMo Gym's shape puts it on the
    message (or the first delta)."""
    holder = choice.get("message") or choice.get("delta") or {}
    return _integers(body.get("prompt_token_ids") or holder.get("prompt_token_ids") or [], "prompt_token_ids")


def _integers(ids: Any, name: str) -> tuple[int, ...]:
    """An upstream's list of token ids as a tuple, or UpstreamInvalid. Checked at C speed: a sum stays
    an int only over integers (a float makes it a float, a string or a null cannot be added). A prompt
    holds thousands of ids, and converting each (`map(int, ...)`, which also took `1.5` for 1 and `"7"`
    for 7) took 327 us on 13,000 against 49 for this check (`benchmarks/json_bodies.py`). The token
    store refuses the rest (a bool, an id out of range) where it stores them."""
    if not isinstance(ids, list):
        raise UpstreamInvalid(f"the upstream's {name} must be a list of integers, not {type(ids).__name__}")
    try:
        integers = type(sum(ids)) is int
    except TypeError:
        integers = False
    if not integers:
        bad = next((i for i in ids if not isinstance(i, int)), None)
        raise UpstreamInvalid(f"the upstream's {name} must be integers; it sent {str(bad)[:40]!r}")
    return tuple(ids)


def _gym_tokens(holder: dict[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """NeMo Gym's vLLM shape (its token_id_capture adapter reads it): `generation_token_ids` with
    `generation_log_probs`, one logprob per id, on the message or on a delta."""
    ids = holder.get("generation_token_ids")
    if ids is None:
        return None
    lps = holder.get("generation_log_probs")
    if not isinstance(ids, list) or not isinstance(lps, list) or len(lps) != len(ids):
        raise GenerationFailed("the upstream's generation_log_probs must give one logprob per generation_token_ids entry "
                               f"({len(lps) if isinstance(lps, list) else lps!r} for {len(ids) if isinstance(ids, list) else ids!r})")
    return _integers(ids, "generation_token_ids"), tuple(f32(x) for x in lps)


# What one reply's tool calls may hold, checked before a slot is made for any of them: an index is a
# position in a list the server builds, so an upstream's index of 2,000,000 would otherwise allocate
# two million slots in the event loop.
MAX_TOOL_CALLS = 128
MAX_TOOL_NAME = 256


def check_tool_calls(tool_calls: Any) -> None:
    """UpstreamInvalid unless `tool_calls` (one delta's, or a whole message's) is a list of objects
    whose indexes are integers below MAX_TOOL_CALLS and whose names are short strings. A gap in the
    indexes is harmless once bounded (merge_delta fills it) and streams may send them out of order."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list) or len(tool_calls) > MAX_TOOL_CALLS:
        raise UpstreamInvalid(f"the upstream's tool_calls must be a list of at most {MAX_TOOL_CALLS}")
    for n, tc in enumerate(tool_calls):
        if not isinstance(tc, dict):
            raise UpstreamInvalid("the upstream sent a tool call that is not an object")
        index = tc.get("index", n)
        if type(index) is not int or not 0 <= index < MAX_TOOL_CALLS:
            raise UpstreamInvalid(f"the upstream's tool-call index {str(index)[:20]} is not an integer in "
                                  f"[0, {MAX_TOOL_CALLS})")
        fn = tc.get("function") or {}
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or (name is not None and (not isinstance(name, str) or len(name) > MAX_TOOL_NAME)):
            raise UpstreamInvalid(f"the upstream's tool call {index} has no valid function (a name of at most "
                                  f"{MAX_TOOL_NAME} characters)")


def extension(partial: dict[str, Any], full: dict[str, Any]) -> dict[str, Any] | None:
    """The delta that turns the partial reply into the full one (merge_delta's way: content and each
    tool call's name and arguments appended), or None if the full one does not start with the partial."""
    have, want = partial.get("content") or "", full.get("content") or ""
    if not want.startswith(have):
        return None
    delta: dict[str, Any] = {"content": want[len(have):]} if want[len(have):] else {}
    had, calls = partial.get("tool_calls") or [], full.get("tool_calls") or []
    if len(calls) < len(had):
        return None
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        old = (had[i].get("function") or {}) if i < len(had) else {}
        name, args = str(fn.get("name") or ""), str(fn.get("arguments") or "")
        old_name, old_args = str(old.get("name") or ""), str(old.get("arguments") or "")
        if not (name.startswith(old_name) and args.startswith(old_args)):
            return None
        piece: dict[str, Any] = {"index": i, "function": {"name": name[len(old_name):], "arguments": args[len(old_args):]}}
        if i >= len(had) or not had[i].get("id"):
            piece.update(id=call.get("id"), type="function")
        out.append(piece)
    if out:
        delta["tool_calls"] = out
    return delta


def _completion_step(choice: dict[str, Any]) -> Step | None:
    """One completions-route chunk: its text and vLLM's logprobs in the completions shape (`tokens` as
    "token_id:N", `token_logprobs`, `top_logprobs` as one object per token)."""
    lp = choice.get("logprobs") or {}
    ids = tuple(parse_token(t) for t in lp.get("tokens") or [])
    lps = tuple(f32(x) for x in lp.get("token_logprobs") or [])
    tops = tuple(tuple((parse_token(t), f32(x)) for t, x in (top or {}).items()) for top in lp.get("top_logprobs") or [])
    if len(lps) != len(ids):
        raise GenerationFailed(f"the upstream's completion gives {len(lps)} logprobs for {len(ids)} tokens")
    reported = choice.get("token_ids")
    if reported is not None and tuple(int(i) for i in reported) != ids:
        raise GenerationFailed(f"the upstream's token_ids {list(reported)[:8]} disagree with its logprobs tokens {list(ids)[:8]}")
    text = choice.get("text")
    delta = {"content": text} if isinstance(text, str) and text else {}
    if not ids and not delta:
        return None
    return Step(ids, lps, delta, tops)


def _step(choice: dict[str, Any]) -> Step | None:
    """One chunk's tokens (or a whole reply's): vLLM's logprob entries with `token_id:N` tokens, else
    NeMo Gym's generation_token_ids / generation_log_probs."""
    holder = choice.get("delta") or choice.get("message") or {}
    delta = {k: v for k, v in holder.items() if k in ("content", "tool_calls") and v}
    check_tool_calls(delta.get("tool_calls"))
    entries = (choice.get("logprobs") or {}).get("content") or []
    ids = tuple(parse_token(e.get("token")) for e in entries)
    lps = tuple(f32(e.get("logprob")) for e in entries)
    tops = tuple(tuple((parse_token(t.get("token")), f32(t.get("logprob"))) for t in e.get("top_logprobs") or []) for e in entries)
    if not entries and (gym := _gym_tokens(holder)) is not None:
        ids, lps = gym
    reported = choice.get("token_ids")
    if reported is not None and tuple(int(i) for i in reported) != ids:
        raise GenerationFailed(f"the upstream's token_ids {list(reported)[:8]} disagree with its logprobs entries {list(ids)[:8]}")
    if not ids and not delta:
        return None
    return Step(ids, lps, delta, tops)


MAX_SSE_LINE_BYTES = 64 * 1024 * 1024


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The response's lines. aiohttp's own line reader stops at 512 KiB, and one chunk of an upstream
    may carry many tokens with their logprobs (vLLM batches what an engine step produced, and a long
    tool argument is one delta): a line is refused only past MAX_SSE_LINE_BYTES."""
    buffer = bytearray()
    async for piece in resp.content.iter_any():
        start = len(buffer)
        buffer += piece
        end = buffer.find(b"\n", start)
        while end >= 0:
            yield bytes(buffer[: end + 1])
            del buffer[: end + 1]
            end = buffer.find(b"\n")
        if len(buffer) > MAX_SSE_LINE_BYTES:
            raise GenerationFailed(f"the upstream sent a line over {MAX_SSE_LINE_BYTES} bytes")
    if buffer:
        yield bytes(buffer)


async def _sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Each chat.completion.chunk of a server-sent event stream, until [DONE]; an error event raises."""
    data: list[str] = []

    def parse(event: str) -> dict[str, Any]:
        try:
            chunk = loads(event)
        except json.JSONDecodeError as exc:
            raise GenerationFailed(f"the upstream stream sent an event that is not JSON: {event[:100]!r}") from exc
        if not isinstance(chunk, dict):
            raise GenerationFailed("the upstream stream sent an event that is not a JSON object")
        if chunk.get("error"):
            raise GenerationFailed(f"the upstream stream reported an error: {str(chunk['error'])[:300]}")
        return chunk

    async for raw in _lines(resp):
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            event, data = "\n".join(data), []
            if event.strip() == "[DONE]":
                return
            yield parse(event)
    if data and "\n".join(data).strip() != "[DONE]":
        yield parse("\n".join(data))
