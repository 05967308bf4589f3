"""The event log, its projections, the token store and the public views.

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE rollbook.events (
    position        bigint PRIMARY KEY,
    stream          text NOT NULL,
    stream_version  integer NOT NULL CHECK (stream_version > 0),
    kind            text NOT NULL,
    data            jsonb NOT NULL,
    schema_version  smallint NOT NULL,
    rollout_id      text,
    attempt         integer CHECK (attempt >= 0),
    writer          text NOT NULL,
    hash            bytea NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream, stream_version)
);
CREATE INDEX events_rollout ON rollbook.events (rollout_id, attempt, position) WHERE rollout_id IS NOT NULL;
CREATE INDEX events_kind ON rollbook.events (kind, position);

-- The head of the log and of each stream, read and moved under the append lock.
CREATE TABLE rollbook.log_head (id smallint PRIMARY KEY CHECK (id = 1), position bigint NOT NULL);
INSERT INTO rollbook.log_head VALUES (1, 0);
CREATE TABLE rollbook.stream_heads (
    stream   text PRIMARY KEY,
    version  integer NOT NULL,
    hash     bytea NOT NULL
);

-- Projections: derived from events in the append transaction; rebuildable from the log alone.
CREATE TABLE rollbook.attempt_state (
    rollout_id text NOT NULL, attempt integer NOT NULL,
    status text, parent_attempt integer, restored_from text, origin_position bigint,
    started_position bigint, ended_position bigint, reward double precision,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE TABLE rollbook.rollout_state (
    rollout_id text PRIMARY KEY, latest_attempt integer, retired_through integer
);
CREATE TABLE rollbook.episode_state (
    rollout_id text NOT NULL, attempt integer NOT NULL,
    env text, task_id text, status text, step text, reward double precision,
    started_position bigint, updated_position bigint,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE TABLE rollbook.session_state (
    rollout_id text NOT NULL, attempt integer NOT NULL,
    env text, status text, revision integer, stream_version integer, updated_position bigint,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE TABLE rollbook.model_call_state (
    call_id text PRIMARY KEY, rollout_id text, attempt integer, status text,
    parent_call_id text, policy_version text, receipt jsonb, tokens integer, disposition text,
    accepted_position bigint, updated_position bigint
);
CREATE TABLE rollbook.checkpoint_state (
    checkpoint_id text PRIMARY KEY, phase text, position bigint, scope_size integer, digest text,
    started_position bigint, published_position bigint, updated_position bigint
);

-- Token store: arrays never enter the log; the log keeps receipts (id, digest, size).
CREATE TABLE rollbook.token_blobs (
    blob_id     text PRIMARY KEY,
    token_ids   integer[] NOT NULL,
    logprobs    real[],
    digest      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE rollbook.token_snapshots (
    snapshot_id text PRIMARY KEY,
    checkpoint_id text NOT NULL,
    blob_ids text[] NOT NULL,
    digest text NOT NULL
);

-- The public contract: stable views documented in the README.
CREATE VIEW rollbook.episode_history AS
    SELECT rollout_id, attempt, position, stream, kind, data, recorded_at
    FROM rollbook.events WHERE rollout_id IS NOT NULL;
CREATE VIEW rollbook.attempts AS
    SELECT a.rollout_id, a.attempt,
           CASE WHEN a.status = 'live' AND a.attempt <= coalesce(r.retired_through, -1) THEN 'retired'
                ELSE a.status END AS status,
           a.parent_attempt, a.restored_from AS restored_from_checkpoint, a.origin_position,
           a.started_position, a.ended_position, a.reward
    FROM rollbook.attempt_state a LEFT JOIN rollbook.rollout_state r USING (rollout_id);
CREATE VIEW rollbook.checkpoints AS
    SELECT c.checkpoint_id, c.phase, c.position AS log_position, c.scope_size, c.digest,
           p.recorded_at AS published_at
    FROM rollbook.checkpoint_state c LEFT JOIN rollbook.events p ON p.position = c.published_position;
CREATE VIEW rollbook.model_calls AS
    SELECT call_id, rollout_id, attempt, status, parent_call_id, policy_version, receipt,
           tokens, disposition, accepted_position, updated_position
    FROM rollbook.model_call_state;
"""

DOWNGRADE = """
DROP VIEW IF EXISTS rollbook.model_calls, rollbook.checkpoints, rollbook.attempts, rollbook.episode_history;
DROP TABLE IF EXISTS rollbook.token_snapshots, rollbook.token_blobs, rollbook.checkpoint_state,
    rollbook.model_call_state, rollbook.session_state, rollbook.episode_state, rollbook.rollout_state,
    rollbook.attempt_state, rollbook.stream_heads, rollbook.log_head, rollbook.events;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
