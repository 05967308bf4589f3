"""The README is a front door and docs/ the manual: the README stays short, its Quickstart holds the
two commands a fresh clone runs (and CI runs verbatim), every relative link in either resolves, and
docs/errors.md is what docs/generate_errors.py writes from engine/errors.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 200
QUICKSTART = [
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/rollbook demo",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest",
]

FENCE = re.compile(r"^ *(```|~~~).*?^ *\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """Every link target outside code blocks and code spans."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def test_link_targets_are_found_outside_code_only() -> None:
    text = ("[a](docs/a.md) and ![b](<img.png> \"title\") `[c](no.md)`\n```\n[d](no.md)\n```\n"
            "[e]: ../f.md\n[g](#anchor)")
    assert link_targets(text) == ["docs/a.md", "img.png", "#anchor", "../f.md"]


def test_readme_is_a_front_door_of_at_most_200_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_quickstart_holds_the_two_commands_a_fresh_clone_and_ci_run() -> None:
    """../shared/tools/fresh-clone-check takes the first fenced block after the Quickstart heading, and
    .ci/run runs the second command verbatim."""
    text = README.read_text()
    after = text[re.search(r"^#+ .*[Qq]uickstart", text, re.MULTILINE).end():]  # type: ignore[union-attr]
    block = re.search(r"^```[^\n]*\n(.*?)^```", after, re.MULTILINE | re.DOTALL)
    assert block is not None
    assert [line for line in block.group(1).splitlines() if line.strip()][:2] == QUICKSTART
    assert QUICKSTART[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file_that_exists() -> None:
    broken = []
    for path in markdown_files():
        for target in link_targets(path.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # an absolute URL (https:, mailto:) or an anchor in the same file
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def generate_errors() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_errors", ROOT / "docs" / "generate_errors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_errors_md_is_what_engine_errors_generates() -> None:
    checked_in = (ROOT / "docs" / "errors.md").read_text()
    assert checked_in == generate_errors().reference(), \
        "docs/errors.md is stale: run .venv/bin/python docs/generate_errors.py"


def test_docs_errors_md_names_every_error_code_with_its_status() -> None:
    from engine.errors import STATUS

    text = (ROOT / "docs" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (\d+) \|", text, re.MULTILINE))
    assert {code: int(status) for code, status in rows.items()} == STATUS
