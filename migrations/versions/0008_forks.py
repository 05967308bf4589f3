"""rollbook.forks: every rollout started from another rollout's boundary, with its origin.

One row per `rollout_forked` event (engine/forks.py): the fork's rollout id, the rollout, attempt
and boundary position it was forked from, its group (the forks of one request), its place in it,
the group's size and its own sampling seed. A fork of a fork has the first fork as its origin, so
the tree is a recursive query on origin_rollout_id (docs/forks.md).

Revision ID: 0008_forks
Revises: 0007_c14_boundary_delta
"""

from alembic import op

revision = "0008_forks"
down_revision = "0007_c14_boundary_delta"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE VIEW rollbook.forks AS
    SELECT rollout_id, data->>'origin_rollout_id' AS origin_rollout_id,
           (data->>'origin_attempt')::integer AS origin_attempt,
           (data->>'origin_position')::bigint AS origin_position,
           data->>'group' AS fork_group, (data->>'index')::integer AS fork_index,
           (data->>'count')::integer AS fork_count, (data->>'seed')::bigint AS seed,
           position, recorded_at
    FROM rollbook.events WHERE kind = 'rollout_forked';
"""

DOWNGRADE = """
DROP VIEW IF EXISTS rollbook.forks;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
