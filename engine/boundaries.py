"""Agent boundaries store what changed since the previous boundary of their stream.

An agent's conversation only grows, so storing the whole message list at every boundary made the
log quadratic in turns (54% of its bytes in a measured run). A boundary holds either

- the whole list, `messages`: the first boundary of its stream (each attempt's agent has its own
  stream), the first of an activation, and every boundary written before deltas existed; or
- a delta on the boundary before it in the same stream: `messages_kept` (how many of that
  boundary's messages it keeps, in practice all of them) and `messages_added` (what follows them).

Readers never see a delta: `with_messages` rebuilds every boundary's whole list from the events
of its stream, in stream order. A delta whose predecessor is not among them, or that keeps more
messages than its predecessor had, means the log no longer tells the conversation: it is refused
(InvalidCheckpointState), so a restore installs nothing from it. An edited delta is already
refused by the hash chain (engine.checkpoint.read_cut).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from engine.catalog import ACTIVATION_COMPLETED, AGENT_BOUNDARY
from engine.errors import InvalidCheckpointState
from engine.events import RecordedEvent

FULL = "messages"
KEPT = "messages_kept"
ADDED = "messages_added"


def boundary_messages(messages: Sequence[dict[str, Any]], previous: int | None) -> dict[str, Any]:
    """The messages part of a boundary's data. `previous`: how many messages the previous boundary
    of this stream recorded (None: no previous boundary in this stream, so the whole list)."""
    if previous is None or previous > len(messages):
        return {FULL: list(messages)}
    return {KEPT: previous, ADDED: list(messages[previous:])}


def is_delta(data: dict[str, Any]) -> bool:
    return FULL not in data and KEPT in data


def with_messages(events: Iterable[RecordedEvent]) -> list[RecordedEvent]:
    """`events` (in log order) with every agent boundary's whole message list rebuilt.

    Every delta's predecessors must be among `events`: pass the stream from its start (an
    attempt's history, or an effective history, always holds its agent streams from their start)."""
    latest: dict[str, tuple[RecordedEvent, list[dict[str, Any]] | None]] = {}
    out: list[RecordedEvent] = []
    for e in events:
        if e.kind != AGENT_BOUNDARY:
            out.append(e)
            continue
        if FULL not in e.data and KEPT not in e.data and ADDED not in e.data:
            latest[e.stream] = (e, None)  # a boundary that records no conversation (an agent of another kind)
            out.append(e)
            continue
        messages = _rebuild(e, latest.get(e.stream))
        latest[e.stream] = (e, messages)
        if FULL in e.data:
            out.append(e)
        else:
            data = {k: v for k, v in e.data.items() if k not in (KEPT, ADDED)}
            data[FULL] = messages
            out.append(replace(e, data=data))
    return out


def full_boundary(history: Sequence[RecordedEvent], boundary: RecordedEvent) -> RecordedEvent:
    """`boundary` with its whole message list, rebuilt from the boundaries of its stream in `history`."""
    if boundary.kind != AGENT_BOUNDARY or FULL in boundary.data:
        return boundary
    chain = [e for e in history if e.kind == AGENT_BOUNDARY and e.stream == boundary.stream
             and e.stream_version < boundary.stream_version]
    return with_messages([*chain, boundary])[-1]


def _rebuild(e: RecordedEvent, previous: tuple[RecordedEvent, list[dict[str, Any]] | None] | None) -> list[dict[str, Any]]:
    d = e.data
    if FULL in d:
        return list(d[FULL])
    kept, added = d.get(KEPT), d.get(ADDED)
    where = f"agent boundary {e.stream}@{e.stream_version} (position {e.position})"
    if not isinstance(kept, int) or isinstance(kept, bool) or kept < 0 or not isinstance(added, list):
        raise InvalidCheckpointState(f"{where} holds neither its messages nor a delta on the boundary before it")
    before, messages = previous if previous is not None else (None, None)
    if before is None or messages is None:
        if kept == 0:
            return list(added)
        raise InvalidCheckpointState(f"{where} keeps {kept} messages of a boundary before it that is missing")
    if before.stream_version >= e.stream_version or kept > len(messages):
        raise InvalidCheckpointState(
            f"{where} keeps {kept} messages of the boundary before it ({before.stream}@{before.stream_version}), "
            f"which has {len(messages)}")
    return messages[:kept] + added


def completed_activations(history: Sequence[RecordedEvent]) -> dict[int, dict[str, Any]]:
    """Each completed activation's reply by index, its `messages` the conversation of the latest
    boundary recorded before it. A completion stores no conversation of its own (one past the event
    size limit would fail its last append on every retry); one written before that rule keeps the
    messages it has. `history` is one lineage in log order, its agent streams from their start (an
    effective history: a continued attempt's own boundaries follow its origin's)."""
    latest: list[dict[str, Any]] = []
    out: dict[int, dict[str, Any]] = {}
    for e in with_messages(history):
        if e.kind == AGENT_BOUNDARY and FULL in e.data:
            latest = e.data[FULL]
        elif e.kind == ACTIVATION_COMPLETED:
            reply = dict(e.data["reply"])
            reply.setdefault(FULL, latest)
            out[int(e.data["index"])] = reply
    return out
