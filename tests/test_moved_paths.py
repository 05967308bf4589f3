"""Import paths a user may have named (an entry point, a config, a backend plugin's imports) from
before the servers moved into one package per kind: each fails naming where the module is now, and
that place imports."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import participants

OLD_PATHS = sorted(participants.MOVED)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_import_path_names_the_new_one(old: str) -> None:
    with pytest.raises(ModuleNotFoundError) as refused:
        importlib.import_module(old)
    assert f"{old} moved: it is now {participants.MOVED[old]}" in str(refused.value)
    importlib.import_module(participants.MOVED[old].split(" ")[0].replace("<kind>", "model"))


def test_an_entry_point_written_against_the_old_layout_says_where_to_look() -> None:
    """As importlib.metadata loads `scripted = "participants.scripted_model:ScriptedBackend"`."""
    code = ("from importlib.metadata import EntryPoint\n"
            "EntryPoint('scripted', 'participants.scripted_model:ScriptedBackend', 'g').load()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "participants.scripted_model moved: it is now participants.model.backends.scripted" in done.stderr


def test_a_module_that_never_existed_is_still_a_plain_missing_module() -> None:
    with pytest.raises(ModuleNotFoundError, match="No module named 'participants.no_such_thing'"):
        importlib.import_module("participants.no_such_thing")
