"""The rollbook.participants view: every server instance recorded in the log, with its state.

Each server process appends `instance_started` once it listens and `instance_renewed` while it
lives (engine/membership.py). The view shows one row per instance: its kind, id, address and
workers, when it started, when its lease was last renewed, and its state by the rule of
engine/membership.py: `stopped` (its last event is `instance_stopped`), `superseded` (a later
instance of its kind started at its address), `live` (renewed less than `lease_s` ago), else
`expired`.

Revision ID: 0010_participants
Revises: 0009_ui_views
"""

from alembic import op

revision = "0010_participants"
down_revision = "0009_ui_views"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE VIEW rollbook.participants AS
SELECT st.data->>'kind' AS kind,
       st.data->>'instance' AS instance,
       st.data->>'address' AS address,
       (st.data->>'workers')::integer AS workers,
       (st.data->>'lease_s')::double precision AS lease_s,
       st.recorded_at AS started_at,
       last.recorded_at AS renewed_at,
       CASE
           WHEN last.kind = 'instance_stopped' THEN 'stopped'
           WHEN EXISTS (SELECT 1 FROM rollbook.events later
                        WHERE later.kind = 'instance_started' AND later.position > st.position
                          AND later.data->>'kind' = st.data->>'kind'
                          AND later.data->>'address' = st.data->>'address') THEN 'superseded'
           WHEN last.recorded_at + make_interval(secs => (st.data->>'lease_s')::double precision) > now() THEN 'live'
           ELSE 'expired'
       END AS state,
       st.position AS started_position
FROM rollbook.events st
JOIN rollbook.stream_heads h ON h.stream = st.stream
JOIN rollbook.events last ON last.stream = h.stream AND last.stream_version = h.version
WHERE st.kind = 'instance_started';
"""

DOWNGRADE = """
DROP VIEW rollbook.participants;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
