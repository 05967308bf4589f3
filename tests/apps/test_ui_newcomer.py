"""What a newcomer does after `rollbook demo --keep`, in the browser: open `rollbook ui`, find the run
the demo crashed, open a rollout continued after the crash and see which turns were kept and which
redone, fork it 4 times from its second boundary with `rollbook fork`, and watch the forks finish in
the page, which follows the log without a reload. Each step leaves a screenshot in test-artifacts/ui/.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from engine.forks import fork_boundaries
from tests.apps.test_ui import TOKEN, signed_in, ui_server
from tests.browser import chromium, screenshot
from tests.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def _sql(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()


@pytest.fixture
def servers(demo_db: str, tmp_path: Path) -> Iterator[Path]:
    """The four servers started again on the kept demo database, as the newcomer would for a fork."""
    config = cfg.Config(dsn=demo_db, control_token=TOKEN, data_token=secrets.token_hex(12),
                        servers={k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}, sandbox=cfg.SandboxConfig())
    cfg.write(config, tmp_path / "rollbook.toml")
    procs = ServerProcesses(config, tmp_path / "rollbook.toml", tmp_path)
    procs.start()
    try:
        yield tmp_path / "rollbook.toml"
    finally:
        procs.stop()


def _second_boundary(dsn: str) -> tuple[str, int, int]:
    """A rollout the restore continued (attempt 1 from attempt 0's boundary) that redid a model call of
    the crashed attempt, and the second boundary of its continued attempt that a fork may start from."""
    candidates = [r for (r,) in _sql(dsn, """
        SELECT DISTINCT a.rollout_id FROM rollbook.attempts a JOIN rollbook.model_calls m
          ON m.rollout_id = a.rollout_id AND m.attempt = 0 AND m.accepted_position > a.origin_position
        WHERE a.attempt = 1 AND a.restored_from_checkpoint IS NOT NULL AND a.status = 'finished'
        ORDER BY a.rollout_id""")]

    async def boundaries() -> dict[str, list[int]]:
        store = PostgresEventStore.connect(dsn, writer="newcomer")
        try:
            return {r: fork_boundaries(await store.read_rollout(r, 1)) for r in candidates}
        finally:
            await store.close()
    with ThreadPoolExecutor(1) as pool:  # a loop of its own: pytest-asyncio may hold this thread's
        found = pool.submit(asyncio.run, boundaries()).result()
    rollout = next((r for r in candidates if len(found[r]) >= 2), None)
    assert rollout is not None, f"the demo left no continued rollout with two boundaries after a redone call: {found}"
    return rollout, 1, found[rollout][1]


def test_a_newcomer_finds_the_crash_forks_a_continued_rollout_and_watches_the_forks_finish(
        demo_db: str, servers: Path) -> None:
    with ui_server(demo_db) as base, chromium() as browser:
        page = signed_in(browser, base)
        page.wait_for_selector("#runs")
        crashed = next(r.get_attribute("data-run") for r in page.locator("#runs tbody tr").all()
                       if r.get_attribute("data-run").endswith("-c"))
        restarted = page.locator(f'#runs tr[data-run="{crashed}"] td[data-col="restarted"]').inner_text()
        assert int(restarted) > 0  # the crashed run shows its restarts
        screenshot(page, "newcomer-1-runs")

        rollout, attempt, at = _second_boundary(demo_db)
        page.goto(f"{base}/rollouts/{quote(rollout)}")
        page.wait_for_selector("#timeline")
        assert page.locator("#timeline g.lane").count() == 2  # the crashed attempt and the one continued after it
        fates = [r.locator('td[data-col="fate"]').inner_text() for r in page.locator("#lineage-1 tbody tr").all()]
        assert "kept" in fates and "redone" in fates, f"kept and redone turns of the crashed attempt: {fates}"
        screenshot(page, "newcomer-2-continued-rollout")

        fork = [sys.executable, "-m", "apps.cli", "fork", rollout, "--attempt", str(attempt), "--at", str(at),
                "--count", "4", "--config", str(servers), "--timeout-s", "300"]
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(subprocess.run, fork, cwd=ROOT, capture_output=True, text=True, timeout=400)
            # The page follows the log: the four forks appear in the fork tree without a reload.
            eventually_sync("four forks in the page's fork tree", lambda: page.locator("#forks li[data-fork]").count() == 4,
                            timeout=120)
            screenshot(page, "newcomer-3-forks-started")
            done = running.result()
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        eventually_sync("every fork finished in the page", lambda: {
            li.get_attribute("data-state") for li in page.locator("#forks li[data-fork]").all()} == {"finished"}, timeout=60)
        screenshot(page, "newcomer-4-forks-finished")
        shown = {li.get_attribute("data-fork"): li.get_attribute("data-state")
                 for li in page.locator("#forks li[data-fork]").all()}
        in_sql = dict(_sql(demo_db, "SELECT f.rollout_id, a.status FROM rollbook.forks f JOIN rollbook.attempts a "
                                    "USING (rollout_id) WHERE f.origin_rollout_id = %s AND f.origin_position = %s",
                           rollout, at))
        assert shown == in_sql and set(in_sql.values()) == {"finished"} and len(in_sql) == 4
        page.close()
