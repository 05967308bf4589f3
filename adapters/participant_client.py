"""The coordinator's HTTP client for participants' control planes."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from engine.errors import DeadlineExceeded, RollbookError

CONTROL = "/rollbook/v1/control"


def _error_classes() -> dict[str, type[RollbookError]]:
    out: dict[str, type[RollbookError]] = {}
    stack: list[type[RollbookError]] = [RollbookError]
    while stack:
        cls = stack.pop()
        out.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return out


class RemoteError(RollbookError):
    """An error code this client does not know; the code is kept as the server sent it."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def raise_for_error(status: int, body: Any) -> None:
    """Turn a participant's JSON error back into the engine exception of the same code."""
    if status < 400:
        return
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code, detail = err.get("code", f"http_{status}"), err.get("detail", str(body))
    cls = _error_classes().get(code)
    if cls is None:
        raise RemoteError(code, detail)
    raise cls(detail, **(err.get("context") or {}))


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
                resp_cm = self.session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))
            async with resp_cm as resp:
                data = await resp.json(content_type=None)
                raise_for_error(resp.status, data)
                return dict(data)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.name} did not answer {operation} in time") from exc
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{self.name} at {self.base_url} is unreachable: {exc}") from exc
