"""NeMo Gym 0.7.0's collector side for tests and benchmarks: its own virtual environment and its processes.

`ng_collect_rollouts`, its head server and `legacy_agent` need Python 3.13 and more of NeMo Gym's
dependencies than the resources servers (`rollbook nemo-gym install`); `gym_venv` builds the smallest
environment that runs them, once, cached under ROLLBOOK_TEST_CACHE (default ~/.cache/rollbook-tests).
Its processes are started in sessions of their own (`spawn`) so `stop` ends each with its children.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

# The smallest install that runs `ng_collect_rollouts` and legacy_agent (docs/nemo-gym.md): nemo-gym
# without its dependencies, then exactly what its import chain and legacy_agent's Ray start need, each
# without dependencies of its own. The full dependency set (about 1.4 GB: MLflow, datasets, pyarrow,
# ray[default], ...) is never imported by these two.
NEMO_GYM = "nemo-gym==0.7.0"
REQUIREMENTS = """
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
anthropic==2.14.0 antlr4-python3-runtime==4.9.3 anyio==4.16.0 attrs==26.1.0 certifi==2026.10.19.post1
click==8.5.1 devtools==0.13.0 distro==1.9.0 docstring_parser==0.18.0 fastapi==0.165.0 frozenlist==1.8.0
httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 hydra-core==1.3.8 idna==3.20 itsdangerous==2.2.0 jiter==0.19.0
markdown-it-py==4.3.0 mdurl==0.1.2 multidict==7.2.1 numpy==2.5.5 omegaconf==2.4.0 openai==2.44.0
opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.4 pandas==3.1.1 platformdirs==4.14.9 propcache==0.5.4
protobuf==7.36.2 psutil==7.2.2 pydantic==2.14.4 pydantic_core==2.50.5 pydot==4.0.1 Pygments==2.21.0
python-dateutil==4.0.0 PyYAML==6.0.4 ray==2.60.0 requests==2.34.2 rich==15.0.0 scipy==1.18.1 sniffio==1.3.1
starlette==1.10.0 tqdm==4.70.1 typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0
uvicorn==0.54.0 wandb==0.31.0 xxhash==4.1.0 yappi==1.7.6 yarl==1.25.1
msgpack filelock jsonschema jsonschema-specifications referencing rpds-py
""".split()
CACHE = Path(os.environ.get("ROLLBOOK_TEST_CACHE", Path.home() / ".cache" / "rollbook-tests"))


def python313() -> Path:
    """pyenv's Python 3.13 (NeMo Gym 0.7.0 needs 3.13; it declares >=3.13.14, this machine has 3.13.0)."""
    explicit = os.environ.get("ROLLBOOK_PY313")
    if explicit:
        return Path(explicit)
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() if shutil.which("pyenv") \
        else str(Path.home() / ".pyenv")
    found = sorted(Path(root).glob("versions/3.13*/bin/python"))
    assert found, f"no Python 3.13 under {root}/versions (set ROLLBOOK_PY313 to one): NeMo Gym 0.7.0 needs it"
    return found[-1]


def gym_venv() -> Path:
    """The cached NeMo Gym virtual environment, built on first use (its build time is printed)."""
    key = hashlib.sha256(" ".join([NEMO_GYM, *REQUIREMENTS]).encode()).hexdigest()[:12]
    venv = CACHE / f"nemo-gym-0.7.0-{key}"
    if (venv / "complete").exists():
        return venv
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(python313()), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--ignore-requires-python", NEMO_GYM,
                    *REQUIREMENTS], check=True)
    (venv / "complete").write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    print(f"built the NeMo Gym virtual environment {venv} in {time.monotonic() - t0:.0f} s")
    return venv


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError as exc:
            if getattr(exc, "code", None):  # an HTTP error status: it answers
                return
        assert proc.poll() is None, f"{log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def spawn(args: list[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
