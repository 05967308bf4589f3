"""Every error rollbook raises: one root, one stable code per failure, and its HTTP status.

Callers catch what they mean. Each class carries its `code` (part of the public contract) and the
`status` a server answers it with; `STATUS` below is built from these classes and is what the
HTTP layer (`participants.base.http_errors`) and the OpenAPI document read. No other module defines a
code (tests/engine/test_errors.py checks it). `ConfigError` is the one exception outside the root: a
mistake in what a command was given, printed as one line, never an HTTP answer.
"""

from __future__ import annotations

from typing import Any


class RollbookError(Exception):
    """The root of every error with a stable code: the servers answer it as JSON with its HTTP status."""

    code: str = "rollbook_error"
    status: int = 500

    def __init__(self, detail: str, **context: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.context = context

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "detail": self.detail, **({"context": self.context} if self.context else {})}}


class ConfigError(Exception):
    """A mistake in what the user gave a command (a DSN, a config file, a tasks line): not a protocol
    error and never an HTTP answer, so not a RollbookError. The command prints it as one line naming
    the cause and then the fix, and exits 2."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(f"{cause}; {fix}")
        self.cause, self.fix = cause, fix


class InvalidPayload(RollbookError):
    """An event's data is not plain JSON, carries a NUL, or is over the size limit."""

    code = "invalid_payload"
    status = 400


class PayloadTooLarge(InvalidPayload):
    """An event's data or a request body over its size limit."""

    code = "payload_too_large"
    status = 413


class VersionConflict(RollbookError):
    """Optimistic concurrency: the stream is not at the version the writer expected."""

    code = "version_conflict"
    status = 409


class StaleAttempt(RollbookError):
    """The attempt is fenced, retired or below the rollout's retire mark: nothing of it may land."""

    code = "stale_attempt"
    status = 409


class UnknownAttempt(RollbookError):
    """An append for an attempt that was never started."""

    code = "unknown_attempt"
    status = 409


class RolloutNotFinished(RollbookError):
    """A rollout attempt marked exported (`rollout_exported`) that has not finished: only a finished
    attempt's result can have been written out."""

    code = "rollout_not_finished"
    status = 409


class RolloutIdRequired(RollbookError):
    """A request that belongs to a rollout named none."""

    code = "rollout_id_required"
    status = 400


class InvalidIdentifier(RollbookError):
    """An id (rollout, checkpoint, call, tool-call key) outside its pattern or length."""

    code = "invalid_identifier"
    status = 400


class InvalidRequest(RollbookError):
    """A request that does not parse or does not validate: refused before anything changes."""

    code = "invalid_request"
    status = 400


class InvalidJson(InvalidRequest):
    """A body that is not UTF-8 JSON within the limits (depth, integer size, finite numbers)."""

    code = "invalid_json"
    status = 400


class Unauthorized(RollbookError):
    """No credential, or not one this server knows."""

    code = "unauthorized"
    status = 401


class Forbidden(RollbookError):
    """A known credential that does not open this route (the data credential on the control plane),
    or something the configuration switched off (the sandbox)."""

    code = "forbidden"
    status = 403


class NotFound(RollbookError):
    """No such route, or no such session of a live attempt."""

    code = "not_found"
    status = 404


class MethodNotAllowed(RollbookError):
    """A known route asked with a method it does not take."""

    code = "method_not_allowed"
    status = 405


class RequestConflict(RollbookError):
    """An identifier reused for a different request (a call id with another body)."""

    code = "conflict"
    status = 409


class UnknownRollout(RollbookError):
    """A fork names a rollout, or an attempt of it, that the log never started."""

    code = "unknown_rollout"
    status = 404


class NotABoundary(RollbookError):
    """A fork's position is not a boundary of that attempt one can fork from (engine/forks.py says
    which are): nothing is written."""

    code = "not_a_boundary"
    status = 422


class RestartOnlyBoundary(RollbookError):
    """A fork's boundary holds a live session that cannot be rebuilt there (a restart-only
    environment's, or a sandbox session with no snapshot at it): nothing is written."""

    code = "restart_only_boundary"
    status = 409


class InvalidPhase(RollbookError):
    """An illegal phase transition: refused loudly, never a silent no-op."""

    code = "invalid_phase"
    status = 409


class CheckpointConflict(RollbookError):
    """Another checkpoint is active on this participant."""

    code = "checkpoint_conflict"
    status = 409


class StaleCheckpoint(RollbookError):
    """The checkpoint has already ended here (resumed or aborted)."""

    code = "stale_checkpoint"
    status = 409


class UnknownCheckpoint(RollbookError):
    """No checkpoint with this id is in the log."""

    code = "unknown_checkpoint"
    status = 404


class DeadlineExceeded(RollbookError):
    """The operation's deadline has passed; nothing changed."""

    code = "deadline_exceeded"
    status = 408


class InvalidDeadline(RollbookError):
    """A deadline that is not a finite number of seconds since the epoch (NaN, infinity)."""

    code = "invalid_deadline"
    status = 400


class RestartInScope(RollbookError):
    """A commit scope names an execution that a participant reported restart-only."""

    code = "restart_in_scope"
    status = 409


class AdmissionClosed(RollbookError):
    """A checkpoint holds this server's admission closed: the request changed nothing; ask again after resume."""

    code = "admission_closed"
    status = 409


class ActivationOutOfOrder(RollbookError):
    """An agent activation index other than the completed one (its recorded reply) or the next one."""

    code = "activation_out_of_order"
    status = 409


class InvalidCheckpointState(RollbookError):
    """A cut that does not validate: a missing event, a digest mismatch, lineage that disagrees."""

    code = "invalid_checkpoint_state"
    status = 422


class SchemaMismatch(RollbookError):
    """The database's schema is not the one this code was built for."""

    code = "schema_mismatch"
    status = 500


class ReplayDivergence(RollbookError):
    """Replaying recorded events did not give back the recorded outcome."""

    code = "replay_divergence"
    status = 500


class AgentDiverged(RollbookError):
    """An agent continued by replay asked for a call other than the one its lineage recorded at that
    place (engine.agent_replay): nothing of the recording after it can be answered."""

    code = "agent_divergence"
    status = 409


class DatabaseUnavailable(RollbookError):
    """The database did not answer within the store's patience (a restart, a dropped network).
    Nothing was written that the caller cannot find again: appends carry an idempotency key."""

    code = "database_unavailable"
    status = 503


class AttemptLost(RollbookError):
    """A part of a live attempt cannot continue (a live session no snapshot rebuilds, or an
    unrecorded model call, died with a server). The attempt's driver restarts that rollout alone
    under a new attempt."""

    code = "attempt_lost"
    status = 409


class TokenEntryConflict(RollbookError):
    """A captured model call was put again with a different payload; the first one stands."""

    code = "token_entry_conflict"
    status = 409


class CaptureFrozen(RollbookError):
    """The rollout's token capture is frozen: a trainer holds its snapshot, no entry may join it."""

    code = "capture_frozen"
    status = 409


class CaptureRetired(RollbookError):
    """The rollout's token capture was retired after its snapshot was consumed."""

    code = "capture_retired"
    status = 409


class UnsupportedParameter(InvalidPayload):
    """A sampling parameter this server or its backend cannot honour: refused, never dropped."""

    code = "unsupported_parameter"
    status = 400


class TaskConflict(RollbookError):
    """A rollout id of a taskset already recorded with another task: two runs share a taskset name."""

    code = "task_conflict"
    status = 409


class ToolCallRefused(RollbookError):
    """An environment refused a call (bad arguments, unknown tool, a finished game): nothing changed."""

    code = "tool_error"
    status = 422


class EpisodeFailed(RollbookError):
    """The episode of a flat row ended in a handled failure (its reason, kind and stage in context)."""

    code = "episode_failed"
    status = 500


class GenerationFailed(RollbookError):
    """The model backend could not produce a reply (upstream error, malformed stream, bad output):
    the upstream failed, not rollbook, hence a gateway error."""

    code = "generation_failed"
    status = 502


class UpstreamInvalid(GenerationFailed):
    """The upstream's reply broke a bound rollbook checks before it allocates anything for it (a
    tool-call index past MAX_TOOL_CALLS or leaving a gap, a tool call's name or arguments too long):
    that one call fails; the server and every other call go on."""

    code = "upstream_invalid"


class GymServerFailed(RollbookError):
    """A NeMo Gym server rollbook relays to failed in a way asking again cannot mend, so the rollout
    ends with this rather than waiting on it: the server cannot start (its import or its config
    failed; the detail is the launcher's one line), it refused the seed or the verify (its status and
    body in context), or its session was rebuilt `rebuild_attempts` times with the server gone again
    each time. context: server, stage (start, seed, verify or rebuild), and status and body when it
    answered."""

    code = "gym_server_failed"
    status = 502


class InternalError(RollbookError):
    """A bug in a server: still a JSON answer with a stable code, its detail naming only the
    exception's type, never a secret."""

    code = "internal_error"
    status = 500


class ParticipantUnavailable(RollbookError):
    """The other server did not answer at all (refused, reset, gone)."""

    code = "participant_unavailable"
    status = 503


def _codes() -> dict[str, int]:
    out: dict[str, int] = {}
    stack: list[type[RollbookError]] = [RollbookError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__ == __name__:  # a relay of a remote code (adapters.http_client) is not a code of ours
            out[cls.code] = cls.status
    return dict(sorted(out.items()))


# Every code and its HTTP status, from the classes above: the one table.
STATUS: dict[str, int] = _codes()
