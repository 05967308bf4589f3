"""How a model call's reply goes out: one OpenAI chat completion, a stream of its chunks, or one
Responses object (a `/v1/responses` call).

A reply that becomes ready while a checkpoint holds admission closed is HELD: the JSON reply, or the
end of a stream, waits for resume, so no agent moves past the boundary the checkpoint is recording.
A call a prepare cut at a token boundary is finished at resume, once its cut is in the log, and
ends its stream with a rollbook cut event (the client repeats it and it continues from the cut); a
stored reply (a repeat, or linked to the call it replaces) goes out whole.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from adapters.openai_wire import (
    ResponsesRequest,
    chunk,
    completion_body,
    error_event,
    logprob_entries,
    response_body,
    rollbook_info,
    sse,
    usage_chunk,
    whole_delta,
)
from engine.admission import Admission
from engine.errors import AdmissionClosed
from engine.tokens import Receipt
from participants.base.http_errors import json_reply
from participants.model.calls import LiveCall, TokenStore


class CallReplies:
    """The replies of one model server's calls: token-level logprobs come from the token store when
    the call was not generated here; `admission` is open while the server admits work."""

    def __init__(self, token_store: TokenStore, admission: Admission) -> None:
        self.token_store = token_store
        self.admission = admission

    async def logprobs(self, call: LiveCall, result: dict[str, Any]) -> list[dict[str, Any]]:
        if call.ids and len(call.ids) == int(result.get("tokens") or 0):
            return logprob_entries(call.ids, call.logprobs, call.tops)
        ids, logprobs = await self.tokens(call, result)
        return logprob_entries(ids, logprobs)

    async def tokens(self, call: LiveCall, result: dict[str, Any]) -> tuple[list[int], list[float]]:
        """The reply's token ids and logprobs: generated here, or read from the token store (a stored or linked reply)."""
        if call.ids and len(call.ids) == int(result.get("tokens") or 0):
            return list(call.ids), list(call.logprobs)
        stored = await self.token_store.get(Receipt.from_json(result["receipt"]).blob_id)
        return list(stored.ids), list(stored.logprobs or [0.0] * len(stored.ids))

    async def _whole(self, call: LiveCall) -> dict[str, Any]:
        """The completed call's result, once the caller may have it (held while a checkpoint is being taken)."""
        await call.done.wait()
        if call.error is not None:
            raise call.error
        if call.state != "completed" or call.result is None:
            raise AdmissionClosed(f"call {call.call_id} was cut at a token boundary for a checkpoint; repeat it after "
                                  "resume and it continues from the cut")
        await self.admission.wait_open()
        call.delivered = True
        return call.result

    async def json(self, call: LiveCall, model: str, logprobs: bool) -> web.Response:
        result = await self._whole(call)
        entries = await self.logprobs(call, result) if logprobs else None
        return json_reply(completion_body(call.call_id, model, result, entries))

    async def response(self, call: LiveCall, model: str, request: ResponsesRequest) -> web.Response:
        """The reply of a `/v1/responses` call: the same call, as a Responses object with its token ids."""
        result = await self._whole(call)
        ids, logprobs = await self.tokens(call, result)
        prompt = list(call.prompt_ids) if call.prompt_ids else list(
            (await self.token_store.get(Receipt.from_json(result["prompt_receipt"]).blob_id)).ids
            if result.get("prompt_receipt") else ())
        return json_reply(response_body(call.call_id, model, request, result, (prompt, ids, logprobs)))

    async def stream(self, request: web.Request, call: LiveCall, model: str, logprobs: bool,
                     include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, call, model, logprobs, include_usage)
        except ConnectionResetError:
            pass  # the client left; the call goes on and its outcome is in the log for a repeat
        return resp

    async def _stream_events(self, resp: web.StreamResponse, call: LiveCall, model: str, logprobs: bool,
                             include_usage: bool) -> None:
        created, sent = int(time.time()), 0
        cid = call.call_id
        await resp.write(sse(chunk(cid, model, created, {"role": "assistant", "content": ""})))
        if call.result is not None and call.state == "completed" and not call.steps:
            # A stored reply (a repeat, or linked to the call it replaces): it goes out whole.
            entries = await self.logprobs(call, call.result) if logprobs else None
            await resp.write(sse(chunk(cid, model, created, whole_delta(call.result["reply"]), None, entries)))
        else:
            while True:
                async with call.changed:
                    await call.changed.wait_for(lambda n=sent: len(call.steps) > n or call.done.is_set())
                batch = call.steps[sent:]
                for step in batch:
                    if step.delta or logprobs:
                        entries = logprob_entries(list(step.ids), list(step.logprobs), list(step.top_logprobs)) if logprobs else None
                        await resp.write(sse(chunk(cid, model, created, step.delta, None, entries)))
                sent += len(batch)
                if call.done.is_set() and sent >= len(call.steps):
                    break
        if call.error is not None:
            await resp.write(sse(error_event(call.error, call_id=cid)))
        elif call.state == "cut" and call.result is not None:
            cut = AdmissionClosed(f"call {cid} was cut after {call.result['tokens']} tokens for a checkpoint; repeat it "
                                  "after resume and it continues from the cut")
            await resp.write(sse(error_event(cut, cut=True, call_id=cid, tokens=call.result["tokens"],
                                             receipt=call.result["receipt"])))
        elif call.result is not None:
            await self.admission.wait_open()  # held: the client has the tokens but not the end of the reply
            call.delivered = True
            last = chunk(cid, model, created, {}, call.result.get("finish_reason") or "stop")
            last["rollbook"] = rollbook_info(cid, call.result)
            await resp.write(sse(last))
            if include_usage:
                await resp.write(sse(usage_chunk(cid, model, created, call.result)))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


__all__ = ["CallReplies"]
