"""The crash check's own failures: a run that never ends is killed and named, with where it waits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import apps.nemo_gym_conformance as conformance
from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.events import AppendRequest, NewEvent
from engine.identity import episode_stream, rollout_stream


async def _start(dsn: str, *rollouts: str) -> None:
    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        for rid in rollouts:
            await store.append(AppendRequest((
                NewEvent(rollout_stream(rid), ev.ATTEMPT_STARTED, {"parent_attempt": None}, rid, 0),
                NewEvent(episode_stream(rid, 0), ev.EPISODE_STARTED, {"task": {}}, rid, 0))))
    finally:
        await store.close()


def test_a_run_past_its_time_is_killed_and_says_where_its_rollouts_wait(dsn: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a `rollbook run` that never exits (a sleeping process stands in for it) on a log where rollout
    ref-0 has started and another run's rollout has too. Before, the check said only "a run took over
    300 s" and left the run going."""
    asyncio.run(_start(dsn, "ref-0", "other-0"))
    started: list[subprocess.Popen[bytes]] = []

    def hanging(_config: Path) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    monkeypatch.setattr(conformance, "_run", hanging)
    monkeypatch.setattr(conformance, "RUN_TIMEOUT_S", 1.0)
    with pytest.raises(conformance._Hung) as hung:
        conformance._to_end(tmp_path / "ref.toml", dsn, "ref")
    assert started[0].returncode == -9  # killed, not left running
    said = str(hung.value)
    assert said.startswith("the ref run took over 1 s and was killed; unfinished"), said
    assert f"ref-0: {ev.EPISODE_STARTED} on {episode_stream('ref-0', 0)}" in said, said
    assert "other-0" not in said, said
