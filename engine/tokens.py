"""What the engine knows of tokens: the record of one model call, receipts, and the store ports.

Token arrays never enter the log (a long generation would outgrow any event payload limit); a
model call's events carry `Receipt`s that point into a token store and vouch for what is there.
Implementations live in adapters.token_store; this module does no I/O.

THE TOKEN RECORD OF A MODEL CALL (`CallTokens`, the one place its shape is defined). Every
completed model call has, in its `call_completed` event:

    receipt         -> the generated token ids with the sampling logprob of each (one blob)
    prompt_receipt  -> the prompt token ids as the upstream tokenized them (one blob, no logprobs)
    finish_reason, usage, policy_version, segments (which policy version produced which tokens)

and its stream's `call_accepted` names the parent call (`parent_call_id`), the rollout and the
attempt. `CallTokens` joins those into one value; `to_token_entry()` gives NeMo Gym's `TokenEntry`
field names (prompt_token_ids, generation_token_ids, generation_log_probs, model_call_id,
parent_call_id, rollout_id) so an adapter converts it without loss.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from engine.events import canonical_json


def f32(x: float) -> float:
    """A logprob as the token store keeps it (PostgreSQL `real`): rounded to float32 once, at the edge,
    so what a client was told, what the store holds and what an export writes are the same number."""
    return f32s((float(x),))[0]


def f32s(values: Iterable[float]) -> tuple[float, ...]:
    """f32 of each value, a whole array at once: TypeError where one is not a number; one too large
    for float32 becomes infinite, which the token store refuses as not finite."""
    return tuple(array("f", values).tolist())


# Converted unsigned, bit 31 then checked on the bytes: array("I") takes Python ints about twice as fast as
# array("i") or min() and max() over them (76 against 201 and 293 us on 13,000 ids).
_BIT_31_BYTE = 3 if sys.byteorder == "little" else 0
_BELOW_BIT_7 = bytes(range(128))


def id_words(ids: Sequence[int]) -> array[int]:
    """Token ids as 32-bit words, each from 0 to 2**31 - 1 (what an integer[] element holds): OverflowError
    for one outside that range, TypeError for one that is not an integer."""
    words = array("I", ids)
    if words.itemsize != 4 or words.tobytes()[_BIT_31_BYTE::4].translate(None, _BELOW_BIT_7):
        raise OverflowError("a token id is past 2**31 - 1")
    return words


def token_digest(ids: Sequence[int], logprobs: Sequence[float] | None) -> str:
    """A token array's content address: sha256 of canonical_json({"ids": ids, "logprobs": logprobs}),
    the ids spelt by orjson (an integer has one spelling in both; a 13,000-id prompt takes a fifteenth
    of the time), the logprobs by canonical_json (orjson spells some floats otherwise: 1e-05)."""
    try:
        spelt = orjson.dumps(ids)
    except TypeError:  # not plain integers (an int past 64 bits): the slow spelling, the same digest
        spelt = canonical_json(list(ids)).encode()
    lps = b"null" if logprobs is None else canonical_json(logprobs).encode()
    return hashlib.sha256(b'{"ids":' + spelt + b',"logprobs":' + lps + b"}").hexdigest()


@dataclass(frozen=True)
class TokenArray:
    """What one blob holds: integer token ids, and the logprob of each when they were generated."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.ids):
            raise ValueError(f"{len(self.ids)} token ids but {len(self.logprobs)} logprobs")


@dataclass(frozen=True)
class Receipt:
    """A stored token sequence: where it is, what it hashes to, how many tokens it holds."""

    blob_id: str
    digest: str
    tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"blob_id": self.blob_id, "digest": self.digest, "tokens": self.tokens}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Receipt:
        return cls(str(d["blob_id"]), str(d["digest"]), int(d["tokens"]))


@dataclass(frozen=True)
class CallTokens:
    """One model call's training tokens (see the module docstring)."""

    model_call_id: str
    rollout_id: str
    attempt: int
    prompt_token_ids: tuple[int, ...]
    generation_token_ids: tuple[int, ...]
    generation_log_probs: tuple[float, ...]
    policy_version: str | None
    finish_reason: str | None = None
    parent_call_id: str | None = None
    segments: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def to_token_entry(self, model: str = "") -> dict[str, Any]:
        """NeMo Gym's TokenEntry fields (schema_version 1)."""
        return {
            "schema_version": 1, "rollout_id": self.rollout_id, "model_call_id": self.model_call_id, "model": model,
            "prompt_token_ids": list(self.prompt_token_ids), "generation_token_ids": list(self.generation_token_ids),
            "generation_log_probs": list(self.generation_log_probs), "parent_call_id": self.parent_call_id,
            "cum_len": len(self.prompt_token_ids) + len(self.generation_token_ids),
        }


class TokenSink(Protocol):
    async def put(self, ids: list[int], logprobs: list[float] | None = None) -> Receipt:
        """Store token ids (and their logprobs) durably; the receipt is valid once this returns."""
        ...


class TokenSource(Protocol):
    async def get(self, blob_id: str) -> TokenArray:
        """The stored tokens; raises InvalidCheckpointState if missing or not matching their digest."""
        ...

