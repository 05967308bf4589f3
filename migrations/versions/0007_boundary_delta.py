"""The episode_history view rebuilds the whole conversation of an agent boundary stored as a delta.

Agent boundaries store what changed since the previous boundary of their stream (`messages_kept`,
`messages_added`; engine/boundaries.py) instead of the whole message list. The view is part of
the public contract, so it still shows every boundary with its whole `messages` list, rebuilt by
rollbook.agent_boundary_messages exactly as engine.boundaries.with_messages does (NULL where the
log no longer tells it: a delta on a boundary that is missing), and without the delta's fields.
Boundaries that hold the whole list (the first of a stream, and every one written before this
change) are shown as stored.

Revision ID: 0007_c14_boundary_delta
Revises: 0006_p10_fence_position
"""

from alembic import op

revision = "0007_c14_boundary_delta"
down_revision = "0006_p10_fence_position"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION rollbook.agent_boundary_messages(p_stream text, p_version integer) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r record;
    msgs jsonb := NULL;
    kept integer;
BEGIN
    -- From the last boundary at or below p_version that holds the whole list, forward.
    FOR r IN
        SELECT data FROM rollbook.events
        WHERE stream = p_stream AND kind = 'agent_boundary' AND stream_version <= p_version
          AND stream_version >= coalesce((SELECT max(stream_version) FROM rollbook.events
                                           WHERE stream = p_stream AND kind = 'agent_boundary'
                                             AND stream_version <= p_version AND data ? 'messages'), 0)
        ORDER BY stream_version
    LOOP
        IF r.data ? 'messages' THEN
            msgs := r.data->'messages';
        ELSIF r.data ? 'messages_kept' THEN
            kept := (r.data->>'messages_kept')::integer;
            IF msgs IS NULL THEN
                IF kept <> 0 THEN
                    RETURN NULL;  -- a delta on a boundary the log does not hold
                END IF;
                msgs := '[]'::jsonb;
            ELSIF kept > jsonb_array_length(msgs) THEN
                RETURN NULL;
            ELSIF kept < jsonb_array_length(msgs) THEN
                msgs := coalesce((SELECT jsonb_agg(x ORDER BY i) FROM jsonb_array_elements(msgs) WITH ORDINALITY t(x, i)
                                  WHERE i <= kept), '[]'::jsonb);
            END IF;
            msgs := msgs || coalesce(r.data->'messages_added', '[]'::jsonb);
        ELSE
            msgs := NULL;  -- a boundary that records no conversation
        END IF;
    END LOOP;
    RETURN msgs;
END
$$;

CREATE OR REPLACE VIEW rollbook.episode_history AS
    SELECT rollout_id, attempt, position, stream, kind,
           CASE WHEN kind = 'agent_boundary' AND data ? 'messages_kept' AND NOT data ? 'messages'
                THEN (data - 'messages_kept' - 'messages_added')
                     || jsonb_build_object('messages', rollbook.agent_boundary_messages(stream, stream_version))
                ELSE data END AS data,
           recorded_at
    FROM rollbook.events WHERE rollout_id IS NOT NULL;
"""

DOWNGRADE = """
CREATE OR REPLACE VIEW rollbook.episode_history AS
    SELECT rollout_id, attempt, position, stream, kind, data, recorded_at
    FROM rollbook.events WHERE rollout_id IS NOT NULL;
DROP FUNCTION rollbook.agent_boundary_messages(text, integer);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
