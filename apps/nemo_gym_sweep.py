"""`rollbook nemo-gym sweep`: every resources server of the installed NeMo Gym, started and seeded as
rollbook runs it, in one table.

For each folder of `resources_servers/` with an `app.py` (143 in NeMo Gym 0.7.0's wheel), the sweep
reads what the server says it needs from its own files: its `requirements.txt` past NeMo Gym itself,
the model servers its `configs/*.yaml` entry names (a judge), Ray where its class does not turn it off,
docker where its code names it. Then rollbook's relay starts it as a rollout would
(participants/environments/nemo_gym_relay.py: the launcher, NeMo Gym's Python, a table holding only
its module) and opens a live session with its first example row (`data/example.jsonl`): seeded with the
row, or for a gymnasium-style server reset with it. The verdict is what happened:

- `seeds`: it started and took the row;
- `cannot start`: the launcher's one line (an import its requirements would bring, a config field it
  requires, ...);
- `refused`: it started and refused the row (its status and body);
- `no example`: it has no example row to seed with;
- `cannot install` (with `--install`): its requirements do not install (pip's account).

With `--crash`, each server that seeds then goes through the crash check
(apps/nemo_gym_conformance.py): its example rows through a SIGKILL of every server, against an
uninterrupted run: a server whose verify compares a cohort of a prompt's rollouts
(`num_rollouts_per_prompt`) gets its first row that many times at once; one whose judge calls name no
rollout (rollbook's model server refuses them) is checked again with a stand-in judge at a URL of its
own, as an operator would give it one (the table's `models`). It writes the table (server, protocol,
needs, verdict, reason, crash check) as Markdown, with the counts and the wall time. Nothing is installed unless `--install` says so: then
each server with a `requirements.txt` runs in an environment of its own over the installed one,
holding them (apps.nemo_gym_install.server_python), so servers whose requirements conflict each get
theirs.

    rollbook nemo-gym sweep [--server NAME ...] [--install] [--crash [--dsn DSN]] [--out FILE] [--parallel 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from adapters.database import prepare_database
from adapters.openai_wire import responses_object
from apps.nemo_gym_conformance import conformance
from apps.nemo_gym_install import install, requirement_name, server_python, server_requirements
from apps.processes import free_port, reap_on_signal
from engine.errors import ConfigError, GymServerFailed
from participants.agent.external import MODEL_SERVER
from participants.environments import Task, gymnasium
from participants.environments.gym_http import close_all
from participants.environments.nemo_gym_launcher import own_config, references
from participants.environments.nemo_gym_relay import (
    BODY_SHOWN,
    GymProcess,
    GymReplyError,
    GymServer,
    Live,
    LiveGone,
    NemoGymEnvironment,
)
from participants.environments.nemo_gym_relay import task_from_row as row_task

START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Verdict:
    server: str
    protocol: str  # "tools" (seed_session, a route per tool, verify) or "gymnasium" (reset, step); "" when it did not start
    needs: tuple[str, ...]
    verdict: str  # seeds | cannot start | refused | no example
    reason: str = ""
    seconds: float = 0.0
    crash: str = ""  # the crash check's verdict (apps/nemo_gym_conformance.py) where it ran: conforms | differs |
    # does not replay | failed
    crash_reason: str = ""


def servers(site: Path) -> list[str]:
    """The resources servers of an installed NeMo Gym: folders of `resources_servers/` with an `app.py`."""
    return sorted(p.parent.name for p in (site / "resources_servers").glob("*/app.py"))


def needs(folder: Path) -> tuple[str, ...]:
    """What a server says it needs, from its own files."""
    out = []
    wanted = server_requirements(folder)
    if wanted:
        out.append("requirements: " + ", ".join(requirement_name(w) for w in wanted))
    try:  # its entry in its own configs/*.yaml, found as the launcher finds it
        entry = own_config(str(folder), folder.name, "resources_servers")
    except yaml.YAMLError:
        entry = {}  # its launch will say what is wrong with it
    models = sorted({k for k, _ in references(entry, "responses_api_models")})
    if models:
        out.append("a model server: " + ", ".join(models))
    if own_agents := _own_agents(entry):
        out.append("its own agent: " + ", ".join(own_agents))
    provider = entry.get("sandbox_provider") if isinstance(entry, dict) else None
    if provider:  # a reference to a top-level block, or the block itself (its provider's name the key)
        out.append("a sandbox provider: " + (", ".join(map(str, provider)) if isinstance(provider, dict) else str(provider)))
    source = "\n".join(p.read_text(errors="replace") for p in folder.glob("*.py"))
    if "ray_enabled = False" not in source:
        out.append("ray")
    if re.search(r"\bdocker\b", source, re.IGNORECASE):
        out.append("docker")
    if re.search(r"\bLocalSandbox\b", source):  # NeMo Skills' code-execution service, waited for at start
        out.append("a code-execution sandbox service")
    # What its agent runs the model's code in: a server that only its own agent can play needs it too.
    agent_source = "\n".join(p.read_text(errors="replace") for a in own_agents
                             for p in (folder.parent.parent / "responses_api_agents" / a).glob("*.py"))
    if re.search(r"\bapptainer\b", agent_source, re.IGNORECASE):
        out.append("apptainer (its agent's sandbox)")
    return tuple(out)


def _own_agents(entry: Any) -> list[str]:
    """The agents a server's config entry allows, where it allows none that rollbook drives."""
    agents = entry.get("allowed_agents") if isinstance(entry, dict) else None
    if not isinstance(agents, list) or not agents or {"simple_agent", "gymnasium_agent"} & set(map(str, agents)):
        return []
    return [str(a) for a in agents]


def own_driver(folder: Path, rows: list[dict[str, Any]]) -> str | None:
    """The agent the crash check drives a server's rows with where only its own agent can: rows that hold
    no prompt (the agent writes it), and one agent its config allows (toolsandbox's toolsandbox_agent)."""
    if not rows or any((r.get("responses_create_params") or {}).get("input") for r in rows):
        return None
    try:
        agents = _own_agents(own_config(str(folder), folder.name, "resources_servers"))
    except yaml.YAMLError:
        return None
    return agents[0] if len(agents) == 1 else None


def cohort(folder: Path) -> int:
    """How many rollouts of one prompt the server compares with each other at verify: its config's
    `num_rollouts_per_prompt` (genrm_compare's 16), else 1."""
    try:
        entry = own_config(str(folder), folder.name, "resources_servers")
    except yaml.YAMLError:
        return 1
    size = entry.get("num_rollouts_per_prompt") if isinstance(entry, dict) else None
    return size if isinstance(size, int) and size > 1 else 1


def example_rows(folder: Path) -> list[dict[str, Any]]:
    """Its `data/example.jsonl` rows, up to the first that is not a data row."""
    example = folder / "data" / "example.jsonl"
    rows = []
    for line in example.read_text(errors="replace").splitlines() if example.exists() else []:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            break
        rows.append(row)
    return rows


# What a process says when it reached for the network and found none (this machine has only package
# registries): a name that does not resolve, a host it cannot reach, Hugging Face's offline refusal.
OFFLINE = re.compile(r"Name or service not known|Temporary failure in name resolution|Network is unreachable|"
                     r"Failed to establish a new connection|Max retries exceeded|LocalEntryNotFoundError|"
                     r"couldn't connect to '?https?://|Could not resolve host|\['git', 'clone'|git clone https?://|"
                     r"NLTK Downloader|Hugging Face|Failed to load [\w ]+ after retries|ENOTFOUND")


# A config value NeMo Gym leaves to the operator's env.yaml (`${policy_base_url}`, `${tavily_api_key}`):
# the `[nemo_gym.<name>]` table's `config` gives the field that names it.
UNSET = re.compile(r"references '(\w+)', which is not set")
UNDECLARED = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


# A file it reads from its own folder that the wheel does not hold (a dataset to download or generate).
LACKS = r"(?:/resources_servers/{name}/)([\w./-]+)"
# A key to a service its config class requires (critpt's api_key, google_search's google_api_key).
KEY = re.compile(r"refuses its config: .*?\b(\w*api_key)\b")
PYTHON = re.compile(r"'uv', 'venv'.*?'--python', '([\d.]+)'")  # a Python of its own, which uv fetches


def try_server(python: Path, site: Path, name: str, crash_dsn: str | None = None, work: Path | None = None,
               timeout_s: float = START_TIMEOUT_S, apart: bool = False) -> Verdict:
    """`_tried`'s verdict, with what its failure shows it needs added to its needs: the network where it
    reached for it, a value its config leaves to the operator, data its wheel lacks."""
    verdict = _tried(python, site, name, crash_dsn, work, timeout_s, apart)
    failed = "" if verdict.verdict == "seeds" else verdict.reason
    said, found = failed + "\n" + verdict.crash_reason, []
    if re.search(r"FileNotFoundError|not found|does not exist", said) and \
            (lacks := re.search(LACKS.format(name=re.escape(name)), said)):
        found.append(f"data its wheel lacks: {lacks.group(1).rstrip('.')}")
    if OFFLINE.search(failed) or OFFLINE.search(verdict.crash_reason):
        found.append("network")
    elif wanted := PYTHON.search(failed):
        found.append(f"network: uv downloads the Python {wanted.group(1)} it runs in")
    elif key := KEY.search(failed):
        found.append(f"network: a service's {key.group(1)}")
    if verdict.verdict == "cannot start" and apart and (missing := UNDECLARED.search(failed)):
        # Its requirements were installed, and it imports what none of them brings.
        found.append(f"a module its requirements do not declare: {missing.group(1)}")
    if unset := UNSET.search(failed):  # a value its config leaves to the operator (NeMo Gym's env.yaml)
        key_name = unset.group(1)
        found.append(f"network: a service's {key_name}" if key_name.endswith("api_key") else
                     f"a model server at a URL you give: {key_name}" if key_name.endswith("_url") else
                     f"a value its config leaves unset: {key_name}")
    return replace(verdict, needs=(*verdict.needs, *found)) if found else verdict


def _tried(python: Path, site: Path, name: str, crash_dsn: str | None, work: Path | None, timeout_s: float,
           apart: bool) -> Verdict:
    """Start server `name` as rollbook's relay does and seed a live session with its first example row;
    with `crash_dsn`, a server that seeds then goes through the crash check on that database's server.
    With `apart`, a server with requirements runs in an environment of its own holding them."""
    if apart:
        try:
            python = server_python(python, name)[0]
        except ConfigError as exc:
            return Verdict(name, "", needs(site / "resources_servers" / name), "cannot install", str(exc))
    seeded = _seed(python, site, name, timeout_s)
    if crash_dsn is None or seeded.verdict != "seeds" or work is None:
        return seeded
    t0 = time.monotonic()
    folder = site / "resources_servers" / name
    rows, size = example_rows(folder), cohort(folder)
    driver = "gymnasium_agent" if seeded.protocol == "gymnasium" else own_driver(folder, rows)
    crash, why = _checked(name, python, rows, driver, crash_dsn, work / name, size)
    if crash == "failed" and "rollout_id_required" in why:
        # Its judge calls name no rollout (genrm_compare judges a cohort in a task of its own): they need a
        # model server of their own, as the operator gives one. The check gives each a stand-in.
        names = sorted({str(ref["name"]) for _, ref in references(own_config(str(folder), name, "resources_servers"),
                                                              "responses_api_models")})
        seeded = replace(seeded, needs=(*seeded.needs, "a model server at a URL you give: " + ", ".join(names)
                                        + " (its calls name no rollout)"))
        judge = _serving(_StandIn)
        try:
            given = {n: f"http://127.0.0.1:{judge.server_address[1]}" for n in names}
            crash, why = _checked(name, python, rows, driver, crash_dsn, work / name, size, given)
        finally:
            judge.shutdown()
            judge.server_close()
    return replace(seeded, crash=crash, crash_reason=why, seconds=seeded.seconds + time.monotonic() - t0)


def _checked(*args: Any) -> tuple[str, str]:
    try:
        return conformance(*args)
    except Exception as exc:  # the check's own failure, said in its row: the other servers are still tried
        return "failed", f"the check itself failed: {type(exc).__name__}: {exc}"


def _serving(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def _seeded(env: NemoGymEnvironment, task: Task, reset: dict[str, Any] | None) -> None:
    """A live session of `task`, seeded (or, for a gymnasium server, reset with the row `reset`)."""
    try:
        live: Live = await env.open_live(task)
        if reset is not None:
            await live.post(f"/{gymnasium.RESET}", reset)
    finally:
        await close_all()


def _seed(python: Path, site: Path, name: str, timeout_s: float) -> Verdict:
    folder = site / "resources_servers" / name
    t0 = time.monotonic()
    said = needs(folder)
    # A model server as `rollbook serve` gives one (a judge its config names resolves to it). A seed asks
    # no judge, so what listens there answers every request 404; but it answers, as NeMo Gym's own
    # poll for a server's status wants (xstest waits at start until its judge is reachable).
    judge = _serving(_Nothing)
    model = {MODEL_SERVER: {"responses_api_models": {"rollbook": {"entrypoint": "rollbook", "host": "127.0.0.1",
                                                                  "port": judge.server_address[1]}}}}
    server = GymServer(f"sweep_{name}", f"resources_servers.{name}.app", state="replay", python=str(python),
                       port=free_port(), start_timeout_s=timeout_s, call_timeout_s=timeout_s,
                       servers=json.dumps({**model, "observability_enabled": True}))
    process = GymProcess(server)
    env = type(f"Sweep_{name}", (NemoGymEnvironment,), {"name": server.name, "state_mode": "replay",
                                                         "verification": "replay", "server": server, "process": process})()
    try:
        why = process.check()
        if why is not None:
            return Verdict(name, "", said, "cannot start", why, time.monotonic() - t0)
        protocol = "gymnasium" if process.gymnasium() else "tools"
        row = next(iter(example_rows(folder)), None)
        if row is None:
            return Verdict(name, protocol, said, "no example", "no data/example.jsonl row with responses_create_params",
                           time.monotonic() - t0)
        try:
            asyncio.run(_seeded(env, row_task(server.name, row, 0), row if protocol == "gymnasium" else None))
        except GymServerFailed as exc:
            return Verdict(name, protocol, said, "refused", exc.detail, time.monotonic() - t0)
        except GymReplyError as exc:
            return Verdict(name, protocol, said, "refused", f"{exc.path}: {exc.status} {exc.body}", time.monotonic() - t0)
        except LiveGone as exc:
            return Verdict(name, protocol, said, "refused", f"its server went away: {exc}", time.monotonic() - t0)
        return Verdict(name, protocol, said, "seeds", "", time.monotonic() - t0)
    finally:
        process.stop()
        judge.shutdown()
        judge.server_close()


class _Nothing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *_: Any) -> None:
        pass


class _StandIn(_Nothing):
    """A stand-in for a model server an operator gives a server (a judge of its own): every Responses call
    is answered with one completed message, the same each time (genrm_compare's parser finds no scores in
    it and takes its default ones)."""

    TEXT = "A stand-in judge: no scores."

    def do_POST(self) -> None:  # noqa: N802 - http.server's names
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps(responses_object("stand-in", [{"role": "assistant", "content": self.TEXT}], {}, 0)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def sweep(names: list[str] | None = None, parallel: int = 2, say: Any = print,
          crash_dsn: str | None = None, apart: bool = False) -> tuple[list[Verdict], float]:
    """Every named server (all, when none is named), `parallel` at a time; the verdicts and the wall
    time. With `crash_dsn` (a database whose server the checks make scratch databases on), each server
    that seeds goes through the crash check too; with `apart`, each server's requirements are installed
    into an environment of its own (apps.nemo_gym_install.server_python) that it runs in."""
    python, _ = install()
    site = next(python.parent.parent.glob("lib/python3*/site-packages"))
    chosen = names or servers(site)
    work = Path(tempfile.mkdtemp(prefix="rollbook-sweep-"))
    t0 = time.monotonic()
    out: list[Verdict] = []
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        tried = pool.map(lambda s: try_server(python, site, s, crash_dsn, work, apart=apart), chosen)
        for n, v in enumerate(tried, start=1):
            out.append(v)
            say(f"[{n}/{len(chosen)}] {v.server}: {v.verdict}" + (f" ({v.reason[:120]})" if v.reason else "")
                + (f"; crash check: {v.crash}" + (f" ({v.crash_reason[:120]})" if v.crash_reason else "") if v.crash else ""))
    shutil.rmtree(work, ignore_errors=True)
    return out, time.monotonic() - t0


def table(verdicts: list[Verdict], wall_s: float) -> str:
    counts = Counter(v.verdict for v in verdicts) + Counter(f"crash check {v.crash}" for v in verdicts if v.crash)
    lines = [f"{len(verdicts)} servers in {wall_s:.0f} s: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()) + ".",
             "", "| server | protocol | needs | verdict | reason | crash check |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        reason = _cell(v.reason)
        crash = f"{v.crash}: {_cell(v.crash_reason)}" if v.crash_reason else v.crash
        lines.append(f"| `{v.server}` | {v.protocol} | {'; '.join(v.needs)} | {v.verdict} | {reason} | {crash} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:BODY_SHOWN]


def _sweep(args: argparse.Namespace) -> int:
    crash_dsn = prepare_database(args.dsn) if args.crash else None
    # After the database is up: an embedded PostgreSQL outlives the sweep; no server it starts does.
    reap_on_signal()
    verdicts, wall = sweep(args.server, args.parallel, lambda line: print(line, file=sys.stderr, flush=True), crash_dsn,
                           args.install)
    text = table(verdicts, wall)
    if args.out:
        out = Path(args.out)
        head = out.read_text().split(MARK)[0].rstrip("\n") + "\n\n" if out.exists() else ""
        out.write_text(head + MARK + "\n\n" + text)
    print(text)
    return 0


MARK = "<!-- the sweep's table: written by `rollbook nemo-gym sweep --out` -->"


def add_parser(gsub: Any) -> None:
    p = gsub.add_parser("sweep", help="start and seed every resources server of the installed NeMo Gym as rollbook runs it")
    p.add_argument("--server", action="append", metavar="NAME", help="only this server (again for more)")
    p.add_argument("--parallel", type=int, default=2, help="servers tried at once (default 2)")
    p.add_argument("--out", help="write the table into this Markdown file, below its marker line (kept above it)")
    p.add_argument("--crash", action="store_true",
                   help="also put each server that seeds through the crash check (its example rows through a SIGKILL "
                        "of every server, against an uninterrupted run), on scratch databases")
    p.add_argument("--install", action="store_true",
                   help="install each server's requirements.txt into an environment of its own first (pip, from the "
                        "package index) and run it there")
    p.add_argument("--dsn", help="the PostgreSQL the crash check makes its scratch databases on (default: the embedded one)")
    p.set_defaults(func=_sweep)
