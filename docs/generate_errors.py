"""Write docs/errors.md, the reference of every error rollbook raises, from engine/errors.py.

    .venv/bin/python docs/generate_errors.py

Each error class there carries its stable `code` and its HTTP `status`; its docstring says when it is
raised. tests/test_docs.py fails when the checked-in file is not what this writes.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import engine.errors as errors  # noqa: E402

NO_DOCSTRING = "*(no docstring in `engine/errors.py` yet)*"


def _when(cls: type[BaseException]) -> str:
    """The class's own docstring on one line (a subclass does not inherit its parent's)."""
    doc = vars(cls).get("__doc__")
    if not doc:
        return NO_DOCSTRING
    return " ".join(inspect.cleandoc(doc).split()).replace("|", "\\|")


def _classes() -> list[type[BaseException]]:
    """Every exception class defined in engine/errors.py, in the order it is defined there."""
    return [obj for obj in vars(errors).values()
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__]


def _kind(cls: type[BaseException]) -> str:
    """The class, and its parent when that is not the root (a caller catching the parent catches it too)."""
    parent = cls.__bases__[0]
    name = f"`{cls.__name__}`"
    if parent is errors.RollbookError or parent.__module__ != errors.__name__:
        return name
    return f"{name}, a subclass of `{parent.__name__}`"


def reference() -> str:
    """docs/errors.md: every error class, its code, its HTTP status and when it is raised."""
    coded = sorted((c for c in _classes() if issubclass(c, errors.RollbookError)),
                   key=lambda c: (c.code, c.__name__))
    others = [c for c in _classes() if not issubclass(c, errors.RollbookError)]
    but = f" but {', '.join(f'`{c.__name__}`' for c in others)} (below)" if others else ""
    lines = [
        "# Errors",
        "",
        "Every error rollbook raises, generated from `engine/errors.py` by `python docs/generate_errors.py`;",
        "do not edit by hand. Each class carries its `code`, stable and part of the public contract, and the",
        "HTTP `status` a server answers it with; a server's JSON error is",
        '`{"error": {"code", "detail", "message", "type"}}` (see [protocol.md](protocol.md)).',
        f"Every class{but} derives from `RollbookError`, so a caller catches the root or exactly what it means.",
        "\"When\" is the class's own docstring.",
        "",
        "| code | HTTP status | class | when |",
        "|:--|--:|:--|:--|",
    ]
    lines += [f"| `{c.code}` | {c.status} | {_kind(c)} | {_when(c)} |" for c in coded]
    for cls in others:
        lines += [
            "",
            f"## `{cls.__name__}`",
            "",
            "Not a `RollbookError`: it has no code and no HTTP status.",
            "",
            _when(cls),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    (HERE / "errors.md").write_text(reference())
    print(f"wrote {HERE / 'errors.md'}")
