"""rollbook.participants with workers: each worker's front, parent and index, and superseding by site.

A server configured with `workers = N` runs N processes behind one public address (apps/workers.py);
each records itself like an instance at its own internal address and names its `front` (the public
address), its `parent` (the process that serves the front) and its `worker` index. The state rule of
engine/membership.py now supersedes by site (the front, or the address of a plain instance): a later
start at a site by another group (another parent's workers, or another plain instance) supersedes
every earlier one there. For a plain instance this is the rule revision 0010 had.

Revision ID: 0011_participant_workers
Revises: 0010_participants
"""

from alembic import op

revision = "0011_participant_workers"
down_revision = "0010_participants"
branch_labels = None
depends_on = None

UPGRADE = """
DROP VIEW rollbook.participants;
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
                          AND COALESCE(later.data->>'front', later.data->>'address')
                              = COALESCE(st.data->>'front', st.data->>'address')
                          AND COALESCE(later.data->>'parent', later.data->>'instance')
                              <> COALESCE(st.data->>'parent', st.data->>'instance')) THEN 'superseded'
           WHEN last.recorded_at + make_interval(secs => (st.data->>'lease_s')::double precision) > now() THEN 'live'
           ELSE 'expired'
       END AS state,
       st.position AS started_position,
       st.data->>'front' AS front,
       st.data->>'parent' AS parent,
       (st.data->>'worker')::integer AS worker
FROM rollbook.events st
JOIN rollbook.stream_heads h ON h.stream = st.stream
JOIN rollbook.events last ON last.stream = h.stream AND last.stream_version = h.version
WHERE st.kind = 'instance_started';
"""

# The view of revision 0010, put back by a downgrade.
_V0010 = """
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


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("DROP VIEW rollbook.participants;")
    op.execute(_V0010)
