"""The exception hierarchy: one root, one stable code per failure.

Callers catch what they mean; the HTTP layer maps each code to one status in one place
(`participants.http_errors`). The codes are part of the public contract.
"""

from __future__ import annotations

from typing import Any


class RollbookError(Exception):
    code: str = "rollbook_error"

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


class PayloadTooLarge(InvalidPayload):
    code = "payload_too_large"


class VersionConflict(RollbookError):
    """Optimistic concurrency: the stream is not at the version the writer expected."""

    code = "version_conflict"


class StaleAttempt(RollbookError):
    """The attempt is fenced, retired or below the rollout's retire mark: nothing of it may land."""

    code = "stale_attempt"


class UnknownAttempt(RollbookError):
    code = "unknown_attempt"


class RolloutIdRequired(RollbookError):
    code = "rollout_id_required"


class InvalidIdentifier(RollbookError):
    code = "invalid_identifier"


class InvalidPhase(RollbookError):
    """An illegal phase transition: refused loudly, never a silent no-op."""

    code = "invalid_phase"


class CheckpointConflict(RollbookError):
    code = "checkpoint_conflict"


class StaleCheckpoint(RollbookError):
    code = "stale_checkpoint"


class UnknownCheckpoint(RollbookError):
    code = "unknown_checkpoint"


class DeadlineExceeded(RollbookError):
    code = "deadline_exceeded"


class InvalidDeadline(RollbookError):
    """A deadline that is not a finite number of seconds since the epoch (NaN, infinity)."""

    code = "invalid_deadline"


class RestartInScope(RollbookError):
    code = "restart_in_scope"


class AdmissionClosed(RollbookError):
    code = "admission_closed"


class ActivationOutOfOrder(RollbookError):
    code = "activation_out_of_order"


class InvalidCheckpointState(RollbookError):
    """A cut that does not validate: a missing event, a digest mismatch, lineage that disagrees."""

    code = "invalid_checkpoint_state"


class ProcessAlreadyServed(RollbookError):
    code = "process_already_served"


class SchemaMismatch(RollbookError):
    code = "schema_mismatch"


class ReplayDivergence(RollbookError):
    code = "replay_divergence"


class DatabaseUnavailable(RollbookError):
    """The database did not answer within the store's patience (a restart, a dropped network).
    Nothing was written that the caller cannot find again: appends carry an idempotency key."""

    code = "database_unavailable"


class AttemptLost(RollbookError):
    """A part of a live attempt cannot continue (its sandbox process or an unrecorded model call
    died with a server). The attempt's driver restarts that rollout alone under a new attempt."""

    code = "attempt_lost"


class TokenEntryConflict(RollbookError):
    """A captured model call was put again with a different payload; the first one stands."""

    code = "token_entry_conflict"


class CaptureFrozen(RollbookError):
    """The rollout's token capture is frozen: a trainer holds its snapshot, no entry may join it."""

    code = "capture_frozen"


class CaptureRetired(RollbookError):
    """The rollout's token capture was retired after its snapshot was consumed."""

    code = "capture_retired"
