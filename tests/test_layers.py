"""The layers point one way: apps -> participants -> adapters -> engine, the engine imports no
HTTP or SQL library, within participants/ the server kinds sit over base/ over environments/ and no
kind imports another, and no modules of any package import each other round a circle. The contracts are in pyproject.toml ([tool.importlinter]); import-linter checks
them here, so CI does."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(cwd), "PATH": str(LINT.parent)})


def test_the_import_layers_of_the_package_hold() -> None:
    done = lint(ROOT / "pyproject.toml", ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 kept, 0 broken" in done.stdout


def contracts_section() -> str:
    """The [tool.importlinter] tables of pyproject.toml, as written there."""
    out, inside = [], False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            inside = line.strip("[]").startswith("tool.importlinter")
        if inside:
            out.append(line)
    assert tomllib.loads("\n".join(out))["tool"]["importlinter"]["contracts"]
    return "\n".join(out) + "\n"


PARTICIPANT_PACKAGES = tuple(f"participants/{p}" for p in ("agent", "base", "environment", "environments", "model",
                                                         "resources"))


def fake_house(tmp_path: Path, offender: str, imports: str) -> Path:
    """The four packages, empty but for one module that imports what it must not, under the
    project's own contracts."""
    for pkg in ("engine", "participants", "adapters", "apps", *PARTICIPANT_PACKAGES):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "adapters" / "postgres.py").write_text("")
    (tmp_path / offender / "bad.py").write_text(f"import {imports}\n")
    (tmp_path / "pyproject.toml").write_text(contracts_section())
    return tmp_path / "pyproject.toml"


def test_a_driver_importing_a_participant_breaks_the_layers(tmp_path: Path) -> None:
    done = lint(fake_house(tmp_path, "adapters", "participants"), tmp_path)
    assert done.returncode == 1 and "adapters.bad -> participants" in done.stdout, done.stdout


def test_a_participant_importing_an_application_breaks_the_layers(tmp_path: Path) -> None:
    done = lint(fake_house(tmp_path, "participants", "apps"), tmp_path)
    assert done.returncode == 1 and "participants.bad -> apps" in done.stdout, done.stdout


def test_the_engine_importing_aiohttp_breaks_its_contract(tmp_path: Path) -> None:
    done = lint(fake_house(tmp_path, "engine", "aiohttp"), tmp_path)
    assert done.returncode == 1 and "engine.bad -> aiohttp" in done.stdout, done.stdout


def test_a_server_importing_the_postgres_store_breaks_its_contract(tmp_path: Path) -> None:
    done = lint(fake_house(tmp_path, "participants", "adapters.postgres"), tmp_path)
    assert done.returncode == 1 and "participants.bad -> adapters.postgres" in done.stdout, done.stdout


def test_two_participants_modules_importing_each_other_break_the_no_circles_contract(tmp_path: Path) -> None:
    """Deferring one of the two imports into a function hides the circle from Python, not from the contract."""
    config = fake_house(tmp_path, "participants", "participants.other")
    (tmp_path / "participants" / "other.py").write_text("def later() -> None:\n    import participants.bad\n")
    done = lint(config, tmp_path)
    assert done.returncode == 1 and "no import circles among the modules of any package BROKEN" in done.stdout, done.stdout


def test_two_modules_of_one_kind_importing_each_other_break_the_no_circles_contract(tmp_path: Path) -> None:
    config = fake_house(tmp_path, "participants/base", "participants.base.other")
    (tmp_path / "participants" / "base" / "other.py").write_text("import participants.base.bad\n")
    done = lint(config, tmp_path)
    assert done.returncode == 1 and "No cycles are allowed in participants.base" in done.stdout, done.stdout


def test_one_server_kind_importing_another_breaks_the_layers(tmp_path: Path) -> None:
    """The kinds speak to each other over HTTP: the agent importing the model server is refused."""
    done = lint(fake_house(tmp_path, "participants/agent", "participants.model"), tmp_path)
    assert done.returncode == 1 and "participants.agent.bad -> participants.model" in done.stdout, done.stdout


def test_the_environments_importing_the_servers_shared_base_breaks_the_layers(tmp_path: Path) -> None:
    done = lint(fake_house(tmp_path, "participants/environments", "participants.base"), tmp_path)
    assert done.returncode == 1 and "participants.environments.bad -> participants.base" in done.stdout, done.stdout


def imports_of_tests(source: str) -> list[str]:
    """The imports in `source` that reach into the tests/ package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found += [n for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_nothing_outside_tests_imports_from_tests() -> None:
    # The benchmarks and testkit/ run without the test folder; the installed packages ship without it.
    offenders = {str(p.relative_to(ROOT)): imports_of_tests(p.read_text())
                 for folder in ("benchmarks", "testkit", "engine", "participants", "adapters", "apps")
                 for p in sorted((ROOT / folder).rglob("*.py"))}
    assert {p: found for p, found in offenders.items() if found} == {}
    assert imports_of_tests("from tests.stack import start_stack\nimport tests.pg\nfrom tests import waiting\n"
                            "from .tests import x\nimport testkit.pg\n") == ["tests.stack", "tests.pg", "tests"]


def test_no_module_of_the_runtime_packages_is_over_600_lines() -> None:
    """A file a newcomer reads whole: past 600 lines a module holds more than one concept."""
    long = {str(p.relative_to(ROOT)): n for pkg in ("engine", "adapters", "participants", "apps")
            for p in sorted((ROOT / pkg).rglob("*.py")) if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
