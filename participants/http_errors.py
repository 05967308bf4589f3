"""Every error the servers return: one JSON shape, one HTTP status per code, mapped here only."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from pydantic import ValidationError

from engine.errors import RollbookError

log = logging.getLogger("rollbook.http")

STATUS: dict[str, int] = {
    "invalid_request": 400,
    "invalid_identifier": 400,
    "invalid_payload": 400,
    "unsupported_parameter": 400,
    "invalid_deadline": 400,
    "payload_too_large": 413,
    "rollout_id_required": 400,
    "unauthorized": 401,
    "unknown_checkpoint": 404,
    "not_found": 404,
    "deadline_exceeded": 408,
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "stale_attempt": 409,
    "unknown_attempt": 409,
    "restart_in_scope": 409,
    "admission_closed": 409,
    "activation_out_of_order": 409,
    "attempt_lost": 409,
    "version_conflict": 409,
    "token_entry_conflict": 409,
    "capture_frozen": 409,
    "capture_retired": 409,
    "task_conflict": 409,
    "invalid_checkpoint_state": 422,
    "tool_error": 422,
    "episode_failed": 500,
    "schema_mismatch": 500,
    "replay_divergence": 500,
    "participant_unavailable": 503,
    "generation_failed": 502,
    "database_unavailable": 503,
}


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
