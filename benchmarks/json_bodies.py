"""What a server pays to read and write one JSON body, against the stdlib and the walk it replaced.

    .venv/bin/python -m benchmarks.json_bodies [--repeats 2000]

Two bodies: a chat call as an agent sends it on a Workplace task (six messages and the environment's
tool schemas), and a model call's token record (13,000 prompt ids, 3,000 completion ids and their
logprobs). For each, alternating in one process, medians of the per-call time of `--repeats` calls:
writing it with `json.dumps` against `engine.events.dumps` (what every client session and reply now
uses), and checking its nesting by walking the parsed value (the rule's check before 2026-12-07, kept
here as the reference) against the check on its bytes that `participants.base.guard.parse_json` makes,
beside orjson's parse of it alone; and the token record's 13,000 prompt ids made a tuple as the model
server takes them from an upstream, converted one by one (before 2026-12-07) against the check of the
whole list (`_integers`); and the same ids checked by the token store and packed for its blob row, as
until 2026-12-07 (min, max, array("i")) against now (unsigned words, bit 31 checked); and each body, and a small event payload, in the canonical spelling that
payloads are hashed and stored in: by json alone (before 2026-12-07) against `canonical_json` (orjson where
its text is json's). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.pg_arrays import INT4, _packed, int4s  # noqa: E402
from adapters.token_store import MAX_TOKEN_ID, normalize  # noqa: E402
from engine.events import _CANONICAL, canonical_json, dumps  # noqa: E402
from participants.base.guard import MAX_DEPTH, _within_depth, parse_json  # noqa: E402
from participants.environments import get_environment  # noqa: E402
from participants.model.backends.openai_compatible import _integers  # noqa: E402


def walked(value: Any) -> Any:
    """The nesting check as it was: every value of the parsed body visited."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                raise ValueError("too deep")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


def bodies() -> dict[str, Any]:
    tools = get_environment("workplace").tools()
    turn = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "email_search_emails", "arguments": '{"query": "quarterly report"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps([{"email_id": "00042", "subject": "Q3 report",
                                                                       "body": "Figures attached.\n" * 20}])}]
    chat = {"model": "policy", "messages": [{"role": "system", "content": "Today is Thursday.\n" * 5},
                                            {"role": "user", "content": "Reply to the last email about the report."},
                                            *turn, *turn], "tools": tools, "temperature": 1.0, "seed": 7}
    tokens = {"prompt_token_ids": list(range(13_000)), "token_ids": list(range(3_000)),
              "logprobs": [-0.25 - i / 10_000 for i in range(3_000)]}
    return {"chat call (Workplace)": chat, "token record": tokens}


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def measure(value: Any, repeats: int, rounds: int) -> dict[str, Any]:
    raw = orjson.dumps(value)
    parsed = orjson.loads(raw)
    assert json.loads(dumps(value)) == json.loads(json.dumps(value)) and parse_json(raw) == parsed
    ways: dict[str, Callable[[], Any]] = {
        "write: json.dumps": lambda: json.dumps(value),
        "write: engine.events.dumps": lambda: dumps(value),
        "read: orjson.loads alone": lambda: orjson.loads(raw),
        "nesting: walk of the value (before)": lambda: walked(parsed),
        "nesting: the bytes (now)": lambda: _within_depth(raw),
        "read: parse_json, the whole rule": lambda: parse_json(raw),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            times[name].append(per_call_us(ways[name], repeats))
    return {"bytes": len(raw), "us_per_call_median": {k: round(statistics.median(v), 1) for k, v in times.items()}}


def compared(ways: dict[str, Callable[[], Any]], repeats: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            times[name].append(per_call_us(ways[name], repeats))
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def prompt_ids(repeats: int, rounds: int) -> dict[str, Any]:
    """An upstream's 13,000 prompt ids made a tuple: each converted, as until 2026-12-07, against the
    model server's check of the whole list (`_integers`: a sum stays an int only over integers)."""
    ids = bodies()["token record"]["prompt_token_ids"]
    return {"ids": len(ids), "us_per_call_median": compared({
        "tuple(map(int, ids)) (before)": lambda: tuple(map(int, ids)),
        "_integers (now)": lambda: _integers(ids, "prompt_token_ids")}, repeats, rounds)}


def checked_and_packed_before(ids: list[int]) -> Any:
    """The token store's check of ids and the blob's integer[] as they were until 2026-12-07: the types,
    min() and max(), then array("i")."""
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise ValueError("not int32 ids")
    return tuple(ids), _packed(INT4, array("i", ids))


def stored_ids(repeats: int, rounds: int) -> dict[str, Any]:
    """The same 13,000 ids checked by the token store (`normalize`) and packed for its blob row (`int4s`):
    the range checked by min() and max() and packed through array("i") (before) against converted to
    unsigned words once for each and bit 31 checked on their bytes (now)."""
    ids = bodies()["token record"]["prompt_token_ids"]
    return {"ids": len(ids), "us_per_call_median": compared({
        "types, min, max, array('i') (before)": lambda: checked_and_packed_before(ids),
        "normalize and int4s (now)": lambda: (normalize(ids, None), int4s(ids))}, repeats, rounds)}


def canonical(repeats: int, rounds: int) -> dict[str, Any]:
    """The canonical spelling (sorted keys, no spaces) of each body and of a small payload, as json wrote
    it alone until 2026-12-07 against `canonical_json` now; the same text either way (asserted)."""
    values = {**bodies(), "small payload": {"rollout_id": "0-0", "attempt": 0, "step": "seed", "ok": True}}
    out: dict[str, Any] = {}
    for name, value in values.items():
        assert canonical_json(value) == _CANONICAL.encode(value)
        n = repeats // 10 if name == "token record" else repeats
        out[name] = {"bytes": len(canonical_json(value).encode()), "us_per_call_median": compared({
            "json (before)": lambda v=value: _CANONICAL.encode(v),
            "canonical_json (now)": lambda v=value: canonical_json(v)}, n, rounds)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    out = {name: measure(value, args.repeats, args.rounds) for name, value in bodies().items()}
    out["prompt ids of the token record"] = prompt_ids(args.repeats // 10, args.rounds)
    out["the same ids checked and packed by the token store"] = stored_ids(args.repeats // 10, args.rounds)
    out["canonical spelling"] = canonical(args.repeats, args.rounds)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
