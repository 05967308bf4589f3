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


class VerifyRequest(Body):
    # The caller's last word on the session: it closes with the verification, in the verify's own
    # append, whatever the reward (an episode's verify step, whose close step follows at once). Without
    # it a failed verify keeps the session, to go on or verify again.
    close: bool = False


class VerifyReply(BaseModel):
    reward: float
    status: str
    revision: int
    repeated: bool | None = None  # the recorded answer of a verify asked again
    closed: bool | None = None  # the session closed with the verify (passed, or asked to close): ask no close


class StateReply(BaseModel):
    state: Any
    revision: int
