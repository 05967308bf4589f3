"""The participants a coordinator drives: every live instance the log records, plus the config's.

Each server instance records itself in the log (engine/membership.py). A checkpoint prepares, commits
and resumes every *live* instance of every kind, so a recorded instance that does not answer (killed,
its lease not yet run out) fails prepare closed; once its lease runs out it is no longer a member and
the checkpoint goes on without it. An address given by the config or the command line is driven too,
unless the log records it as an instance that is no longer live, or as the front of workers (a server
run with `workers = N`, apps/workers.py: its workers are the members, each driven by itself): a server
that predates instance records, or one the log has not heard of, is never silently left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from adapters.membership import MembershipReader
from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from engine.coordinator import ParticipantClient


class LoggedParticipants:
    def __init__(self, store: PostgresEventStore, configured: Sequence[tuple[str, str]], token: str,
                 session: aiohttp.ClientSession) -> None:
        self.reader = MembershipReader(store)
        self.configured = [(k, u.rstrip("/")) for k, u in configured]  # (kind, base URL)
        self.token, self.session = token, session

    async def current(self) -> Sequence[ParticipantClient]:
        members = await self.reader.members()
        out: list[ParticipantClient] = []
        for kind, url in self.configured:
            recorded = [m for m in members if m.instance.kind == kind and m.instance.address.rstrip("/") == url]
            fronted = any(m.instance.kind == kind and (m.instance.front or "").rstrip("/") == url for m in members)
            # A front holds no work: the workers behind it are members, each driven below.
            if not fronted and (not recorded or any(m.live for m in recorded)):
                out.append(HttpParticipant(kind, kind, url, self.token, self.session))
        for m in members:
            i = m.instance
            if m.live and (i.kind, i.address.rstrip("/")) not in self.configured:
                out.append(HttpParticipant(f"{i.kind}:{i.instance}", i.kind, i.address, self.token, self.session))
        return out


__all__ = ["LoggedParticipants"]
