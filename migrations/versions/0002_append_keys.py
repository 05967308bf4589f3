"""Idempotency keys of appends: a request retried after a lost commit lands once.

Revision ID: 0002_i9b_append_keys
Revises: 0001
"""

from alembic import op

revision = "0002_i9b_append_keys"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = """
-- One row per committed append request that carried a key (the store gives every request one).
-- Written in the append transaction, under the log-head lock: a retry of a request whose commit
-- outcome was lost finds its key and gets the events the first try wrote, never a second copy.
-- Rows older than any retry window may be deleted; nothing else reads them.
CREATE TABLE rollbook.append_keys (
    key             text PRIMARY KEY,
    first_position  bigint NOT NULL,
    last_position   bigint NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now()
);
"""

DOWNGRADE = "DROP TABLE IF EXISTS rollbook.append_keys;"


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
