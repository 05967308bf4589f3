"""What the relay's client costs the resources server per call to a NeMo Gym server, against what it replaced.

    .venv/bin/python -m benchmarks.relay_client [--sessions 8] [--calls 200] [--rounds 5]

A NeMo Gym server stand-in (aiohttp, in a process of its own, so its CPU is not counted) answers every
POST with the body it got and sets a session cookie on `/seed_session`. In this process, `--sessions`
live sessions are seeded and then make `--calls` tool calls each, all sessions at once, as the resources
server's event loop makes them, with a Workplace-sized tool call (its arguments and a reply of about
1.5 KB). Two clients, alternated round by round, medians of the rounds:

- `relay`: `participants.environments.nemo_gym_relay.Live.post`, an async pooled client
  (participants/environments/gym_http.py);
- `thread`: the client it replaced (until 2026-12-07): kept-alive `http.client` connections, one per
  call in flight, each call run through `asyncio.to_thread` (kept here as the reference). Both write
  and read the JSON with the same functions (`engine.events.dumps` and `loads`).

Reports this process's CPU (user and system) per call, and wall time per round (noisy). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.processes import free_port  # noqa: E402
from engine.events import dumps, loads  # noqa: E402
from participants.environments.gym_http import Cookies, close_all  # noqa: E402
from participants.environments.nemo_gym_relay import Live  # noqa: E402

SERVER = """
import sys
from aiohttp import web
async def echo(request):
    body = await request.read()
    resp = web.Response(body=body, content_type="application/json")
    if request.path == "/seed_session":
        resp.set_cookie("session", "s" * 40)
    return resp
app = web.Application()
app.router.add_post("/{tail:.*}", echo)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""
ARGUMENTS = {"query": "quarterly review", "sender": "alex.kim@atlas.com", "recipients": ["sam.lee@atlas.com"] * 4,
             "body": "Please find the figures for the review attached. " * 20}


class ThreadClient:
    """The reference: kept-alive http.client connections shared by threads, a call per thread hop."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()

    def _post(self, path: str, body: bytes, cookies: Cookies) -> tuple[int, bytes]:
        with self.lock:
            conn = self.idle.pop() if self.idle else http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if (cookie := cookies.header()) is not None:
            headers["Cookie"] = cookie
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        raw = resp.read()
        cookies.take(resp.headers.get_all("Set-Cookie") or [])
        with self.lock:
            self.idle.append(conn)
        return resp.status, raw

    async def post(self, path: str, body: dict[str, Any], cookies: Cookies) -> Any:
        status, raw = await asyncio.to_thread(self._post, path, dumps(body).encode(), cookies)
        assert status == 200
        return loads(raw)


async def one_round(way: str, port: int, sessions: int, calls: int, reference: ThreadClient) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of `calls` tool calls on each of `sessions` sessions, seeded first."""
    lives = [Live(f"http://127.0.0.1:{port}", None, 30.0) for _ in range(sessions)]
    cookies = [Cookies() for _ in range(sessions)]

    async def post(i: int, path: str, body: dict[str, Any]) -> Any:
        if way == "relay":
            return await lives[i].post(path, body)
        return await reference.post(path, body, cookies[i])

    async def session(i: int) -> None:
        await post(i, "/seed_session", {"row": i})
        for n in range(calls):
            reply = await post(i, "/email_send_email", {**ARGUMENTS, "n": n})
            assert reply["n"] == n

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    return time.process_time() - cpu0, time.perf_counter() - wall0


async def run(args: argparse.Namespace, port: int) -> dict[str, Any]:
    reference = ThreadClient(port)
    cpu: dict[str, list[float]] = {"relay": [], "thread": []}
    wall: dict[str, list[float]] = {"relay": [], "thread": []}
    n = args.sessions * (args.calls + 1)
    await one_round("relay", port, args.sessions, 5, reference)  # warm both: connections, imports, threads
    await one_round("thread", port, args.sessions, 5, reference)
    for r in range(args.rounds):
        for way in ("relay", "thread") if r % 2 == 0 else ("thread", "relay"):
            c, w = await one_round(way, port, args.sessions, args.calls, reference)
            cpu[way].append(1e6 * c / n)
            wall[way].append(w)
            print(f"[relay_client] round {r + 1}/{args.rounds} {way}: {1e6 * c / n:.0f} us CPU per call", file=sys.stderr)
    await close_all()
    med = {way: statistics.median(v) for way, v in cpu.items()}
    return {"sessions": args.sessions, "calls_per_session": args.calls, "rounds": args.rounds,
            "cpu_us_per_call": {way: round(v, 1) for way, v in med.items()},
            "ratio_relay_to_thread": round(med["relay"] / med["thread"], 3),
            "cpu_us_per_call_rounds": {way: [round(x, 1) for x in v] for way, v in cpu.items()},
            "wall_s_median_noisy": {way: round(statistics.median(v), 3) for way, v in wall.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the stand-in server did not start") from None
                time.sleep(0.1)
        print(json.dumps(asyncio.run(run(args, port)), indent=1))
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
