"""One OpenAPI 3.1 document per server, generated from its `Route`s and the pydantic models that parse them.

The control plane and the server's data plane alike: every route with its path and header
parameters, its request body (the very model `participants.base.guard.read_body` validates with), its
reply and the error codes it can answer with. Every operation needs a bearer credential; its
description says which one.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.errors import Forbidden, InvalidJson, InvalidRequest, PayloadTooLarge, RollbookError, Unauthorized
from participants.base.guard import PATH_PARAMETERS, Route
from participants.base.wire import ErrorReply

# Every operation may answer these: a bad credential, a body over the limit or not JSON, a body that
# does not validate, a server that is not ready; `default` documents any other error status.
ALWAYS: tuple[type[RollbookError], ...] = (Unauthorized, Forbidden, InvalidRequest, InvalidJson, PayloadTooLarge)
_SCOPE = {"control": "the control credential", "data": "the data credential", "any": "either credential"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def document(title: str, routes: list[Route]) -> dict[str, Any]:
    models: set[type[BaseModel]] = {ErrorReply}
    for r in routes:
        models |= {m for m in (r.body, r.reply) if m is not None}
    _, schemas = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                    ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": _ref(ErrorReply)}}
    paths: dict[str, Any] = {}
    for r in routes:
        ok_schema = _ref(r.reply) if r.reply is not None else {"type": "object"}
        content: dict[str, Any] = ({m: {"schema": {"type": "string"}} for m in r.media} if r.media
                                   else {"application/json": {"schema": ok_schema}})
        if r.stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        responses: dict[str, Any] = {"200": {"description": "ok", "content": content}}
        for refusal in dict.fromkeys((*ALWAYS, *r.errors)):
            code = refusal.code
            if refusal in (InvalidRequest, InvalidJson, PayloadTooLarge) and r.body is None:  # no body to refuse
                continue
            status = str(refusal.status)
            entry = responses.setdefault(status, {"description": "", "content": error})
            entry["description"] = ", ".join(filter(None, [entry["description"], code]))
        responses["default"] = {"description": "any other error, with its stable code", "content": error}
        params: list[dict[str, Any]] = [
            {"name": name, "in": "path", "required": True, "schema": PATH_PARAMETERS[name]}
            for name in re.findall(r"{(\w+)}", r.path)
        ]
        params += [{"name": h.name, "in": "header", "required": h.required, "description": h.description,
                    "schema": {"type": "string", "pattern": h.pattern}} for h in r.headers]
        op: dict[str, Any] = {
            "operationId": r.operation_id,
            "description": f"Needs {_SCOPE[r.scope]}" + (" (bearer, or the password of HTTP Basic)." if r.basic else "."),
            "security": [{"bearer": []}, {"basic": []}] if r.basic else [{"bearer": []}],
            "responses": responses,
        }
        if params:
            op["parameters"] = params
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(r.body)}}}
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {}), "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "basic": {"type": "http", "scheme": "basic", "description": "the data credential as the password "
                      "(any user name); only on NeMo Gym's fronts, whose callers can set an address but no header"},
        }},
    }
