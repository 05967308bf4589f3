"""The log head also holds the position of the latest fence, so a server can cache its attempt checks.

Every data request checks that its attempt is still live (engine.attempts.AttemptGate). An attempt
that was live stops being live only by an `attempt_fenced` or a `rollout_retired` event; the append
that writes one moves `fence_position` in the same transaction. A server that found an attempt live
while `fence_position` was F may answer the same again without reading it while F has not moved:
one single-row read per request instead of two read transactions.

Revision ID: 0006_p10_fence_position
Revises: 0005_s14_snapshot_parent
"""

from alembic import op

revision = "0006_p10_fence_position"
down_revision = "0005_s14_snapshot_parent"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE rollbook.log_head ADD COLUMN fence_position bigint NOT NULL DEFAULT 0")
    op.execute("UPDATE rollbook.log_head SET fence_position = coalesce((SELECT max(position) FROM rollbook.events "
               "WHERE kind IN ('attempt_fenced', 'rollout_retired')), 0)")


def downgrade() -> None:
    op.execute("ALTER TABLE rollbook.log_head DROP COLUMN fence_position")
