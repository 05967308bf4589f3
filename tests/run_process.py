"""`rollbook run` in a subprocess whose JSON lines a test reads as they come (tests/e2e).

`wait_for(event, count)` blocks on the line queue, not on a sleep: it returns the moment the
`count`-th line of that event is printed, and fails naming what it saw if none comes in time.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path


class Run:
    """`rollbook run` in a subprocess whose JSON lines we read as they come."""

    def __init__(self, config_path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "run", "--config", str(config_path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                self.lines.put({"event": "text", "line": line})

    def wait_for(self, event: str, count: int = 1, timeout: float = 90) -> list[dict]:
        seen, end = [], time.time() + timeout
        while len([e for e in seen if e.get("event") == event]) < count:
            try:
                seen.append(self.lines.get(timeout=max(0.1, end - time.time())))
            except queue.Empty:
                raise AssertionError(f"no {event} within {timeout} s; saw {seen[-5:]}") from None
        return seen
