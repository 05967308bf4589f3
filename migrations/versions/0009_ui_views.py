"""Each checkpoint's cut, one row per rollout attempt it names: the reader's view of a checkpoint.

`checkpoint_committed` holds the cut as three lists (scope: continued attempts and their boundary;
fresh_dispatch: attempts that restart from their input; completed: attempts finished at the cut).
Readers (`rollbook ui`, SQL users) want one row per rollout, so this view unnests them.

Revision ID: 0009_ui_views
Revises: 0008_forks
"""

from alembic import op

revision = "0009_ui_views"
down_revision = "0008_forks"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE VIEW rollbook.checkpoint_rollouts AS
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

DOWNGRADE = "DROP VIEW IF EXISTS rollbook.checkpoint_rollouts;"


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
