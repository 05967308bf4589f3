"""A model call as this process serves it.

A call as the log tells it (`CallRecord`, its custody folded by engine.calls.call_records) is the
engine's; `LiveCall` is a call this process is generating: its tokens
so far, what a streaming client has been sent, and its outcome once it has one; `pump` moves a
generation backend's steps into it until the generation ends or a checkpoint cuts it.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters.openai_wire import merge_delta, whole_delta
from engine.calls import CallRecord
from engine.errors import RollbookError
from engine.events import canonical_json
from engine.tokens import Receipt, TokenSink, TokenSource
from participants.model.backends import End, GenerationBackend, Prefix, Start, Step


class TokenStore(TokenSink, TokenSource, Protocol):
    """What the model server needs of adapters.token_store: put a call's tokens, get a prefix back."""

    async def stage(self, ids: list[int], logprobs: list[float] | None = None) -> Receipt:
        """A receipt whose blob is durable no later than the next event this process appends: the
        call's outcome, which names it, is appended right after (one transaction for both)."""
        ...


@dataclass(frozen=True)
class DurablePrefix:
    """Tokens of a generation in flight that are already in the token store: what a cut records
    without writing a blob (participants.model.progress keeps it fresh)."""

    tokens: int
    receipt: Receipt
    prompt_receipt: Receipt
    partial: dict[str, Any]
    segments: list[dict[str, Any]]


@dataclass(frozen=True)
class Progress:
    """A generation's tokens as they stand, copied at once so they agree with each other."""

    call: LiveCall
    ids: list[int]
    logprobs: list[float]
    prompt_ids: tuple[int, ...]
    partial: dict[str, Any]
    segments: list[dict[str, Any]]


@dataclass(eq=False)
class LiveCall:
    """A call this process is serving. Mutable on purpose: it is live state, never logged as such."""

    call_id: str
    rollout_id: str
    attempt: int
    stream: bool
    request: dict[str, Any] = field(default_factory=dict)
    policy_version: str | None = None
    prefix: Prefix | None = None
    prefix_segments: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # merged into call_completed
    digest: str = ""  # request_digest of the body it was accepted with
    # accepting -> generating -> recording (its own task appends its outcome) -> completed | cut | failed |
    # stale; generating -> cutting (a prepare records the cut for it, at its durable prefix) -> cut
    state: str = "accepting"
    prompt_ids: tuple[int, ...] = ()
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # what a streaming client is sent, in order
    message: dict[str, Any] = field(default_factory=dict)  # the deltas so far, merged
    finish_reason: str | None = None
    upstream_usage: dict[str, Any] | None = None
    continuation: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: RollbookError | None = None
    delivered: bool = False
    cut_requested: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None
    durable: DurablePrefix | None = None  # the longest prefix known to be in the token store
    # The tokens the cut this call continues had kept. A cut of this call must keep more: an upstream that
    # cannot continue exactly regenerates from the start, and a call cut again before it is back where it
    # was would be cut at the same place by every checkpoint that comes faster than the model (one cut 163
    # times in 8 minutes on a real vLLM). Until it passes this, a prepare lets it run on.
    floor: int = 0

    def generated_here(self) -> int:
        """The tokens this generation made itself, past the prefix it continues."""
        return len(self.ids) - (len(self.prefix.ids) if self.prefix is not None else 0)

    def saved_here(self) -> DurablePrefix | None:
        """The durable prefix, if it holds tokens this generation made past the prefix it continues and
        past the cut before it."""
        d = self.durable
        return d if d is not None and d.tokens > max(len(self.ids) - self.generated_here(), self.floor) else None

    def progress(self) -> Progress | None:
        """What to make durable now: None while the durable prefix is as long as the tokens (or there
        are none yet: a cut before the first token has nothing to keep)."""
        if self.state != "generating" or not self.ids or (self.durable is not None and self.durable.tokens >= len(self.ids)):
            return None
        return self.snapshot()

    def snapshot(self) -> Progress:
        """The tokens and the reply so far, copied together: the call's own task may add a step while
        a save writes them, so what is kept must be taken before any await (a cut keeps the saved copy)."""
        return Progress(self, list(self.ids), list(self.logprobs), self.prompt_ids, _copy_message(self.message), self.segments())

    def saved(self, progress: Progress, receipt: Receipt, prompt_receipt: Receipt) -> None:
        """`progress` is durable; it becomes the durable prefix unless the tokens started over since."""
        n = len(progress.ids)
        if self.ids[:n] == progress.ids and (self.durable is None or self.durable.tokens < n):
            self.durable = DurablePrefix(n, receipt, prompt_receipt, progress.partial, progress.segments)

    @classmethod
    def stored(cls, record: CallRecord, stream: bool) -> LiveCall:
        call = cls(record.call_id, record.rollout_id or "", record.attempt or 0, stream, state="completed", result=record.data)
        call.done.set()
        return call

    def restart_from(self, prefix: Prefix | None) -> None:
        """The tokens start over from `prefix` (none: from nothing)."""
        self.prefix = prefix if prefix is not None and prefix.ids else None
        p = self.prefix
        self.ids = list(p.ids) if p else []
        self.logprobs = list(p.logprobs) if p else []
        self.tops = [()] * len(self.ids)
        self.message = _copy_message(p.message if p else {})
        self.steps = []  # the prefix joins them once the backend says it continues it (see pump)
        if not p:
            self.prefix_segments = []
            self.durable = None  # started over: an older durable prefix is not a prefix of this generation

    def segments(self) -> list[dict[str, Any]]:
        """Which policy version produced which tokens: a call cut under one version and continued under
        another records both, so staleness is known per token."""
        prefix = self.prefix_segments if self.prefix else []
        new = len(self.ids) - (len(self.prefix.ids) if self.prefix else 0)
        out = [dict(x) for x in prefix]
        if new or not out:
            if out and out[-1]["policy_version"] == self.policy_version:
                out[-1]["tokens"] += new
            else:
                out.append({"policy_version": self.policy_version, "tokens": new})
        return out

    async def pump(self, backend: GenerationBackend) -> bool:
        """Move steps from the backend into the call until it ends (False) or a cut lands (True).

        A cut never splits a token: the pending step is cancelled, so the prefix is exactly the
        tokens already received."""
        if self.prefix is None:
            self.restart_from(None)
        gen = backend.generate(self.request, self.prefix)
        cut_wait = asyncio.ensure_future(self.cut_requested.wait())
        step: asyncio.Future[Any] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(gen))
                await asyncio.wait({step, cut_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return True
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return False
                if isinstance(event, Start):
                    self.prompt_ids = event.prompt_token_ids
                    if event.continuation is not None:
                        self.continuation = self.extra["continuation"] = event.continuation
                        if event.continuation.get("mode") != "continued":  # the prefix is dropped, and why is recorded
                            self.restart_from(None)
                        elif self.prefix is not None:
                            # A streaming client gets one ordinary completion: the prefix as one delta, then the rest.
                            p = self.prefix
                            self.steps.append(Step(p.ids, p.logprobs, whole_delta(p.message) if p.message else {}))
                    continue
                if isinstance(event, End):
                    self.finish_reason, self.upstream_usage = event.finish_reason, event.usage
                    continue
                self.ids.extend(event.ids)
                self.logprobs.extend(event.logprobs)
                self.tops.extend(event.top_logprobs or [()] * len(event.ids))
                merge_delta(self.message, event.delta)
                self.steps.append(event)
                async with self.changed:
                    self.changed.notify_all()
        finally:
            cut_wait.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.wait({step})  # the generator must settle before it can be closed
            await gen.aclose()



def _copy_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in message.items()}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": dict(c["function"])} for c in message["tool_calls"]]
    return out


# Options that choose how the reply is shown, not what is generated: a call cut by a checkpoint may be
# asked again with them changed (streamed this time, with logprobs) and is still the same call.
PRESENTATION = ("stream", "stream_options", "logprobs", "top_logprobs")


def request_digest(payload: dict[str, Any]) -> str:
    """What makes two requests under one call id the same request: the body but its presentation options."""
    same = {k: v for k, v in payload.items() if k not in PRESENTATION}
    # surrogatepass: a conversation may hold a lone surrogate the model emitted (the log keeps it
    # exactly); every other string digests as it always did.
    return hashlib.sha256(canonical_json(same).encode("utf-8", "surrogatepass")).hexdigest()


__all__ = ["DurablePrefix", "LiveCall", "Progress", "TokenStore", "request_digest"]
