"""Every JSON reply of the servers (`json_reply`, written by engine.events.dumps), and every error
they return: one JSON shape, one HTTP status per code.

The shape is `{"error": {"code", "detail", "message", "type"}}` (plus `context` when there is some):
`code` and `detail` are rollbook's; `message` and `type` are OpenAI's, so an OpenAI SDK pointed at
the model server shows the message. The status of each code is the one engine/errors.py declares.
Anything unforeseen is a JSON `internal_error`, never a page.
"""

from __future__ import annotations

import functools
import json
import logging

from aiohttp import web
from pydantic import ValidationError

from engine.errors import STATUS, RollbookError
from engine.events import dumps

log = logging.getLogger("rollbook.http")

# OpenAI's error `type` by status, so its SDKs raise the matching exception class.
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}

# web.json_response, written several times faster than json.dumps writes it (engine.events.dumps).
json_reply = functools.partial(web.json_response, dumps=dumps)


def error_body(code: str, detail: str, **context: object) -> dict[str, object]:
    """The one error shape, for replies and for the error event of a stream alike."""
    status = STATUS.get(code, 500)
    body: dict[str, object] = {"code": code, "detail": detail, "message": detail,
                               "type": _OPENAI_TYPE.get(status, "api_error" if status >= 500 else "invalid_request_error")}
    if context:
        body["context"] = context
    return {"error": body}


def error_response(code: str, detail: str, **context: object) -> web.Response:
    return json_reply(error_body(code, detail, **context), status=STATUS.get(code, 500))


@web.middleware
async def errors_as_json(request: web.Request, handler):  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except RollbookError as exc:
        return error_response(exc.code, exc.detail, **exc.context)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        return error_response("invalid_request", f"the request body is not valid: {problems}")
    except json.JSONDecodeError as exc:
        return error_response("invalid_json", f"the request body is not JSON: {exc}")
    except ConnectionResetError:
        if request.content.exception() is None:
            raise  # not the caller: something this handler called went away
        # The caller went away before its request body arrived (it was killed): nobody waits for
        # an answer, and it is not a fault of this server, so one line instead of a traceback.
        log.info("%s %s: the client closed the connection before its request body arrived", request.method, request.path)
        return error_response("invalid_request", "the client closed the connection before its request body arrived")
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status, "invalid_request")
            return error_response(code, exc.reason)
        raise
    except Exception as exc:  # a bug: still JSON with a stable code; the detail names the type, never a secret
        request.app.logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal_error", f"internal error ({type(exc).__name__})")
