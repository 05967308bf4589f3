"""The resources server's request and reply bodies: what a caller sends and gets back, validated at
the edge (participants/resources/server.py serves them; docs/openapi is generated from them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from participants.base.guard import Body, Identifier
from participants.base.wire import TaskBody


class OpenRequest(Body):
    env: Identifier
    task: TaskBody


class ToolRequest(Body):
    arguments: dict[str, Any] = {}


class SessionReply(BaseModel):
    state_mode: str
    verification: str
    revision: int
    tools: list[dict[str, Any]]


class ToolReply(BaseModel):
    output: Any
    revision: int
    done: bool
    repeated: bool | None = None


class VerifyReply(BaseModel):
    reward: float
    status: str
    revision: int
    repeated: bool | None = None  # the recorded answer of a verify asked again
    closed: bool | None = None  # the session is closed (a passed verify closes it in its own append): ask no close


class StateReply(BaseModel):
    state: Any
    revision: int
