"""Headless Chromium for the tests that use `rollbook ui` as a person does.

The browser is Debian's `chromium` package at /usr/bin/chromium, driven by the `playwright` package
(the test extra) through `executable_path`: playwright never downloads a browser of its own here
(`playwright install` fetches from outside the package registries, which this project's machines
cannot reach). On a fresh machine the package is not there, so `ensure_chromium` installs it with
apt (the suite runs as root, as CI does); if that fails the test fails and says why: a missing
browser is never a skip.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox: root runs it (Chromium refuses its sandbox as root); the rest keep it off the network
# (nothing but the page under test may be reached) and away from first-run work.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "ui"


def _apt(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another apt on the machine (an unattended upgrade) holds dpkg's lock for a while: wait for it.
    return subprocess.run(["apt-get", "-o", f"DPkg::Lock::Timeout={int(timeout)}", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def ensure_chromium() -> Path:
    """/usr/bin/chromium, installed from Debian's packages first if it is missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail(f"{CHROMIUM} is missing and this process cannot install it (needs apt-get as root): "
                    "run `apt-get install -y --no-install-recommends chromium` as root")
    # Test workers reach here at once on a fresh machine: one installs, the others wait and find it.
    with open(Path(tempfile.gettempdir()) / "rollbook-chromium.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not CHROMIUM.exists():
            _install_chromium()
    return CHROMIUM


def _install_chromium() -> None:
    problems = []
    for step in (("update",), ("install", "-y", "--no-install-recommends", "chromium")):
        done = _apt(*step, timeout=900)
        if done.returncode != 0:
            problems.append(f"apt-get {' '.join(step)} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
            if step[0] == "install":
                break
    if not CHROMIUM.exists():
        pytest.fail(f"installing Debian's chromium failed, so the browser tests cannot run: {' | '.join(problems)}")


@contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium (playwright's Browser) with an empty profile of its own."""
    from playwright.sync_api import sync_playwright

    path = ensure_chromium()
    with tempfile.TemporaryDirectory(prefix="rb-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=str(path), args=ARGS,
                                                        headless=True, viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


def screenshot(page: object, name: str) -> Path:
    """Keep what the page showed as a test artifact (test-artifacts/ui/, ignored by git)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    print(f"screenshot: {path}")
    return path
