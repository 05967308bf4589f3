"""Content-addressed blobs of sandbox sessions' trees (engine.file_blobs).

A session's files at each boundary are stored once per content: the digest is the row's key, and
`names` lists the blobs a manifest names, so retention keeps a named manifest's files with it.
`written_at` is set again whenever a writer puts a blob already stored: retention drops only blobs
nothing names that no writer has put for longer than the retention.

Revision ID: 0015_file_blobs
Revises: 0014_cut_of_what_is_in_flight
"""

from alembic import op

revision = "0015_file_blobs"
down_revision = "0014_cut_of_what_is_in_flight"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE rollbook.file_blobs (
    digest      text PRIMARY KEY,
    content     bytea NOT NULL,
    names       text[] NOT NULL DEFAULT '{}',
    written_at  timestamptz NOT NULL DEFAULT now()
)""")


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS rollbook.file_blobs")
