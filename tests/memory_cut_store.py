"""The log in memory (adapters.memory_store) with the faults of a careless disk or operator: a test
edits or deletes a recorded event behind the store's back, and reads the log's events and state as
the engine's fast tests of engine.checkpoint and engine.coordinator need."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from adapters.memory_store import MemoryEventStore
from engine.events import RecordedEvent
from engine.log import LogState


class MemoryCutStore(MemoryEventStore):
    def __init__(self, writer: str = "test") -> None:
        super().__init__(writer=writer)

    @property
    def events(self) -> list[RecordedEvent]:
        return self.log.events

    @property
    def state(self) -> LogState:
        return self.log.state

    def tamper(self, position: int, **data: Any) -> None:
        """Edit a recorded event's data (its hash stays as recorded)."""
        i = next(i for i, e in enumerate(self.log.events) if e.position == position)
        self.log.events[i] = replace(self.log.events[i], data={**self.log.events[i].data, **data})

    def delete(self, position: int) -> None:
        self.log.events[:] = [e for e in self.log.events if e.position != position]
