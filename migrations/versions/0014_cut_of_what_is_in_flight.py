"""A cut is the size of what is in flight: it no longer lists the attempts complete at P.

A committed cut listed every completed attempt of the rollouts it covered, and every rollout its
framework named (a framework naming none covered the whole database). Its size and its cost grew
with everything the run or the database had finished (benchmarks.cut_scaling: 320 ms a checkpoint
with 40,000 finished attempts in the database, refused as too large from about 35,000 named
rollouts). Now a framework names its run, and a cut reads only the attempts live now or finished
after P: `attempt_state_live` (0013) and the index below answer that without reading history.

`checkpoint_rollouts` keeps its `completed` rows: for a cut that no longer lists them they are the
attempts of its run (of every rollout, with no run) finished at or below P and not fenced there
since, read from the log, as restore reads them (engine.checkpoint.complete_at).

Revision ID: 0014_cut_of_what_is_in_flight
Revises: 0013_open_state_indexes
"""

from alembic import op

revision = "0014_cut_of_what_is_in_flight"
down_revision = "0013_open_state_indexes"
branch_labels = None
depends_on = None

# adapters.pg_reads.RUN_OF, on the finishing event's rollout.
_RUN_OF = "regexp_replace(f.rollout_id, '-[0-9]+$', '')"

# No shared CTE (0009 had one): PostgreSQL materializes a CTE read by several branches, so a
# filter on one checkpoint or one rollout would not reach the derived branch, which would then join
# every committed cut with every finish in the log.
_CUT = "rollbook.events c"
_IS_CUT = "c.kind = 'checkpoint_committed'"
_P = "(c.data->>'position')::bigint"
VIEW = f"""
CREATE OR REPLACE VIEW rollbook.checkpoint_rollouts AS
    SELECT c.data->>'checkpoint_id' AS checkpoint_id, {_P} AS log_position,
           s->>'rollout_id' AS rollout_id, (s->>'attempt')::integer AS attempt,
           (s->>'boundary')::bigint AS boundary, 'continue' AS disposition,
           c.position AS committed_position, c.recorded_at AS committed_at
    FROM {_CUT}, jsonb_array_elements(c.data->'scope') s WHERE {_IS_CUT}
    UNION ALL
    SELECT c.data->>'checkpoint_id', {_P}, f->>0, (f->>1)::integer, NULL::bigint, 'fresh_dispatch', c.position, c.recorded_at
    FROM {_CUT}, jsonb_array_elements(coalesce(c.data->'fresh_dispatch', '[]'::jsonb)) f WHERE {_IS_CUT}
    UNION ALL
    SELECT c.data->>'checkpoint_id', {_P}, d->>0, (d->>1)::integer, NULL::bigint, 'completed', c.position, c.recorded_at
    FROM {_CUT}, jsonb_array_elements(coalesce(c.data->'completed', '[]'::jsonb)) d WHERE {_IS_CUT}
    UNION ALL
    SELECT c.data->>'checkpoint_id', {_P}, f.rollout_id, f.attempt, NULL::bigint, 'completed', c.position, c.recorded_at
    FROM {_CUT} JOIN rollbook.events f ON f.kind = 'attempt_finished' AND f.position <= {_P}
    WHERE {_IS_CUT} AND NOT c.data ? 'completed'
      AND (c.data->>'run' IS NULL OR {_RUN_OF} = c.data->>'run')
      AND NOT EXISTS (SELECT 1 FROM rollbook.events x WHERE x.kind = 'attempt_fenced' AND x.rollout_id = f.rollout_id
                      AND x.attempt = f.attempt AND x.position > f.position AND x.position <= {_P});
"""

# 0009's definition, for the downgrade.
OLD_VIEW = """
CREATE OR REPLACE VIEW rollbook.checkpoint_rollouts AS
    WITH c AS (SELECT data, position AS committed_position, recorded_at AS committed_at
               FROM rollbook.events WHERE kind = 'checkpoint_committed')
    SELECT c.data->>'checkpoint_id' AS checkpoint_id, (c.data->>'position')::bigint AS log_position,
           s->>'rollout_id' AS rollout_id, (s->>'attempt')::integer AS attempt,
           (s->>'boundary')::bigint AS boundary, 'continue' AS disposition, c.committed_position, c.committed_at
    FROM c, jsonb_array_elements(c.data->'scope') s
    UNION ALL
    SELECT c.data->>'checkpoint_id', (c.data->>'position')::bigint, f->>0, (f->>1)::integer, NULL::bigint,
           'fresh_dispatch', c.committed_position, c.committed_at
    FROM c, jsonb_array_elements(coalesce(c.data->'fresh_dispatch', '[]'::jsonb)) f
    UNION ALL
    SELECT c.data->>'checkpoint_id', (c.data->>'position')::bigint, d->>0, (d->>1)::integer, NULL::bigint,
           'completed', c.committed_position, c.committed_at
    FROM c, jsonb_array_elements(coalesce(c.data->'completed', '[]'::jsonb)) d;
"""


def upgrade() -> None:
    op.execute("CREATE INDEX attempt_state_finished ON rollbook.attempt_state (ended_position) WHERE status = 'finished'")
    op.execute(VIEW)


def downgrade() -> None:
    # CREATE OR REPLACE VIEW cannot drop columns or change their types; both definitions have the same.
    op.execute(OLD_VIEW)
    op.execute("DROP INDEX rollbook.attempt_state_finished")
