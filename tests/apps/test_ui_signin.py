"""The sign-in of `rollbook ui` against a hostile local user: each test plays one attack that worked
against the ui's first sign-in (a fixed HMAC of the credential in a cookie with no expiry, `next`
checked by its first two characters, no CSRF token, no limit on guesses) and checks it fails now.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import pytest

from tests.apps.test_ui import TOKEN, hidden, request, sign_in_http, ui_server
from tests.browser import chromium
from tests.waiting import eventually_sync

FORM = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "text/html"}
# `next` values a browser reads as another origin (its URL parser drops tabs and newlines, reads a
# backslash as a slash, and strips leading control characters and spaces).
HOSTILE_NEXT = ["/\\127.0.0.1:9/x", "/\t/127.0.0.1:9/x", "/\\/127.0.0.1:9/x", "//127.0.0.1:9/x",
                "/\n/127.0.0.1:9/x", "\\\\127.0.0.1:9/x", " //127.0.0.1:9/x", "\x00//127.0.0.1:9/x",
                "http://127.0.0.1:9/x", "javascript:alert(1)", "/\r\n/127.0.0.1:9/x", "https:127.0.0.1:9"]


def cookie_header(jar: dict[str, str]) -> dict[str, str]:
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in jar.items())}


def signed_in_http(base: str) -> dict[str, str]:
    status, answer, jar = sign_in_http(base)
    assert status == 303, status
    assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 200
    return jar


def sign_out_csrf(base: str, jar: dict[str, str]) -> str:
    """The CSRF token of the sign-out form on a page of the session."""
    status, _, html = request("GET", base + "/", {**cookie_header(jar), "Accept": "text/html"})
    assert status == 200
    return hidden(html, "csrf")


@contextmanager
def listener() -> Iterator[tuple[int, list[dict[str, str]]]]:
    """An HTTP server on another port of 127.0.0.1, as a hostile local user runs one: it records
    each request's Host and Cookie headers and answers a page."""
    seen: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append({"path": self.path, "host": self.headers.get("Host", ""),
                         "cookie": self.headers.get("Cookie", "")})
            body = b"<!doctype html><title>elsewhere</title><p id='elsewhere'>another listener</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as context:
        yield context


def _browser_sign_in(page: Any) -> None:
    page.fill("#token", TOKEN)
    with page.expect_navigation():
        page.click("#sign-in")


def test_next_never_sends_the_browser_to_another_origin(dsn: str) -> None:
    """Attack: an open redirect. A link to the sign-in form with next=/\\127.0.0.1:9/x (or /<tab>/...,
    /\\/..., a scheme) sent the browser to the attacker's origin right after it signed in; now any
    `next` a browser would read as another origin falls back to the app's home."""
    with ui_server(dsn) as base:
        for nxt in HOSTILE_NEXT:
            _, _, html = request("GET", f"{base}/login?{urlencode({'next': nxt})}", {"Accept": "text/html"})
            assert hidden(html, "next") == "/", nxt  # the form never carries it
            status, answer, _ = sign_in_http(base, nxt=nxt)
            assert (status, answer["Location"]) == (303, "/"), nxt
        status, answer, _ = sign_in_http(base, nxt="/runs/r-1?x=%2F%2Fy")  # a page of the app stays
        assert (status, answer["Location"]) == (303, "/runs/r-1?x=%2F%2Fy")


def test_next_in_chromium_keeps_the_browser_on_the_apps_origin(dsn: str, browser: Any) -> None:
    """Attack: the open redirect as a browser reads it. After a sign-in from a link whose next is
    /\\127.0.0.1:PORT/..., /<tab>/127.0.0.1:PORT/... or /\\/127.0.0.1:PORT/..., the ui's redirect
    pointed Chromium at a listener on that port (its URL parser reads the backslash as a slash and
    drops the tab; only the CSP's form-action, where a browser applies it to redirects, stood in
    the way). Now Chromium resolves the redirect to the ui's own origin, lands there, and the
    listener sees no request."""
    with ui_server(dsn) as base, listener() as (port, seen):
        origin = f"{urlsplit(base).scheme}://{urlsplit(base).netloc}"
        page = browser.new_page()
        answers: list[str] = []

        def sign_in(route: Any) -> None:
            """Post the form as the browser would, keep the ui's answer as it is, and hand it back to
            the browser to follow (from here: playwright's own fetch cannot resolve `*.localhost`)."""
            if route.request.method != "POST":
                return route.continue_()
            sent = {k: v for k, v in route.request.headers.items() if k.lower() in ("content-type", "cookie", "accept")}
            status, msg, body = request("POST", route.request.url, sent, route.request.post_data)
            answers.append(msg.get("Location", ""))
            headers = {k: v for k, v in msg.items() if k.lower() not in ("content-length", "set-cookie")}
            route.fulfill(status=status, body=body, headers={**headers, "Set-Cookie": "\n".join(
                msg.get_all("Set-Cookie") or [])})

        for nxt in (f"/\\127.0.0.1:{port}/stolen", f"/\t/127.0.0.1:{port}/stolen", f"/\\/127.0.0.1:{port}/stolen"):
            page.goto(f"{base}/login?next={quote(nxt, safe='')}")
            page.fill("#token", TOKEN)
            answers.clear()
            page.route(f"{base}/login", sign_in)
            page.click("#sign-in")
            eventually_sync("the sign-in's answer", lambda: page.wait_for_timeout(50) or bool(answers), timeout=10)
            page.unroute(f"{base}/login")
            # Where the browser's own URL parser sends it, whatever a later check would make of it.
            assert page.evaluate("([l, b]) => new URL(l, b).origin", [answers[0], base + "/login"]) == origin, (
                nxt, answers[0])
            page.wait_for_url(origin + "/")
            page.wait_for_selector("#live")  # signed in, on the app's home
            assert page.locator("#elsewhere").count() == 0
        assert seen == []
        page.close()


def test_a_session_ends_at_sign_out_and_at_a_restart(dsn: str) -> None:
    """Attack: replaying an old cookie. The cookie was a fixed HMAC of the credential, so one copied
    before a sign-out, or before `rollbook ui` restarted, still opened /api/runs; now a session is a
    random id held by the ui process, which sign-out deletes and a restart forgets."""
    with ui_server(dsn) as base:
        jar = signed_in_http(base)
        status, answer, _ = request("POST", base + "/logout", {**FORM, **cookie_header(jar)},
                                    urlencode({"csrf": sign_out_csrf(base, jar)}))
        assert (status, answer["Location"]) == (303, "/login")
        assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 401

        jar = signed_in_http(base)  # signed in again, then the ui restarts on the same port
    port = urlsplit(base).port
    with ui_server(dsn, port=port) as again:
        for where in (again, base, f"http://127.0.0.1:{port}"):
            assert request("GET", where + "/api/runs", cookie_header(jar))[0] == 401, where
        (value,) = jar.values()  # the old id under the new process's cookie name is refused too
        fresh = signed_in_http(again)
        (name,) = fresh
        assert request("GET", again + "/api/runs", {"Cookie": f"{name}={value}"})[0] == 401
        assert request("GET", again + "/api/runs", cookie_header(fresh))[0] == 200


def test_a_listener_on_another_local_port_gets_no_cookie_that_works(dsn: str, browser: Any) -> None:
    """Attack: cookies ignore ports. Chromium sent the ui's cookie to every port of 127.0.0.1, and a
    local user's listener there read /api/runs with it. Now the browser signs in at the ui's own
    host name, so the listener (visited as 127.0.0.1 and as localhost) receives no cookie of the ui,
    and whatever it did receive is refused by the ui."""
    with ui_server(dsn) as base, listener() as (port, seen):
        browser.clear_cookies()
        page = browser.new_page()
        page.goto(base + "/")
        _browser_sign_in(page)
        page.wait_for_selector("#runs, .empty")
        assert page.goto(base + "/api/runs").status == 200  # the browser is signed in
        for elsewhere in (f"http://127.0.0.1:{port}/steal", f"http://localhost:{port}/steal"):
            page.goto(elsewhere)
            assert page.locator("#elsewhere").count() == 1
        page.close()
        assert {s["path"] for s in seen} >= {"/steal"}
        ui_port = urlsplit(base).port
        for s in seen:
            if not s["cookie"]:
                continue
            for where in (base, f"http://127.0.0.1:{ui_port}", f"http://localhost:{ui_port}"):
                assert request("GET", where + "/api/runs", {"Cookie": s["cookie"]})[0] == 401, (s, where)
        print(f"the other port received: {[s['cookie'] for s in seen]}")


def test_sign_out_and_sign_in_without_the_csrf_token_are_refused(dsn: str) -> None:
    """Attack: cross-site request forgery. Any page could post the sign-out form (and the sign-in
    form) with no token; now a POST without the form's CSRF token is refused with 403 and a reason,
    and changes nothing: the session still works, and no session is started."""
    with ui_server(dsn) as base:
        jar = signed_in_http(base)
        for form in ({}, {"csrf": ""}, {"csrf": "forged"}):
            status, _, body = request("POST", base + "/logout", {**FORM, **cookie_header(jar)}, urlencode(form))
            assert status == 403 and b"CSRF token is missing or wrong" in body, (form, status)
            status, _, body = request("POST", base + "/logout", {
                "Content-Type": "application/x-www-form-urlencoded", **cookie_header(jar)}, urlencode(form))
            assert status == 403 and b'"forbidden"' in body  # a program is told the same, as JSON
        assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 200  # still signed in
        assert sign_out_csrf(base, jar)

        status, answer, body = request("POST", base + "/login", FORM, urlencode({"token": TOKEN, "next": "/"}))
        assert status == 403 and b"CSRF token is missing or wrong" in body
        assert not answer.get_all("Set-Cookie") or all("rb_session_" not in c for c in answer.get_all("Set-Cookie"))


def test_sign_in_is_rate_limited(dsn: str) -> None:
    """Attack: guessing the credential. Every wrong guess was answered at once, without end; now
    after 5 failures in a minute from one address the form answers 429 with Retry-After, even to
    the right credential, until the window has passed."""
    with ui_server(dsn) as base:
        for _ in range(5):
            assert sign_in_http(base, token="a guess")[0] == 401
        status, answer, jar = sign_in_http(base)
        assert status == 429 and 1 <= int(answer["Retry-After"]) <= 60
        assert not any(k.startswith("rb_session_") for k in jar)
        assert request("GET", base + "/api/runs", {"Authorization": f"Bearer {TOKEN}"})[0] == 200  # programs go on


def test_a_session_past_its_expiry_is_refused(dsn: str) -> None:
    """Attack: a cookie kept forever. The old cookie had no expiry, so one copied once worked for as
    long as the credential did; now a session lasts --session-ttl-s from its sign-in, and the ui
    refuses it after that, whatever the browser still holds."""
    with ui_server(dsn, "--session-ttl-s", "2") as base:
        status, answer, jar = sign_in_http(base)
        assert status == 303 and any("rb_session_" in c and "Max-Age=2" in c for c in answer.get_all("Set-Cookie"))
        assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 200
        time.sleep(2.5)
        assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 401


def test_over_tls_the_cookie_is_host_prefixed_and_secure(dsn: str, tmp_path: Path) -> None:
    """Attack: cookies ignore ports, over TLS. Served with --tls-cert and --tls-key (where a browser may
    sign in at any host name), the session cookie is `__Host-` prefixed and Secure, on Path=/ with no
    Domain: a browser sends it over TLS only, so a plain-HTTP listener on another port never gets it,
    and a TLS one would need a certificate the browser trusts for that host."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    with ui_server(dsn, "--tls-cert", str(cert), "--tls-key", str(key)) as base:
        assert base.startswith("https://127.0.0.1:")
        status, answer, jar = sign_in_http(base)
        assert status == 303
        (header,) = [c for c in answer.get_all("Set-Cookie") if "rb_session_" in c]
        attributes = {a.strip().split("=")[0].lower() for a in header.split(";")}
        assert header.startswith("__Host-rb_session_") and {"secure", "httponly", "path"} <= attributes
        assert "domain" not in attributes and "Path=/;" in header + ";" and "SameSite=Strict" in header
        assert request("GET", base + "/api/runs", cookie_header(jar))[0] == 200
