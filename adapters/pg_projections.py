"""Writing the projection tables (engine.projections) from the changes a group of events makes.

Set-based: the rows of one table and one column set go to the server as one JSON array and are
upserted by one statement (`INSERT ... SELECT FROM jsonb_populate_recordset ... ON CONFLICT`), so an
append's projections cost no statement of their own: `upsert_ctes` gives them as common table
expressions of the statement that moves the heads (adapters.postgres).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from engine.events import escape_strings
from engine.projections import POSITION_COLUMNS, TABLES, Change


def merge_changes(changes: Iterable[Change]) -> list[Change]:
    """Sequential upserts of one row equal one upsert of their merged columns, later ones winning."""
    merged: dict[tuple[str, tuple[Any, ...]], Change] = {}
    for ch in changes:
        if ch.guard is not None:
            continue  # applied after the upserts (guarded_updates)
        key = (ch.table, tuple(ch.key[c] for c in TABLES[ch.table]))
        prior = merged.get(key)
        merged[key] = ch if prior is None else Change(ch.table, ch.key, {**prior.values, **ch.values})
    return list(merged.values())


def upsert_ctes(changes: Iterable[Change], prefix: str = "u", moved_by: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The upserts of `changes` as `name AS (INSERT ...)` expressions and their parameters. Each row
    is touched by one of them at most (merge_changes), as one statement requires. `moved_by` names a
    relation of the same statement with one column, `delta`, added to every position column
    (engine.projections.POSITION_COLUMNS); an empty relation writes no row."""
    groups: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for ch in merge_changes(changes):
        # Projected values come from event data: stored in the same escaped spelling as the events
        # (engine.events.escape_strings), or a NUL in a task id would fail the whole group's transaction.
        groups.setdefault((ch.table, tuple(sorted(ch.values))), []).append(escape_strings({**ch.key, **ch.values}))
    ctes: list[str] = []
    params: dict[str, str] = {}
    for i, ((table, cols), rows) in enumerate(groups.items()):
        keys = TABLES[table]
        allcols = ", ".join(keys + cols)
        values = allcols if moved_by is None else ", ".join(
            f"r.{c} + {moved_by}.delta" if c in POSITION_COLUMNS else f"r.{c}" for c in keys + cols)
        source = "" if moved_by is None else f" AS r, {moved_by}"
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols) or f"{keys[0]} = EXCLUDED.{keys[0]}"
        name = f"{prefix}{i}"
        ctes.append(f"{name} AS (INSERT INTO rollbook.{table} ({allcols}) SELECT {values} FROM "
                    f"jsonb_populate_recordset(NULL::rollbook.{table}, %({name})s::jsonb){source} "
                    f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates})")
        params[name] = json.dumps(rows)
    return ctes, params


def until_guarded(changes: Sequence[Change]) -> tuple[list[Change], list[Change]]:
    """The changes before the first one that applies only to rows in a given state, and the rest
    (from that one on). The upserts before it are one statement; it must see what they wrote and
    nothing written after it: retire, forget and a new start of the same attempt in one group would
    otherwise retire the attempt started after the retire."""
    i = next((k for k, ch in enumerate(changes) if ch.guard is not None), len(changes))
    return list(changes[:i]), list(changes[i:])


async def _guarded_update(conn: psycopg.AsyncConnection[Any], ch: Change) -> None:
    if ch.guard == "live_through":
        sets = ", ".join(f"{c} = %({c})s" for c in sorted(ch.values))
        await conn.execute(f"UPDATE rollbook.{ch.table} SET {sets} WHERE rollout_id = %(rollout_id)s "
                           "AND attempt <= %(attempt)s AND status = 'live'", {**ch.key, **ch.values})


async def apply_changes(conn: psycopg.AsyncConnection[Any], changes: Iterable[Change]) -> None:
    """Every change in log order: each run of upserts in one statement, each guarded change after the
    upserts before it and before those after it (a rebuild's page, the rest of an append's group)."""
    rest = list(changes)
    while rest:
        upserts, rest = until_guarded(rest)
        ctes, params = upsert_ctes(upserts)
        if ctes:
            await conn.execute("WITH " + ", ".join(ctes) + " SELECT 1", params)
        if rest:
            await _guarded_update(conn, rest.pop(0))
