"""Every error the servers return, in one JSON shape, with the status engine/errors.py gives its code."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from pydantic import ValidationError

from engine.errors import STATUS, RollbookError

log = logging.getLogger("rollbook.http")


def error_response(code: str, detail: str, **context: object) -> web.Response:
    # `message` and `type` beside rollbook's `code` and `detail`: OpenAI's error shape, so an OpenAI
    # SDK pointed at the model server shows the sentence instead of a bare status.
    body: dict[str, object] = {"code": code, "detail": detail, "message": detail, "type": code}
    if context:
        body["context"] = context
    return web.json_response({"error": body}, status=STATUS.get(code, 500))


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
        return error_response("invalid_request", f"the request body is not JSON: {exc}")
    except ConnectionResetError:
        if request.content.exception() is None:
            raise  # not the caller: something this handler called went away
        # The caller went away before its request body arrived (it was killed): nobody waits for
        # an answer, and it is not a fault of this server, so one line instead of a traceback.
        log.info("%s %s: the client closed the connection before its request body arrived", request.method, request.path)
        return error_response("invalid_request", "the client closed the connection before its request body arrived")
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return error_response("not_found" if exc.status == 404 else "invalid_request", exc.reason)
        raise
