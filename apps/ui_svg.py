"""Inline SVG drawings of `rollbook ui`: a rollout's lanes on one time axis, and a call's logprobs.

Colours come from classes in ui.css and presentation attributes only: the page's
Content-Security-Policy allows no inline style.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape
from typing import Any

from apps.ui_lanes import Lane

WIDTH, LEFT, RIGHT, LANE_H, TOP = 1100, 120, 60, 104, 44


class Axis:
    def __init__(self, t0: datetime, t1: datetime) -> None:
        self.t0 = t0
        self.span = max((t1 - t0).total_seconds(), 0.01)

    def x(self, t: datetime) -> float:
        return LEFT + (t - self.t0).total_seconds() / self.span * (WIDTH - LEFT - RIGHT)


def _a(text: Any) -> str:
    return escape(str(text), quote=True)


def _title(text: str) -> str:
    return f"<title>{_a(text)}</title>"


def _seconds(s: float, span: float) -> str:
    return f"{s * 1000:.0f} ms" if span < 2 else f"{s:.2f} s"


def _ticks(axis: Axis, height: float) -> list[str]:
    out = []
    for i in range(6):
        s = axis.span * i / 5
        x = LEFT + (WIDTH - LEFT - RIGHT) * i / 5
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height}"/>'
                   f'<text class="axis" x="{x:.1f}" y="{TOP - 10}" text-anchor="middle">{_seconds(s, axis.span)}</text>')
    return out


def _calls(lane: Lane, axis: Axis, y: float) -> list[str]:
    out = []
    for i, c in enumerate(lane.calls):
        x0 = axis.x(c.start)
        w = max(axis.x(c.end) - x0, 4.0) if c.end else 8.0
        ms = f"{c.duration_ms:.0f} ms" if c.duration_ms is not None else c.status
        tip = f"model call {c.call_id}: turn {c.turn}, {c.status}, {ms}, {c.tokens if c.tokens is not None else '?'} tokens"
        label = f"t{c.turn} {c.tokens}tok" if c.tokens is not None else f"t{c.turn}"
        # A label near the right edge ends at its call instead of running off the drawing.
        anchor = f'x="{x0 + w:.1f}" text-anchor="end"' if x0 > WIDTH - RIGHT - 120 else f'x="{x0 + 2:.1f}"'
        out.append(f'<a href="/calls/{_a(c.call_id)}" class="call-link" data-call="{_a(c.call_id)}">'
                   f'<rect class="call {_a(c.status.replace(" ", "-"))}" x="{x0:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="22" rx="3">{_title(tip)}</rect>'
                   f'<text class="call-label" {anchor} y="{y - 9 if i % 2 else y + 34:.1f}">{_a(label)} · {_a(ms)}</text></a>')
    return out


def _marks(lane: Lane, axis: Axis, y: float) -> list[str]:
    out = []
    for m in lane.marks:
        x = axis.x(m.at)
        tip = _title(f"{m.label} (position {m.position})")
        if m.kind == "boundary":
            out.append(f'<line class="boundary" data-position="{m.position}" x1="{x:.1f}" y1="{y + 44}" x2="{x:.1f}" '
                       f'y2="{y + 62}">{tip}</line>')
        elif m.kind == "mutation":
            out.append(f'<path class="mutation" d="M{x:.1f} {y + 46} l6 7 l-6 7 l-6 -7 z">{tip}</path>')
        elif m.kind in ("fence", "recovered"):
            ty = y + LANE_H - 18 if m.kind == "fence" else y + 6  # the two often fall at one instant
            where = f'x="{x - 3:.1f}" text-anchor="end"' if x > WIDTH / 2 else f'x="{x + 3:.1f}"'
            out.append(f'<line class="{m.kind}" x1="{x:.1f}" y1="{y - 4}" x2="{x:.1f}" y2="{y + LANE_H - 16}">{tip}</line>'
                       f'<text class="{m.kind}-label" {where} y="{ty}">{_a(m.label)}</text>')
        elif m.kind == "finished":
            out.append(f'<circle class="finished" cx="{x:.1f}" cy="{y + 66}" r="5">{tip}</circle>'
                       f'<text class="finished-label" x="{x - 4:.1f}" y="{y + 82}" text-anchor="end">{_a(m.label)}</text>')
        else:
            out.append(f'<rect class="{m.kind}" x="{x - 2:.1f}" y="{y + 64}" width="4" height="6">{tip}</rect>')
    return out


def timeline(ls: list[Lane], cuts: Sequence[dict[str, Any]]) -> str:
    """Every attempt a lane, on the wall-clock time the log recorded; checkpoint cuts across all lanes."""
    times = [t for lane in ls for t in (lane.start, lane.end) if t is not None]
    times += [c["committed_at"] for c in cuts if c.get("committed_at") is not None]
    if not times:
        return '<p class="empty">no events yet</p>'
    axis = Axis(min(times), max(times))
    height = TOP + LANE_H * len(ls) + 28
    parts = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="attempts on one time axis">',
             '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
             '<line x1="0" y1="0" x2="0" y2="6" class="hatch"/></pattern>'
             '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto">'
             '<path d="M0 0 L10 5 L0 10 z" class="arrowhead"/></marker></defs>', *_ticks(axis, height - 10)]
    row = {lane.attempt: TOP + 8 + LANE_H * i for i, lane in enumerate(ls)}
    by = {lane.attempt: lane for lane in ls}
    for lane in ls:
        y = row[lane.attempt]
        parts.append(f'<g class="lane" data-attempt="{lane.attempt}">'
                     f'<rect class="lane-bg" x="0" y="{y - 6}" width="{WIDTH}" height="{LANE_H - 8}"/>'
                     f'<text class="lane-label" x="6" y="{y + 14}">attempt {lane.attempt}</text>'
                     f'<text class="lane-sub" x="6" y="{y + 30}">{_a(lane.status)}</text>'
                     f'<text class="lane-sub" x="6" y="{y + 46}">reward {_a(lane.reward if lane.reward is not None else "-")}</text>')
        parts += _discarded(lane, by, axis, y)
        parts += _calls(lane, axis, y)
        parts += _marks(lane, axis, y)
        parts.append("</g>")
    parts += _origins(ls, by, row, axis)
    for c in {c["checkpoint_id"]: c for c in cuts}.values():
        x = axis.x(c["committed_at"])
        tip = _title(f"checkpoint {c['checkpoint_id']} committed its cut at log position {c['log_position']}")
        parts.append(f'<line class="cut" x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - 10}">{tip}</line>'
                     f'<text class="cut-label" x="{x + 3:.1f}" y="{height - 12}">cut {_a(c["checkpoint_id"])} @{c["log_position"]}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _discarded(lane: Lane, by: dict[int, Lane], axis: Axis, y: float) -> list[str]:
    """Shade what a later attempt redid: this lane after the boundary the later one continued from."""
    out = []
    for later in by.values():
        if later.origin_attempt != lane.attempt or later.origin_position is None or lane.end is None:
            continue
        after = [m.at for m in lane.marks if m.position > later.origin_position] + [
            c.start for c in lane.calls if c.accepted_position > later.origin_position]
        if not after:
            continue
        x0, x1 = axis.x(min(after)), axis.x(lane.end)
        tip = _title(f"after position {later.origin_position}: redone by attempt {later.attempt}")
        out.append(f'<rect class="discarded" fill="url(#hatch)" x="{x0:.1f}" y="{y - 4}" width="{max(x1 - x0, 3):.1f}" '
                   f'height="{LANE_H - 12}">{tip}</rect>')
    return out


def _origins(ls: list[Lane], by: dict[int, Lane], row: dict[int, float], axis: Axis) -> list[str]:
    out = []
    for lane in ls:
        origin = by.get(lane.origin_attempt) if lane.origin_attempt is not None else None
        if origin is None or lane.origin_position is None or lane.start is None:
            continue
        at = max((m for m in origin.marks if m.position <= lane.origin_position), key=lambda m: m.position, default=None)
        if at is None:
            continue
        x0, y0 = axis.x(at.at), row[origin.attempt] + 62
        x1, y1 = axis.x(lane.start), row[lane.attempt] + 4
        tip = _title(f"attempt {lane.attempt} continues from this boundary (position {lane.origin_position})")
        out.append(f'<circle class="origin-point" cx="{x0:.1f}" cy="{y0 - 9:.1f}" r="5">{tip}</circle>'
                   f'<path class="origin" marker-end="url(#arrow)" d="M{x0:.1f} {y0:.1f} C{x0:.1f} {y1 - 20:.1f} '
                   f'{x1:.1f} {y0 + 20:.1f} {x1:.1f} {y1:.1f}"/>')
    return out


def logprob_plot(logprobs: Sequence[float], segments: Sequence[dict[str, Any]], cut_at: int | None) -> str:
    """Each generated token's logprob; the policy version of each segment as a band; the cut point."""
    if not logprobs:
        return '<p class="empty">no logprobs recorded</p>'
    w, h, left, bottom = 1000, 260, 50, 30
    low = min(min(logprobs), -1e-3)
    n = len(logprobs)

    def x(i: float) -> float:
        return left + (i / max(n - 1, 1)) * (w - left - 10)

    def y(v: float) -> float:
        return 10 + (v / low) * (h - bottom - 20)

    parts = [f'<svg id="logprobs" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'role="img" aria-label="logprob of each generated token">']
    start = 0
    for i, seg in enumerate(segments):
        k = int(seg.get("tokens") or 0)
        tip = _title(f"tokens {start}-{start + k - 1}: {seg.get('policy_version')}")
        parts.append(f'<rect class="segment s{i % 4}" x="{x(start):.1f}" y="10" width="{max(x(start + k) - x(start), 2):.1f}" '
                     f'height="{h - bottom - 20}">{tip}</rect>'
                     f'<text class="segment-label" x="{x(start) + 4:.1f}" y="24">{_a(seg.get("policy_version"))}</text>')
        start += k
    for v in (0.0, low / 2, low):
        parts.append(f'<line class="tick" x1="{left}" x2="{w - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                     f'<text class="axis" x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(logprobs))
    parts.append(f'<polyline class="logprob" points="{pts}"/>')
    parts += [f'<circle class="logprob-pt" cx="{x(i):.1f}" cy="{y(v):.1f}" r="2">{_title(f"token {i}: {v:.4f}")}</circle>'
              for i, v in enumerate(logprobs)]
    if cut_at is not None:
        parts.append(f'<line class="cut" x1="{x(cut_at - 0.5):.1f}" x2="{x(cut_at - 0.5):.1f}" y1="6" y2="{h - bottom}"/>'
                     f'<text class="cut-label" x="{x(cut_at - 0.5) + 4:.1f}" y="{h - bottom - 6}">cut at token {cut_at}</text>')
    parts.append(f'<text class="axis" x="{left}" y="{h - 8}">token 0</text>'
                 f'<text class="axis" x="{w - 10}" y="{h - 8}" text-anchor="end">token {n - 1}</text></svg>')
    return "".join(parts)
