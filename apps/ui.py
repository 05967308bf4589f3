"""`rollbook ui`: a read-only web app over one database's log, behind the control credential.

It reads through the public views only (adapters.ui_reads). Every route but the login form and the
static files asks for the credential: `Authorization: Bearer <control credential>`, or the cookie
the login form sets, which holds an HMAC of the credential (never the credential itself) and is
HttpOnly and SameSite=Strict. A request without it gets 401 `unauthorized` (a browser: the login
form). Every answer carries a Content-Security-Policy that allows scripts, styles and fetches from
this origin only, and no inline script or style: nothing is loaded from outside the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from adapters.ui_reads import UiReads
from apps import ui_pages as pages
from engine.errors import ConfigError, NotFound, Unauthorized
from engine.identity import run_of

COOKIE = "rollbook_ui"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
STATIC = {"ui.css": "text/css", "ui.js": "text/javascript"}
READS = web.AppKey("reads", UiReads)
TOKEN = web.AppKey("token", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def session_value(token: str) -> str:
    """What the cookie holds: derived from the credential, so a stolen cookie does not reveal it."""
    return hmac.new(token.encode(), b"rollbook ui session", hashlib.sha256).hexdigest()


def authorized(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer ") and hmac.compare_digest(header[len("Bearer "):].encode(), token.encode()):
        return True
    return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), session_value(token).encode())


def _wants_html(request: web.Request) -> bool:
    return request.method == "GET" and "text/html" in request.headers.get("Accept", "")


def _html(body: str, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


def _error(exc: Unauthorized | NotFound, request: web.Request) -> web.Response:
    if isinstance(exc, Unauthorized) and _wants_html(request):
        return _html(pages.login_page(request.path_qs, None), exc.status)
    return web.json_response(exc.to_json(), status=exc.status)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    open_route = request.path in ("/login", "/favicon.ico") or request.path.startswith("/static/")
    try:
        if not open_route and not authorized(request, request.app[TOKEN]):
            raise Unauthorized("rollbook ui needs the control credential: sign in, or send Authorization: Bearer")
        response = await handler(request)
    except (Unauthorized, NotFound) as exc:
        response = _error(exc, request)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


async def login_form(request: web.Request) -> web.Response:
    return _html(pages.login_page(request.query.get("next", "/"), None))


async def login(request: web.Request) -> web.Response:
    form = await request.post()
    token, nxt = str(form.get("token", "")), str(form.get("next", "/"))
    if not nxt.startswith("/") or nxt.startswith("//"):
        nxt = "/"  # only a page of this app: never send the browser elsewhere
    if not hmac.compare_digest(token.encode(), request.app[TOKEN].encode()):
        return _html(pages.login_page(nxt, "that is not the control credential"), 401)
    response = web.Response(status=303, headers={"Location": nxt})
    response.set_cookie(COOKIE, session_value(request.app[TOKEN]), httponly=True, samesite="Strict", path="/")
    return response


async def logout(request: web.Request) -> web.Response:
    response = web.Response(status=303, headers={"Location": "/login"})
    response.del_cookie(COOKIE, path="/")
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
        return _html(pages.page(title, body, "/fragments" + request.rel_url.raw_path))
    return handle


async def head(request: web.Request) -> web.Response:
    return web.json_response(await request.app[READS].head())


async def runs_json(request: web.Request) -> web.Response:
    return web.json_response({"runs": await request.app[READS].runs()})


def build_app(dsn: str, token: str) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=64 * 1024)
    app[READS] = UiReads(dsn)
    app[TOKEN] = token

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


def run(args: argparse.Namespace) -> int:
    from adapters import database

    dsn, token = args.dsn, None
    if args.config:
        from apps import config

        loaded = config.load(args.config)
        dsn, token = dsn or loaded.dsn, loaded.control_token
    token = token or ui_token(args)
    app = build_app(database.prepare_database(dsn), token)
    print(f"rollbook ui: http://{args.host}:{args.port}/", flush=True)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
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
    p.add_argument("--control-token", help=argparse.SUPPRESS)  # refused by name, as `rollbook checkpoint` does
    p.set_defaults(func=run)
