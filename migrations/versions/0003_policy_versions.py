"""Policy versions: the order they were set in, and how stale each sample is.

Revision ID: 0002_i12_policy_versions
Revises: 0002_i9b_append_keys
"""

from alembic import op

revision = "0002_i12_policy_versions"
down_revision = "0002_i9b_append_keys"
branch_labels = None
depends_on = None

UPGRADE = """
-- Every version the model servers were given (from the config at start, or by the control-plane
-- operation after a weight sync), in log order; seq 1 is the first.
CREATE VIEW rollbook.policy_versions AS
    SELECT row_number() OVER (ORDER BY position) AS seq, data->>'policy_version' AS policy_version,
           data->>'previous' AS previous, data->>'source' AS source, data->>'instance' AS instance,
           position, recorded_at
    FROM rollbook.events WHERE kind = 'policy_version_changed';

-- One row per completed model call (a sample): the version that produced it, its token segments
-- per version (a call cut under one version and continued under another has two), and how many
-- version changes it is behind the newest version and behind the version in force when its rollout
-- finished (NULL while the rollout is unfinished).
CREATE VIEW rollbook.sample_staleness AS
    WITH v AS (SELECT seq, policy_version, position FROM rollbook.policy_versions),
         c AS (SELECT e.data->>'call_id' AS call_id, e.rollout_id, e.attempt, e.data->>'policy_version' AS policy_version,
                      (e.data->>'tokens')::integer AS tokens, e.data->'segments' AS segments, e.position
               FROM rollbook.events e WHERE e.kind = 'call_completed')
    SELECT c.call_id, c.rollout_id, c.attempt, c.policy_version, c.tokens, c.segments, c.position,
           (SELECT max(seq) FROM v WHERE v.policy_version = c.policy_version AND v.position <= c.position) AS version_seq,
           (SELECT max(seq) FROM v) - (SELECT max(seq) FROM v WHERE v.policy_version = c.policy_version
                                       AND v.position <= c.position) AS versions_behind_latest,
           (SELECT max(seq) FROM v WHERE v.position <= f.ended_position)
             - (SELECT max(seq) FROM v WHERE v.policy_version = c.policy_version AND v.position <= c.position)
             AS versions_behind_at_finish
    FROM c LEFT JOIN rollbook.attempts f ON f.rollout_id = c.rollout_id AND f.status = 'finished';

-- Which rollouts mix versions: every version of every token segment of every completed call of the rollout.
CREATE VIEW rollbook.rollout_policy_versions AS
    SELECT s.rollout_id,
           array_agg(DISTINCT coalesce(seg->>'policy_version', s.policy_version)) AS policy_versions,
           count(DISTINCT coalesce(seg->>'policy_version', s.policy_version)) > 1 AS mixes_versions,
           max(s.versions_behind_latest) AS max_versions_behind_latest,
           max(s.versions_behind_at_finish) AS max_versions_behind_at_finish
    FROM rollbook.sample_staleness s
    LEFT JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(s.segments) = 'array' THEN s.segments
                                                ELSE '[]'::jsonb END) seg ON true
    GROUP BY s.rollout_id;
"""

DOWNGRADE = """
DROP VIEW IF EXISTS rollbook.rollout_policy_versions, rollbook.sample_staleness, rollbook.policy_versions;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
