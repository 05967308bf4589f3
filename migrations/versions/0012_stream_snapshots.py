"""rollbook.stream_snapshots: a session's replayed state as of a log position (engine/snapshots.py).

A speed-up, never the truth: a reader uses a row only if its digest matches its content and its
recorded stream heads match the log's events; otherwise it folds the events from the start.
Keyed by (stream, position): the session stream of the attempt folded, and the position folded up to.

Revision ID: 0012_stream_snapshots
Revises: 0011_participant_workers
"""

from alembic import op

revision = "0012_stream_snapshots"
down_revision = "0011_participant_workers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE rollbook.stream_snapshots (
    stream     text        NOT NULL,
    position   bigint      NOT NULL,
    data       jsonb       NOT NULL,
    digest     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, position)
)""")


def downgrade() -> None:
    op.execute("DROP TABLE rollbook.stream_snapshots")
