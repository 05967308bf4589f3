"""What a server is to a checkpoint: the `Participant` base class and the report of its prepare.

The control plane (participants.base.control_plane) calls these hooks; each server kind overrides them
with what a prepare, commit, restore or resume means for its own state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import attempts as A
from engine.admission import Admission
from engine.checkpoint import Cut, ParticipantStore
from engine.ownership import LiveInstances
from engine.prepare_records import PrepareRecord
from participants.base.guard import Route
from participants.base.routing import Peers
from participants.base.wire import Execution


class PrepareReport(BaseModel):
    """What a participant says after parking its work."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[Execution] = Field(default_factory=list)
    # Events the coordinator appends with `checkpoint_prepared`, so that the prepare appends nothing
    # (engine.prepare_records); the participant appends what a checkpoint aborted before then left out.
    records: list[PrepareRecord] = Field(default_factory=list)

    model_config = ConfigDict(arbitrary_types_allowed=True)


class Participant:
    """A server's part in a checkpoint. Subclasses override the hooks; defaults do nothing."""

    kind: ClassVar[str] = "participant"
    checkpoint_mode: ClassVar[Literal["native", "restart_only"]] = "native"
    concurrency: ClassVar[str] = "sessions serialized per rollout attempt; control operations serialized"

    def __init__(self, store: ParticipantStore, instance: str) -> None:
        self.store = store
        self.instance = instance
        self.attempts = A.AttemptGate(store)
        self.served_sessions = False
        self.admission = Admission()  # engine.admission: closed from prepare (or restore) until resume
        # Who else is live (engine.ownership): set where instances are recorded (`rollbook serve`).
        self.members: LiveInstances | None = None
        self.joined = True  # False from build until `rollbook serve` has recorded the instance (participants/base/instances.py)
        # The live processes of this server's own kind, and where the others reach this one (set by
        # `rollbook serve`): of the work a restore stages on every worker, each installs only what routes to it.
        self.own = Peers("", self.kind)
        self.address: str | None = None

    async def routed_here(self, rollout_id: str, attempt: int) -> bool:
        """Whether (rollout_id, attempt) routes to this process (participants/base/routing.py); True for a
        server alone on its log (no instances recorded)."""
        if self.own.source is None or self.address is None:
            return True
        return await self.own.url(rollout_id, attempt) == self.address.rstrip("/")

    @property
    def admission_open(self) -> bool:
        return self.admission.is_open

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareReport:
        """Close admission and park what runs; subclasses close first, then drain their own work."""
        self.admission.close(checkpoint_id=checkpoint_id)
        return PrepareReport(ready=True)

    async def commit(self, checkpoint_id: str, scope: list[Execution]) -> dict[str, Any]:
        return {}

    async def restore(self, cut: Cut) -> dict[str, Any]:
        """Validate and stage the state of every execution in the cut; install nothing live."""
        return {}

    async def resume(self, checkpoint_id: str, restored: bool) -> dict[str, Any]:
        self.admission.open(checkpoint_id=checkpoint_id)
        return {}

    async def retire(self, rollout_id: str, through: int) -> None:
        return None

    async def stop(self) -> None:
        """At shutdown: cancel work in flight (the server waits for open handlers, which wait on it)."""
        return None

    async def close(self) -> None:
        """At cleanup: release clients and connections the participant opened."""
        return None

    async def forget(self, rollout_id: str) -> None:
        return None

    def in_flight(self) -> int:
        """Rollout attempts with work in progress here (the `rollbook_rollouts_in_flight` gauge)."""
        return 0

    def routes(self) -> list[Route]:
        """The server's data routes (participants.base.guard.Route): mounted and documented alike."""
        return []

    async def check_attempt(self, rollout_id: str, attempt: int) -> None:
        """Fencing lives in the database, so every server refuses the same attempts at once; the
        gate answers from memory while no fence has landed (engine.attempts.AttemptGate)."""
        await self.attempts.check(rollout_id, attempt)


__all__ = ["Participant", "PrepareReport"]
