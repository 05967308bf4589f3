"""The coordinator's HTTP client for participants' control planes."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from adapters.http_client import CONTROL, error_from_reply
from engine.errors import DeadlineExceeded


class HttpParticipant:
    def __init__(self, name: str, kind: str, base_url: str, token: str, session: aiohttp.ClientSession) -> None:
        self.name = name
        self.kind = kind
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.session = session

    async def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = max(1.0, float(body.get("deadline", time.time() + 30)) - time.time() + 5)
        headers = {"Authorization": f"Bearer {self.token}"}
        url = f"{self.base_url}{CONTROL}/{operation}"
        try:
            if operation == "status":
                resp_cm = self.session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))
            else:
                # The deadline travels with this clock's reading: the receiver judges the span, not the instant.
                resp_cm = self.session.post(url, json={**body, "sent_at": time.time()}, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout))
            async with resp_cm as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise error_from_reply(resp.status, data)
                return dict(data)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.name} did not answer {operation} in time") from exc
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{self.name} at {self.base_url} is unreachable: {exc}") from exc
