"""A server pointed at a database whose schema does not match the code refuses and names the fix."""

from __future__ import annotations

import psycopg
import pytest

from adapters import database
from engine.errors import SchemaMismatch


def test_matching_schema_is_accepted(dsn: str) -> None:
    database.check_schema(dsn)


def test_schema_behind_refuses_and_names_the_upgrade_command(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM rollbook.alembic_version")
    with pytest.raises(SchemaMismatch) as err:
        database.check_schema(dsn)
    assert "behind" in err.value.detail and "rollbook db upgrade" in err.value.detail


def test_schema_ahead_refuses(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE rollbook.alembic_version SET version_num = '9999_future'")
    with pytest.raises(SchemaMismatch) as err:
        database.check_schema(dsn)
    assert "ahead" in err.value.detail


def test_a_schema_at_two_revisions_at_once_refuses(dsn: str) -> None:
    """The bad input: a second row in the version table, as two half-applied branches would leave it."""
    head = database.code_revision()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO rollbook.alembic_version VALUES ('0001_other_branch')")
    with pytest.raises(SchemaMismatch) as err:
        database.check_schema(dsn)
    assert f"2 revisions at once (0001_other_branch,{head})" in err.value.detail


def test_the_revisions_read_from_the_migration_files_are_alembics() -> None:
    """Servers check the schema without loading Alembic (adapters.database.known_revisions reads the
    files' revision lines); Alembic's own reading of the same files must agree."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(database._alembic_config("postgresql://x/y"))
    head, known = database.known_revisions()
    assert head == scripts.get_current_head()
    assert known == {rev.revision for rev in scripts.walk_revisions()}


@pytest.mark.parametrize("query", ["open_sessions", "open_checkpoints", "last_snapshot", "running_attempts"])
def test_what_a_checkpoint_asks_about_open_state_can_be_answered_from_the_open_state_indexes(dsn: str, query: str) -> None:
    """Asked at every checkpoint: with a sequential scan ruled out, each question reads a partial index
    of what is open (or published) rather than every row the run ever projected."""
    from adapters.collection_store import LAST_SNAPSHOT
    from adapters.pg_reads import CHECKPOINTS_IN_PHASE, OPEN_SESSIONS, RUNNING_ATTEMPTS
    sql, params, index = {
        # a cut's attempts: live ones through one index, those finished after P through the other
        "running_attempts": (RUNNING_ATTEMPTS, {"p": 10, "run": "run"}, "attempt_state_finished"),
        "open_sessions": (OPEN_SESSIONS, {}, "session_state_open"),
        "open_checkpoints": (CHECKPOINTS_IN_PHASE, {"ph": ["started", "prepared"]},
                             "checkpoint_state_open"),
        "last_snapshot": (LAST_SNAPSHOT.replace(":p", "%(p)s").replace(":b", "%(b)s"), {"p": "run-ck%", "b": 10**6},
                          "checkpoint_state_published"),
    }[query]
    with psycopg.connect(database.libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql, params).fetchall())
    assert index in plan, plan
    assert query != "running_attempts" or "attempt_state_live" in plan, plan


def test_sql_and_python_agree_on_the_run_of_any_rollout_id(dsn: str) -> None:
    """A cut names its run, and the PostgreSQL store picks the run's attempts in SQL
    (adapters.pg_reads.RUN_OF) while the memory store and restore use engine.identity.run_of: for any
    id in the identifier alphabet, dashes and digits weighted in, the two give one run."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from adapters.pg_reads import RUN_OF
    from engine.identity import in_run, run_of

    ids = st.text(alphabet=st.sampled_from("ab9-0-1.x_-"), min_size=0, max_size=12).map(lambda t: "r" + t)
    with psycopg.connect(dsn, autocommit=True) as conn:

        @settings(max_examples=300, deadline=None)
        @given(rollout_id=ids, other=ids)
        def agree(rollout_id: str, other: str) -> None:
            row = conn.execute(f"SELECT {RUN_OF}, {RUN_OF.replace('rollout_id', '%(o)s')} = %(run)s "
                               "FROM (SELECT %(r)s::text AS rollout_id) t",
                               {"r": rollout_id, "o": other, "run": run_of(rollout_id)}).fetchone()
            assert row is not None and row[0] == run_of(rollout_id)
            assert row[1] == in_run(other, run_of(rollout_id))

        agree()


def test_reading_a_cuts_own_lists_from_the_view_never_joins_the_finishes_of_the_log(dsn: str) -> None:
    """Retention and the UI's per-run counts read checkpoint_rollouts without its `completed` rows; the
    planner drops the branch that derives them from every finish up to each cut's position."""
    from adapters.ui_reads import RUN_CHECKPOINTS
    with psycopg.connect(database.libpq_dsn(dsn), autocommit=True) as conn:
        for sql in ("SELECT rollout_id FROM rollbook.checkpoint_rollouts WHERE disposition <> 'completed'",
                    f"SELECT run_id, count(DISTINCT checkpoint_id) FROM {RUN_CHECKPOINTS} rc GROUP BY 1"):
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql).fetchall())
            assert "attempt_finished" not in plan and "attempt_fenced" not in plan, plan
        everything = "\n".join(r[0] for r in conn.execute("EXPLAIN SELECT * FROM rollbook.checkpoint_rollouts").fetchall())
    assert "attempt_finished" in everything  # the derived branch is there when `completed` rows are asked for
