"""A server process joining the deployment: recorded in the log, and closed while a checkpoint is open.

The coordinator reads the live instances from the log after it records `checkpoint_started`
(engine/coordinator.py), and a joining instance records itself before it looks for an open
checkpoint. So whichever comes first in the log, a paused checkpoint never misses an instance that
serves: either the coordinator saw it and prepares it, or it saw the checkpoint and stays closed
until the checkpoint is committed or aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from adapters.membership import Lease, MembershipReader
from engine.admission import JOINING
from participants.base.participant import Participant

log = logging.getLogger(__name__)
POLL_S = 0.2


class Joining:
    """Admission holds closed (engine.admission.JOINING) from build until the instance is recorded and
    no paused checkpoint is open; a checkpoint's own hold is apart from it."""

    def __init__(self, participant: Participant, lease: Lease, reader: MembershipReader,
                 checkpoint_open: Callable[[], Awaitable[bool]]) -> None:
        self.participant, self.lease, self.reader, self.checkpoint_open = participant, lease, reader, checkpoint_open
        self._waiter: asyncio.Task[None] | None = None
        participant.admission.close(JOINING)  # nothing is admitted before the instance that takes it is in the log
        participant.members = reader
        participant.joined = False

    async def join(self) -> None:
        await self.lease.start()
        self.participant.joined = True
        if await self.checkpoint_open():
            log.info("instance %s joined while a paused checkpoint is open: closed until it ends", self.lease.instance)
            self._waiter = asyncio.get_running_loop().create_task(self._open_when_done())
        else:
            self.participant.admission.open(JOINING)

    async def _open_when_done(self) -> None:
        while await self.checkpoint_open():
            await asyncio.sleep(POLL_S)
        self.participant.admission.open(JOINING)

    async def leave(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()
        await self.lease.stop()


__all__ = ["Joining"]
