"""The control plane's OpenAPI 3 document, generated from its pydantic models."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from engine.errors import STATUS
from participants import control_plane as cp

_OPS: dict[str, tuple[str, type[Any] | None, type[Any], list[str]]] = {
    # path: (method, request model, reply model, error codes it can return)
    "status": ("get", None, cp.Status, ["unauthorized"]),
    "prepare": ("post", cp.ControlRequest, cp.PrepareReply,
                ["unauthorized", "invalid_request", "checkpoint_conflict", "stale_checkpoint", "deadline_exceeded"]),
    "renew": ("post", cp.ControlRequest, cp.OperationReply, ["unauthorized", "invalid_request", "checkpoint_conflict", "stale_checkpoint"]),
    "commit": ("post", cp.CommitRequest, cp.OperationReply,
               ["unauthorized", "invalid_request", "checkpoint_conflict", "stale_checkpoint", "invalid_phase", "restart_in_scope",
                "deadline_exceeded"]),
    "restore": ("post", cp.ControlRequest, cp.OperationReply,
                ["unauthorized", "invalid_request", "invalid_phase", "unknown_checkpoint", "invalid_checkpoint_state",
                 "stale_checkpoint", "checkpoint_conflict", "deadline_exceeded"]),
    "resume": ("post", cp.ControlRequest, cp.OperationReply,
               ["unauthorized", "invalid_request", "invalid_phase", "checkpoint_conflict", "stale_checkpoint"]),
    "retire": ("post", cp.RetireRequest, cp.OperationReply, ["unauthorized", "invalid_request"]),
    "forget": ("post", cp.ForgetRequest, cp.OperationReply, ["unauthorized", "invalid_request"]),
}


def document() -> dict[str, Any]:
    models = {m for _, req, rep, _ in _OPS.values() for m in (req, rep) if m is not None} | {cp.ErrorReply}
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for name, (method, req, rep, codes) in _OPS.items():
        responses: dict[str, Any] = {
            "200": {"description": "ok", "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{rep.__name__}"}}}}
        }
        for code in codes:
            status = str(STATUS[code])
            entry = responses.setdefault(status, {"description": "", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorReply"}}}})
            entry["description"] = ", ".join(filter(None, [entry["description"], code]))
        op: dict[str, Any] = {"operationId": name, "security": [{"bearer": []}], "responses": responses}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{req.__name__}"}}}}
        paths[f"{cp.CONTROL}/{name}"] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rollbook control plane", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {}), "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
