"""A small deterministic tokenizer and output distribution for the scripted policy.

The scripted policy (participants.model.backends.scripted) decides *what* to say; this module decides how a
model would emit it, so the scripted backend produces real integer token ids and logprobs, the
way a vLLM server does:

- Vocabulary: ids 0-255 are raw bytes (a byte-level fallback, so any text encodes and decodes
  exactly), then five special tokens, then a few hundred common words with and without a
  leading space. Text is split into pieces (scripted_tokens); a piece in the
  vocabulary is one id, any other piece is its UTF-8 bytes.
- Chat template: ChatML (`<|im_start|>role\\n ... <|im_end|>\\n`), tools in a system block, and the
  assistant's tool calls written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
  `prompt_ids` ends with the generation prompt `<|im_start|>assistant\\n`.
- A reply is rendered as `Piece`s: the ids of one piece of text and the OpenAI chat delta those
  ids stand for (content text, or a piece of a tool call), ending with `<|im_end|>` (EOS).
- Logprobs: each generated token is the argmax of a 4-way distribution whose logits are a hash of
  (prompt, position, token id); `token_logprobs` gives its logprob and the three alternatives.
  Deterministic, so a regenerated or continued call has the same logprobs to the bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_WORDS = (
    "the a an and or of to in on for with is are was be it this that you I we they he she not no yes "
    "what which who how when where why do does did have has had can could will would should may must "
    "hand card cards hit stand dealer player total bust win lose draw score blackjack "
    "answer number result sum math is equals plus minus times "
    "email send deal update create event meeting calendar customer name subject body date time "
    "run command file files output error ok done stop made many tool calls here will "
    "string match text word words letter reverse copy "
    "content role assistant user system function arguments id type call "
    "true false null"
).split()
VOCAB: tuple[str, ...] = SPECIALS + tuple(dict.fromkeys(w for word in _WORDS for w in (word, " " + word)))
BYTE_TOKENS = 256
SPECIAL_ID = {s: BYTE_TOKENS + i for i, s in enumerate(SPECIALS)}
_PIECE_ID = {p: BYTE_TOKENS + i for i, p in enumerate(VOCAB)}
VOCAB_SIZE = BYTE_TOKENS + len(VOCAB)
EOS = SPECIAL_ID["<|im_end|>"]
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


_TOKEN = re.compile(r"\s*(?:[A-Za-z]+|\d{1,3}|[^\sA-Za-z\d])|\s+")


def scripted_tokens(text: str | None) -> list[str]:
    """Token-like pieces (a word or up to 3 digits with its leading space); they join back to ``text``."""
    return _TOKEN.findall(text or "")


def encode(text: str) -> list[int]:
    ids: list[int] = []
    for part in _SPECIAL_SPLIT.split(text):
        if part in SPECIAL_ID:
            ids.append(SPECIAL_ID[part])
            continue
        for piece in scripted_tokens(part):
            ids.extend(_piece_ids(piece))
    return ids


def _piece_ids(piece: str) -> list[int]:
    known = _PIECE_ID.get(piece)
    return [known] if known is not None and piece not in SPECIAL_ID else list(piece.encode("utf-8", "surrogatepass"))


def decode(ids: list[int] | tuple[int, ...]) -> str:
    out = bytearray()
    for i in ids:
        if 0 <= i < BYTE_TOKENS:
            out.append(i)
        elif BYTE_TOKENS <= i < VOCAB_SIZE:
            out.extend(VOCAB[i - BYTE_TOKENS].encode("utf-8", "surrogatepass"))
        else:
            raise ValueError(f"token id {i} is not in the scripted vocabulary (size {VOCAB_SIZE})")
    # A model's text may hold a lone surrogate (a misbehaving upstream's "\ud800"): its bytes come
    # back as the same code point, so decode(encode(text)) == text for any text. A prefix cut inside
    # a character still decodes, with a replacement character.
    try:
        return out.decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        return out.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Piece:
    """Some whole tokens of a reply and the chat-completions delta they stand for ({} for markup)."""

    ids: tuple[int, ...]
    delta: dict[str, Any]


def _text_pieces(text: str, delta_for: Any) -> list[Piece]:
    return [Piece(tuple(_piece_ids(p)), delta_for(p)) for p in scripted_tokens(text)]


def reply_pieces(message: dict[str, Any]) -> list[Piece]:
    """How the scripted model emits `message`: content, then each tool call, then EOS."""
    content = message.get("content")
    if isinstance(content, list):  # a client sends its history's text as parts, as a chat template joins them
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    pieces = _text_pieces(content or "", lambda p: {"content": p})
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") or {}
        name, args = str(fn.get("name") or ""), str(fn.get("arguments") or "")
        header = {"tool_calls": [{"index": i, "id": tc.get("id"), "type": "function",
                                  "function": {"name": name, "arguments": ""}}]}
        pieces.append(Piece((SPECIAL_ID["<tool_call>"],), header))
        pieces += _text_pieces('{"name": ' + json.dumps(name) + ', "arguments": ', lambda p: {})
        pieces += _text_pieces(args, lambda p, i=i: {"tool_calls": [{"index": i, "function": {"arguments": p}}]})
        pieces += _text_pieces("}", lambda p: {})
        pieces.append(Piece((SPECIAL_ID["</tool_call>"],), {}))
    pieces.append(Piece((EOS,), {}))
    return pieces


def _render(message: dict[str, Any]) -> list[int]:
    role = str(message.get("role") or "user")
    head = [SPECIAL_ID["<|im_start|>"], *encode(role + "\n")]
    if role == "assistant":
        body = [i for p in reply_pieces(message) for i in p.ids]  # exactly what the model generated, EOS included
        return head + body + encode("\n")
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return head + encode(text) + [EOS] + encode("\n")


def prompt_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    ids: list[int] = []
    if tools:
        ids += [SPECIAL_ID["<|im_start|>"], *encode("system\n# Tools\n" + json.dumps(tools, sort_keys=True)), EOS, *encode("\n")]
    for m in messages:
        ids += _render(m)
    return ids + [SPECIAL_ID["<|im_start|>"], *encode("assistant\n")]


def prompt_digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).digest()


def token_logprobs(context: bytes, position: int, token_id: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The logprob of `token_id` at `position` after a prompt hashed to `context`, and the `top`
    most likely tokens there (it is always the first: the scripted model is greedy)."""
    h = hashlib.blake2b(context + position.to_bytes(4, "big") + token_id.to_bytes(4, "big"), digest_size=8).digest()
    u = [b / 255 for b in h[:4]]
    logits = [4.0 + u[0], 2.0 + u[1], 1.5 + u[2], 1.0 + u[3]]
    alts = [token_id] + [(token_id + 1 + 37 * j) % VOCAB_SIZE for j in range(3)]
    norm = math.log(sum(math.exp(z) for z in logits))
    lps = [z - norm for z in logits]
    return lps[0], list(zip(alts, lps, strict=True))[: max(0, top)]
