"""Token snapshots may extend a parent snapshot, so a publish hashes only what its cut added.

A run's checkpoint k pins every token blob written up to its cut. Listing (and re-hashing) all of
them at every publish makes publish grow with the run; instead snapshot k names snapshot k-1 as its
parent and lists only the blobs written since, and its digest covers the parent's digest.

Revision ID: 0005_s14_snapshot_parent
Revises: 0002_i15_token_logprobs_f8
"""

from alembic import op

revision = "0005_s14_snapshot_parent"
down_revision = "0002_i15_token_logprobs_f8"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE rollbook.token_snapshots ADD COLUMN parent_snapshot_id text "
               "REFERENCES rollbook.token_snapshots (snapshot_id)")


def downgrade() -> None:
    op.execute("ALTER TABLE rollbook.token_snapshots DROP COLUMN parent_snapshot_id")
