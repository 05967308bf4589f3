"""What an append plans from, remembered from this process's own reads and writes.

Every append plans from the rows READ_HEADS returns for its keys, streams and rollouts (adapters.postgres),
and its writing statement checks, under the log's lock, that those rows are still what the log holds,
writing nothing when they are not. So the rows need not be read before every append: a process that
remembers them (the heads of the streams it wrote, the attempts of the rollouts it read) plans from
memory, and skips the read and the round trip that waits for it. The database stays the judge: a
remembered row another process has changed since makes the write find a difference, write nothing,
and the group is planned again from a read under the lock. That costs a retry, never a wrong write;
and a plan from memory that refuses a request is not trusted either (the refusal is decided on a read).

What is taken without a read: a request's idempotency key is new (it is made per call of `append`; a
retry of a group reads); a stream this process never saw has no head (a new call, session or episode
stream); a rollout this process has not read since (or has changed since), when the group writes
events of its first attempt and does not start it, has that attempt live and no retire mark. That is
every rollout of a run as all servers but the one that starts it first meet it, so a rollout costs
one read, not one per server; a guess that is wrong (the rollout was restarted, retired or fenced)
costs the retry. What is read every time: any other rollout this process has not read since its own
writes could have changed its attempts, and any stream or rollout that another process was found
writing ("shared").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from adapters.pg_arrays import Texts, texts
from engine.attempts import RolloutState
from engine.catalog import ATTEMPT_STARTED
from engine.events import AppendRequest
from engine.log import LogState, StreamHead

# One row of READ_HEADS: (what, name, n, m, status, digest).
Row = tuple[Any, ...]
# The tables whose rows READ_HEADS returns for a rollout ('a' and 'r' rows).
ROLLOUT_TABLES = frozenset({"attempt_state", "rollout_state"})


def read_inputs(requests: Sequence[AppendRequest]) -> dict[str, list[str]]:
    """READ_HEADS's parameters: the keys, streams and rollouts whose rows a plan of `requests` reads."""
    events = [e for r in requests for e in r.events]
    return {"keys": [r.key for r in requests if r.key is not None],
            "streams": sorted({e.stream for e in events} | {s for r in requests for s in r.expected_versions}),
            "rollouts": sorted({e.rollout_id for e in events if e.rollout_id is not None})}


def first_attempt_rollouts(requests: Sequence[AppendRequest]) -> frozenset[str]:
    """The rollouts whose events in `requests` are all of attempt 0, none starting it: a plan may take
    that attempt as live (PlanInputs.rows) where it remembers nothing of the rollout."""
    events = [e for r in requests for e in r.events if e.rollout_id is not None]
    others = {e.rollout_id for e in events if e.attempt != 0 or e.kind == ATTEMPT_STARTED}
    return frozenset(str(e.rollout_id) for e in events if e.rollout_id not in others)


def first_attempt_live(rollout_id: str) -> list[Row]:
    """READ_HEADS's rows for a rollout whose attempt 0 was started and nothing since changed its rows."""
    return [("r", rollout_id, None, None, None, None), ("a", rollout_id, 0, None, "live", None)]


def packed_inputs(inputs: dict[str, list[str]]) -> dict[str, Texts]:
    """READ_HEADS's parameters (read_inputs) as they go to the server."""
    return {name: texts(values) for name, values in inputs.items()}


def log_state(position: int, rows: Sequence[Any]) -> tuple[LogState, dict[str, tuple[int, int]]]:
    """READ_HEADS's rows as the state a plan starts from, and the keys already recorded."""
    state = LogState(position=position)
    done: dict[str, tuple[int, int]] = {}
    marks: list[tuple[str, int | None]] = []
    for what, name, n, m, status, digest in rows:
        if what == "k":
            done[name] = (n, m)
        elif what == "h":
            state.streams[name] = StreamHead(n, bytes(digest))
        elif what == "r":
            marks.append((name, n))
        else:
            state.rollouts.setdefault(name, RolloutState({})).attempts[n] = status
    for rollout_id, mark in marks:
        state.rollouts.setdefault(rollout_id, RolloutState({})).retired_through = mark if mark is not None else -1
    return state, done


class PlanInputs:
    """The rows READ_HEADS last returned, or this process last wrote, per stream and rollout."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self.position = 0  # a log position at or before now: a plan from memory is moved from here when written
        self._max = max_entries
        self._heads: dict[str, Row | None] = {}
        self._rollouts: dict[str, list[Row]] = {}
        self._shared: set[str] = set()

    def rows(self, inputs: dict[str, list[str]], first_attempt: frozenset[str] = frozenset()) -> list[Row] | None:
        """READ_HEADS's rows for these inputs as remembered, a rollout of `first_attempt` not remembered
        taken as that attempt live (first_attempt_rollouts); None when one must be read."""
        out: list[Row] = []
        for stream in inputs["streams"]:
            if stream in self._shared:
                return None
            head = self._heads.get(stream)
            if head is not None:
                out.append(head)
        for rollout in inputs["rollouts"]:
            if rollout in self._shared:
                return None
            remembered = self._rollouts.get(rollout)
            if remembered is None and rollout not in first_attempt:
                return None
            out.extend(first_attempt_live(rollout) if remembered is None else remembered)
        return out

    def read(self, inputs: dict[str, list[str]], rows: Sequence[Row], position: int) -> None:
        """READ_HEADS returned `rows` for `inputs` at `position`."""
        self._bound()
        heads = {r[1]: r for r in rows if r[0] == "h"}
        for stream in inputs["streams"]:
            self._heads[stream] = heads.get(stream)
        by_rollout: dict[str, list[Row]] = defaultdict(list)
        for r in rows:
            if r[0] in ("a", "r"):
                by_rollout[r[1]].append(r)
        for rollout in inputs["rollouts"]:
            self._rollouts[rollout] = by_rollout.get(rollout, [])
        self.position = max(self.position, position)

    def written(self, heads: dict[str, StreamHead], rollouts: Iterable[str], position: int) -> None:
        """This process's append committed: the streams' new heads; the rollouts whose attempt or retire
        rows it changed are read again before the next plan (their new rows are the projections')."""
        self._bound()
        for stream, head in heads.items():
            self._heads[stream] = ("h", stream, head.version, None, None, head.hash)
        for rollout in rollouts:
            self._rollouts.pop(rollout, None)
        self.position = max(self.position, position)

    def differed(self, remembered: Sequence[Row], read: Sequence[Row]) -> None:
        """A plan from `remembered` was stale, and a read found `read`: the streams and rollouts whose rows
        differ are written by another process too, and are read before every plan from now on."""
        for row in set(remembered) ^ set(read):
            name = row[1]
            # A stream never seen was only taken as new: learning it exists is no sign of another writer.
            if row[0] != "k" and (name in self._rollouts or self._heads.get(name) is not None):
                self._shared.add(name)

    def _bound(self) -> None:
        if len(self._heads) + len(self._rollouts) + len(self._shared) >= self._max:
            self._heads.clear()
            self._rollouts.clear()
            self._shared.clear()


__all__ = ["ROLLOUT_TABLES", "PlanInputs", "Row", "first_attempt_rollouts", "log_state", "packed_inputs", "read_inputs"]
