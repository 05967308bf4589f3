"""The public-view queries that find work done twice or after a fence across a rollout's attempts,
shared by the end-to-end tests, the stateful machines and the soak benchmark (benchmarks/soak.py).

Each takes `:p`, a LIKE pattern of the rollout ids to look at, and returns the offending rows (none: the
invariant holds). Two lineages: CONTINUED_LINEAGE follows every continued attempt (restored from a
checkpoint or recovered from the log), RESTORED_LINEAGE only those restored from a checkpoint, with
that checkpoint's cut position.
"""

from __future__ import annotations

from pathlib import Path

# Lineage through every continued attempt (restored from a checkpoint or recovered from the log).
CONTINUED_LINEAGE = """
WITH RECURSIVE origin AS (
    SELECT rollout_id, attempt, (data->>'origin_attempt')::int AS origin_attempt,
           (data->>'origin_position')::bigint AS boundary
    FROM rollbook.episode_history
    WHERE kind = 'attempt_started' AND rollout_id LIKE :p AND data->>'origin_attempt' IS NOT NULL
), lineage AS (
    SELECT rollout_id, attempt, origin_attempt AS ancestor, boundary FROM origin
    UNION ALL
    SELECT l.rollout_id, l.attempt, o.origin_attempt, o.boundary
    FROM lineage l JOIN origin o ON o.rollout_id = l.rollout_id AND o.attempt = l.ancestor
)
"""
# An agent turn recorded twice within one attempt: the attempt redid work it had done.
REPEATED_TURNS = """
SELECT rollout_id, attempt, data->>'activation' AS activation, data->>'turn' AS turn, data->>'state' AS state, count(*)
FROM rollbook.episode_history WHERE kind = 'agent_boundary' AND rollout_id LIKE :p
GROUP BY 1, 2, 3, 4, 5 HAVING count(*) > 1
"""
# One tool call (named by the agent: activation, turn, index) applied twice within one attempt.
REPEATED_TOOL_CALLS = """
SELECT rollout_id, attempt, data->>'tool_call' AS tool_call, count(*)
FROM rollbook.episode_history WHERE kind = 'mutation_applied' AND rollout_id LIKE :p AND data->>'tool_call' IS NOT NULL
GROUP BY 1, 2, 3 HAVING count(*) > 1
"""
# A mutation of a continued attempt at a revision an ancestor had applied before the boundary it continued.
REPEATED_MUTATIONS = CONTINUED_LINEAGE + """
SELECT b.rollout_id, b.attempt, (b.data->>'revision')::int AS revision
FROM rollbook.episode_history b
JOIN lineage l ON l.rollout_id = b.rollout_id AND l.attempt = b.attempt
JOIN rollbook.episode_history a ON a.rollout_id = l.rollout_id AND a.attempt = l.ancestor AND a.kind = 'mutation_applied'
  AND a.position <= l.boundary AND (a.data->>'revision') = (b.data->>'revision')
WHERE b.kind = 'mutation_applied'
"""
# A model call generated for a turn whose reply was already recorded: in the same attempt, or by an
# ancestor before the boundary this attempt continued.
REGENERATED_WITHIN = """
SELECT rollout_id, attempt, split_part(data->>'call_id', '.t', 2) AS turn, count(*)
FROM rollbook.episode_history
WHERE kind = 'call_completed' AND rollout_id LIKE :p AND coalesce(data->>'disposition', 'generated') = 'generated'
GROUP BY 1, 2, 3 HAVING count(*) > 1
"""
REGENERATED_ACROSS = CONTINUED_LINEAGE + """
SELECT b.rollout_id, b.data->>'call_id' AS call_id, a.data->>'call_id' AS earlier
FROM rollbook.episode_history b
JOIN lineage l ON l.rollout_id = b.rollout_id AND l.attempt = b.attempt
JOIN rollbook.episode_history a ON a.rollout_id = l.rollout_id AND a.attempt = l.ancestor AND a.kind = 'call_completed'
  AND a.position <= l.boundary AND split_part(a.data->>'call_id', '.t', 2) = split_part(b.data->>'call_id', '.t', 2)
WHERE b.kind = 'call_completed' AND coalesce(b.data->>'disposition', 'generated') = 'generated'
"""

# The ancestry of every continued attempt: its origin, its origin's origin... each with the boundary
# its successor continued from and the cut position of the checkpoint that successor was restored from.
RESTORED_LINEAGE = """
WITH RECURSIVE origin AS (
    SELECT s.rollout_id, s.attempt, (s.data->>'origin_attempt')::int AS origin_attempt,
           (s.data->>'origin_position')::bigint AS boundary, c.log_position AS cut
    FROM rollbook.episode_history s
    JOIN rollbook.checkpoints c ON c.checkpoint_id = s.data->>'restored_from'
    WHERE s.kind = 'attempt_started' AND s.rollout_id LIKE :p AND s.data->>'origin_attempt' IS NOT NULL
), lineage AS (
    SELECT rollout_id, attempt, origin_attempt AS ancestor, boundary, cut FROM origin
    UNION ALL
    SELECT l.rollout_id, l.attempt, o.origin_attempt, o.boundary, o.cut
    FROM lineage l JOIN origin o ON o.rollout_id = l.rollout_id AND o.attempt = l.ancestor
)
"""

# apps.demo.REPEATED_CALLS, over the whole ancestry instead of the direct origin only (after two
# restores, the origin's origin also completed turns the newest attempt must not generate again).
REPEATED_CALLS = RESTORED_LINEAGE + """
SELECT b.rollout_id, b.data->>'call_id' AS call_id, a.data->>'call_id' AS earlier
FROM rollbook.episode_history b
JOIN lineage l ON l.rollout_id = b.rollout_id AND l.attempt = b.attempt
JOIN rollbook.episode_history a ON a.rollout_id = l.rollout_id AND a.attempt = l.ancestor AND a.kind = 'call_completed'
  AND a.position <= l.{upto} AND split_part(a.data->>'call_id', '.t', 2) = split_part(b.data->>'call_id', '.t', 2)
WHERE b.kind = 'call_completed' AND coalesce(b.data->>'disposition', 'generated') = 'generated'
"""
# apps.demo.REPEATED_MUTATIONS, over the whole ancestry.
RESTORED_REPEATED_MUTATIONS = RESTORED_LINEAGE + """
SELECT b.rollout_id, b.attempt, (b.data->>'revision')::int AS revision
FROM rollbook.episode_history b
JOIN lineage l ON l.rollout_id = b.rollout_id AND l.attempt = b.attempt
JOIN rollbook.episode_history a ON a.rollout_id = l.rollout_id AND a.attempt = l.ancestor AND a.kind = 'mutation_applied'
  AND a.position <= l.boundary AND (a.data->>'revision') = (b.data->>'revision')
WHERE b.kind = 'mutation_applied'
"""


def tracebacks(folder: Path) -> list[str]:
    """Each server log in `folder` that holds a traceback, with the traceback."""
    return [f"{log.name}: {log.read_text()[log.read_text().index('Traceback'):][:1500]}"
            for log in sorted(folder.glob("*.log")) if "Traceback" in log.read_text()]

# Two owners of a model call at once: a call accepted again with no outcome (completed, cut, failed,
# lost) between. A call cut by a paused prepare is accepted again to continue it: one owner after another.
ACCEPTED_TWICE = """
SELECT stream FROM (SELECT stream, kind, lag(kind) OVER (PARTITION BY stream ORDER BY stream_version) AS before
                    FROM rollbook.events WHERE stream LIKE 'call:' || :p) s
WHERE kind = 'call_accepted' AND before = 'call_accepted'
"""
