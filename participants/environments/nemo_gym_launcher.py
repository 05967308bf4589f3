"""Run one NeMo Gym server, unchanged, the way `ng_run` runs it: with NeMo Gym's Python.

    python nemo_gym_launcher.py MODULE NAME PORT [PATH ...]

MODULE is the server's module (`resources_servers.workplace_assistant.app`, a resources server, or
`responses_api_agents.simple_agent.app`, an agent: its server class says which), NAME its name in the
config NeMo Gym builds here, PORT where it listens (127.0.0.1), each PATH a folder put in front of
sys.path (a NeMo Gym checkout). `ng_run` resolves its config in the parent and hands each server
NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH; this resolves the same config in this process (NeMo
Gym caches it) and runs the module as `__main__`, where every server calls its own `run_webserver`.

What `ng_run` gives a server, this gives it too:
- its own folder first on sys.path (`ng_run` runs `app.py` from there, and servers import their
  sibling modules as top-level ones: `from utils import ...`), and this file's folder (rollbook's
  modules) off it;
- its environment's scripts first on PATH, as an activated environment has them;
- its own config: the entry its `configs/*.yaml` declares for it (ROLLBOOK_GYM_CONFIG_FILE, else
  `configs/<folder>.yaml`, else the first there), with the `[nemo_gym.NAME]` table's overrides
  (ROLLBOOK_GYM_OVERRIDES, a JSON object) merged over it, each key checked against the fields of
  the server's own config class, and the whole validated by that class before the server starts;
- the servers it calls by name (an agent's model and resources servers): ROLLBOOK_GYM_SERVERS, a JSON
  object of top-level entries added to the config as they are; a model server its own config names
  and nothing defines (a judge) is the one model server defined there, rollbook's.

A server that cannot import, or whose config does not validate, writes one line saying why (its
traceback's last line, or the fields at fault) to ROLLBOOK_GYM_FAILURE and exits 3: the resources
server shows that line instead of starting it again and again.
It ends when the rollbook server that started it is gone (`end_with_parent`).
It imports nothing of rollbook: it runs in NeMo Gym's environment, not rollbook's.
"""

import importlib
import importlib.util
import json
import os
import runpy
import shutil
import sys
import tempfile
import threading
import time
import traceback

FAILED = 3  # the exit status of a server that cannot start as configured (the reason is in ROLLBOOK_GYM_FAILURE)


class Refused(Exception):
    """The table or the server's config is wrong: the message is the whole line a person reads."""


def server_folder(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise Refused(f"no module {module!r} on {sys.path}")
    return os.path.dirname(spec.origin)


def own_config(folder: str, name: str, kind: str, table: str = "nemo_gym") -> dict:
    """The server's entry in its own configs/*.yaml (`<kind>.<folder name>`), or nothing."""
    import yaml

    chosen = os.environ.get("ROLLBOOK_GYM_CONFIG_FILE")
    configs = os.path.join(folder, "configs")
    if chosen:
        files = [chosen if os.path.isabs(chosen) else os.path.join(folder, chosen)]
        if not os.path.isfile(files[0]):
            raise Refused(f"{table}.{name}: config_file {chosen!r} is not a file under {folder}")
    else:
        found = sorted(f for f in os.listdir(configs) if f.endswith((".yaml", ".yml"))) if os.path.isdir(configs) else []
        mine = [f for f in found if os.path.splitext(f)[0] == os.path.basename(folder)]
        files = [os.path.join(configs, f) for f in mine + [f for f in found if f not in mine]]
    for path in files:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        for top in doc.values():
            entry = (top or {}).get(kind, {}) if isinstance(top, dict) else {}
            if isinstance(entry, dict) and isinstance(entry.get(os.path.basename(folder)), dict):
                return dict(entry[os.path.basename(folder)])
    return {}


def server_class(module: str):  # noqa: ANN201 - a NeMo Gym class, typed in NeMo Gym's environment
    """The server class MODULE defines (the one its `__main__` runs)."""
    from nemo_gym.base_resources_server import BaseResourcesServer
    from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgent

    mod = importlib.import_module(module)
    found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, (BaseResourcesServer, BaseResponsesAPIAgent))
             and c.__module__ == mod.__name__]
    return found[-1] if found else None


def server_kind(module: str) -> str:
    """`responses_api_agents` for an agent (its server class is one of NeMo Gym's agents, wherever
    its module lives), else `resources_servers`."""
    from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgent

    cls = server_class(module)
    return "responses_api_agents" if cls is not None and issubclass(cls, BaseResponsesAPIAgent) else "resources_servers"


def checked(module: str, name: str, entry: dict, overrides: dict, table: str = "nemo_gym") -> dict:
    """The merged config, validated by the server's own config class (as `run_webserver` will)."""
    cls = server_class(module)
    if cls is None:
        return {**entry, **overrides}
    config_cls = cls.model_fields["config"].annotation
    fields = sorted(config_cls.model_fields)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise Refused(f"{table}.{name}.config: {', '.join(unknown)} is no field of {config_cls.__name__} "
                      f"({module}); its fields: {', '.join(fields)}")
    merged = {**entry, **overrides}
    from pydantic import ValidationError

    values, pending = resolved_values(merged)
    try:
        config_cls.model_validate({**values, "name": name})
    except ValidationError as exc:
        # A field that names another part of the config (`${policy_base_url}`) is NeMo Gym's to resolve,
        # once the whole config is built, and to refuse: it names what is missing itself.
        errors = [e for e in exc.errors() if not (e["loc"] and e["loc"][0] in pending)]
        if errors:
            said = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in errors)
            raise Refused(f"{table}.{name}: {config_cls.__name__} of {module} refuses its config: {said}") from None
    return merged


def resolved_values(entry: dict) -> tuple:
    """(the entry with each field's interpolations resolved as NeMo Gym's OmegaConf will resolve them,
    the fields that name other parts of the config and resolve only within it). The entry itself goes
    to NeMo Gym unresolved: `${oc.env:NEMO_SKILLS_SANDBOX_PORT,6000}` is 6000 for the validation, and
    still follows the environment when the server starts."""
    from omegaconf import OmegaConf

    values, pending = {}, set()
    for key, value in entry.items():
        if "${" not in json.dumps(value):
            values[key] = value
            continue
        try:
            values[key] = OmegaConf.to_container(OmegaConf.create({"v": value}), resolve=True)["v"]
        except Exception:  # noqa: BLE001 - OmegaConf's own errors: an interpolation of the whole config
            values[key], pending = value, pending | {key}
    return values, pending


def resolved_models(value, servers: dict):  # noqa: ANN001, ANN201 - plain JSON in NeMo Gym's environment
    """`value` (a server's own config entry) with every model server it names that the config does not
    define (a judge's `judge_model_server: {type: responses_api_models, name: genrm_model}`) pointed at
    rollbook's model server (of those ROLLBOOK_GYM_SERVERS defines, the one named "rollbook"), which
    records those calls too. One the config defines (at a URL the operator gave) is left as it is."""
    models = [k for k, v in servers.items() if isinstance(v, dict) and "rollbook" in (v.get("responses_api_models") or {})]
    if len(models) != 1:
        return value
    if isinstance(value, dict):
        if value.get("type") == "responses_api_models" and value.get("name") not in servers:
            return {**value, "name": models[0]}
        return {k: resolved_models(v, servers) for k, v in value.items()}
    if isinstance(value, list):
        return [resolved_models(v, servers) for v in value]
    return value


def strings(value):  # noqa: ANN001, ANN201 - plain JSON in NeMo Gym's environment
    """Every string in `value`, however deep (the names a config may call a server by: a reference's
    name, or a plain field, as verifif's `judge_server_name`)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)
    elif isinstance(value, str):
        yield value


def references(value, kind: str, key: str = "") -> list:  # noqa: ANN001 - plain JSON in NeMo Gym's environment
    """The (field, reference) pairs of `value` that point at a server of `kind` ({type: kind, name: ...})."""
    if isinstance(value, dict):
        if value.get("type") == kind and "name" in value:
            return [(key, value)]
        return [r for k, v in value.items() for r in references(v, kind, str(k))]
    if isinstance(value, list):
        return [r for v in value for r in references(v, kind, key)]
    return []


def end_with_parent() -> None:
    """Exit once the rollbook server that started this one is gone, however it went (a SIGKILL of its
    process alone, an exit on a lost lease): a server left behind keeps its port and its sessions, and
    the server started again in its place cannot listen there. Its parent changes when it is gone
    (reparented to init or a subreaper); polled, as no signal says so to a process of another program."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def main(argv: list[str]) -> None:
    end_with_parent()
    module, name, port, *paths = argv
    # Python put this file's folder first: rollbook's modules there (gymnasium.py) would shadow the
    # server's own imports (grl_tetris's `import gymnasium`), and ng_run puts no such folder there.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    # As in the activated environment ng_run starts a server in: its scripts (uv, say) on PATH first.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    for path in reversed(paths):
        sys.path.insert(0, path)
    folder = server_folder(module)
    sys.path.insert(0, folder)  # ng_run runs app.py from here: its sibling modules import as top-level ones
    overrides = json.loads(os.environ.get("ROLLBOOK_GYM_OVERRIDES") or "{}")
    servers = json.loads(os.environ.get("ROLLBOOK_GYM_SERVERS") or "{}")
    kind = server_kind(module)
    table = "nemo_gym_agent" if kind == "responses_api_agents" else "nemo_gym"  # the config table a person fixes
    entry = resolved_models(own_config(folder, name, kind, table), servers)
    # Where it listens and what it runs are rollbook's to say, as ng_run's are.
    entry.update({"entrypoint": "app.py", "host": "127.0.0.1", "port": int(port)})
    entry.setdefault("domain", "other")
    merged = checked(module, name, entry, overrides, table)
    merged.update({"host": "127.0.0.1", "port": int(port)})
    named = set(strings(merged))
    for given in sorted(k for k, v in servers.items()
                        if isinstance(v, dict) and "given" in (v.get("responses_api_models") or {})):
        if given not in named:  # a misspelt judge would otherwise be rollbook's model server, silently
            refs = sorted({str(r["name"]) for _, r in references(merged, "responses_api_models")})
            raise Refused(f"{table}.{name}.models: {given!r} is no model server {module}'s config names; it names "
                          f"{', '.join(refs) or 'none'}")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump({"head_server": {"host": "127.0.0.1", "port": 0}, **servers,
                   name: {kind: {os.path.basename(folder): merged}}}, f)  # JSON is YAML
    sys.argv = [sys.argv[0], f"+config_paths=[{f.name}]"]
    from nemo_gym.global_config import get_global_config_dict

    # Hydra writes its run folder (outputs/<date>/<time>/.hydra) under the working directory: a scratch one.
    scratch = tempfile.mkdtemp(prefix="rollbook-gym-")
    os.chdir(scratch)
    get_global_config_dict()  # resolved once, cached: run_webserver reads this one
    os.unlink(f.name)
    # Hydra left a log file handler in the scratch folder, opened at its first record: once the folder is
    # gone, any server that logs (a judge's verify does) fails that request with FileNotFoundError.
    import logging

    for logger in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]:
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler) and h.baseFilename.startswith(scratch)]:
            logger.removeHandler(handler)
            handler.close()
    shutil.rmtree(scratch, ignore_errors=True)
    os.environ["NEMO_GYM_CONFIG_PATH"] = name
    os.chdir(folder)  # ng_run starts a server in its own folder
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def fail(line: str) -> None:
    where = os.environ.get("ROLLBOOK_GYM_FAILURE")
    if where:
        with open(where, "w") as f:
            f.write(line[:2000])
    print(f"rollbook: {line}", file=sys.stderr, flush=True)
    sys.exit(FAILED)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Refused as exc:
        fail(str(exc))
    except Exception as exc:  # an import or a start that failed: its traceback's last line says why
        traceback.print_exc()
        fail(traceback.format_exception_only(exc)[-1].strip())
