"""CPU seconds by process, read from /proc: where a mode's extra cost goes on a machine the run keeps busy.

A run on two cores is CPU-bound (four servers, PostgreSQL and the driver share them), so a checkpoint
costs the run what it costs in CPU, wherever that CPU is spent. Each group is a process and its live
descendants, plus what its children that already exited spent (the kernel's cutime): a PostgreSQL
backend that ends mid-run still counts. Linux only; elsewhere every figure is None.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and of its reaped children), or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    # fields[1] is the parent; utime, stime, cutime, cstime are fields 14-17 of stat(5), here 11-14
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            kids.setdefault(s[0], []).append(int(entry.name))
    return kids


def tree_seconds(pid: int, kids: dict[int, list[int]] | None = None) -> float | None:
    """CPU seconds of `pid`, its live descendants and every child they reaped."""
    kids = _children() if kids is None else kids
    s = _stat(pid)
    if s is None:
        return None
    return s[1] + sum(tree_seconds(k, kids) or 0.0 for k in kids.get(pid, []))


def own_seconds() -> float:
    """This process alone (its children, the embedded PostgreSQL among them, are counted apart)."""
    t = os.times()
    return t.user + t.system


def idle_seconds() -> float | None:
    """Seconds all cores together spent idle since boot (/proc/stat): 0 growth means the run had every core."""
    try:
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return (int(cpu[4]) + int(cpu[5])) / TICK  # idle + iowait


def sample(groups: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds now of each named process tree, of this process ('driver') and idle ('idle')."""
    kids = _children()
    out: dict[str, float | None] = {name: tree_seconds(pid, kids) for name, pid in groups.items()}
    out["driver"] = own_seconds()
    out["idle"] = idle_seconds()
    return out


def spent(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    """What each group spent between two samples (None where either sample lacks it)."""
    return {k: (round(after[k] - v, 2) if v is not None and after.get(k) is not None else None)  # type: ignore[operator]
            for k, v in before.items()}
