"""`rollbook ui`: a read-only web app over one database's log, behind the control credential.

It reads through the public views only (adapters.ui_reads). Every route but the sign-in form and the
static files asks for the credential: `Authorization: Bearer <control credential>`, or a session the
sign-in form started (apps/ui_auth.py: a random id held in this process's memory, with an expiry,
revoked at sign-out and by a restart, in an HttpOnly, SameSite=Strict cookie a browser sends to this
process's host name only). A request without it gets 401 `unauthorized` (a browser: the sign-in
form). Both forms carry a CSRF token, and a client address that fails the sign-in too often is told
to wait (429). Every answer carries a Content-Security-Policy that allows scripts, styles and
fetches from this origin only, and no inline script or style: nothing is loaded from outside the
machine.
"""

from __future__ import annotations

import argparse
import hmac
import ssl
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from adapters.ui_reads import UiReads
from apps import ui_pages as pages
from apps.ui_auth import SESSION_TTL_S, Auth, Session, is_loopback, safe_next
from engine.errors import ConfigError, Forbidden, NotFound, RollbookError, Unauthorized
from engine.identity import run_of
from participants.base.http_errors import json_reply

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
STATIC = {"ui.css": "text/css", "ui.js": "text/javascript"}
READS = web.AppKey("reads", UiReads)
TOKEN = web.AppKey("token", str)
AUTH = web.AppKey("auth", Auth)
SESSION = "rollbook.session"  # request key: (session id, Session) when a cookie signed the request in
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
WRONG_ADDRESS = ("Sign in at the address rollbook ui printed when it started (http://rb-….localhost:PORT/), or "
                 "serve it over TLS (--tls-cert, --tls-key): a sign-in at this address would leave a cookie that "
                 "the browser also sends to every other port of this host.")


def browser_may_sign_in(request: web.Request) -> bool:
    """A session cookie set for this request's host would reach this process alone (see ui_auth)."""
    return request.secure or (request.url.host or "").lower() == request.app[AUTH].host


def authorized(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer ") and hmac.compare_digest(header[len("Bearer "):].encode(), token.encode()):
        return True
    if not browser_may_sign_in(request):
        return False
    auth = request.app[AUTH]
    sid = request.cookies.get(auth.cookie(request.secure), "")
    session = auth.session(sid)
    if session is None:
        return False
    request[SESSION] = (sid, session)
    return True


def _wants_html(request: web.Request) -> bool:
    return "text/html" in request.headers.get("Accept", "")


def _html(body: str, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


def _signin_page(request: web.Request, nxt: str, problem: str | None, status: int = 200) -> web.Response:
    """The sign-in form, with a CSRF token bound to a cookie of its own (set here when missing)."""
    if not browser_may_sign_in(request):
        return _html(pages.problem_page("sign in elsewhere", WRONG_ADDRESS), 403 if status == 200 else status)
    auth = request.app[AUTH]
    name = auth.signin_cookie(request.secure)
    nonce = request.cookies.get(name, "")
    fresh = len(nonce) < 32
    if fresh:
        nonce = auth.new_nonce()
    response = _html(pages.login_page(safe_next(nxt), auth.signin_csrf(nonce), problem), status)
    if fresh:
        response.set_cookie(name, nonce, httponly=True, samesite="Strict", path="/login", secure=request.secure)
    return response


def _error(exc: RollbookError, request: web.Request) -> web.Response:
    if isinstance(exc, Unauthorized) and request.method == "GET" and _wants_html(request):
        return _signin_page(request, request.rel_url.raw_path_qs, None, exc.status)
    if not isinstance(exc, NotFound) and request.method == "POST" and _wants_html(request):
        return _html(pages.problem_page("refused", exc.detail), exc.status)
    return json_reply(exc.to_json(), status=exc.status)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    open_route = request.path in ("/login", "/favicon.ico") or request.path.startswith("/static/")
    try:
        if not open_route and not authorized(request, request.app[TOKEN]):
            raise Unauthorized("rollbook ui needs the control credential: sign in, or send Authorization: Bearer")
        response = await handler(request)
    except (Unauthorized, Forbidden, NotFound) as exc:
        response = _error(exc, request)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


async def login_form(request: web.Request) -> web.Response:
    return _signin_page(request, request.query.get("next", "/"), None)


async def login(request: web.Request) -> web.Response:
    auth = request.app[AUTH]
    if not browser_may_sign_in(request):
        return _html(pages.problem_page("sign in elsewhere", WRONG_ADDRESS), 403)
    client = request.remote or ""
    wait = auth.retry_after(client)
    if wait:
        response = _html(pages.problem_page("too many failed sign-ins", f"Too many failed sign-ins from this "
                                            f"address: try again in {wait} s."), 429)
        response.headers["Retry-After"] = str(wait)
        return response
    form = await request.post()
    token, nxt = str(form.get("token", "")), safe_next(str(form.get("next", "/")))
    # Not counted as a failure: any web page can post a form here without the token, and it must not
    # lock the operator out by doing so.
    if not auth.signin_ok(request.cookies.get(auth.signin_cookie(request.secure), ""), str(form.get("csrf", ""))):
        return _signin_page(request, nxt, "the form's CSRF token is missing or wrong: nothing was done; "
                                          "sign in again from this form", 403)
    if not hmac.compare_digest(token.encode(), request.app[TOKEN].encode()):
        auth.failed(client)
        return _signin_page(request, nxt, "that is not the control credential", 401)
    sid, _ = auth.start()
    response = web.Response(status=303, headers={"Location": nxt})
    response.set_cookie(auth.cookie(request.secure), sid, httponly=True, samesite="Strict", path="/",
                        secure=request.secure, max_age=int(auth.ttl_s))
    response.del_cookie(auth.signin_cookie(request.secure), path="/login")
    return response


async def logout(request: web.Request) -> web.Response:
    auth = request.app[AUTH]
    form = await request.post()
    held: tuple[str, Session] | None = request.get(SESSION)
    if held is None:
        raise Forbidden("no session of this browser to sign out (a bearer credential is not signed in)")
    sid, session = held
    if not hmac.compare_digest(str(form.get("csrf", "")).encode(), session.csrf.encode()):
        raise Forbidden("the sign-out form's CSRF token is missing or wrong: nothing was changed, and this "
                        "session is still signed in")
    auth.end(sid)
    response = web.Response(status=303, headers={"Location": "/login"})
    response.del_cookie(auth.cookie(request.secure), path="/")
    return response


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise NotFound(f"no static file {name}")
    body = resources.files("apps").joinpath("ui_static", name).read_text(encoding="utf-8")
    return web.Response(text=body, content_type=STATIC[name], charset="utf-8")


async def no_icon(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def _runs(reads: UiReads, _: str) -> tuple[str, str]:
    return "runs", pages.runs_fragment(await reads.runs())


async def _run(reads: UiReads, run_id: str) -> tuple[str, str]:
    rollouts = await reads.rollouts(run_id)
    if not rollouts:
        raise NotFound(f"no run {run_id}")
    run = next((r for r in await reads.runs() if r["run_id"] == run_id), None)
    return f"run {run_id}", pages.run_fragment(run, rollouts, await reads.run_checkpoints(run_id))


async def _rollout(reads: UiReads, rollout_id: str) -> tuple[str, str]:
    r = await reads.rollout(rollout_id)
    if r is None:
        raise NotFound(f"no rollout {rollout_id}")
    return f"rollout {rollout_id}", (f'<p class="crumb">run <a href="{pages.href("/runs", run_of(rollout_id))}">'
                                      f'{pages.e(run_of(rollout_id))}</a></p>' + pages.rollout_fragment(r))


async def _call(reads: UiReads, call_id: str) -> tuple[str, str]:
    c = await reads.model_call(call_id)
    if c is None:
        raise NotFound(f"no model call {call_id}")
    return f"model call {call_id}", pages.call_page_body(c)


async def _checkpoint(reads: UiReads, checkpoint_id: str) -> tuple[str, str]:
    ck = await reads.checkpoint(checkpoint_id)
    if ck is None:
        raise NotFound(f"no checkpoint {checkpoint_id}")
    return f"checkpoint {checkpoint_id}", pages.checkpoint_fragment(ck)


VIEWS: dict[str, Callable[[UiReads, str], Awaitable[tuple[str, str]]]] = {
    "runs": _runs, "rollouts": _rollout, "calls": _call, "checkpoints": _checkpoint}


def _page_handler(kind: str, fragment_only: bool) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        ident = request.match_info.get("ident", "")
        view = _run if kind == "runs" and ident else VIEWS[kind]
        title, body = await view(request.app[READS], ident)
        if fragment_only:
            return _html(body)
        held = request.get(SESSION)
        return _html(pages.page(title, body, "/fragments" + request.rel_url.raw_path, held[1].csrf if held else ""))
    return handle


async def head(request: web.Request) -> web.Response:
    return json_reply(await request.app[READS].head())


async def runs_json(request: web.Request) -> web.Response:
    return json_reply({"runs": await request.app[READS].runs()})


def build_app(dsn: str, token: str, session_ttl_s: float = SESSION_TTL_S) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=64 * 1024)
    app[READS] = UiReads(dsn)
    app[TOKEN] = token
    app[AUTH] = Auth(ttl_s=session_ttl_s)

    async def close(app: web.Application) -> None:
        await app[READS].close()

    app.on_cleanup.append(close)
    r = app.router
    r.add_get("/login", login_form)
    r.add_post("/login", login)
    r.add_post("/logout", logout)
    r.add_get("/static/{name}", static)
    r.add_get("/favicon.ico", no_icon)
    r.add_get("/api/head", head)
    r.add_get("/api/runs", runs_json)
    for fragment_only, prefix in ((False, ""), (True, "/fragments")):
        r.add_get(f"{prefix}/", _page_handler("runs", fragment_only))
        for kind in ("runs", "rollouts", "calls", "checkpoints"):
            r.add_get(f"{prefix}/{kind}/{{ident}}", _page_handler(kind, fragment_only))
    return app


def ui_token(args: argparse.Namespace) -> str:
    from apps.checkpoint_cli import TOKEN_FIX, control_token

    token = control_token(args)
    if not token:
        raise ConfigError("rollbook ui shows the log only to a holder of the control credential, and none was given",
                          "pass --config FILE (its control_token), or " + TOKEN_FIX)
    return token


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert and not args.tls_key:
        return None
    if not (args.tls_cert and args.tls_key):
        raise ConfigError("rollbook ui serves TLS with both a certificate and its key", "pass --tls-cert and --tls-key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {args.tls_cert} and key {args.tls_key} ({exc})",
                          "pass a PEM certificate chain and its private key") from None
    return context


def run(args: argparse.Namespace) -> int:
    from adapters import database

    dsn, token = args.dsn, None
    if args.config:
        from apps import config

        loaded = config.load(args.config)
        dsn, token = dsn or loaded.dsn, loaded.control_token
    token = token or ui_token(args)
    if args.session_ttl_s <= 0:
        raise ConfigError(f"--session-ttl-s {args.session_ttl_s} is not a duration", "pass a number of seconds above 0")
    tls = _tls(args)
    app = build_app(database.prepare_database(dsn), token, args.session_ttl_s)
    auth, host = app[AUTH], args.host if ":" not in args.host else f"[{args.host}]"
    if tls:
        print(f"rollbook ui: https://{host}:{args.port}/", flush=True)
    elif is_loopback(args.host) or args.host in ("0.0.0.0", "::", ""):
        # The name is the sign-in's secret from other local users: it is printed here and nowhere else.
        print(f"rollbook ui: http://{auth.host}:{args.port}/ (a browser signs in there only; programs may use "
              f"http://{host}:{args.port}/ with Authorization: Bearer)", flush=True)
    else:
        print(f"rollbook ui: http://{host}:{args.port}/ (Authorization: Bearer only: a browser signs in over "
              "TLS, --tls-cert and --tls-key)", flush=True)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, ssl_context=tls)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({exc.strerror})",
                          "pass --port a free port (or stop what listens there)") from None
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ui", help="a read-only web app over the log: runs, rollouts, model calls, checkpoints")
    p.add_argument("--config", help="the TOML config file: its dsn and control_token")
    p.add_argument("--dsn", help="PostgreSQL DSN (default: the config's, ROLLBOOK_DSN, else the embedded server)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--control-token-file", metavar="PATH",
                   help="a file (mode 0600) holding the control credential (default: ROLLBOOK_CONTROL_TOKEN)")
    p.add_argument("--session-ttl-s", type=float, default=SESSION_TTL_S, metavar="SECONDS",
                   help=f"how long a browser's sign-in lasts (default {SESSION_TTL_S} s)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate chain (and --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--control-token", help=argparse.SUPPRESS)  # refused by name, as `rollbook checkpoint` does
    p.set_defaults(func=run)
