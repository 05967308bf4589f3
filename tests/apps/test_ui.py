"""`rollbook ui` used as a person uses it: headless Chromium against the server in its own process.

The read-only pages run over the demo's database (a SIGKILL of every server mid-run, then a restore
and the finish), and every figure on screen is checked against the public views. Each page's
screenshot is kept in test-artifacts/ui/. The live page runs over a database of its own, where
the test appends events while the page is open.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import psycopg
import pytest

from adapters.postgres import PostgresEventStore
from apps import cli
from apps.processes import free_port
from apps.ui_auth import COOKIE_PREFIX
from engine import catalog as ev
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream, call_stream, episode_stream, rollout_stream
from testkit.pg import DemoRun
from tests.browser import chromium, screenshot
from tests.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ui-test-control-credential"


@contextmanager
def ui_server(dsn: str, *extra: str, port: int | None = None) -> Iterator[str]:
    """`rollbook ui` in a process of its own; yields the address it printed (a browser signs in there)."""
    port = port or free_port()
    env = {**os.environ, "ROLLBOOK_CONTROL_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "ui", "--dsn", dsn, "--port", str(port), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(proc.stdout.readline).result(timeout=60) if proc.stdout else ""
        printed = re.search(r"https?://\S+?(?=/?(\s|$))", line)
        assert printed, f"rollbook ui printed no address: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        base = printed.group(0)
        eventually_sync("rollbook ui to listen", lambda: proc.poll() is not None or _status(base + "/favicon.ico") == 204,
                        timeout=30)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _status(url: str) -> int:
    try:
        return _get(url)[0]
    except OSError:
        return 0


def request(method: str, url: str, headers: dict[str, str] | None = None, body: str | None = None,
            ) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One HTTP request; a `*.localhost` name is reached at 127.0.0.1 with its Host header, as a browser does."""
    parts = urlsplit(url)
    host = "127.0.0.1" if (parts.hostname or "").endswith(".localhost") else parts.hostname
    conn = (http.client.HTTPSConnection(host, parts.port, timeout=10, context=ssl._create_unverified_context())
            if parts.scheme == "https" else http.client.HTTPConnection(host, parts.port, timeout=10))
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body,
                     {"Host": parts.netloc, **(headers or {})})
        answer = conn.getresponse()
        return answer.status, answer.msg, answer.read()
    finally:
        conn.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    status, msg, body = request("GET", url, headers)
    return status, dict(msg), body


def set_cookies(msg: http.client.HTTPMessage) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    for header in msg.get_all("Set-Cookie") or []:
        jar.load(header)
    return {name: morsel.value for name, morsel in jar.items() if morsel.value}  # not those it deletes


def hidden(html: bytes, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html.decode())
    return found.group(1) if found else ""


def sign_in_http(base: str, token: str = TOKEN, nxt: str = "/") -> tuple[int, http.client.HTTPMessage, dict[str, str]]:
    """Sign in as the form does: fetch it (its CSRF token and cookie), then post it back."""
    _, msg, html = request("GET", f"{base}/login?{urlencode({'next': nxt})}", {"Accept": "text/html"})
    jar = set_cookies(msg)
    form = urlencode({"token": token, "next": nxt, "csrf": hidden(html, "csrf")})
    status, answer, _ = request("POST", base + "/login", {
        "Content-Type": "application/x-www-form-urlencoded", "Accept": "text/html",
        "Cookie": "; ".join(f"{k}={v}" for k, v in jar.items())}, form)
    return status, answer, set_cookies(answer)


def sql(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


@pytest.fixture(scope="module")
def demo(demo_run: DemoRun) -> Iterator[tuple[str, str]]:
    assert demo_run.returncode == 0, demo_run.stderr[-2000:]
    with ui_server(demo_run.dsn) as base:
        yield demo_run.dsn, base


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as context:
        yield context


def signed_in(browser: Any, base: str) -> Any:
    page = browser.new_page()
    page.goto(base + "/")
    if page.locator("#token").count():
        page.fill("#token", TOKEN)
        with page.expect_navigation():
            page.click("#sign-in")
    return page


def cells(page: Any, selector: str) -> dict[str, str]:
    return {c.get_attribute("data-col"): c.inner_text().strip() for c in page.locator(f"{selector} td").all()}


def test_a_request_without_the_credential_is_refused(demo: tuple[str, str], browser: Any) -> None:
    _, base = demo
    for path in ("/api/head", "/", "/runs/x", "/fragments/", "/api/runs"):
        status, headers, body = _get(base + path)
        assert status == 401, path
        assert json.loads(body)["error"]["code"] == "unauthorized"
    assert _get(base + "/api/head", {"Authorization": "Bearer not-the-credential"})[0] == 401
    # The cookie never holds the credential.
    assert _get(base + "/api/head", {"Cookie": f"{COOKIE_PREFIX}x={TOKEN}; rollbook_ui={TOKEN}"})[0] == 401
    assert _get(base + "/api/head", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    status, _, body = _get(base + "/rollouts/no-such-rollout", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    # Signing in sends the browser back to a page of this app only, never to another site.
    status, answer, _ = sign_in_http(base, nxt="//elsewhere.example/")
    assert status == 303 and answer["Location"] == "/"

    browser.clear_cookies()
    page = browser.new_page()
    response = page.goto(base + "/")
    assert response.status == 401 and page.locator("#token").count() == 1  # a browser gets the login form
    screenshot(page, "login")
    page.fill("#token", "wrong credential")
    page.click("#sign-in")
    assert page.locator("#problem").inner_text() == "that is not the control credential"
    page.fill("#token", TOKEN)
    page.click("#sign-in")
    page.wait_for_selector("#runs")
    cookie = next(c for c in browser.cookies() if c["name"].startswith(COOKIE_PREFIX))
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
    page.click("header button")  # sign out: the cookie is gone and the pages are closed again
    page.wait_for_selector("#token")
    assert not [c for c in browser.cookies() if c["name"].startswith(COOKIE_PREFIX)]
    assert page.goto(base + "/").status == 401
    page.close()


def test_the_run_list_shows_what_sql_says(demo: tuple[str, str], browser: Any) -> None:
    dsn, base = demo
    page = signed_in(browser, base)
    page.wait_for_selector("#runs")
    screenshot(page, "runs")
    runs = {r.get_attribute("data-run") for r in page.locator("#runs tbody tr").all()}
    assert runs == {r for (r,) in sql(dsn, "SELECT DISTINCT regexp_replace(rollout_id, '-[0-9]+$', '') "
                                           "FROM rollbook.attempts")}
    run = next(r for r in runs if r.endswith("-c"))  # the demo's checkpointed run
    shown = cells(page, f'#runs tr[data-run="{run}"]')
    like = run + "-%"
    (rollouts, finished, restarted, mean), = sql(dsn, """
        SELECT count(*), count(*) FILTER (WHERE last = 'finished'), count(*) FILTER (WHERE n > 1),
               avg(reward) FILTER (WHERE last = 'finished')
        FROM (SELECT rollout_id, count(*) AS n, (array_agg(status ORDER BY attempt DESC))[1] AS last,
                     (array_agg(reward ORDER BY attempt DESC))[1] AS reward
              FROM rollbook.attempts WHERE rollout_id LIKE %s GROUP BY rollout_id) r""", like)
    (restored,), = sql(dsn, "SELECT count(*) FROM rollbook.attempts WHERE rollout_id LIKE %s "
                            "AND restored_from_checkpoint IS NOT NULL", like)
    (checkpoints,), = sql(dsn, "SELECT count(DISTINCT checkpoint_id) FROM rollbook.checkpoint_rollouts "
                               "WHERE rollout_id LIKE %s", like)
    (tasks,), = sql(dsn, "SELECT count(DISTINCT data->>'task_id') FROM rollbook.episode_history "
                         "WHERE rollout_id LIKE %s AND kind = 'episode_started'", like)
    assert restarted > 0 and restored > 0 and checkpoints == 1  # the demo restored a checkpoint
    assert shown["rollouts"] == str(rollouts) and shown["finished"] == str(finished) == str(rollouts)
    assert shown["restarted"] == str(restarted) and shown["restored"] == str(restored)
    assert shown["checkpoints"] == str(checkpoints) and shown["tasks"] == str(tasks)
    assert shown["live"] == "0" and shown["failed"] == "0"
    assert float(shown["mean reward"]) == pytest.approx(float(mean), abs=1e-4)
    status, _, body = _get(base + "/api/runs", {"Authorization": f"Bearer {TOKEN}"})  # the same, for a program
    api = next(r for r in json.loads(body)["runs"] if r["run_id"] == run)
    assert status == 200 and (api["finished"], api["restarted"], api["checkpoints"]) == (finished, restarted, 1)

    page.click(f'#runs tr[data-run="{run}"] a')
    page.wait_for_selector("#rollouts")
    assert page.locator("#rollouts tbody tr").count() == rollouts
    screenshot(page, "run")
    page.close()


def _continued_rollout(dsn: str) -> tuple[str, int, int, str]:
    """A rollout whose attempt 0 had a model call past the boundary the restore continued from."""
    rows = sql(dsn, """
        SELECT a.rollout_id, a.attempt, a.origin_position, a.restored_from_checkpoint
        FROM rollbook.attempts a JOIN rollbook.model_calls m ON m.rollout_id = a.rollout_id AND m.attempt = 0
        WHERE a.attempt = 1 AND a.origin_position IS NOT NULL AND m.accepted_position > a.origin_position
        ORDER BY a.rollout_id LIMIT 1""")
    assert rows, "the demo left no rollout continued past a model call"
    return rows[0]


def test_a_rollout_with_a_crash_and_a_restore(demo: tuple[str, str], browser: Any) -> None:
    dsn, base = demo
    rollout, attempt, origin, checkpoint = _continued_rollout(dsn)
    page = signed_in(browser, base)
    page.goto(f"{base}/rollouts/{quote(rollout)}")
    page.wait_for_selector("#timeline")
    screenshot(page, "rollout")
    attempts = sql(dsn, "SELECT attempt, status, reward FROM rollbook.attempts WHERE rollout_id = %s ORDER BY attempt",
                   rollout)
    assert page.locator("#timeline g.lane").count() == len(attempts) == 2
    assert page.locator("#state").inner_text() == attempts[-1][1] == "finished"
    assert float(page.locator("#reward").inner_text()) == pytest.approx(attempts[-1][2])
    # The fence of attempt 0 and the checkpoint's cut are drawn; the cut at the view's log position.
    assert page.locator("#timeline line.fence").count() == 1
    (position,), = sql(dsn, "SELECT log_position FROM rollbook.checkpoints WHERE checkpoint_id = %s", checkpoint)
    assert f"cut {checkpoint} @{position}" in page.locator("#timeline text.cut-label").text_content()
    # Every model call with its token count, and what attempt 1 kept and redid of attempt 0.
    calls = sql(dsn, "SELECT call_id, attempt, tokens, accepted_position FROM rollbook.model_calls "
                     "WHERE rollout_id = %s ORDER BY accepted_position", rollout)
    assert page.locator("#timeline rect.call").count() == len(calls)
    for call_id, _, tokens, _ in calls:  # a call the crash caught mid-generation has no count: shown "-"
        assert cells(page, f'#call-table tr[data-call="{call_id}"]')["tokens"] == ("-" if tokens is None else str(tokens))
    fates = [(r.locator('td[data-col="fate"]').inner_text(), r.locator('td[data-col="what"]').inner_text())
             for r in page.locator(f"#lineage-{attempt} tbody tr").all()]
    for call_id, a, _, accepted in calls:
        if a == 0:
            want = "kept" if accepted <= origin else "redone"
            assert any(f == want and w.startswith(call_id) for f, w in fates), (call_id, fates)
    assert page.locator('#timeline g.lane[data-attempt="0"] rect.discarded').count() == 1
    assert page.locator("#forks").count() == 1  # the fork tree's place

    # A restart-only rollout the restore dispatched afresh kept nothing of attempt 0.
    (fresh,), = sql(dsn, "SELECT rollout_id FROM rollbook.checkpoint_rollouts WHERE disposition = 'fresh_dispatch' "
                         "ORDER BY rollout_id LIMIT 1")[:1]
    page.goto(f"{base}/rollouts/{quote(fresh)}")
    page.wait_for_selector("#timeline")
    assert "restarted from its input: nothing kept" in page.locator('h3[data-lineage="1"]').inner_text()
    fates = {c.inner_text() for c in page.locator('#lineage-1 td[data-col="fate"]').all()}
    assert fates == {"redone"}
    screenshot(page, "rollout-fresh-dispatch")
    page.close()


def test_a_model_call_continued_after_its_cut(demo: tuple[str, str], browser: Any) -> None:
    dsn, base = demo
    rows = sql(dsn, """SELECT data->>'call_id', (data->>'prefix_tokens')::int, data->'segments'
                       FROM rollbook.episode_history WHERE kind = 'call_completed' AND data ? 'prefix_tokens'
                         AND coalesce(data->'continuation'->>'mode', 'continued') = 'continued'
                       ORDER BY position LIMIT 1""")
    assert rows, "the demo cut no model call at its checkpoint"
    call_id, prefix, segments = rows[0]
    (tokens, version, continues), = sql(dsn, """
        SELECT m.tokens, m.policy_version, h.data->'continues'->>'call_id' FROM rollbook.model_calls m
        JOIN rollbook.episode_history h ON h.kind = 'call_accepted' AND h.data->>'call_id' = m.call_id
        WHERE m.call_id = %s""", call_id)
    page = signed_in(browser, base)
    page.goto(f"{base}/calls/{quote(call_id)}")
    page.wait_for_selector("#logprobs")
    screenshot(page, "model-call")
    assert page.locator('dd[data-key="tokens generated"]').inner_text() == str(tokens)
    assert page.locator("#generated-tokens .tok").count() == tokens
    assert page.locator("#logprobs circle.logprob-pt").count() == tokens
    assert page.locator("#logprobs text.cut-label").text_content() == f"cut at token {prefix}"
    assert page.locator('dd[data-key="continues"]').inner_text() == f"{continues} from token {prefix}"
    assert [c.inner_text() for c in page.locator('#segments td[data-col="policy version"]').all()] == [
        s["policy_version"] for s in segments] and version in {s["policy_version"] for s in segments}
    with page.expect_navigation():  # the cut call it continues: its own tokens end at the cut
        page.click('dd[data-key="continues"] a')
    assert page.locator('dd[data-key="status"]').inner_text() == "cut"
    assert page.locator("#generated-tokens .tok").count() == prefix
    page.close()


def test_a_checkpoint_page(demo: tuple[str, str], browser: Any) -> None:
    dsn, base = demo
    (checkpoint, position, scope), = sql(dsn, "SELECT checkpoint_id, log_position, scope_size FROM rollbook.checkpoints")
    page = signed_in(browser, base)
    page.goto(f"{base}/checkpoints/{quote(checkpoint)}")
    page.wait_for_selector("#cut")
    screenshot(page, "checkpoint")
    assert page.locator('dd[data-key="log position"]').inner_text() == str(position)
    assert page.locator('dd[data-key="scope"]').inner_text() == str(scope)
    want = sql(dsn, "SELECT rollout_id, disposition, boundary FROM rollbook.checkpoint_rollouts "
                    "WHERE checkpoint_id = %s", checkpoint)
    shown = {}
    for row in page.locator("#cut tbody tr").all():
        c = {td.get_attribute("data-col"): td.inner_text() for td in row.locator("td").all()}
        shown[c["rollout"]] = (c["disposition"], None if c["boundary"] == "-" else int(c["boundary"].split()[0]))
    assert shown == {r: (d, b) for r, d, b in want}
    assert sum(d == "continue" for d, _ in shown.values()) == scope
    page.close()


def test_no_script_or_style_from_outside(demo: tuple[str, str], browser: Any) -> None:
    dsn, base = demo
    rollout, *_ = _continued_rollout(dsn)
    (call_id,), = sql(dsn, "SELECT call_id FROM rollbook.model_calls ORDER BY accepted_position LIMIT 1")
    page = signed_in(browser, base)
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    for path in ("/", f"/rollouts/{quote(rollout)}", f"/calls/{quote(call_id)}"):
        response = page.goto(base + path)
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "style-src 'self'" in csp and "default-src 'none'" in csp
        assert "unsafe-inline" not in csp and "http" not in csp
        assert page.evaluate("""() => [...document.scripts].every(s => s.src && new URL(s.src).origin === location.origin)
            && document.querySelectorAll('style, [style]').length === 0
            && [...document.styleSheets].every(s => s.href && new URL(s.href).origin === location.origin)""")
    page.wait_for_timeout(1500)  # a poll of the live page goes out too
    assert fetched and all(u.startswith(base + "/") for u in fetched), [u for u in fetched if not u.startswith(base)]
    assert any(u.endswith("/api/head") for u in fetched)
    # The policy is enforced, not only sent: a script injected inline does not run.
    page.evaluate("() => { const s = document.createElement('script'); s.textContent = 'window.ran = 1';"
                  " document.body.appendChild(s); }")
    assert page.evaluate("() => window.ran === undefined")
    page.close()


async def _append(dsn: str, *events: NewEvent) -> None:
    store = PostgresEventStore.connect(dsn, writer="test")
    try:
        await store.append(AppendRequest(events))
    finally:
        await store.close()


def append(dsn: str, *events: NewEvent) -> None:
    """Append from a thread of its own: playwright's sync API holds this thread's event loop."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _append(dsn, *events)).result()


def test_a_live_run_is_followed_without_a_reload(dsn: str, browser: Any) -> None:
    r = "live-7-0000"
    append(dsn, NewEvent(rollout_stream(r), ev.ATTEMPT_STARTED, {"parent_attempt": None}, r, 0),
                        NewEvent(episode_stream(r, 0), ev.EPISODE_STARTED, {"env": "math", "task_id": "t1"}, r, 0))
    with ui_server(dsn) as base:
        page = signed_in(browser, base)
        page.wait_for_selector('#runs tr[data-run="live-7"]')
        assert cells(page, '#runs tr[data-run="live-7"]')["live"] == "1"
        page.evaluate("() => { window.notReloaded = true; }")
        r2 = "live-7-0001"  # another rollout of the run starts while the page is open
        append(dsn, NewEvent(rollout_stream(r2), ev.ATTEMPT_STARTED, {"parent_attempt": None}, r2, 0),
                            NewEvent(episode_stream(r2, 0), ev.EPISODE_STARTED, {"env": "math", "task_id": "t2"}, r2, 0))
        page.wait_for_function("() => document.querySelector('#runs tr[data-run=\"live-7\"] td[data-col=\"live\"]')"
                               ".textContent === '2'", timeout=15000)
        screenshot(page, "live-runs")
        page.goto(f"{base}/rollouts/{r}")
        page.wait_for_selector("#timeline")
        page.evaluate("() => { window.notReloaded = true; }")
        call = f"{r}.0.t0"
        append(dsn, NewEvent(call_stream(call), ev.CALL_ACCEPTED, {"call_id": call}, r, 0),
                            NewEvent(call_stream(call), ev.CALL_COMPLETED, {"call_id": call, "tokens": 7}, r, 0),
                            NewEvent(rollout_stream(r), ev.ATTEMPT_FINISHED, {"reward": 0.5}, r, 0))
        page.wait_for_function("() => document.getElementById('state').textContent === 'finished'", timeout=15000)
        assert page.locator("#reward").inner_text() == "0.5"
        assert cells(page, f'#call-table tr[data-call="{call}"]')["tokens"] == "7"
        assert page.evaluate("() => window.notReloaded === true")  # the same document: swapped in, not reloaded
        (last,), = sql(dsn, "SELECT max(position) FROM rollbook.episode_history WHERE rollout_id = %s", r)
        assert page.locator("#last-position").inner_text() == str(last)
        screenshot(page, "live-rollout")

        # The other rollout loses its server and recovery continues it from its boundary under attempt 1.
        page.goto(f"{base}/rollouts/{r2}")
        page.wait_for_selector("#timeline")
        append(dsn, NewEvent(agent_stream(r2, 0), ev.AGENT_BOUNDARY, {"turn": 0, "state": "before_model",
                                                                      "activation": 0, "messages": []}, r2, 0))
        (boundary,), = sql(dsn, "SELECT max(position) FROM rollbook.episode_history WHERE rollout_id = %s", r2)
        lost = f"{r2}.0.t0"
        append(dsn, NewEvent(call_stream(lost), ev.CALL_ACCEPTED, {"call_id": lost}, r2, 0))
        page.evaluate("() => { window.notReloaded = true; }")
        append(dsn, NewEvent(rollout_stream(r2), ev.ROLLOUT_RECOVERED, {"attempt": 0, "disposition": "continue",
                   "boundary": boundary, "new_attempt": True, "reason": "its model call was lost"}, r2, 0),
               NewEvent(rollout_stream(r2), ev.ATTEMPT_FENCED, {"reason": "recovery"}, r2, 0),
               NewEvent(rollout_stream(r2), ev.ATTEMPT_STARTED, {"parent_attempt": 0, "origin_attempt": 0,
                        "origin_position": boundary, "disposition": "continue", "recovered": True}, r2, 1))
        page.wait_for_selector("#timeline line.recovered", state="attached", timeout=15000)
        assert page.evaluate("() => window.notReloaded === true")
        assert page.locator("#timeline g.lane").count() == 2
        assert f"boundary at position {boundary}" in page.locator('h3[data-lineage="1"]').inner_text()
        assert cells(page, "#lineage-1 tbody tr")["fate"] == "dropped"  # the lost call was never asked again
        screenshot(page, "live-recovered")
        page.goto(base + "/")
        assert cells(page, '#runs tr[data-run="live-7"]')["recoveries"] == "1"
        page.close()


def test_the_fork_tree_reads_the_forks_view_where_the_database_has_one(dsn: str, browser: Any) -> None:
    origin, fork, fork_of_fork = "tree-1-0000", "tree-1-0001", "tree-1-0002"
    for r in (origin, fork, fork_of_fork):
        # A fork's first attempt names the attempt of the rollout it came from: not an attempt of its own.
        start = {"parent_attempt": None} if r == origin else {"parent_attempt": None, "origin_attempt": 0,
                                                               "origin_position": 10**6, "disposition": "continue"}
        append(dsn, NewEvent(rollout_stream(r), ev.ATTEMPT_STARTED, start, r, 0),
               NewEvent(episode_stream(r, 0), ev.EPISODE_STARTED, {"env": "math", "task_id": "t"}, r, 0))
    with ui_server(dsn) as base:
        page = signed_in(browser, base)
        page.goto(f"{base}/rollouts/{origin}")
        assert "no forks of this rollout" in page.locator("#forks").inner_text()
        # The view as forks record them (rollout, origin rollout, origin attempt, origin position), here
        # standing on fixed rows: this test's database is its own, so its forks view is replaced.
        sql(dsn, "DROP VIEW IF EXISTS rollbook.forks")
        sql(dsn, f"""CREATE VIEW rollbook.forks AS SELECT * FROM (VALUES ('{fork}', '{origin}', 0, 2::bigint),
                     ('{fork_of_fork}', '{fork}', 0, 4::bigint)) v(rollout_id, origin_rollout_id, origin_attempt,
                     origin_position)""")
        page.goto(f"{base}/rollouts/{origin}")
        assert page.locator(f'#forks li[data-fork="{fork}"] li[data-fork="{fork_of_fork}"]').count() == 1
        assert "from attempt 0 at position 2" in page.locator(f'#forks li[data-fork="{fork}"]').inner_text()
        screenshot(page, "fork-tree")
        page.goto(f"{base}/rollouts/{fork_of_fork}")  # a fork's page shows where it came from
        assert page.locator(f'#forks li[data-fork="{fork_of_fork}"]').count() == 1
        assert page.locator("#timeline g.lane").count() == 1 and page.locator("#timeline path.origin").count() == 0
        page.close()


def test_a_model_call_page_with_its_tokens_gone_or_its_continuation_refused(dsn: str, browser: Any) -> None:
    r, gone, cut, again = "gone-1-0000", "gone-1-0000.0.t0", "gone-1-0000.0.t1", "gone-1-0000.0.t1b"
    missing = {"blob_id": "sha256-" + "0" * 64, "digest": "0" * 64, "tokens": 3}
    append(dsn, NewEvent(rollout_stream(r), ev.ATTEMPT_STARTED, {"parent_attempt": None}, r, 0),
           NewEvent(call_stream(gone), ev.CALL_ACCEPTED, {"call_id": gone}, r, 0),
           NewEvent(call_stream(gone), ev.CALL_COMPLETED, {"call_id": gone, "tokens": 3, "receipt": missing}, r, 0),
           NewEvent(call_stream(cut), ev.CALL_ACCEPTED, {"call_id": cut}, r, 0),
           NewEvent(call_stream(cut), ev.CALL_CUT, {"call_id": cut, "tokens": 0}, r, 0),
           NewEvent(call_stream(again), ev.CALL_ACCEPTED, {"call_id": again, "replaces": cut,
                                                           "continues": {"call_id": cut, "receipt": missing}}, r, 0),
           NewEvent(call_stream(again), ev.CALL_COMPLETED, {
               "call_id": again, "tokens": 0, "prefix_tokens": 3, "replaces": cut,
               "continuation": {"mode": "regenerated", "reason": "the upstream cannot continue"}}, r, 0))
    with ui_server(dsn) as base:
        page = signed_in(browser, base)
        response = page.goto(f"{base}/calls/{gone}")  # its token blobs are not in the store
        assert response.status == 200
        assert "is missing" in page.locator("#token-problem").inner_text()
        assert page.locator("#custody tbody tr").count() == 2
        page.goto(f"{base}/calls/{again}")  # the backend started over: no prefix, so no cut in its tokens
        assert page.locator('dd[data-key="continues"]').inner_text() == (
            f"{cut} (regenerated: the upstream cannot continue)")
        assert page.locator("#generated-tokens .cutmark").count() == 0
        page.goto(f"{base}/calls/{cut}")
        assert page.locator('dd[data-key="continued by"]').inner_text() == again
        page.close()


def test_without_a_credential_rollbook_ui_does_not_start(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ROLLBOOK_CONTROL_TOKEN", raising=False)
    for extra, says in (([], "rollbook ui shows the log only to a holder of the control credential"),
                        (["--control-token", "on-the-command-line"], "--control-token puts the control credential")):
        assert cli.main(["ui", "--dsn", "postgresql://nobody@127.0.0.1:1/x", *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and "ROLLBOOK_CONTROL_TOKEN" in err, err  # and it names where the credential goes
