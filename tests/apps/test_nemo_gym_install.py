"""`rollbook nemo-gym install --server NAME`: a NeMo Gym server's own requirements, added to the
environment rollbook runs NeMo Gym's servers in, as `ng_run` installs them into a server's own.

The servers are NeMo Gym 0.7.0's, from its wheel (`structeval` needs `toml` and `xmltodict`, which
the pinned environment lacks: without its requirements it fails at import), and folders of the
test's own for what no real server does on purpose (a requirement that conflicts with the pins, a
module that still does not import). pip reads PyPI.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from apps import nemo_gym_install
from engine.errors import ConfigError

pytestmark = pytest.mark.timeout(900)

IFBENCH = """-e nemo-gym[dev] @ ../../
setuptools<71
# a comment
absl-py
tqdm>=4.66.0             # MPL-2.0/MIT (scenario playback progress)

https://example.org/en_core_web_sm-3.8.0-py3-none-any.whl
"""


def test_a_requirements_file_less_nemo_gym_itself_comments_and_blank_lines() -> None:
    assert nemo_gym_install.requirement_lines(IFBENCH) == [
        "setuptools<71", "absl-py", "tqdm>=4.66.0", "https://example.org/en_core_web_sm-3.8.0-py3-none-any.whl"]
    assert nemo_gym_install.requirement_lines("nemo_gym==0.7.0\nNeMo-Gym[dev]\n") == []
    # arc_agi's: NeMo Gym as the checkout two folders up, its newline lost
    assert nemo_gym_install.requirement_lines("-e ../../-e nemo-gym[dev] @ ../../\n-e ../..\n../../\n") == []
    assert nemo_gym_install.requirement_name("Foo_Bar[x]>=1.0 ; python_version>'3'") == "foo-bar"
    assert nemo_gym_install.requirement_name("-e ./pocketshell[pcre]") == "./pocketshell"


@pytest.fixture(scope="module")
def python() -> Path:
    return nemo_gym_install.install()[0]


def imports(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def test_a_servers_requirements_are_installed_once_and_then_it_imports(python: Path) -> None:
    added, _ = nemo_gym_install.install_server(python, "structeval")
    assert imports(python, "toml") and imports(python, "xmltodict")
    marker = python.parent.parent / "servers" / "structeval.txt"
    assert marker.exists()
    if added:  # a fresh environment: what its requirements.txt names, less NeMo Gym itself
        assert added == ["xmltodict==1.0.2", "pyyaml>=6.0", "toml"]
    assert nemo_gym_install.install_server(python, "structeval")[0] == []  # the same requirements: nothing again


def test_a_requirement_that_conflicts_with_the_pins_is_refused_naming_the_server_and_both_versions(
        python: Path, tmp_path: Path) -> None:
    """Input: a server folder whose requirements.txt asks for pandas==2.0.0 (the environment pins 3.1.1)."""
    server = tmp_path / "old_pandas_server"
    server.mkdir()
    (server / "requirements.txt").write_text("pandas==2.0.0\n")
    (server / "app.py").write_text("")
    with pytest.raises(ConfigError) as refused:
        nemo_gym_install.install_server(python, str(server))
    said = str(refused.value)
    assert str(server) in said and "pandas==2.0.0" in said and "pandas==3.1.1" in said, said
    version = subprocess.run([str(python), "-c", "import pandas; print(pandas.__version__)"], capture_output=True, text=True)
    assert version.stdout.strip() == "3.1.1"  # nothing moved


def test_a_server_that_still_does_not_import_says_why_in_one_line(python: Path, tmp_path: Path) -> None:
    """Input: a server folder with no requirements.txt whose app.py imports a module nobody installs."""
    server = tmp_path / "missing_dep_server"
    server.mkdir()
    (server / "app.py").write_text("import rollbook_no_such_module\n")
    with pytest.raises(ConfigError, match="does not import: ModuleNotFoundError: No module named 'rollbook_no_such_module'"):
        nemo_gym_install.install_server(python, str(server))


def test_an_unknown_server_is_refused_naming_where_it_was_looked_for(python: Path) -> None:
    """Input: a name no resources server or agent of the installed NeMo Gym has, and a path-like name."""
    for name in ("no_such_server", "../structeval"):
        with pytest.raises(ConfigError, match="no NeMo Gym server named"):
            nemo_gym_install.install_server(python, name)


def version(python: Path, module: str) -> str:
    return subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({module!r}))"],
                          capture_output=True, text=True).stdout.strip()


def test_servers_whose_requirements_conflict_each_run_apart_in_an_environment_of_their_own(
        python: Path, tmp_path: Path) -> None:
    """Input: two server folders whose requirements.txt ask for toml 0.10.1 and toml 0.10.2, and one with none."""
    folders = []
    for name, pin in (("old_toml_server", "toml==0.10.1"), ("new_toml_server", "toml==0.10.2"), ("plain_server", None)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "app.py").write_text("import toml\n" if pin else "")
        if pin:
            (folder / "requirements.txt").write_text(f"-e nemo-gym[dev] @ ../../\n{pin}\n")
        folders.append(folder)
    (old, added, _), (new, _, _) = (nemo_gym_install.server_python(python, str(f)) for f in folders[:2])
    assert added == ["toml==0.10.1"] and len({old, new, python}) == 3
    assert (version(old, "toml"), version(new, "toml")) == ("0.10.1", "0.10.2")
    assert version(old, "pandas") == version(python, "pandas") == "3.1.1"  # the installed environment behind its own
    assert nemo_gym_install.server_python(python, str(folders[0]))[1:] == ([], 0.0)  # built once
    # nothing of its own: NeMo Gym with all it declares, which code_fim's and the other ray users' `msgpack` is part of
    plain = nemo_gym_install.server_python(python, str(folders[2]))[0]
    assert plain == nemo_gym_install.nemo_gym_python(python) and imports(plain, "msgpack") and not imports(python, "msgpack")
    assert (plain.parent / "uv").exists()  # ng_run builds environments with it; bigcodebench builds its own
    assert imports(old, "msgpack")  # a server's own environment is over it


def test_a_servers_own_pin_wins_in_its_own_environment_and_its_local_paths_resolve_from_its_folder(
        python: Path, tmp_path: Path) -> None:
    """Input: code_gen's shape (a pin of a package the installed environment pins otherwise: code_gen's is
    numpy, here tqdm 4.66.1 against 4.70.1; cvdp's, pydantic 2.13.4, whose pydantic-core is pinned otherwise) and browsecomp_advanced_harness's (`-e ./pocketshell`, a package in the server's folder)."""
    folder = tmp_path / "own_pin_server"
    (folder / "localpkg" / "localpkg").mkdir(parents=True)
    (folder / "localpkg" / "localpkg" / "__init__.py").write_text("WHERE = 'local'\n")
    (folder / "localpkg" / "pyproject.toml").write_text(
        '[project]\nname = "localpkg"\nversion = "0.1"\n[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n')
    (folder / "requirements.txt").write_text("-e nemo-gym[dev] @ ../../\ntqdm==4.66.1\npydantic==2.13.4\n-e ./localpkg\n")
    (folder / "app.py").write_text("import tqdm, localpkg\n")
    own, added, _ = nemo_gym_install.server_python(python, str(folder))
    assert added == ["tqdm==4.66.1", "pydantic==2.13.4", "-e ./localpkg"] and version(own, "localpkg") == "0.1"
    assert (version(own, "tqdm"), version(python, "tqdm")) == ("4.66.1", "4.70.1")
    # cvdp's shape: what its pin depends on moves too (pydantic 2.13.4 needs pydantic-core 2.46.4, pinned 2.50.5)
    assert (version(own, "pydantic-core"), version(python, "pydantic-core")) == ("2.46.4", "2.50.5")
