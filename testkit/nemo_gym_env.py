"""NeMo Gym 0.7.0 for the tests, installed the light way into a cache folder outside git.

nemo-gym declares Python >= 3.13.14 and depends on Ray, MLflow, pyarrow and more (about 1.4 GB),
none of which `nemo_gym.token_id_capture` imports: `pip install --no-deps --ignore-requires-python`
into a folder of its own, plus pydantic and orjson (rollbook's test extra), is enough on 3.11. The
folder is ROLLBOOK_TEST_CACHE (default ~/.cache/rollbook-tests), kept between runs; the first run
downloads the wheel (about 1 MB). Nothing is installed into the virtual environment itself.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NEMO_GYM = "nemo-gym==0.7.0"


def target() -> Path:
    root = Path(os.environ.get("ROLLBOOK_TEST_CACHE") or Path.home() / ".cache" / "rollbook-tests")
    return root / "nemo-gym-0.7.0"


def ensure() -> Path:
    """The folder that holds `nemo_gym`, installed on first use and put on sys.path. Test workers race to
    it on a fresh machine: one installs under a lock while the others wait, then find it made."""
    folder = target()
    marker = folder / "nemo_gym" / "token_id_capture" / "conformance.py"
    if not marker.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / ".nemo-gym.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not marker.exists():
                _install(folder)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


def _install(folder: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=".nemo-gym-", dir=folder.parent))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--ignore-requires-python", "--target", str(scratch), NEMO_GYM],
            check=True, timeout=600,
        )
        shutil.rmtree(folder, ignore_errors=True)  # a half-made folder from an interrupted run
        os.rename(scratch, folder)  # whole or not at all
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
