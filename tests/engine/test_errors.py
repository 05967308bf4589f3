"""Every error code is declared once, in engine/errors.py, with the HTTP status a server answers it
with; the servers' JSON errors and the OpenAPI document read that one table.

An error's JSON (engine.errors): its code and detail, and its context only when it has one.
"""

from __future__ import annotations

import importlib
import pkgutil

import engine.errors as E
from engine.errors import STATUS, RollbookError, StaleAttempt

PACKAGES = ("engine", "participants", "adapters", "apps")
NEEDS_NEMO_GYM = {"adapters.nemo_gym_tokens"}  # imports nemo_gym, which lives in its own test environment


def every_module() -> list[str]:
    names = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, f"{pkg}.") if m.name not in NEEDS_NEMO_GYM]
    return names


def subclasses(cls: type[RollbookError]) -> list[type[RollbookError]]:
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.__subclasses__())
    return out


def test_no_module_but_engine_errors_declares_an_error_code() -> None:
    for name in every_module():
        importlib.import_module(name)
    elsewhere = [f"{c.__module__}.{c.__qualname__}" for c in subclasses(RollbookError)
                 if "code" in vars(c) and c.__module__ != E.__name__ and c.__module__.split(".")[0] in PACKAGES]
    assert elsewhere == []


def test_every_code_has_one_class_and_one_status() -> None:
    ours = [c for c in subclasses(RollbookError) if c.__module__ == E.__name__]
    codes = [c.code for c in ours]
    assert sorted(codes) == sorted(set(codes)), "a code is declared twice"
    assert STATUS == {c.code: c.status for c in ours}
    assert (STATUS["generation_failed"], STATUS["database_unavailable"], STATUS["stale_attempt"]) == (502, 503, 409)


def test_an_error_answers_its_code_and_detail_and_its_context_only_when_it_has_one() -> None:
    assert StaleAttempt("gone").to_json() == {"error": {"code": "stale_attempt", "detail": "gone"}}
    assert StaleAttempt("gone", rollout_id="r", attempt=1).to_json() == {
        "error": {"code": "stale_attempt", "detail": "gone", "context": {"rollout_id": "r", "attempt": 1}}}
