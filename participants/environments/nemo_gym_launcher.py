"""Run one NeMo Gym resources server, unchanged, the way `ng_run` runs it: with NeMo Gym's Python.

    python nemo_gym_launcher.py MODULE NAME PORT [PATH ...]

MODULE is the server's module (`resources_servers.workplace_assistant.app`), NAME its name in the
config NeMo Gym builds here, PORT where it listens (127.0.0.1), each PATH a folder put in front of
sys.path (a NeMo Gym checkout). `ng_run` resolves its config in the parent and hands each server
NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH; this resolves the same config in this process (NeMo
Gym caches it) and runs the module as `__main__`, where every server calls its own `run_webserver`.
It imports nothing of rollbook: it runs in NeMo Gym's environment, not rollbook's.
"""

import os
import runpy
import shutil
import sys
import tempfile


def main(argv: list[str]) -> None:
    module, name, port, *paths = argv
    for path in reversed(paths):
        sys.path.insert(0, path)
    config = (f"head_server:\n  host: 127.0.0.1\n  port: 0\n{name}:\n  resources_servers:\n    {name}:\n"
              f"      entrypoint: app.py\n      host: 127.0.0.1\n      port: {int(port)}\n      domain: other\n")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config)
    sys.argv = [sys.argv[0], f"+config_paths=[{f.name}]"]
    from nemo_gym.global_config import get_global_config_dict

    # Hydra writes its run folder (outputs/<date>/<time>/.hydra) under the working directory: a scratch one.
    scratch = tempfile.mkdtemp(prefix="rollbook-gym-")
    os.chdir(scratch)
    get_global_config_dict()  # resolved once, cached: run_webserver reads this one
    os.unlink(f.name)
    shutil.rmtree(scratch, ignore_errors=True)
    os.environ["NEMO_GYM_CONFIG_PATH"] = name
    spec = __import__("importlib.util").util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SystemExit(f"no module {module!r} on {sys.path}")
    os.chdir(os.path.dirname(spec.origin))  # ng_run starts a server in its own folder
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
