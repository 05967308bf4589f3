"""`rollbook nemo-gym install`: the smallest environment that runs NeMo Gym 0.7.0's resources servers unchanged.

nemo-gym declares Python >= 3.13.14 and depends on about 1.4 GB (MLflow, datasets, ray[default], ...).
A resources server imports far less: nemo-gym itself, installed `--no-deps`, and the pinned list below,
each `--no-deps` too (what `nemo_gym.base_resources_server`, its server stack and Workplace Assistant's
pandas tools import; `ray` is there for its version metadata, which `nemo_gym.global_config` reads at
import, never started). It goes into a virtual environment of its own, built once with a Python 3.13
(`--python`, else ROLLBOOK_PY313, else pyenv's newest 3.13, else `python3.13` on PATH) under
ROLLBOOK_NEMO_GYM_HOME (default ~/.cache/rollbook), in a folder named by a hash of the list, so a
changed list builds anew and an interrupted build is never taken for a finished one.

`--server NAME` adds a server's own `requirements.txt` to that environment, as `ng_run` installs it
into the server's own one: NAME is a resources server or an agent of the installed NeMo Gym
(`resources_servers/NAME`, `responses_api_agents/NAME`) or a folder holding one. The line that points
at NeMo Gym itself (`-e nemo-gym[dev] @ ../../`) is left out: it is installed. The rest is installed
with its dependencies, constrained to the pinned list, so no server moves a package the others run on;
a requirement that needs another version fails, naming the server and pip's account of the conflict.
Then the server's module is imported as the launcher imports it, and one that still cannot import
says why in one line. A server installed once is not installed again while its requirements are the same.

`--server NAME --apart` installs them into an environment of the server's own instead, as `ng_run`
gives each server its own: layered over NeMo Gym with everything it declares (built once, over the
installed one; a `.pth` puts each layer's packages behind the next), so a server that imports one of
NeMo Gym's own dependencies (ray's msgpack, mcp, anthropic) finds it, and two servers whose
requirements conflict each get theirs. The command prints the Python to name as the table's
`python`. `rollbook nemo-gym sweep --install` runs every server so.

A user with a NeMo Gym checkout of their own does not need this: `python` and `paths` in the
`[nemo_gym.<name>]` table point at it (docs/nemo-gym.md).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

NEMO_GYM = "nemo-gym==0.7.0"
REQUIREMENTS = """
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
antlr4-python3-runtime==4.9.3 anyio==4.16.0 attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
click==8.5.1 cwevals==0.0.1b1 distro==1.9.0 fastapi==0.165.0 frozenlist==1.8.0 googleapis-common-protos==1.76.0
h11==0.16.0 httpcore==1.0.9 httpcore2==2.16.2 httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 hydra-core==1.3.8
idna==3.20 itsdangerous==2.2.0 jiter==0.19.0 markdown-it-py==4.3.0 mdurl==0.1.2 multidict==7.2.1 numpy==2.5.5
omegaconf==2.3.1 openai==2.44.0 opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2 orjson==3.13.0 packaging==26.4 pandas==3.1.1 platformdirs==4.14.9
propcache==0.5.4 protobuf==7.36.2 pydantic==2.14.4 pydantic_core==2.50.5 pydot==4.0.1 Pygments==2.21.0
pyparsing==3.3.3 python-dateutil==4.0.0 PyYAML==6.0.4 ray==2.60.0 requests==2.34.2 rich==15.0.0 scipy==1.18.1
six sniffio==1.3.1 starlette==1.10.0 tqdm==4.70.1 truststore==0.10.5 typing-inspection==0.4.5
typing_extensions==4.16.0 tzdata==2026.6 urllib3==2.8.0 uvicorn==0.54.0 wandb==0.31.0 xxhash==4.1.0
yappi==1.7.6 yarl==1.25.1
""".split()
WORKPLACE = "resources_servers.workplace_assistant.app"
# NeMo Gym with all it declares, and uv, which ng_run builds every server's environment with (so a
# server that builds one of its own, as bigcodebench does, finds it on the PATH of its activated one).
NEMO_GYM_LAYER = [NEMO_GYM, "uv"]


def home() -> Path:
    return Path(os.environ.get("ROLLBOOK_NEMO_GYM_HOME") or Path.home() / ".cache" / "rollbook")


def venv_dir() -> Path:
    key = hashlib.sha256(" ".join([NEMO_GYM, *REQUIREMENTS]).encode()).hexdigest()[:12]
    return home() / f"nemo-gym-0.7.0-{key}"


def installed_python() -> Path:
    """The installed environment's Python (it may not exist yet: `install` builds it)."""
    return venv_dir() / "bin" / "python"


def python313() -> Path:
    explicit = os.environ.get("ROLLBOOK_PY313")
    if explicit:
        return Path(explicit)
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = sorted(root.glob("versions/3.13*/bin/python"))
    if found:
        return found[-1]
    which = shutil.which("python3.13")
    if which:
        return Path(which)
    raise ConfigError("no Python 3.13 found (NeMo Gym 0.7.0 needs one)",
                      "pass --python, or set ROLLBOOK_PY313 to a Python 3.13 interpreter")


def install(python: Path | None = None) -> tuple[Path, float]:
    """Build the environment unless it is complete; its Python and the seconds the build took (0: cached)."""
    venv = venv_dir()
    if (venv / "complete").exists():
        return venv / "bin" / "python", 0.0
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".install.lock", "w") as lock:  # a second install waits, then finds it built
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "complete").exists():
            return venv / "bin" / "python", 0.0
        return _build(venv, python)


def _build(venv: Path, python: Path | None) -> tuple[Path, float]:
    t0 = time.monotonic()
    # Built where it will live (a virtual environment names its folder in its scripts); the marker,
    # written last, is what says it is finished, so an interrupted build is built again.
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([str(python or python313()), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--ignore-requires-python", NEMO_GYM, *REQUIREMENTS], check=True, timeout=3600)
    check = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {WORKPLACE}"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ConfigError(f"the NeMo Gym environment at {venv} does not import {WORKPLACE}: {check.stderr[-800:]}",
                          "remove that folder and install again")
    (venv / "complete").write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return venv / "bin" / "python", time.monotonic() - t0


def requirement_lines(text: str) -> list[str]:
    """A requirements.txt's requirements, less comments, blank lines and NeMo Gym itself (by name, or as
    the checkout two folders up that a server's requirements name it by: `-e ../../`)."""
    lines = [line.split(" #")[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [line for line in lines
            if line and not re.match(r"^(-e\s+)?(nemo[-_]gym\b|\.\./\.\.(/|$|-e\b))", line, re.IGNORECASE)]


def requirement_name(line: str) -> str:
    """The distribution or path a requirement line names, normalized (`Foo_Bar[x]>=1` -> `foo-bar`,
    `-e ./pocketshell[pcre]` -> `./pocketshell`)."""
    return re.split(r"[<>=!~\[; @]", re.sub(r"^-e\s+", "", line.strip()), maxsplit=1)[0].lower().replace("_", "-")


def server_folder(venv: Path, name: str) -> tuple[Path, str]:
    """The server's folder and its module: a name in the installed NeMo Gym, or a folder of one's own."""
    given = Path(name)
    if given.is_dir():
        return given.resolve(), f"{given.resolve().name}.app"
    for kind in ("resources_servers", "responses_api_agents"):
        found = sorted(venv.glob(f"lib/python3*/site-packages/{kind}/{name}"))
        if re.fullmatch(r"[A-Za-z0-9_]+", name) and found:
            return found[0], f"{kind}.{name}.app"
    raise ConfigError(f"no NeMo Gym server named {name!r} in {venv}",
                      "name one of its resources_servers or responses_api_agents, or give a folder")


def install_server(python: Path, name: str) -> tuple[list[str], float]:
    """Install server `name`'s own requirements into the environment of `python`; what was
    installed (none: nothing new) and the seconds it took."""
    venv = python.parent.parent
    folder, module = server_folder(venv, name)
    t0 = time.monotonic()
    added = _requirements_into(python, venv, folder, name, server_requirements(folder))
    _imports(python, folder, module, name)
    return added, time.monotonic() - t0


def nemo_gym_python(python: Path) -> Path:
    """The Python of NeMo Gym with all it declares (`nemo-gym[dev] @ ../../`, the first line of every
    server's requirements.txt, as ng_run installs it into each server's environment): an environment
    over the installed one (a `.pth` puts those packages behind its own) holding what nemo-gym depends on
    and the installed one lacks (MLflow, datasets, ray's own dependencies, mcp, anthropic, ...),
    constrained to the pinned list. Built once, about 600 MB."""
    base = python.parent.parent
    key = hashlib.sha256(" ".join(NEMO_GYM_LAYER).encode()).hexdigest()[:8]
    layer = base.parent / f"{base.name}-nemo-gym-{key}"
    own = layer / "bin" / "python"
    if (layer / "complete").exists():
        return own
    with open(base.parent / ".nemo-gym-layer.lock", "w") as lock:  # the sweep's threads build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (layer / "complete").exists():
            t0 = time.monotonic()
            shutil.rmtree(layer, ignore_errors=True)
            _layered(python, layer, [base])
            _requirements_into(own, layer, layer, "nemo-gym", NEMO_GYM_LAYER)
            (layer / "complete").write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return own


def _layered(python: Path, layer: Path, under: list[Path]) -> None:
    """A virtual environment at `layer` whose Python also sees the packages of the environments `under`
    (in that order, behind its own)."""
    subprocess.run([str(python), "-m", "venv", str(layer)], check=True, capture_output=True)
    sites = [site for env in under for site in sorted(env.glob("lib/python3*/site-packages"))]
    (next(layer.glob("lib/python3*/site-packages")) / "rollbook_nemo_gym.pth").write_text("".join(f"{p}\n" for p in sites))


def server_python(python: Path, name: str) -> tuple[Path, list[str], float]:
    """A Python for server `name` alone, as ng_run gives each server an environment of its own: NeMo Gym
    with all it declares (`nemo_gym_python`), and over it the server's own requirements, so that servers
    whose requirements conflict each run with theirs. Built once per set of requirements; NeMo Gym's
    own Python for a server that names none. (its Python, what was installed, the seconds it took)"""
    base = python.parent.parent
    folder, module = server_folder(base, name)
    wanted = server_requirements(folder)
    full = nemo_gym_python(python)
    if not wanted:
        return full, [], 0.0
    # One per server folder and requirements: a folder of one's own with the same name is another server.
    key = hashlib.sha256("\n".join([str(full), str(folder), *wanted]).encode()).hexdigest()[:12]
    layer = base.parent / f"{base.name}-servers" / f"{folder.name}-{key}"
    own = layer / "bin" / "python"
    if (layer / "complete").exists():
        return own, [], 0.0
    t0 = time.monotonic()
    shutil.rmtree(layer, ignore_errors=True)
    _layered(python, layer, [full.parent.parent, base])
    added = _requirements_into(own, layer, folder, name, wanted, own=True)
    _imports(own, folder, module, name)
    (layer / "complete").write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return own, added, time.monotonic() - t0


def server_requirements(folder: Path) -> list[str]:
    """What a server folder's requirements.txt asks for, NeMo Gym itself left out (none without one)."""
    return requirement_lines((folder / "requirements.txt").read_text()) if (folder / "requirements.txt").exists() else []


def _requirements_into(python: Path, venv: Path, folder: Path, name: str, wanted: list[str], own: bool = False
                       ) -> list[str]:
    """pip installs the server's requirements (`wanted`) into `python`'s environment, constrained to the
    pinned list (`own`: to NeMo Gym's declarations alone); what it installed (none when they were installed
    already)."""
    marker = venv / "servers" / f"{folder.name}.txt"
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()
    if not wanted or (marker.exists() and marker.read_text() == digest):
        return []
    constraints = venv / "servers" / "constraints.txt"
    constraints.parent.mkdir(exist_ok=True)
    # In a shared environment the pins keep NeMo Gym's stack as installed (a requirement that needs
    # another version is a conflict, named). In an environment of the server's own, only NeMo Gym and
    # what it declares bind, as when ng_run resolves `nemo-gym[dev]` with the server's requirements: a
    # package the server needs at another version goes into its layer, in front of the one below.
    pins = [] if own else [r for r in REQUIREMENTS if "==" in r]
    constraints.write_text("\n".join([NEMO_GYM, *pins]) + "\n")
    args = _pip_args([*wanted, NEMO_GYM] if own else wanted)
    # From the server's folder: its requirements name their local paths relative to it (`-e ./pocketshell`).
    pip = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
                          "--constraint", str(constraints), *args], capture_output=True, text=True, timeout=3600,
                         cwd=folder)
    if pip.returncode != 0:
        said = [line.strip() for line in (pip.stdout + pip.stderr).splitlines() if line.strip()]
        # pip's own account of a conflict ("The user requested pandas==2.0.0", "... (constraint) pandas==3.1.1"),
        # else its errors and those of the tools it ran (git's "fatal: unable to access ...").
        shown = [line for line in said if line.startswith("The user requested") or " depends on " in line] \
            or [line for line in said if line.startswith(("ERROR", "fatal:"))] or said[-3:]
        raise ConfigError(f"NeMo Gym server {name}: its requirements ({', '.join(wanted)}) do not install into {venv}: "
                          + " / ".join(shown[-8:])[:1500],
                          "change the server's requirements.txt, or run it from a NeMo Gym environment of its own "
                          "(`python` in its table)")
    marker.write_text(digest)
    return wanted


def _pip_args(wanted: list[str]) -> list[str]:
    """Requirement lines as pip's arguments: an editable one (`-e ./pocketshell[pcre]`) is two."""
    return [arg for w in wanted for arg in (["-e", w[2:].strip()] if re.match(r"-e\s", w) else [w])]


def _imports(python: Path, folder: Path, module: str, name: str) -> None:
    """Import the server's module as the launcher imports it: its folder first on sys.path, and for a
    folder of one's own, its parent too; one that cannot says why in one line."""
    check = subprocess.run([str(python), "-c", f"import sys; sys.path[:0] = [{str(folder)!r}, {str(folder.parent)!r}]; "
                            f"import {module}"],
                           capture_output=True, text=True, cwd=folder)
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"NeMo Gym server {name}: {module} does not import: {last}",
                          "install what it names (its requirements.txt may lack it)")


def _install(args: argparse.Namespace) -> int:
    python, seconds = install(Path(args.python) if args.python else None)
    print(f"{python}  ({f'built in {seconds:.0f} s' if seconds else 'already installed'})")
    for name in args.server or []:
        with open(python.parent.parent.parent / ".install.lock", "w") as lock:  # one pip at a time per environment
            fcntl.flock(lock, fcntl.LOCK_EX)
            own, added, took = server_python(python, name) if args.apart else (python, *install_server(python, name))
        print(f"{name}: {'installed ' + ', '.join(added) + f' in {took:.0f} s' if added else 'its requirements are installed'}; "
              "it imports" + (f"; its Python (the table's `python`): {own}" if args.apart else ""))
    return 0


def add_parser(sub: Any) -> Any:
    """`rollbook nemo-gym install`; the `nemo-gym` subcommands, for the others to join."""
    gym = sub.add_parser("nemo-gym", help="NeMo Gym resources servers: install what runs them, try them all")
    gsub = gym.add_subparsers(dest="nemo_gym_command", required=True)
    inst = gsub.add_parser("install", help="build the environment that runs NeMo Gym 0.7.0's resources servers")
    inst.add_argument("--python", help="a Python 3.13 interpreter (default: pyenv's, or python3.13)")
    inst.add_argument("--server", action="append", metavar="NAME",
                      help="also install this server's own requirements.txt (a NeMo Gym resources server or agent, "
                           "or a folder holding one); again for more")
    inst.add_argument("--apart", action="store_true",
                      help="each --server into an environment of its own over the installed one (servers whose "
                           "requirements conflict); prints the Python to name in its table")
    inst.set_defaults(func=_install)
    return gsub
