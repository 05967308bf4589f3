"""What every server checks before a handler runs: who is calling, and whether the request parses.

Credentials. Two bearer tokens, compared in constant time and never logged:
- the control credential opens `/rollbook/v1/control/*` (held by the framework and its coordinator);
- the data credential opens every other route (held by the servers that call each other, and by
  the framework that dispatches rollouts to the environment server).
A known credential on the wrong plane is `forbidden` (403); anything else is `unauthorized` (401).
The OpenAPI document opens with either. The NeMo Gym fronts (`POST /run`, `POST /aggregate_metrics`)
also take the data credential as the password of HTTP Basic: NeMo Gym's collector and its
legacy_agent send no header of their own, only what their configured server address holds, and
aiohttp turns `http://rollbook:<data credential>@host:port` into `Authorization: Basic ...`.

Bodies. Read whole up to MAX_BODY_BYTES (`payload_too_large`, 413), then decoded as strict UTF-8 and
parsed as JSON within bounds (`invalid_json`, 400): nesting at most MAX_DEPTH, integers within 64
bits, finite numbers. Strings may hold any code point, NUL and lone surrogates included: a tool's
output or a model's text holds them, the next hop must carry them, and the log stores them (in an
escaped spelling, engine.events.escape_strings) and gives them back. Then the
route's pydantic model validates it in strict mode, unknown fields refused (`invalid_request`).
Only then does the handler run, so a refused request has changed nothing.

Routes. Each server declares its routes as `Route`s: method, path, handler, the body model that
parses the request and the reply model that describes the answer. The same declarations mount the
aiohttp routes and generate the server's OpenAPI document (participants.base.openapi).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from engine.capability import PREFIX as CAPABILITY
from engine.capability import capability_opens
from engine.errors import Forbidden, InvalidJson, PayloadTooLarge, RollbookError, Unauthorized
from engine.events import orjson_value
from engine.identity import ATTEMPT_MAX, ATTEMPT_PATTERN, ID_PATTERN, MAX_ID_LENGTH

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
MAX_STRING_CHARS = MAX_BODY_BYTES

Identifier = Annotated[str, Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)]
AttemptIndex = Annotated[int, Field(ge=0, le=ATTEMPT_MAX)]
Int64 = Annotated[int, Field(ge=INT_MIN, le=INT_MAX)]
Scope = Literal["control", "data", "any"]


class Body(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Empty(Body):
    """A body (or reply) with nothing in it: `{}`."""


# ---- credentials -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    control: str = field(repr=False)
    data: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.control or not self.data:
            raise ValueError("both the control and the data credential must be set")
        if self.control == self.data:
            raise ValueError("the control and the data credential must differ")


def _matches(given: bytes, token: str) -> bool:
    return hmac.compare_digest(given, b"Bearer " + token.encode())


def _basic_as_bearer(header: str) -> str:
    """`Basic base64(user:password)` as `Bearer password` (the user name is not checked); else ""."""
    try:
        decoded = base64.b64decode(header[len("Basic "):].strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return ""
    _, colon, password = decoded.partition(":")
    return f"Bearer {password}" if colon and password else ""


def check_credential(header: str | None, creds: Credentials, scope: Scope, basic: bool = False,
                     identity: tuple[str | None, str | None] = (None, None)) -> None:
    """Raise unless the Authorization header carries a credential that opens `scope`.

    `basic`: the route also takes the credential as the password of HTTP Basic (the NeMo Gym fronts).
    `identity`: the (rollout, attempt) the route's path names, if any: a capability for exactly that
    attempt (engine.capability) opens the data plane there, and only there."""
    header = header or ""
    if basic and header[:6].lower() == "basic ":
        header = _basic_as_bearer(header)
    given = header.encode("utf-8", "surrogateescape")
    # Both compared every time, so the time taken says nothing about which one nearly matched.
    control, data = _matches(given, creds.control), _matches(given, creds.data)
    if not (control or data):
        token = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        if token.startswith(CAPABILITY):
            if scope == "data" and capability_opens(token, creds.data, *identity):
                return
            if _capability_is_ours(token, creds.data):
                raise Forbidden("a capability opens only the data routes of its own rollout and attempt")
        raise Unauthorized("a valid bearer credential is required")
    if scope == "control" and not control:
        raise Forbidden("the control plane needs the control credential")
    if scope == "data" and not data:
        raise Forbidden("the data plane needs the data credential")


def _capability_is_ours(token: str, secret: str) -> bool:
    """A well-made capability used outside its attempt is forbidden (403); a forged one is unknown (401)."""
    named, _, _mac = token[len(CAPABILITY):].rpartition(".")
    rollout_id, _, attempt = named.rpartition(".")
    return bool(rollout_id) and capability_opens(token, secret, rollout_id, attempt)


# ---- bodies ------------------------------------------------------------------------------------


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise InvalidJson("an integer in the body is too large (at most 64 bits)")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise InvalidJson("an integer in the body is too large (at most 64 bits)")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJson(f"the number {text[:40]} is not finite")
    return value


def _constant(text: str) -> Any:
    raise InvalidJson(f"{text} is not JSON")


def parse_json(raw: bytes) -> Any:
    """Strict UTF-8 JSON within the bounds above, or InvalidJson."""
    # What orjson does not read as json.loads would (NaN, a number past a double or past 64 bits, a lone
    # surrogate, which the rule keeps) goes the slow way below, which says why it is refused, if it is.
    fast, value = orjson_value(raw)
    if fast:
        _within_depth(raw)
        return value
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"the body is not UTF-8 (byte {exc.start})") from None
    return parse_json_text(text)


def parse_json_text(text: str) -> Any:
    """parse_json's rule on text already decoded."""
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise InvalidJson(f"the body is nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise InvalidJson(f"the body is not JSON: {exc.msg} at {exc.pos}") from None
    _within_depth(text.encode("utf-8", "surrogatepass"))
    return value


# A JSON text's nesting, read from its bytes: once every escape (a backslash and the byte after it) is
# gone, every quote opens or closes a string, and what lies between a string's quotes (brackets among
# it) is dropped. Left: its brackets, in order.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = {0x5B: 1, 0x7B: 1, 0x5D: -1, 0x7D: -1}


def _within_depth(raw: bytes) -> None:
    """InvalidJson when the JSON text `raw`, parsed already (so well formed), nests deeper than MAX_DEPTH.
    Read from the bytes, not the parsed value: a walk of every value took 4 times as long as orjson's
    parse of a NeMo Gym row, and 11 times as long on a body of 16,000 numbers (a call's token ids)."""
    kept = _ESCAPE.sub(b"", raw).translate(None, _NOT_STRUCTURE)
    brackets = b"".join(kept.split(b'"')[::2])
    if brackets.count(b"[") + brackets.count(b"{") > MAX_DEPTH and \
            max(accumulate(map(_STEP.__getitem__, brackets))) > MAX_DEPTH:
        raise InvalidJson(f"the body is nested more than {MAX_DEPTH} levels deep")


def tool_arguments(raw: object) -> dict[str, Any]:
    """A model's tool-call arguments as the servers will read them: a JSON object under the same rule
    as any body (parse_json: finite numbers, 64-bit integers, 64 levels, the body's size), or
    InvalidJson saying why. The agent checks with this before it sends them, so whatever the model
    emits is a refusal it sees (`bad_arguments`), never a request a server refuses and the rollout
    fails on."""
    text = "{}" if raw is None or raw == "" else raw
    if not isinstance(text, str):
        raise InvalidJson("tool arguments must be a JSON object, written as a string")
    if len(text) > MAX_BODY_BYTES:
        raise InvalidJson(f"tool arguments are {len(text)} characters; the limit is {MAX_BODY_BYTES}")
    value = parse_json_text(text)
    if not isinstance(value, dict):
        raise InvalidJson("tool arguments must be a JSON object")
    return value


SENT_BODY = web.RequestKey("sent_body", object)  # the request's JSON body as parsed, before its model validated it


async def read_body(request: web.Request, model: type[BaseModel]) -> Any:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the body is {request.content_length} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the body is over the limit of {MAX_BODY_BYTES} bytes") from None
    value = parse_json(raw)
    # The body as sent, for a handler that passes it on: dumping a model of a NeMo Gym row back to JSON
    # cost several times its validation (pydantic walks every value typed Any).
    request[SENT_BODY] = value
    return model.model_validate(value, strict=True)


# ---- routes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A request header a route reads, documented in OpenAPI."""

    name: str
    pattern: str
    required: bool = True
    description: str = ""


Handler = Callable[[web.Request, Any], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    body: type[BaseModel] | None = None  # parses the request; None: the route takes no body
    reply: type[BaseModel] | None = None  # describes the 200 reply (None: any JSON object)
    errors: tuple[type[RollbookError], ...] = ()  # what it may answer besides 200, for the OpenAPI document
    scope: Scope = "data"
    headers: tuple[Header, ...] = ()
    stream: bool = False  # the 200 reply may also be text/event-stream
    name: str = ""
    basic: bool = False  # also HTTP Basic with the credential as password (clients that can only set a URL)
    media: tuple[str, ...] = ()  # the 200 reply is text in one of these media types, not JSON (GET /metrics)

    @property
    def operation_id(self) -> str:
        return self.name or self.handler.__name__.strip("_")

    def mount(self) -> web.RouteDef:
        body_model, handler = self.body, self.handler

        async def run(request: web.Request) -> web.StreamResponse:
            body = await read_body(request, body_model) if body_model is not None else None
            return await handler(request, body)

        run.rollbook_scope = self.scope  # type: ignore[attr-defined]  # read by the auth middleware
        run.rollbook_basic = self.basic  # type: ignore[attr-defined]
        return web.route(self.method, self.path, run)


def authenticate(creds: Credentials) -> Any:
    """The middleware that checks the credential before anything else (unknown paths too)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        scope = getattr(request.match_info.handler, "rollbook_scope", "any")
        basic = getattr(request.match_info.handler, "rollbook_basic", False)
        identity = (request.match_info.get("rollout_id"), request.match_info.get("attempt"))
        check_credential(request.headers.get("Authorization"), creds, scope, basic, identity)
        return await handler(request)

    return middleware


PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "rollout_id": {"type": "string", "pattern": ID_PATTERN, "maxLength": MAX_ID_LENGTH},
    "attempt": {"type": "string", "pattern": ATTEMPT_PATTERN},
    "name": {"type": "string", "pattern": ID_PATTERN, "maxLength": MAX_ID_LENGTH},
    # A NeMo Gym agent's activation id (participants.base.wire.capture_id): <rollout>.<attempt>.<activation>.
    "capture": {"type": "string", "pattern": ID_PATTERN, "maxLength": MAX_ID_LENGTH + 24},
}
