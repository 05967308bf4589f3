"""Partial indexes on what is open: a question about what is live now costs what is live, not what ran.

Asked at every checkpoint: the resources server's prepare reads every open session of a live attempt
(restart-only ones a dead instance held), the lease sweep reads every open checkpoint, and a framework
that publishes reads its last published checkpoint. Each was a scan of every row ever projected, so
over a long run (a checkpoint a second is 86,400 checkpoint rows a day) it grew with the run's
history; measured on 40,000 sessions and 20,000 checkpoints: 1.6, 1.0 and 1.0 ms, against 0.08,
0.005 and 0.04 ms with these.

Revision ID: 0013_open_state_indexes
Revises: 0012_stream_snapshots
"""

from alembic import op

revision = "0013_open_state_indexes"
down_revision = "0012_stream_snapshots"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX session_state_open ON rollbook.session_state (rollout_id, attempt) WHERE status = 'open'")
    op.execute("CREATE INDEX attempt_state_live ON rollbook.attempt_state (rollout_id, attempt) WHERE status = 'live'")
    op.execute("CREATE INDEX checkpoint_state_open ON rollbook.checkpoint_state (checkpoint_id) "
               "WHERE phase IN ('started', 'prepared')")
    op.execute("CREATE INDEX checkpoint_state_published ON rollbook.checkpoint_state (position) WHERE phase = 'published'")


def downgrade() -> None:
    op.execute("DROP INDEX rollbook.session_state_open, rollbook.attempt_state_live, rollbook.checkpoint_state_open, "
               "rollbook.checkpoint_state_published")
