"""A separate process that holds rollbook token-capture clients, driven over stdin/stdout.

The conformance suite calls factories for fresh clients; tests/adapters/test_nemo_gym_tokens.py makes each
one a proxy whose real client lives in one of these processes (round robin), so a record put by one
process is frozen, resolved and retired by another. One JSON request per line in, one reply out:

    {"op": "new", "kind": "capture" | "lineage"}           -> {"ok": handle}
    {"op": "call", "handle": h, "method": m, "args": {...}} -> {"ok": result} | {"error": {...}}

Run as `python -m tests.nemo_gym_worker DSN` from the repository root.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from typing import Any

from testkit import nemo_gym_env

nemo_gym_env.ensure()

from nemo_gym.token_id_capture.records import TokenEntry  # noqa: E402

from adapters.nemo_gym_tokens import RollbookLineageStore, RollbookTokenCapture  # noqa: E402
from engine.errors import RollbookError  # noqa: E402


async def _call(client: Any, method: str, args: dict[str, Any]) -> Any:
    if method == "put":
        return await client.put(TokenEntry.model_validate(args["entry"]))
    if method == "freeze":
        snap = await client.freeze(args["rollout_id"])
        return {"rollout_id": snap.rollout_id, "entries": [e.model_dump(mode="json") for e in snap.entries],
                "incomplete": snap.incomplete, "snapshot_id": snap.snapshot_id, "version": snap.version}
    if method == "resolve":
        res = await client.resolve(args["rollout_id"], args["request_items"])
        match = None if res.match is None else {
            "model_call_id": res.match.model_call_id, "cumulative_token_ids": list(res.match.cumulative_token_ids),
            "digest": res.match.digest}
        return {"status": res.status.value, "reason": res.reason, "match": match}
    if method in ("mark_incomplete", "begin_call", "drop", "close"):
        return await getattr(client, method)(**args)
    raise ValueError(f"unknown method {method}")


async def main(dsn: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    clients: dict[int, Any] = {}
    handles = itertools.count(1)
    while line := await reader.readline():
        request = json.loads(line)
        try:
            if request["op"] == "new":
                handle = next(handles)
                kind = {"capture": RollbookTokenCapture, "lineage": RollbookLineageStore}[request["kind"]]
                clients[handle] = kind(dsn)
                reply: dict[str, Any] = {"ok": handle}
            else:
                reply = {"ok": await _call(clients[request["handle"]], request["method"], request["args"])}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller, named
            code = exc.code if isinstance(exc, RollbookError) else type(exc).__name__
            reply = {"error": {"code": code, "detail": str(exc)}}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    for client in clients.values():
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
