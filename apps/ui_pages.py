"""The HTML of `rollbook ui`: whole pages, and the fragments a page swaps in as the log grows.

Every value from the database is escaped here; the pages carry no inline script or style (the
Content-Security-Policy forbids both), only /static/ui.css and /static/ui.js.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from adapters.ui_reads import Rollout
from apps import ui_svg
from apps.ui_lanes import lanes, lineage
from engine import catalog as ev


def e(value: Any) -> str:
    return "-" if value is None else escape(str(value), quote=True)


def href(prefix: str, ident: str) -> str:
    return f"{prefix}/{quote(ident, safe='')}"


def num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def page(title: str, body: str, fragment: str | None = None, csrf: str = "") -> str:
    """A whole page; `fragment` is the URL of its live part, which ui.js fetches again when the log moves;
    `csrf` the session's token, which the sign-out form must bring back."""
    live = (f'<div id="live" data-fragment="{e(fragment)}">{body}</div>' if fragment else body)
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{e(title)} · rollbook</title><link rel=\"stylesheet\" href=\"/static/ui.css\">"
            "<script src=\"/static/ui.js\" defer></script></head><body>"
            "<header><a class=\"brand\" href=\"/\">rollbook</a><nav><a href=\"/\">runs</a></nav>"
            "<span id=\"follow\" class=\"follow\">following the log</span>"
            f'<form method="post" action="/logout"><input type="hidden" name="csrf" value="{e(csrf)}">'
            "<button>sign out</button></form></header>"
            f"<main><h1>{e(title)}</h1>{live}</main></body></html>")


def table(cols: Sequence[str], rows: Iterable[Sequence[str]], ident: str, row_attrs: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{e(c)}</th>" for c in cols)
    body = []
    for i, r in enumerate(rows):
        attrs = row_attrs[i] if row_attrs else ""
        body.append(f"<tr {attrs}>" + "".join(f'<td data-col="{e(c)}">{v}</td>' for c, v in zip(cols, r, strict=True))
                    + "</tr>")
    return f'<table id="{e(ident)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


RUN_COLS = ("run", "rollouts", "tasks", "finished", "live", "failed", "restarted", "checkpoints", "restored",
            "recoveries", "mean reward")


def runs_fragment(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return '<p class="empty">no rollouts in this database yet</p>'
    rows = [[f'<a href="{href("/runs", r["run_id"])}">{e(r["run_id"])}</a>', e(r["rollouts"]), e(r["tasks"]),
             e(r["finished"]), e(r["live"]), e(r["failed"]), e(r["restarted"]), e(r["checkpoints"]), e(r["restored"]),
             e(r["recoveries"]), num(r["mean_reward"])] for r in runs]
    return (table(RUN_COLS, rows, "runs", [f'data-run="{e(r["run_id"])}"' for r in runs])
            + '<p class="note">restarted: rollouts with more than one attempt; restored: attempts a checkpoint '
              'restore started; recoveries: attempts restarted by recovery after a crash; mean reward over finished '
              'rollouts.</p>')


def run_fragment(run: dict[str, Any] | None, rollouts: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> str:
    parts = [runs_fragment([run]) if run else ""]
    if checkpoints:
        parts.append("<h2>checkpoints</h2>" + table(
            ("checkpoint", "phase", "log position", "scope", "published"),
            [[f'<a href="{href("/checkpoints", c["checkpoint_id"])}">{e(c["checkpoint_id"])}</a>', e(c["phase"]),
              e(c["log_position"]), e(c["scope_size"]), e(c["published_at"])] for c in checkpoints], "checkpoints"))
    parts.append("<h2>rollouts</h2>" + table(
        ("rollout", "task", "env", "state", "attempts", "reward", "last position"),
        [[f'<a href="{href("/rollouts", r["rollout_id"])}">{e(r["rollout_id"])}</a>', e(r["task_id"]), e(r["env"]),
          f'<span class="state {e(r["state"])}">{e(r["state"])}</span>', e(r["attempts"]), num(r["reward"]),
          e(r["last_position"])] for r in rollouts], "rollouts", [f'data-rollout="{e(r["rollout_id"])}"' for r in rollouts]))
    return "".join(parts)


def _reward(reward: Any) -> str:
    return "" if reward is None else f', reward <span class="reward">{float(reward):.4g}</span>'


def _fork_tree(forks: list[dict[str, Any]], rollout_id: str) -> str:
    if not forks:
        return '<section id="forks" class="forks"><h2>fork tree</h2><p class="empty">no forks of this rollout</p></section>'
    children: dict[str, list[dict[str, Any]]] = {}
    for f in forks:
        children.setdefault(f["origin_rollout_id"], []).append(f)

    def tree(node: str, depth: int) -> str:
        if depth > 32:
            return ""
        items = [f'<li data-fork="{e(f["rollout_id"])}" data-state="{e(f.get("state", ""))}">'
                 f'<a href="{href("/rollouts", f["rollout_id"])}">{e(f["rollout_id"])}</a> from attempt '
                 f'{e(f["origin_attempt"])} at position {e(f["origin_position"])}: <span class="state">'
                 f'{e(f.get("state", ""))}</span>{_reward(f.get("reward"))}{tree(f["rollout_id"], depth + 1)}</li>'
                 for f in children.get(node, [])]
        return f"<ul>{''.join(items)}</ul>" if items else ""

    roots = {f["origin_rollout_id"] for f in forks} - {f["rollout_id"] for f in forks}
    body = "".join(f'<div class="fork-root">{e(r)}{tree(r, 0)}</div>' for r in sorted(roots or {rollout_id}))
    return f'<section id="forks" class="forks"><h2>fork tree</h2>{body}</section>'


def rollout_fragment(r: Rollout) -> str:
    ls = lanes(r)
    last = r.attempts[-1]
    summary = (f'<dl class="summary"><dt>attempts</dt><dd id="attempts">{len(r.attempts)}</dd>'
               f'<dt>state</dt><dd id="state">{e(last["status"])}</dd>'
               f'<dt>reward</dt><dd id="reward">{num(last["reward"])}</dd>'
               f'<dt>events</dt><dd id="events">{len(r.events)}</dd>'
               f'<dt>last position</dt><dd id="last-position">{e(r.events[-1]["position"] if r.events else None)}</dd></dl>')
    legend = ('<p class="legend"><span class="k generated">generated call</span><span class="k linked">linked (recorded '
              'reply delivered)</span><span class="k cut">cut at a checkpoint</span><span class="k failed">failed</span>'
              '<span class="k mutation">tool call (mutation)</span><span class="k boundary">boundary</span>'
              '<span class="k fence">fence</span><span class="k recovered">recovery</span><span class="k cutline">'
              'checkpoint cut</span><span class="k discarded">redone by a later attempt</span></p>')
    fates = []
    for lin in lineage(ls):
        rows = [[f'<span class="fate {e(t.fate)}">{e(t.fate)}</span>', e(t.turn), e(t.detail)] for t in lin.turns]
        fates.append(f'<h3 data-lineage="{lin.attempt}">attempt {lin.attempt}: {e(lin.how)}</h3>'
                     + table(("fate", "turn", "what"), rows, f"lineage-{lin.attempt}"))
    attempts = table(
        ("attempt", "status", "parent", "restored from", "origin position", "started", "ended", "reward"),
        [[e(a["attempt"]), e(a["status"]), e(a["parent_attempt"]),
          f'<a href="{href("/checkpoints", a["restored_from_checkpoint"])}">{e(a["restored_from_checkpoint"])}</a>'
          if a["restored_from_checkpoint"] else "-", e(a["origin_position"]), e(a["started_position"]),
          e(a["ended_position"]), num(a["reward"])] for a in r.attempts], "attempt-table")
    calls = table(("turn", "model call", "attempt", "status", "duration ms", "tokens"),
                  [[e(c.turn), _call_link(c.call_id), e(lane.attempt), e(c.status),
                    num(c.duration_ms, 5), e(c.tokens)] for lane in ls for c in lane.calls],
                  "call-table", [f'data-call="{e(c.call_id)}"' for lane in ls for c in lane.calls])
    events = table(("position", "attempt", "kind", "stream"),
                   [[e(x["position"]), e(x["attempt"]), e(x["kind"]), e(x["stream"])] for x in r.events[-40:]],
                   "event-table", [f'data-position="{e(x["position"])}"' for x in r.events[-40:]])
    return (summary + "<h2>attempts on one time axis</h2>" + legend + ui_svg.timeline(ls, r.cuts) + attempts
            + "<h2>model calls</h2>" + calls
            + "<h2>what each later attempt kept or redid</h2>"
            + ("".join(fates) or '<p class="empty">one attempt: nothing redone</p>')
            + _fork_tree(r.forks, r.rollout_id) + "<h2>latest events</h2>" + events)


def call_page_body(c: dict[str, Any]) -> str:
    call = c["call"]
    end = next((x for x in reversed(c["events"]) if x["kind"] in (ev.CALL_COMPLETED, ev.CALL_CUT)), None)
    d = end["data"] if end else {}
    segments = d.get("segments") or []
    cont = (c["events"][0]["data"].get("continues") or {}) if c["events"] else {}
    prefix, how = _continuation(d, bool(cont))
    info = [("rollout", f'<a href="{href("/rollouts", call["rollout_id"])}">{e(call["rollout_id"])}</a>'),
            ("attempt", e(call["attempt"])), ("status", e(call["status"])), ("disposition", e(call["disposition"])),
            ("policy version", e(call["policy_version"])), ("parent call", _call_link(call["parent_call_id"])),
            ("tokens generated", e(call["tokens"])), ("prompt tokens", e(len(c["prompt"]))),
            ("finish reason", e(d.get("finish_reason"))),
            ("continues", _call_link(cont.get("call_id")) + how),
            ("continued by", ", ".join(_call_link(x["call_id"]) for x in c["continued_by"]) or "-")]
    dl = '<dl class="summary">' + "".join(f'<dt>{e(k)}</dt><dd data-key="{e(k)}">{v}</dd>' for k, v in info) + "</dl>"
    segs = table(("segment", "policy version", "tokens"),
                 [[e(i), e(s.get("policy_version")), e(s.get("tokens"))] for i, s in enumerate(segments)], "segments")
    cut_at = prefix if prefix is not None else (len(c["generated"]["ids"]) if call["status"] == "cut" else None)
    gen = _tokens(c["generated"]["ids"], cut_at, "generated")
    reply = d.get("reply") or d.get("partial")
    problem = f'<p class="problem" id="token-problem">{e(c["token_problem"])}</p>' if c["token_problem"] else ""
    return (dl + problem + "<h2>logprobs of the generated tokens</h2>" + ui_svg.logprob_plot(c["generated"]["logprobs"], segments, cut_at)
            + "<h2>policy version per segment</h2>" + segs
            + f"<h2>generated tokens ({len(c['generated']['ids'])})</h2>" + gen
            + (f'<h2>reply</h2><pre class="reply">{e(json.dumps(reply, indent=1, ensure_ascii=False))}</pre>' if reply else "")
            + f"<h2>prompt tokens ({len(c['prompt'])})</h2>" + _tokens(c["prompt"], None, "prompt")
            + "<h2>custody</h2>" + table(("position", "attempt", "kind", "recorded"),
                                         [[e(x["position"]), e(x["attempt"]), e(x["kind"]), e(x["recorded_at"])]
                                          for x in c["events"]], "custody"))


def _continuation(d: dict[str, Any], continues: bool) -> tuple[int | None, str]:
    """Where a continued call's own tokens start, and how it continued. A continuation the backend
    refused starts over: its tokens hold no prefix, so no cut is drawn in them."""
    mode = (d.get("continuation") or {}).get("mode", "continued")
    prefix = d.get("prefix_tokens") if mode == "continued" else None
    if prefix is not None:
        return prefix, f" from token {e(prefix)}"
    why = (d.get("continuation") or {}).get("reason", "the prefix was dropped")
    return None, f" ({e(mode)}: {e(why)})" if continues else ""


def _call_link(call_id: str | None) -> str:
    return f'<a href="{href("/calls", call_id)}">{e(call_id)}</a>' if call_id else "-"


def _tokens(ids: Sequence[int], cut_at: int | None, kind: str) -> str:
    spans = []
    for i, t in enumerate(ids):
        if cut_at is not None and i == cut_at:
            spans.append('<span class="cutmark" title="cut here: a continuation begins">|</span>')
        spans.append(f'<span class="tok" title="token {i}">{t}</span>')
    if cut_at is not None and cut_at >= len(ids):
        spans.append('<span class="cutmark" title="cut here">|</span>')
    return f'<div class="tokens {kind}" id="{kind}-tokens">{" ".join(spans)}</div>'


def checkpoint_fragment(ck: dict[str, Any]) -> str:
    c = ck["checkpoint"]
    dl = ('<dl class="summary">' + "".join(f'<dt>{e(k)}</dt><dd data-key="{e(k)}">{e(v)}</dd>' for k, v in (
        ("phase", c["phase"]), ("log position", c["log_position"]), ("scope", c["scope_size"]),
        ("digest", c["digest"]), ("published", c["published_at"]))) + "</dl>")
    rows = []
    for r in ck["rollouts"]:
        boundary = "-" if r["boundary"] is None else (
            f'{e(r["boundary"])} ({e(r["boundary_kind"])}'
            + (f' turn {e(r["boundary_turn"])} {e(r["boundary_state"])}' if r["boundary_turn"] is not None else "")
            + (f' step {e(r["boundary_step"])}' if r["boundary_step"] is not None else "") + ")")
        after = "-" if r["next_attempt"] is None else f'attempt {e(r["next_attempt"])} ({e(r["next_status"])}, reward {num(r["next_reward"])})'
        rows.append([f'<a href="{href("/rollouts", r["rollout_id"])}">{e(r["rollout_id"])}</a>', e(r["attempt"]),
                     f'<span class="disp {e(r["disposition"])}">{e(r["disposition"])}</span>', boundary, after])
    return dl + "<h2>each rollout in the cut</h2>" + table(
        ("rollout", "attempt", "disposition", "boundary", "restored as"), rows, "cut",
        [f'data-rollout="{e(r["rollout_id"])}"' for r in ck["rollouts"]])


def login_page(next_url: str, csrf: str, problem: str | None) -> str:
    msg = f'<p class="problem" id="problem">{e(problem)}</p>' if problem else ""
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>sign in · rollbook</title>"
            "<link rel=\"stylesheet\" href=\"/static/ui.css\"></head><body><main class=\"login\"><h1>rollbook</h1>"
            "<p>This page shows the log of one rollbook database. Give the control credential of its config "
            "(<code>control_token</code>, or <code>ROLLBOOK_CONTROL_TOKEN</code>).</p>" + msg
            + f'<form method="post" action="/login"><input type="hidden" name="next" value="{e(next_url)}">'
            f'<input type="hidden" name="csrf" value="{e(csrf)}">'
            '<label>control credential <input type="password" name="token" id="token" autocomplete="current-password" '
            'autofocus></label><button type="submit" id="sign-in">sign in</button></form></main></body></html>')


def problem_page(title: str, detail: str) -> str:
    """What a browser is shown when a form or an address is refused."""
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{e(title)} · rollbook</title><link rel=\"stylesheet\" href=\"/static/ui.css\"></head><body>"
            f'<main class="login"><h1>rollbook</h1><p class="problem" id="problem">{e(detail)}</p>'
            '<p><a href="/login">sign in</a></p></main></body></html>')
