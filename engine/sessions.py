"""A resources session replayed from the log: the one reading of session events.

The resources server rebuilds sessions with it (restore, and recovery after a crash), `rollbook
replay` steps through it, and the cut's lineage check reads the revisions it keeps. The rules:

- `session_opened` starts a session at revision 0 from its task's initial state. One that says it
  was restored or recovered (a new attempt reopening its origin's session) starts nothing: it must
  agree with the replay of its origin (a session open, the same environment, the same revision).
- Each `mutation_applied` is the next revision, exactly one above the last. Its effect goes through
  the environment's reducer, except for a `restart_only` environment, whose effects are records of
  a live process, not state.
- `session_closed` ends the session.
- A boundary (an agent boundary names the revision it saw of each session) must agree with the
  revision the log gives that session's stream at the boundary.

Anything that does not add up, a reducer's own failure included, is a ReplayDivergence at the
event's position; callers say what it means for them (a refused restore, a replay error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import catalog as ev
from engine.errors import ReplayDivergence, RollbookError
from engine.events import RecordedEvent
from engine.identity import is_session_stream


class SessionEnvironment(Protocol):
    """What the replay needs of an environment (participants.environments.Environment is one)."""

    @property
    def name(self) -> str: ...

    @property
    def state_mode(self) -> str: ...

    def apply(self, state: Any, effect: Any) -> Any: ...


# From a `session_opened` event's data: its environment, its task and the task's initial state. The
# registry of environments is the participants' business, so the caller hands this in.
Opener = Callable[[Mapping[str, Any]], tuple[SessionEnvironment, Any, Any]]


def note_revision(revisions: dict[str, int], e: RecordedEvent) -> None:
    """Each session stream's revision as the log records it (a reopened session carries its origin's)."""
    if e.kind == ev.MUTATION_APPLIED:
        revisions[e.stream] = e.data["revision"]
    elif e.kind == ev.SESSION_OPENED:
        revisions[e.stream] = e.data.get("revision", 0)


def session_revisions(events: Iterable[RecordedEvent]) -> dict[str, int]:
    revisions: dict[str, int] = {}
    for e in events:
        note_revision(revisions, e)
    return revisions


def boundary_disagreement(boundary: Mapping[str, Any], revisions: Mapping[str, int]) -> tuple[str, int, int] | None:
    """The first session stream a boundary's data saw at another revision than `revisions` gives it
    (stream, seen, logged); None when they agree. A stream the log never changed is at revision 0."""
    for stream, seen in (boundary.get("revisions") or {}).items():
        if revisions.get(stream, 0) != seen:
            return stream, seen, revisions.get(stream, 0)
    return None


@dataclass
class SessionReplay:
    """One attempt's session, advanced event by event over its effective history."""

    opener: Opener
    env: SessionEnvironment | None = None
    task: Any = None
    state: Any = None
    revision: int = 0
    open: bool = False
    revisions: dict[str, int] = field(default_factory=dict)  # every session stream seen, as recorded

    def apply(self, e: RecordedEvent) -> str | None:
        """Advance by one event: "opened", "restored", "mutated", "closed" or "recorded" (another event
        of a session stream); None for an event of no session. Raises ReplayDivergence."""
        if not is_session_stream(e.stream):
            return None
        try:
            what = self._apply(e)
        except RollbookError:
            raise
        except Exception as exc:  # whatever a reducer raises, this log does not replay
            raise ReplayDivergence(f"{e.stream}@{e.stream_version} does not replay: {exc}", position=e.position) from exc
        note_revision(self.revisions, e)
        return what

    def _apply(self, e: RecordedEvent) -> str:
        d = e.data
        if e.kind == ev.SESSION_OPENED:
            if d.get("restored_from") is not None or d.get("recovered"):
                if not self.open or self.env is None or d.get("revision") != self.revision or d.get("env") != self.env.name:
                    raise ReplayDivergence(
                        f"{e.stream} says it was restored at revision {d.get('revision')}, the replay of its origin "
                        f"is at {self.revision if self.open else 'no session'}", position=e.position)
                return "restored"
            self.env, self.task, self.state = self.opener(d)
            self.revision, self.open = 0, True
            return "opened"
        if e.kind == ev.MUTATION_APPLIED:
            if not self.open or self.env is None:
                raise ReplayDivergence(f"{e.stream} has a mutation before any session_opened", position=e.position)
            if d.get("revision") != self.revision + 1:
                raise ReplayDivergence(f"{e.stream}: revision {d.get('revision')} follows {self.revision}", position=e.position)
            if self.env.state_mode != "restart_only":  # a live process's effects are records, not state
                self.state = self.env.apply(self.state, d["effect"])
            self.revision += 1
            return "mutated"
        if e.kind == ev.SESSION_CLOSED:
            self.open = False
            return "closed"
        return "recorded"


def open_session_restart(history: Sequence[RecordedEvent]) -> str | None:
    """Why the resources session open at the end of `history` cannot be rebuilt there, so that its
    rollout restarts from its input (None: it can, or none is open): its environment is restart-only,
    or its last change left a live process no snapshot holds (its `mutation_applied` says why, as
    `unrestorable`: a background process still running at the boundary, say)."""
    mode = open_session_mode(history)
    if mode is None:
        return None
    if mode == "restart_only":
        return "its session is a live process of a restart-only environment"
    for e in reversed(history):
        if is_session_stream(e.stream) and e.kind in (ev.MUTATION_APPLIED, ev.SESSION_OPENED):
            why = e.data.get("unrestorable") if e.kind == ev.MUTATION_APPLIED else None
            return f"its live session cannot be rebuilt there: {why}" if why else None
    return None


def open_session_mode(history: Sequence[RecordedEvent]) -> str | None:
    """The state mode of the resources session open at the end of `history` (None: none open)."""
    mode: str | None = None
    seeded: str | None = None
    for e in history:
        if e.kind == ev.EPISODE_STEP and e.data.get("step") == "seed":
            seeded = e.data.get("state_mode")
        if not is_session_stream(e.stream):
            continue
        if e.kind == ev.SESSION_OPENED:
            mode = e.data.get("state_mode") or seeded or "exported"
        elif e.kind == ev.SESSION_CLOSED:
            mode = None
    return mode
