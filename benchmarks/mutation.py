"""A mutation run over `engine/`: how many small, wrong versions of each rule the fast tests catch.

    .venv/bin/python -m benchmarks.mutation [--module attempts,phases] [--list] [--timeout S] [--out PATH]

For each module of `engine/` it makes one mutant per mutation point (`Mutator` says which), runs
that module's fast tests against it, and counts the mutant killed when a test fails (or the run
times out), survived when every test passes. The mutant never touches a file: the runner imports
pytest, the project's dependencies and the test modules' libraries once, then forks one child per
mutant; the child drops the project's modules from `sys.modules`, puts the mutated module's code in
front of the import system and runs pytest in-process. A run costs the tests, not an interpreter.

The fast tests are the module's test files (`TESTS`) less every test that asks for a PostgreSQL
fixture (`PG_FIXTURES`): those are deselected, so a mutant takes about a second. A test that runs
the code in another process cannot see the mutant, which is why the map names in-process tests.

Mutants a reviewer judged equivalent (no test could tell them from the original) are listed with a
one-line reason in `benchmarks/mutation_equivalents.toml`; the score is killed / (mutants less
those). The runner prints each survivor, the table per module, and writes everything to
`benchmarks/results/mutation.json`.
"""

from __future__ import annotations

import argparse
import ast
import copy
import fcntl
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = Path(__file__).with_name("mutation_equivalents.toml")
PROJECT_PACKAGES = ("engine", "participants", "adapters", "apps", "tests", "migrations")
PG_FIXTURES = {"dsn", "any_dsn", "store", "any_store", "demo_run", "demo_db"}

# Each module's fast tests: the files that exercise its rules in this process. The smaller and more
# central modules come first, so a partial run (`--module`) covers what most depends on.
TESTS: dict[str, list[str]] = {
    "attempts": ["engine/test_attempts.py", "engine/test_retry.py", "engine/test_checkpoint.py"],
    "phases": ["engine/test_phases.py", "engine/test_control.py"],
    "boundaries": ["engine/test_boundaries.py", "engine/test_checkpoint.py"],
    "identity": ["engine/test_identity.py", "engine/test_attempts.py", "engine/test_calls.py", "engine/test_sessions.py", "engine/test_phases.py"],
    "calls": ["engine/test_calls.py", "test_engine_calls.py"],
    "sessions": ["engine/test_sessions.py", "engine/test_checkpoint.py"],
    "recovery": ["engine/test_recovery.py"],
    "agent_replay": ["engine/test_agent_replay.py", "participants/agent/test_gym_agents.py",
                     "participants/model/test_agent_replay.py"],
    "checkpoint": ["engine/test_checkpoint.py", "engine/test_calls.py"],
    "log": ["engine/test_log.py", "engine/test_attempts.py"],
    "events": ["engine/test_events.py", "engine/test_log.py", "participants/base/test_bounds.py", "engine/test_checkpoint.py"],
    "projections": ["engine/test_projections.py"],
    "capability": ["engine/test_capability.py"],
    "patience": ["engine/test_patience.py", "test_engine_patience.py"],
    "retry": ["engine/test_retry.py", "engine/test_attempts.py"],
    "tokens": ["engine/test_tokens.py", "adapters/test_token_store.py"],
    "token_capture": ["engine/test_token_capture.py"],
    "control": ["engine/test_control.py"],
    "coordinator": ["engine/test_coordinator.py", "engine/test_checkpoint.py"],
    "errors": ["engine/test_errors.py", "test_docs.py"],
    "catalog": ["engine/test_catalog.py", "engine/test_checkpoint.py"],
}

COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
    ast.GtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Point:
    """One place a mutant differs from the original, named so that the name survives edits elsewhere."""

    index: int
    line: int
    end_line: int
    where: str  # the enclosing function or class, dotted
    kind: str
    before: str
    after: str

    @property
    def key(self) -> str:
        return f"{self.where} | {self.kind} | {self.before} -> {self.after}"


def _snippet(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 70 else text[:67] + "..."


class Mutator(ast.NodeTransformer):
    """Walks a module in a fixed order, numbering each mutation point; when `target` is that number it
    returns the mutated node. The kinds: a comparison flipped (== and !=, in and not in, is and is not
    swapped; < <= > >= moved by one), `and`/`or` swapped, an if/while/conditional test negated, a raise
    deleted, a return inside a branch deleted (the early return), an int constant moved by +1 and by
    -1, True and False swapped. Type annotations and `if TYPE_CHECKING:` blocks are left alone."""

    def __init__(self, target: int = -1) -> None:
        self.target = target
        self.points: list[Point] = []
        self.scope: list[str] = []
        self.branch_depth = 0

    def _point(self, node: ast.AST, kind: str, before: ast.AST, after: ast.AST) -> bool:
        index = len(self.points)
        where = ".".join(self.scope) or "<module>"
        line = getattr(node, "lineno", 0)
        self.points.append(Point(index, line, getattr(node, "end_lineno", None) or line, where, kind,
                                 _snippet(before), _snippet(after)))
        return index == self.target

    # Scopes, for names; annotations are skipped.
    def _scoped(self, node: Any) -> Any:
        self.scope.append(node.name)
        depth, self.branch_depth = self.branch_depth, 0
        # Decorators (`@dataclass(frozen=True)`) and base classes declare, they hold no rule to mutate.
        if hasattr(node, "args"):
            node.args = self._arguments(node.args)
        node.body = self._body(node.body)
        self.branch_depth = depth
        self.scope.pop()
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _arguments(self, args: ast.arguments) -> ast.arguments:
        args.defaults = [self.visit(d) for d in args.defaults]
        args.kw_defaults = [self.visit(d) if d is not None else None for d in args.kw_defaults]
        return args

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            new = self.visit(stmt)
            if isinstance(new, list):
                out.extend(new)
            elif new is not None:
                out.append(new)
        return out or [ast.Pass()]

    def _branches(self, node: Any, fields: tuple[str, ...]) -> Any:
        self.branch_depth += 1
        for name in fields:
            setattr(node, name, self._body(getattr(node, name)))
        self.branch_depth -= 1
        return node

    def _negated(self, node: Any) -> None:
        negated = ast.UnaryOp(op=ast.Not(), operand=node.test)
        if self._point(node, "negate", node.test, negated):
            node.test = ast.copy_location(negated, node.test)
        else:
            node.test = self.visit(node.test)

    def visit_If(self, node: ast.If) -> ast.AST:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return node
        self._negated(node)
        return self._branches(node, ("body", "orelse"))

    def visit_While(self, node: ast.While) -> ast.AST:
        self._negated(node)
        return self._branches(node, ("body", "orelse"))

    def visit_For(self, node: ast.For) -> ast.AST:
        node.iter = self.visit(node.iter)
        return self._branches(node, ("body", "orelse"))

    visit_AsyncFor = visit_For

    def visit_With(self, node: Any) -> ast.AST:
        node.items = [self.visit(item) for item in node.items]
        return self._branches(node, ("body",))

    visit_AsyncWith = visit_With

    def visit_Try(self, node: ast.Try) -> ast.AST:
        for handler in node.handlers:
            if handler.type is not None:
                handler.type = self.visit(handler.type)
        self.branch_depth += 1
        for handler in node.handlers:
            handler.body = self._body(handler.body)
        self.branch_depth -= 1
        return self._branches(node, ("body", "orelse", "finalbody"))

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self._negated(node)
        node.body = self.visit(node.body)
        node.orelse = self.visit(node.orelse)
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        if self._point(node, "delete raise", node, ast.Pass()):
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> ast.AST:
        if self.branch_depth and self._point(node, "delete early return", node, ast.Pass()):
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        for i, op in enumerate(node.ops):
            swapped = copy.copy(node)
            swapped.ops = list(node.ops)
            swapped.ops[i] = COMPARE_SWAP[type(op)]()
            if self._point(node, "compare", node, swapped):
                return swapped
        return self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        swapped = ast.BoolOp(op=ast.Or() if isinstance(node.op, ast.And) else ast.And(), values=node.values)
        if self._point(node, "and/or", node, swapped):
            return ast.copy_location(swapped, node)
        return self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        # `-1` is a minus applied to 1: moved as the number it spells, not as its digit.
        if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            value = node.operand.value
            if isinstance(value, int) and not isinstance(value, bool):
                return self._moved(node, -value)
        return self.generic_visit(node)

    def _moved(self, node: ast.AST, value: int) -> ast.AST:
        for delta in (1, -1):
            moved = ast.copy_location(ast.Constant(value + delta), node)
            if self._point(node, f"int {delta:+d}", node, moved):
                return moved
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, bool):
            flipped = ast.copy_location(ast.Constant(not node.value), node)
            return flipped if self._point(node, "true/false", node, flipped) else node
        if isinstance(node.value, int):
            return self._moved(node, node.value)
        return node


def module_path(name: str) -> Path:
    return ROOT / "engine" / f"{name}.py"


def points_of(name: str) -> tuple[ast.Module, list[Point]]:
    tree = ast.parse(module_path(name).read_text(), filename=str(module_path(name)))
    counter = Mutator()
    counter.visit(copy.deepcopy(tree))
    return tree, counter.points


def mutant_code(name: str, tree: ast.Module, index: int) -> CodeType:
    mutated = Mutator(target=index).visit(copy.deepcopy(tree))
    ast.fix_missing_locations(mutated)
    return compile(mutated, str(module_path(name)), "exec")


class _MutantLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module of the project from a code object instead of its file."""

    def __init__(self, fullname: str, path: Path, code: CodeType) -> None:
        self.fullname, self.path, self.code = fullname, path, code

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.fullname:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec: Any) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(self.code, module.__dict__)


class _NoDatabase:
    """A pytest plugin: deselects every test that asks for a PostgreSQL fixture."""

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        keep = [item for item in items if not PG_FIXTURES & set(getattr(item, "fixturenames", ()))]
        gone = [item for item in items if item not in keep]
        if gone:
            config.hook.pytest_deselected(items=gone)
        items[:] = keep


class _LinesRun:
    """A pytest plugin for the unmutated run: which lines of one file each test executes. A mutant is
    then run against only the tests that reach its lines (a test that never executes a line cannot
    tell a change there); a line no test reaches while running (a default, a constant: run at import)
    gets every test."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.order: list[str] = []
        self.lines: dict[int, set[str]] = {}
        self.current: str | None = None

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != self.path:
            return None
        if self.current is not None and event == "line":
            self.lines.setdefault(frame.f_lineno, set()).add(self.current)
        return self._trace

    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> None:
        self.current = item.nodeid
        self.order.append(item.nodeid)
        sys.settrace(self._trace)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        sys.settrace(None)
        self.current = None


def _preload(names: list[str]) -> None:
    """Import, once, what every child would otherwise import again: pytest, the third-party libraries,
    the project and the test modules (of which each child drops the mutated module and every module
    that imports it, directly or not: `_importers`)."""
    import pytest  # noqa: F401

    tests = sorted({f"tests.{f.removesuffix('.py').replace('/', '.')}" for n in names for f in TESTS[n] if (ROOT / "tests" / f).exists()})
    for name in ("hypothesis", "sqlalchemy", "aiohttp", "pydantic", "transitions", "yaml", "psycopg",
                 "prometheus_client", "adapters.postgres", "participants.agent.server", "apps.cli", "tests.conftest",
                 *tests):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _imports_of(module: ModuleType) -> set[str]:
    """The modules a module's source imports (anywhere in it), as absolute names."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return set()
    package = module.__name__ if path.endswith("__init__.py") else module.__name__.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return out


def _importers(target: str) -> set[str]:
    """`target` and every loaded module of the project that imports it, directly or through others."""
    graph = {name: _imports_of(mod) for name, mod in list(sys.modules.items())
             if name.split(".")[0] in PROJECT_PACKAGES and mod is not None}
    tainted = {target}
    grew = True
    while grew:
        grew = False
        for name, deps in graph.items():
            if name not in tainted and deps & tainted:
                tainted.add(name)
                grew = True
    return tainted


def _forget(names: set[str]) -> None:
    """Drop modules so the next import runs them again, their parent package's attribute with them
    (`from engine import catalog` would otherwise hand back the old one)."""
    for name in names:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            delattr(sys.modules[parent], child)


def pytest_args(name: str, extra: list[str]) -> list[str]:
    files = [str(ROOT / "tests" / f) for f in TESTS[name] if (ROOT / "tests" / f).exists()]
    if not files:
        raise SystemExit(f"no test file of {name} exists: {TESTS[name]}")
    # A map may name a file a later change adds (`test_engine_<module>.py`); the ones here are run.
    # The plugins the tests use, named: autoloading every installed one (schemathesis's among them) and
    # rewriting their asserts cost a second a mutant. Plain asserts fail as surely.
    plugins = ["xdist.plugin", "pytest_asyncio.plugin", "pytest_timeout", "_hypothesis_pytestplugin"]
    return files + [arg for p in plugins for arg in ("-p", p)] + [
        "-n", "0", "-x", "-q", "-p", "no:cacheprovider", "--assert=plain", "-o", "addopts=", *extra]


def run_child(name: str, code: CodeType | None, args: list[str], timeout: float, quiet: bool = True,
              lines_to: Path | None = None) -> str:
    """Fork, put the mutant in place, run pytest; 'passed', 'failed' or 'timeout'. With `lines_to`, the
    child writes there which tests executed which lines of the module (`_LinesRun`)."""
    pid = os.fork()
    if pid == 0:  # the child
        os.setpgid(0, 0)
        status = 70
        try:
            if quiet:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            _forget(_importers(f"engine.{name}"))
            if code is not None:
                sys.meta_path.insert(0, _MutantLoader(f"engine.{name}", module_path(name), code))
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
            import pytest
            from hypothesis import settings

            # The same examples every run, and no deadline: on a loaded machine (or under the line
            # tracer) a slow example is not a failure, and a mutant must fail on its merits.
            settings.register_profile("mutation", deadline=None, derandomize=True, database=None)
            settings.load_profile("mutation")

            plugins: list[Any] = [_NoDatabase()]
            if lines_to is not None:
                plugins.append(_LinesRun(module_path(name)))
            status = int(pytest.main(args, plugins=plugins))
            if lines_to is not None:
                run = plugins[1]
                lines_to.write_text(json.dumps({"order": run.order,
                                                "lines": {str(k): sorted(v) for k, v in run.lines.items()}}))
        finally:
            os._exit(status)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code_ = os.waitstatus_to_exitcode(status)
            if code_ == 5:
                raise SystemExit(f"{name}: no test collected by {args}")
            return "passed" if code_ == 0 else "failed"
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.01)


def load_equivalents() -> dict[str, dict[str, str]]:
    """module -> mutant key -> reason."""
    data = tomllib.loads(EQUIVALENTS.read_text()) if EQUIVALENTS.exists() else {}
    out: dict[str, dict[str, str]] = {}
    for entry in data.get("equivalent", []):
        out.setdefault(entry["module"], {})[entry["mutant"]] = entry["reason"]
    return out


def run_module(name: str, equivalents: dict[str, str], timeout: float, extra: list[str],
               before: dict[str, str] | None = None) -> dict[str, Any]:
    """`before` (key -> outcome of an earlier run, `--survivors`): a mutant killed then stays killed,
    since tests were only added; the rest (survivors, timeouts) run again."""
    tree, points = points_of(name)
    args = pytest_args(name, extra)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        lines_file = Path(tmp) / "lines.json"
        unmutated = run_child(name, None, args, 600, quiet=False, lines_to=lines_file)
        if unmutated != "passed":
            raise SystemExit(f"{name}: the tests on the unmutated module {unmutated} (they must pass)")
        covered = json.loads(lines_file.read_text())
    baseline = time.monotonic() - started
    limit = max(timeout, baseline * 3)
    rank = {nodeid: i for i, nodeid in enumerate(covered["order"])}
    lines = {int(k): v for k, v in covered["lines"].items()}
    options = [a for a in args if (ROOT / "tests").as_posix() not in a]

    def tests_reaching(point: Point) -> list[str]:
        reach = {t for line in range(point.line, point.end_line + 1) for t in lines.get(line, ())}
        if not reach:
            return args  # run at import (a default, a constant) or by no test: every test
        return [str(ROOT / t) for t in sorted(reach, key=rank.__getitem__)] + options
    results: list[dict[str, Any]] = []
    seen: Counter[str] = Counter()
    for point in points:
        seen[point.key] += 1
        key = point.key if seen[point.key] == 1 else f"{point.key} #{seen[point.key]}"
        if key in equivalents:
            outcome = "equivalent"
        elif before is not None and before.get(key) == "killed":
            outcome = before[key]
        else:
            outcome = run_child(name, mutant_code(name, tree, point.index), tests_reaching(point), limit)
            outcome = {"passed": "survived", "failed": "killed"}.get(outcome, outcome)
        results.append({**asdict(point), "key": key, "outcome": outcome})
        if outcome == "survived":
            print(f"  survived engine/{name}.py:{point.line} [{key}]", flush=True)
    stale = sorted(set(equivalents) - {r["key"] for r in results})
    for key in stale:
        print(f"  stale equivalent (no such mutant now): {name}: {key}", flush=True)
    count = Counter(r["outcome"] for r in results)
    live = len(results) - count["equivalent"]
    killed = count["killed"] + count["timeout"]
    return {
        "module": name, "mutants": len(results), "killed": count["killed"], "timeout": count["timeout"],
        "survived": count["survived"], "equivalent": count["equivalent"],
        "score": round(killed / live, 4) if live else 1.0, "seconds": round(time.monotonic() - started, 1),
        "tests": TESTS[name], "stale_equivalents": stale, "mutants_detail": results,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| module | mutants | equivalent | killed (timeouts) | survived | score |",
             "|:--|--:|--:|--:|--:|--:|"]
    for r in rows:
        live = r["mutants"] - r["equivalent"]
        lines.append(f"| `engine/{r['module']}.py` | {r['mutants']} | {r['equivalent']} | "
                     f"{r['killed'] + r['timeout']} / {live} ({r['timeout']}) | {r['survived']} | "
                     f"{100 * r['score']:.1f}% |")
    return "\n".join(lines)


def save(out: Path, row: dict[str, Any]) -> None:
    """Add one module's results to the results file (two runs over different modules may share it)."""
    with open(Path(tempfile.gettempdir()) / "rollbook-mutation.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = json.loads(out.read_text()) if out.exists() else {}
        saved[row["module"]] = row
        out.write_text(json.dumps(saved, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--module", default=",".join(TESTS), help="comma-separated engine modules")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--report", action="store_true", help="print the table of the results file, run nothing")
    parser.add_argument("--survivors", action="store_true", help="run again only the survivors and timeouts of "
                        "the results file's last run of each module (after tests were added)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a mutant's tests may take, "
                        "at least five times the unmutated run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutation.json"))
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    options = parser.parse_args(argv)
    names = [n.strip() for n in options.module.split(",") if n.strip()]
    unknown = [n for n in names if n not in TESTS]
    if unknown:
        parser.error(f"no test map for {unknown}; known: {', '.join(TESTS)}")
    out = Path(options.out)
    if options.report:
        saved = json.loads(out.read_text())
        print(table([saved[n] for n in names if n in saved]))
        return 0
    if options.list:
        for name in names:
            for point in points_of(name)[1]:
                print(f"engine/{name}.py:{point.line} [{point.key}]")
        return 0
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    sys.dont_write_bytecode = True
    _preload(names)
    equivalents = load_equivalents()
    rows = []
    for name in names:
        print(f"engine/{name}.py ...", flush=True)
        saved = json.loads(out.read_text()).get(name) if options.survivors and out.exists() else None
        before = {m["key"]: m["outcome"] for m in saved["mutants_detail"]} if saved else None
        row = run_module(name, equivalents.get(name, {}), options.timeout, options.pytest_args, before)
        print(f"  {row['killed'] + row['timeout']} / {row['mutants'] - row['equivalent']} killed, "
              f"{row['survived']} survived, {row['equivalent']} equivalent ({row['seconds']} s)", flush=True)
        rows.append(row)
        save(out, row)
    print(table(rows))
    return 0 if all(row["survived"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
