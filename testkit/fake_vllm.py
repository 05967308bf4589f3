"""A fake vLLM OpenAI-compatible server: the one stand-in for a real model in the tests.

Its "model" is the scripted policy with the scripted tokenizer (adapters.scripted_tokenizer), so
replies are deterministic, but everything on the wire is vLLM's:

- chat request: `logprobs`, `top_logprobs`, `return_tokens_as_token_ids` (each logprob entry's
  `token` becomes "token_id:N"), `return_token_ids` (the first stream chunk carries
  `prompt_token_ids`, each chunk's choice its `token_ids`), `stream_options.include_usage`,
  `continue_final_message` / `add_generation_prompt` (the partial assistant message is rendered and
  re-tokenized, as vLLM does; NeMo Gym's `required_prefix_token_ids` is ignored, as stock vLLM
  ignores it); `"tools": []` is refused with vLLM's 400;
- completions request with a token-id prompt (`prompt: [ids]`): continues a generation of a chat
  request this fake served, from any of its step boundaries (the fake's model plans from messages,
  so a prompt it never served is refused with a 400: the one thing here vLLM does not do);
- `/v1/chat/completions/derender` (vLLM with `--enable-scale-out`; `derender=False` leaves it out):
  a generation's token ids and its chat request in, the parsed chat reply out;
- response: chat.completion.chunk (or text_completion) events, one per step, `[DONE]` at the end;
  non-streaming replies carry `prompt_token_ids` and `choices[0].token_ids` too; errors are vLLM's
  `{"error": {"message", "type", "param", "code"}}`.

What vLLM sends and this fake does is compared, field by field, in tests/participants/model/test_real_vllm.py.

Knobs for tests: `token_latency_s`; `stall_after` (stop sending after N steps of a stream and
hang until `unstall()`: a call the test knows is in flight, for as long as it needs), `fail_after`
(drop the connection after N steps); `continuation`: "vllm" (as above), "nemo_gym" (honour
`required_prefix_token_ids`, as NeMo Gym's patched vLLM does), "drift" (the re-tokenized partial
message comes out as other ids, as a real tokenizer's may), "refuse" (answer 400 to any
continuation, either route). `requests` keeps every body received.

Run alone: `python -m testkit.fake_vllm --port 8000` (the e2e suite starts it as a process; there
`POST /fake/stall` stalls every stream before its next step and `POST /fake/unstall` lets them all go;
`GET /fake/requests` counts the requests served and the streams stalled now).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

from adapters import scripted_tokenizer as tok
from participants.model.backends import Step
from participants.model.backends.scripted import ScriptedBackend

MODEL = "fake-policy"


class FakeVLLM:
    def __init__(self, token_latency_s: float = 0.0, continuation: str = "vllm", shape: str = "vllm",
                 derender: bool = True) -> None:
        # shape "nemo_gym": whole replies (even when asked to stream) carrying NeMo Gym's message fields
        # generation_token_ids / generation_log_probs / prompt_token_ids instead of logprob entries.
        self.shape = shape
        self.derender = derender  # vLLM serves /v1/chat/completions/derender with --enable-scale-out
        self.token_latency_s = token_latency_s
        self.continuation = continuation
        self.stall_after: int | None = None
        self._unstalled = asyncio.Event()
        self.stalled = 0  # streams waiting in a stall now: calls that cannot complete until `unstall()`
        self.fail_after: int | None = None
        self.requests: list[dict[str, Any]] = []
        self.served: dict[tuple[int, ...], dict[str, Any]] = {}  # prompt ids -> the chat request that had them
        self.steps_sent = 0
        self.model = ScriptedBackend()
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        # vLLM takes a prompt as long as its context allows; aiohttp's default refuses bodies over 1 MiB.
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.text_completions)
        if self.derender:
            app.router.add_post("/v1/chat/completions/derender", self.derender_chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/fake/stall", self._stall)
        app.router.add_post("/fake/unstall", self._unstall)
        app.router.add_get("/fake/requests", self._count)
        return app

    def unstall(self) -> None:
        """Every stalled stream goes on; streams started from now on do not stall."""
        self.stall_after = None
        self._unstalled.set()

    async def _stall(self, request: web.Request) -> web.Response:
        self._unstalled.clear()
        self.stall_after = 0
        return web.json_response({"stall_after": 0})

    async def _count(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": len(self.requests), "steps_sent": self.steps_sent, "stalled": self.stalled})

    async def _unstall(self, request: web.Request) -> web.Response:
        self.unstall()
        return web.json_response({"stall_after": None})

    async def start(self, port: int = 0) -> str:
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"
        return self.url

    async def stop(self) -> None:
        self.unstall()  # a stalled handler must not hold up the runner's shutdown
        if self.runner is not None:
            await self.runner.cleanup()

    async def __aenter__(self) -> FakeVLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]})

    @staticmethod
    def _error(status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": param,
                                            "code": status}}, status=status)

    def _plan(self, body: dict[str, Any]) -> tuple[list[int], list[Step], str, list[int]] | web.Response:
        """(reported prompt ids, steps to send, finish reason, prefix ids) for a chat request."""
        if body.get("tools") == []:
            return self._error(400, "`tools` must not be an empty array. Either provide at least one tool or omit "
                                    "the field entirely.", param="tools")
        messages = list(body.get("messages") or [])
        continuing = bool(body.get("continue_final_message")) and messages and messages[-1].get("role") == "assistant"
        if not continuing:
            prompt, steps, finish = self.model.plan(body)
            self.served[tuple(prompt)] = body
            return prompt, steps, finish, []
        if self.continuation == "refuse":
            return self._error(400, "continue_final_message is not supported by this server")
        original = {**body, "messages": messages[:-1], "max_tokens": None, "max_completion_tokens": None}
        prompt, steps, finish = self.model.plan(original)
        if self.continuation == "nemo_gym":
            reported = list(body.get("required_prefix_token_ids") or [])
            if reported[: len(prompt)] != prompt:
                return self._error(400, "required_prefix_token_ids must start with the prompt's token ids")
        else:  # the partial message rendered and re-tokenized, end of turn left open
            partial = [i for p in tok.reply_pieces(messages[-1])[:-1] for i in p.ids]
            reported = prompt + partial
            if self.continuation == "drift":
                reported = reported[:-1] + [(reported[-1] + 1) % tok.VOCAB_SIZE]
        return self._rest(reported, prompt, steps, finish, body.get("max_tokens"))

    def _rest(self, reported: list[int], prompt: list[int], steps: list[Step], finish: str, limit: Any
              ) -> tuple[list[int], list[Step], str, list[int]] | web.Response:
        """The steps after the prefix `reported` holds past `prompt`, within `limit` tokens."""
        prefix, n, k = reported[len(prompt):], 0, 0
        while k < len(steps) and n < len(prefix):
            n += len(steps[k].ids)
            k += 1
        if [i for s in steps[:k] for i in s.ids] != prefix:
            if self.continuation == "nemo_gym":
                return self._error(400, "required_prefix_token_ids is not a prefix this model generates")
            k = 0  # a model handed text it would not have written goes on from it somehow: here, from the start
        rest = steps[k:]
        if limit is not None and sum(len(s.ids) for s in rest) > int(limit):
            kept, m = [], 0
            for s in rest:
                if m + len(s.ids) > int(limit):
                    break
                kept.append(s)
                m += len(s.ids)
            rest, finish = kept, "length"
        return reported, rest, finish, prefix

    async def derender_chat(self, request: web.Request) -> web.Response:
        """A generation's token ids (and the chat request) in, the chat reply its ids stand for out: the
        fake's "parser" is its own plan, so ids that are not a step-aligned prefix of it are refused."""
        body = await request.json()
        if not isinstance(body.get("generate_response"), dict) or not isinstance(body.get("chat_request"), dict):
            return self._error(400, "generate_response and chat_request are required")
        self.requests.append(body)
        generated = body.get("generate_response") or {}
        choice = next(iter(generated.get("choices") or []), {})
        chat = body.get("chat_request") or {}
        prompt, steps, finish = self.model.plan({**chat, "max_tokens": None, "max_completion_tokens": None})
        if list(body.get("prompt_token_ids") or generated.get("prompt_token_ids") or prompt) != prompt:
            return self._error(400, "prompt_token_ids are not the chat request's prompt", param="prompt_token_ids")
        ids, n, k = list(choice.get("token_ids") or []), 0, 0
        while k < len(steps) and n < len(ids):
            n += len(steps[k].ids)
            k += 1
        if [i for s in steps[:k] for i in s.ids] != ids:
            return self._error(400, "token_ids are not a generation this model makes for the request", param="token_ids")
        from adapters.openai_wire import final_message, merge_delta

        message: dict[str, Any] = {}
        for s in steps[:k]:
            merge_delta(message, s.delta)
        reason = finish if k == len(steps) else str(choice.get("finish_reason") or "length")
        return web.json_response({"id": f"chatcmpl-fake-{len(self.requests)}", "object": "chat.completion",
                                  "created": int(time.time()), "model": MODEL,
                                  "choices": [{"index": 0, "message": final_message(message), "finish_reason": reason}],
                                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                            "total_tokens": len(prompt) + len(ids)}})

    async def text_completions(self, request: web.Request) -> web.StreamResponse:
        """The completions route, for a token-id prompt that continues a chat generation served here."""
        body = await request.json()
        self.requests.append(body)
        if self.continuation == "refuse":
            return self._error(400, "this server does not continue generations")
        ids = body.get("prompt")
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            return self._error(400, "this fake takes a prompt of token ids only", param="prompt")
        served = [p for p in self.served if tuple(ids[: len(p)]) == p]
        if not served:
            return self._error(400, "this fake continues only the prompts of chat requests it served", param="prompt")
        original = self.served[max(served, key=len)]
        prompt, steps, finish = self.model.plan({**original, "max_tokens": None, "max_completion_tokens": None,
                                                 "top_logprobs": int(body.get("logprobs") or 0)})
        planned = self._rest(ids, prompt, steps, finish, body.get("max_tokens"))
        if isinstance(planned, web.Response):
            return planned
        _, rest, finish, _ = planned
        rid, created = f"cmpl-fake-{len(self.requests)}", int(time.time())
        as_ids, want_ids, want_lps = bool(body.get("return_tokens_as_token_ids")), bool(body.get("return_token_ids")), body.get("logprobs") is not None

        def choice(s: Step, first: bool, last: bool) -> dict[str, Any]:
            name = (lambda i: f"token_id:{i}") if as_ids else (lambda i: tok.decode([i]))
            # special tokens are left out of the text, as vLLM skips them
            out: dict[str, Any] = {"index": 0, "text": str(s.delta.get("content") or ""), "finish_reason": finish if last else None,
                                   "stop_reason": None, "logprobs": None}
            if want_lps:
                out["logprobs"] = {"text_offset": [0] * len(s.ids), "token_logprobs": list(s.logprobs),
                                   "tokens": [name(i) for i in s.ids],
                                   "top_logprobs": [{name(i): lp, **{name(a): x for a, x in (s.top_logprobs[j] if j < len(s.top_logprobs) else ())}}
                                                    for j, (i, lp) in enumerate(zip(s.ids, s.logprobs, strict=True))]}
            if want_ids:
                out.update(prompt_token_ids=ids if first else None, token_ids=list(s.ids))
            return out

        n = sum(len(s.ids) for s in rest)
        usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + n, "completion_tokens": n}
        if not body.get("stream"):
            self.steps_sent += len(rest)
            whole = Step(tuple(i for s in rest for i in s.ids), tuple(x for s in rest for x in s.logprobs),
                         {"content": "".join(str(s.delta.get("content") or "") for s in rest)},
                         tuple(t for s in rest for t in s.top_logprobs))
            return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": MODEL,
                                      "choices": [choice(whole, True, True)], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for k, s in enumerate(rest or [Step((), (), {})]):  # nothing left: one chunk with the finish reason
            if self.token_latency_s:
                await asyncio.sleep(self.token_latency_s)
            await resp.write(f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': created, 'model': MODEL, 'choices': [choice(s, k == 0, k >= len(rest) - 1)]})}\n\n".encode())
            self.steps_sent += 1
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': created, 'model': MODEL, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _logprobs(step: Step, as_ids: bool) -> dict[str, Any]:
        def name(i: int) -> str:
            return f"token_id:{i}" if as_ids else tok.decode([i])

        return {"content": [
            {"token": name(i), "logprob": lp, "bytes": list(tok.decode([i]).encode()),
             "top_logprobs": [{"token": name(a), "logprob": x, "bytes": None} for a, x in (step.top_logprobs[j] if j < len(step.top_logprobs) else ())]}
            for j, (i, lp) in enumerate(zip(step.ids, step.logprobs, strict=True))]}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if int(body.get("n") or 1) != 1:
            return self._error(400, "this fake serves n=1 only")
        planned = self._plan(body)
        if isinstance(planned, web.Response):
            return planned
        prompt, steps, finish, prefix = planned
        as_ids, want_ids = bool(body.get("return_tokens_as_token_ids")), bool(body.get("return_token_ids"))
        want_lps = bool(body.get("logprobs"))
        rid, created = f"chatcmpl-fake-{len(self.requests)}", int(time.time())
        completion_tokens = sum(len(s.ids) for s in steps)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens, "total_tokens": len(prompt) + completion_tokens}
        if self.shape == "nemo_gym":
            message = {}
            from adapters.openai_wire import final_message, merge_delta

            for s in steps:
                merge_delta(message, s.delta)
            gym = {**final_message(message), "prompt_token_ids": prompt,
                   "generation_token_ids": [i for s in steps for i in s.ids],
                   "generation_log_probs": [lp for s in steps for lp in s.logprobs]}
            return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": MODEL,
                                      "choices": [{"index": 0, "message": gym, "finish_reason": finish}], "usage": usage})
        if not body.get("stream"):
            message: dict[str, Any] = {}
            from adapters.openai_wire import final_message, merge_delta

            for s in steps:
                merge_delta(message, s.delta)
            choice: dict[str, Any] = {"index": 0, "message": final_message(message), "finish_reason": finish,
                                      "logprobs": {"content": [e for s in steps for e in self._logprobs(s, as_ids)["content"]]} if want_lps else None}
            out: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created, "model": MODEL,
                                   "choices": [choice], "usage": usage}
            if want_ids:
                out["prompt_token_ids"] = prompt
                choice["token_ids"] = [i for s in steps for i in s.ids]
            return web.json_response(out)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(value: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(value)}\n\n".encode())

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [choice]}

        first = chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        if want_ids:
            first["prompt_token_ids"] = prompt
        await send(first)
        for n, s in enumerate(steps):
            if self.stall_after is not None and n >= self.stall_after:
                self.stalled += 1
                try:
                    await self._unstalled.wait()  # hangs until the test lets it go
                finally:
                    self.stalled -= 1
            if self.fail_after is not None and n >= self.fail_after:
                assert request.transport is not None
                request.transport.close()  # the connection drops mid-stream
                return resp
            if self.token_latency_s:
                await asyncio.sleep(self.token_latency_s)
            choice = {"index": 0, "delta": s.delta, "logprobs": self._logprobs(s, as_ids) if want_lps else None,
                      "finish_reason": None}
            if want_ids:
                choice["token_ids"] = list(s.ids)
            await send(chunk(choice))
            self.steps_sent += 1
        await send(chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [],
                        "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def teach_nemo_gym_players() -> None:
    """The players a NeMo Gym environment brings (participants/environments/players.py), which
    this process, reading no config, would not otherwise register."""
    from participants.environments import ENVIRONMENTS
    from participants.environments.players import GYM_PLAYER, SCHEMA

    ENVIRONMENTS["nemo-gym-players"] = type("NemoGymPlayers", (), {"scripted": (GYM_PLAYER, SCHEMA)})  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-latency-s", type=float, default=0.0)
    parser.add_argument("--continuation", choices=("vllm", "nemo_gym", "drift", "refuse"), default="vllm")
    parser.add_argument("--no-derender", action="store_true", help="as vLLM without --enable-scale-out")
    parser.add_argument("--nemo-gym-players", action="store_true",
                        help="its policy plays NeMo Gym's servers as rollbook's own model server does when a "
                             "[nemo_gym] table registers them: Workplace Assistant's tools, and any tools by their schemas")
    args = parser.parse_args()
    if args.nemo_gym_players:
        teach_nemo_gym_players()
    fake = FakeVLLM(token_latency_s=args.token_latency_s, continuation=args.continuation, derender=not args.no_derender)
    # A short shutdown: a test that stops this process must not wait a minute for a stalled stream.
    web.run_app(fake.app(), host="127.0.0.1", port=args.port, print=None, access_log=None, shutdown_timeout=2.0)


if __name__ == "__main__":
    main()
