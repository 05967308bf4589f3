"""Execution identity and the names of streams.

A rollout is one task execution; each try of it is an attempt (0, 1, ...). Every event that
belongs to a rollout carries both, and the stream names below are the one place they are spelt.
"""

from __future__ import annotations

import re

from engine.errors import InvalidIdentifier, RolloutIdRequired

Key = tuple[str, int]  # an execution: (rollout_id, attempt)

# The one identifier alphabet (NeMo Gym's EpisodeId uses the same): ASCII only, so an id is one
# spelling in paths, logs, file names and SQL.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_ID = re.compile(ID_PATTERN.strip("^$"))
MAX_ID_LENGTH = 128
# Attempts are stored as PostgreSQL integers; anything larger is refused at the edge, not by the database.
ATTEMPT_MAX = 2**31 - 1
# Plain ASCII decimal, no sign, no leading zero, no spaces or underscores: one spelling per attempt.
ATTEMPT_PATTERN = r"^(0|[1-9][0-9]{0,9})$"
_ATTEMPT = re.compile(ATTEMPT_PATTERN.strip("^$"))
# A tool call's key within its session (activation, turn, index), as the agent server derives it;
# the session (rollout, attempt) comes from the request's path, never from the key.
TOOL_CALL_KEY_PATTERN = r"^a(0|[1-9][0-9]{0,8})\.t(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})$"
_TOOL_CALL_KEY = re.compile(TOOL_CALL_KEY_PATTERN.strip("^$"))


def validate_tool_call_key(value: str) -> str:
    if not _TOOL_CALL_KEY.fullmatch(value):
        raise InvalidIdentifier(f"tool-call key {value[:40]!r} must be a<activation>.t<turn>.<index>")
    return value


def validate_id(value: object, what: str) -> str:
    """Checkpoint ids, rollout ids and call ids share one alphabet: safe in paths, logs and SQL."""
    if not isinstance(value, str) or not value:
        if what == "rollout id":
            raise RolloutIdRequired("a rollout id is required")
        raise InvalidIdentifier(f"{what} is required")
    if len(value) > MAX_ID_LENGTH or not _ID.fullmatch(value):
        raise InvalidIdentifier(
            f"{what} {value[:40]!r} must match [A-Za-z0-9][A-Za-z0-9._-]* and be at most {MAX_ID_LENGTH} characters"
        )
    return value


def validate_attempt(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > ATTEMPT_MAX:
        raise InvalidIdentifier(f"attempt must be an integer from 0 to {ATTEMPT_MAX}, got {value!r}"[:160])
    return value


def parse_attempt(raw: object, what: str = "attempt") -> int:
    """An attempt index as text (a path segment, a header): ASCII decimal digits only.

    `int()` would also take ' 0', '0_0', '+0' and other scripts' digits ('\u0660'), each a second
    name for attempt 0; those are refused here."""
    if not isinstance(raw, str) or not _ATTEMPT.fullmatch(raw) or int(raw) > ATTEMPT_MAX:
        raise InvalidIdentifier(f"{what} must be ASCII decimal digits from 0 to {ATTEMPT_MAX}, got {str(raw)[:40]!r}")
    return int(raw)


# A run's rollouts are `<run>-<n>` (`rollbook run` names its task i `<run>-0001`...): a rollout's
# run is its id less a trailing `-<digits>`, so run `exp` never holds `exp-2-0001` (run `exp-2`'s).
# A framework names its rollouts by run, and a cut of its run stays the size of what is in flight.
# adapters.pg_reads.RUN_OF spells the same rule for SQL.
_RUN_SUFFIX = re.compile(r"-[0-9]+\Z")


def run_of(rollout_id: str) -> str:
    return _RUN_SUFFIX.sub("", rollout_id)


def in_run(rollout_id: str, run: str | None) -> bool:
    """Whether the rollout is the run's; with no run, every rollout is."""
    return run is None or run_of(rollout_id) == run


def rollout_stream(rollout_id: str) -> str:
    return f"rollout:{rollout_id}"


def episode_stream(rollout_id: str, attempt: int) -> str:
    return f"episode:{rollout_id}:{attempt}"


def agent_stream(rollout_id: str, attempt: int) -> str:
    return f"agent:{rollout_id}:{attempt}"


def session_stream(rollout_id: str, attempt: int) -> str:
    return f"session:{rollout_id}:{attempt}"


def is_session_stream(stream: str, rollout_id: str | None = None) -> bool:
    """Whether `stream` is a session stream (of `rollout_id`, any attempt, when given)."""
    return stream.startswith(f"session:{rollout_id}:" if rollout_id is not None else "session:")


def server_call_id(rollout_id: str, attempt: int, activation: int, number: int) -> str:
    """The id the model server gives the `number`-th call of an activation whose caller names none
    (engine.calls.CallNumbering); rollbook's own agent names its calls `<rollout>.<attempt>[.a<n>].t<turn>`."""
    return f"{rollout_id}.{attempt}.a{activation}.m{number}"


def server_call_number(call_id: str, rollout_id: str) -> tuple[int, int, int] | None:
    """(attempt, activation, number) of a server_call_id of `rollout_id`; None for any other id."""
    m = re.fullmatch(re.escape(rollout_id) + r"\.([0-9]+)\.a([0-9]+)\.m([0-9]+)", call_id)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def call_stream(call_id: str) -> str:
    return f"call:{call_id}"


def capture_stream(rollout_id: str, attempt: int) -> str:
    """One attempt's token capture for a trainer (engine.token_capture)."""
    return f"capture:{rollout_id}:{attempt}"


def checkpoint_stream(checkpoint_id: str) -> str:
    return f"checkpoint:{checkpoint_id}"


def participant_stream(kind: str, instance: str) -> str:
    return f"participant:{kind}:{instance}"


def instance_stream(kind: str, instance: str) -> str:
    """One server process's membership: its start, the renewals of its lease, its stop."""
    return f"instance:{kind}:{instance}"


def restore_stream(checkpoint_id: str) -> str:
    """The record of one installed restore of a checkpoint."""
    return f"restore:{checkpoint_id}"


def policy_stream() -> str:
    """One stream for the whole deployment: the order of policy versions is its order."""
    return "policy"
