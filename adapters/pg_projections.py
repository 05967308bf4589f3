"""Writing the projection tables (engine.projections) from the changes a group of events makes.

Set-based: the rows of one table and one column set go to the server as one JSON array and are
upserted by one statement (`INSERT ... SELECT FROM jsonb_populate_recordset ... ON CONFLICT`), so an
append's projections cost no statement of their own: `upsert_ctes` gives them as common table
expressions of the statement that moves the heads (adapters.postgres).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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


async def guarded_updates(conn: psycopg.AsyncConnection[Any], changes: Iterable[Change]) -> None:
    """The changes that apply only to rows in a given state, after every upsert of the same group: no
    event the append check admits after a retire (in the same group) can touch an attempt it ended,
    so applying them last is in log order."""
    for ch in changes:
        if ch.guard == "live_through":
            sets = ", ".join(f"{c} = %({c})s" for c in sorted(ch.values))
            await conn.execute(f"UPDATE rollbook.{ch.table} SET {sets} WHERE rollout_id = %(rollout_id)s "
                               "AND attempt <= %(attempt)s AND status = 'live'", {**ch.key, **ch.values})


async def apply_changes(conn: psycopg.AsyncConnection[Any], changes: Iterable[Change]) -> None:
    """Every change, in one upsert statement then the guarded updates (a rebuild's page)."""
    changes = list(changes)
    ctes, params = upsert_ctes(changes)
    if ctes:
        await conn.execute("WITH " + ", ".join(ctes) + " SELECT 1", params)
    await guarded_updates(conn, changes)
