"""The catalog of events: every kind rollbook writes, its stream, its payload fields and its writer.

This module is the one place an event kind is spelt. Writers name a kind by its constant here,
readers compare against the same constants, and the store checks every append of a cataloged kind
against its entry (`check`: the stream family it must go to); `problems` holds a recorded event
to the whole entry (required fields, types, no field the catalog does not name), and the tests run
it over every event of real runs. `docs/events.md`,
the SQL user's reference, is generated from this list (`python docs/generate_events.py`), and a
test fails when the checked-in copy differs from what this module says.

Types are JSON types as a SQL user reads them out of `data` (`data->>'field'`): string, integer,
number, boolean, object, array; `|null` when a writer may store null.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import identity
from engine.errors import InvalidPayload
from engine.events import NewEvent, RecordedEvent


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    doc: str
    required: bool = False  # every writer sets it


@dataclass(frozen=True)
class Stream:
    """A family of streams, spelt by one function of engine.identity."""

    spell: Callable[..., str]
    params: tuple[str, ...]
    execution: bool  # its events carry rollout_id and attempt

    @property
    def pattern(self) -> str:
        return self.spell(*(f"<{p}>" for p in self.params))

    @property
    def prefix(self) -> str:
        return self.pattern.split("<", 1)[0]


ROLLOUT = Stream(identity.rollout_stream, ("rollout_id",), True)
EPISODE = Stream(identity.episode_stream, ("rollout_id", "attempt"), True)
AGENT = Stream(identity.agent_stream, ("rollout_id", "attempt"), True)
SESSION = Stream(identity.session_stream, ("rollout_id", "attempt"), True)
CALL = Stream(identity.call_stream, ("call_id",), True)
CAPTURE = Stream(identity.capture_stream, ("rollout_id", "attempt"), True)
CHECKPOINT = Stream(identity.checkpoint_stream, ("checkpoint_id",), False)
PARTICIPANT = Stream(identity.participant_stream, ("kind", "instance"), False)
INSTANCE = Stream(identity.instance_stream, ("kind", "instance"), False)
RESTORE = Stream(identity.restore_stream, ("checkpoint_id",), False)
POLICY = Stream(identity.policy_stream, (), False)


@dataclass(frozen=True)
class EventKind:
    name: str
    stream: Stream
    writer: str
    doc: str
    fields: tuple[Field, ...] = ()

    def goes_to(self, stream: str) -> bool:
        return stream == self.stream.pattern if not self.stream.params else stream.startswith(self.stream.prefix)

    def check(self, event: NewEvent) -> None:
        """Refuse an append of this kind to another stream family (a reader looks for it there only)."""
        if not self.goes_to(event.stream):
            raise InvalidPayload(f"a {self.name} event goes to a {self.stream.pattern} stream, not {event.stream!r}",
                                 kind=self.name, stream=event.stream)

    def problems(self, stream: str, data: dict[str, Any], has_execution: bool) -> list[str]:
        """Where a recorded event of this kind departs from its entry (empty: it conforms)."""
        out = [] if self.goes_to(stream) else [f"stream {stream!r} is not {self.stream.pattern}"]
        if has_execution != self.stream.execution:
            out.append("rollout_id/attempt " + ("missing" if self.stream.execution else "set on a non-execution stream"))
        declared = {f.name: f for f in self.fields}
        out += [f"missing required field {f.name}" for f in self.fields if f.required and f.name not in data]
        out += [f"field {k} is not in the catalog" for k in data if k not in declared]
        out += [f"field {k} is a {type(v).__name__}, not {declared[k].type}" for k, v in data.items()
                if k in declared and not json_type_matches(declared[k].type, v)]
        return out


CATALOG: dict[str, EventKind] = {}


def _kind(name: str, stream: Stream, writer: str, doc: str, *fields: Field) -> str:
    CATALOG[name] = EventKind(name, stream, writer, doc, fields)
    return name


def kinds_on(stream: Stream) -> tuple[str, ...]:
    """The cataloged kinds that go to the streams of `stream`'s family."""
    return tuple(name for name, kind in CATALOG.items() if kind.stream is stream)


def check(event: NewEvent) -> None:
    """Called by the store for every event it appends; a kind outside the catalog is not rollbook's
    own (a test's, a benchmark's) and the log stays a general log for it."""
    kind = CATALOG.get(event.kind)
    if kind is not None:
        kind.check(event)


def problems(event: RecordedEvent) -> list[str]:
    """Where a recorded event departs from the catalog (empty: it conforms)."""
    kind = CATALOG.get(event.kind)
    if kind is None:
        return [f"{event.kind} is not in the catalog"]
    return [f"{event.kind}: {p}" for p in kind.problems(event.stream, event.data, event.rollout_id is not None)]


def need(name: str, type: str, doc: str) -> Field:
    return Field(name, type, doc, required=True)


def may(name: str, type: str, doc: str) -> Field:
    return Field(name, type, doc)


_FORK = "a fork (engine/forks.py, appended by the environment server's control operation `fork`)"
_ENV = ("environment server (participants/environment/lifecycle.py, payloads from engine/episodes.py; NeMo Gym's "
        "episodes go through it from participants/environment/nemo_gym.py)")
_RESTORE = "restore (engine/install.py install_request, appended by the coordinator's restore)"
_RECOVERY = "recovery (engine/recovery.py, appended by the environment server or `rollbook run`)"
_TAKEOVER = "a caller's retry (engine/retry.py, appended by the environment server for its NeMo Gym episode front)"
_CAPTURE = "NeMo Gym token capture (adapters/nemo_gym_tokens.py)"
_CONTROL = "the control plane of every server (participants/base/control_plane.py)"
_COORDINATOR = "the coordinator (engine/coordinator.py: `rollbook run`, `rollbook checkpoint`, a framework)"

# ---- a rollout's stream: its attempts ----------------------------------------------------------

ATTEMPT_STARTED = _kind(
    "attempt_started", ROLLOUT,
    f"{_ENV}; {_RESTORE}; {_RECOVERY}; {_TAKEOVER}; {_CAPTURE}; {_FORK}",
    "An attempt of the rollout begins; its events may land from now on (engine/attempts.py).",
    may("parent_attempt", "integer|null", "the attempt it follows (null for attempt 0)"),
    may("restored_from", "string|null", "the checkpoint whose restore started it"),
    may("origin_attempt", "integer|null", "the attempt whose history it continues (null: a fresh dispatch)"),
    may("origin_position", "integer|null", "the log position of the boundary it continues from"),
    may("origin_rollout_id", "string", "a fork's origin rollout (absent: the origin attempt is of this rollout)"),
    may("seed", "integer", "a fork's own sampling seed, in place of its origin episode's"),
    may("disposition", "string", "continue, fresh_dispatch or fork"),
    may("recovered", "boolean", "true when recovery after a crash started it"),
    may("reason", "string", "why a caller's retry started it"),
    may("started_by", "string", "nemo_gym_token_capture for an attempt a trainer's capture opened"),
    may("capture_key", "string", "that capture's key (rollout-aN)"),
)
ATTEMPT_FENCED = _kind(
    "attempt_fenced", ROLLOUT, f"{_RESTORE}; {_RECOVERY}; {_TAKEOVER}; {_ENV} (a failed episode)",
    "The attempt ends: nothing of it lands after this event commits.",
    need("reason", "string", "restore, recovery, a caller's retry reason, or failed (its episode failed)"),
    may("checkpoint_id", "string", "the checkpoint being restored"),
    may("disposition", "string", "what the next attempt does: continue or fresh_dispatch"),
    may("code", "string", "failed: the error code that ended the episode (engine/errors.py)"),
    may("detail", "string", "failed: the error's detail (truncated)"),
    may("context", "object", "failed: the error's context (a NeMo Gym server's stage, status and body)"),
)
ATTEMPT_FINISHED = _kind(
    "attempt_finished", ROLLOUT, _ENV,
    "The attempt's episode closed; its result is the rollout's result. Atomic with the close step.",
    need("reward", "number|null", "the verified reward"),
)
ROLLOUT_RETIRED = _kind(
    "rollout_retired", ROLLOUT, f"{_CONTROL} (retire)",
    "Every attempt at or below the mark is retired and never enters a later cut; its attempt is the mark.",
    need("through", "integer", "the retire mark"),
)
ROLLOUT_FORGOTTEN = _kind(
    "rollout_forgotten", ROLLOUT, f"{_CONTROL} (forget)",
    "The retire mark is cleared, so the rollout may run again.",
)
ROLLOUT_RECOVERED = _kind(
    "rollout_recovered", ROLLOUT, _RECOVERY,
    "After a crash the attempt cannot go on as it is: how it is restarted, in one append with the fence and the next start.",
    need("attempt", "integer", "the attempt being restarted"),
    need("disposition", "string", "continue (from the boundary) or fresh_dispatch (from the input)"),
    may("boundary", "integer|null", "the log position of the boundary it continues from"),
    may("new_attempt", "boolean", "true: it goes on under attempt + 1"),
    need("reason", "string", "why (the lost call or session)"),
)

ROLLOUT_FORKED = _kind(
    "rollout_forked", ROLLOUT, _FORK,
    "A new rollout starts from a boundary of another rollout's attempt; in one append with its attempt 0's start.",
    need("origin_rollout_id", "string", "the rollout it was forked from"),
    need("origin_attempt", "integer", "the attempt of that rollout"),
    need("origin_position", "integer", "the log position of the boundary it starts from"),
    need("group", "string", "the fork group: every rollout forked by one request"),
    need("index", "integer", "its place in the group (0 to count - 1)"),
    need("count", "integer", "how many rollouts the request forked"),
    need("seed", "integer", "its own sampling seed"),
)

ROLLOUT_EXPORTED = _kind(
    "rollout_exported", ROLLOUT, "`rollbook export` (adapters/export.py, through engine/exports.py)",
    "The finished attempt's training record was written out; once per attempt. Retention may drop "
    "the attempt's events from now on (adapters/retention.py).",
    need("run_id", "string", "the run the export was of"), need("format", "string", "jsonl or parquet"),
)

# ---- an attempt's episode (environment server) -------------------------------------------------

_EPISODE_STATUS = may("status", "string", "running, finished or failed (episode_state.status)")
_EPISODE_OWNER = may("instance", "string", "the environment server instance that drives the episode (engine/ownership.py)")
EPISODE_STARTED = _kind(
    "episode_started", EPISODE, _ENV,
    "The attempt's episode starts from its input.",
    need("env", "string", "the environment"), need("task_id", "string", "the task"),
    may("task", "object", "the whole task: env, task_id, prompt, params"),
    may("seed", "integer", "the episode seed the agent and model get"), may("max_steps", "integer", "the agent's turn cap"),
    _EPISODE_STATUS, _EPISODE_OWNER,
    may("gym", "object", "NeMo Gym's episode id and task id, when its collector asked"),
)
EPISODE_CONTINUED = _kind(
    "episode_continued", EPISODE, _ENV,
    "The attempt's episode goes on from an earlier attempt's boundary (a restore, a recovery or a retry).",
    need("env", "string", "the environment"), need("task_id", "string", "the task"),
    may("origin_attempt", "integer", "the attempt whose steps it inherits"),
    may("next_step", "string|null", "the first step not yet recorded"),
    may("restored_from", "string", "the checkpoint restored"), may("recovered", "boolean", "true after a crash"),
    may("forked_from", "string", "a fork's origin rollout (its steps are the origin attempt's up to the boundary)"),
    _EPISODE_STATUS, _EPISODE_OWNER,
    may("gym", "object", "NeMo Gym's episode id and task id, when its collector asked"),
)
# The environment server's steps of an episode, in the order it runs them.
EPISODE_STEPS = ("seed", "agent", "verify", "close")
EPISODE_STEP = _kind(
    "episode_step", EPISODE, _ENV,
    "One step of the episode is done (seed, agent, verify, close): the environment server's boundary.",
    need("step", "string", "seed, agent, verify or close"), _EPISODE_STATUS,
    may("state_mode", "string", "seed: replayable or restart_only"),
    may("verification", "string", "seed: how the task is verified"),
    may("revision", "integer", "seed: the session's revision"), may("tools", "array", "seed: the tools offered"),
    may("activation", "integer", "agent: the activation index"), may("final_answer", "string|null", "agent: the answer"),
    may("turns", "integer", "agent: turns taken"), may("usage", "object", "agent: token usage"),
    may("reward", "number|null", "verify and close: the reward"),
)

# ---- an attempt's agent (agent server) ---------------------------------------------------------

_AGENT = "agent server (participants/agent/server.py)"
AGENT_BOUNDARY = _kind(
    "agent_boundary", AGENT, _AGENT,
    "The agent's whole state at a boundary: a restore or a restart continues from the latest one. The conversation "
    "is the whole list (`messages`) on the first boundary of the stream and of an activation; later boundaries hold "
    "what changed since the boundary before them in the stream (`messages_kept`, `messages_added`): the "
    "`episode_history` view and every reader rebuild the whole list (engine/boundaries.py).",
    need("turn", "integer", "turns taken"), may("messages", "array", "the conversation so far (whole list)"),
    may("messages_kept", "integer", "a delta: how many messages of the stream's previous boundary it keeps"),
    may("messages_added", "array", "a delta: the messages that follow them"),
    may("usage", "object", "token usage so far"), may("cookies", "object", "the agent's cookies"),
    may("last_call_id", "string|null", "the latest model call"),
    may("pending_call_id", "string|null", "a model call asked for and not yet answered"),
    may("replaces_call_id", "string|null", "the cut call the pending one replaces"),
    may("calls", "array", "the model calls its state depends on (a cut must hold their replies)"), may("revisions", "object", "session revisions seen per tool call"),
    may("revision_seen", "integer", "the latest session revision seen"),
    need("state", "string", "awaiting_model, awaiting_tool, finished ..."), need("activation", "integer", "the activation index"),
    may("done", "boolean", "the activation is over"), may("finished", "boolean", "the agent gave its final answer"),
    may("final_answer", "string|null", "the answer"), may("policy_version", "string|null", "the policy that answered last"),
    may("instance", "string", "the agent server instance that claimed the activation (engine/ownership.py): on its "
        "first boundary only"),
)
ACTIVATION_CLAIMED = _kind(
    "agent_activation_claimed", AGENT, _AGENT,
    "An agent server instance takes over an unfinished activation whose owner is gone (engine/ownership.py); it "
    "goes on from the activation's last boundary, which it does not record again.",
    need("index", "integer", "the activation index"), need("instance", "string", "the instance that took it over"),
)
ACTIVATION_COMPLETED = _kind(
    "agent_activation_completed", AGENT, _AGENT,
    "An activation of the agent is over; asking for it again returns this reply.",
    need("index", "integer", "the activation index"), need("reply", "object", "final_answer, usage, turns; the conversation is the agent boundary appended with it "
                                    "(engine.boundaries.completed_activations; events written before that hold messages)"),
)

# ---- an attempt's session (resources server) ---------------------------------------------------

_RESOURCES = "resources server (participants/resources/server.py)"
SESSION_OPENED = _kind(
    "session_opened", SESSION, _RESOURCES,
    "The environment's session for the attempt opens (fresh, or restored at a revision).",
    need("env", "string", "the environment"), need("task", "object", "the task"),
    may("state_mode", "string", "stateless, exported, replay, snapshot or restart_only"), may("revision", "integer", "the revision it opens at"),
    may("restored_from", "string", "the checkpoint restored"),
    may("origin_attempt", "integer|null", "the attempt it carries over"),
    may("recovered", "boolean", "true when reopened from the log after a restart"),
    may("instance", "string", "the resources server instance that holds the session (engine/ownership.py)"),
    may("live", "string", "a relayed server's live session it seeded (engine.tool_replay)"),
)
MUTATION_APPLIED = _kind(
    "mutation_applied", SESSION, _RESOURCES,
    "A tool call changed the session; asked again under the same key, the recorded answer is returned.",
    need("revision", "integer", "the session's revision after it"), need("tool", "string", "the tool"),
    may("arguments", "object", "its arguments"), may("effect", "object|null", "what changed, for replay"),
    may("output", "object|string|null", "what the tool answered"), may("done", "boolean", "the episode is over"),
    may("tool_call", "string|null", "the tool call's key: activation, turn, index"),
    may("live", "string", "the relayed server's live session that applied it"),
    may("unrestorable", "string", "why the live session's state after it is in no snapshot: its rollout restarts "
                                  "from its input rather than continue from a boundary after it"),
)
TOOL_CALL_DIVERGED = _kind(
    "tool_call_diverged", SESSION, _RESOURCES,
    "A tool call refused and not applied: an agent continued by replay asked, at a place whose change its "
    "lineage recorded, for another tool or other arguments (engine.agent_replay). Its rollout starts over.",
    need("tool_call", "string", "the place: a<activation>.s<n>"), need("tool", "string", "the tool asked for"),
    may("arguments", "object", "the arguments asked with"), need("reason", "string", "agent_divergence"),
    need("diverges_from", "object", "the recorded call at that place: its tool and arguments"),
)
SESSION_REPLAYED = _kind(
    "session_replayed", SESSION, _RESOURCES,
    "A relayed server's fresh live session was seeded and the session's recorded tool calls sent to it again, "
    "in order, each reply equal to the recorded one (engine.tool_replay).",
    need("live", "string", "the live session seeded"), need("revision", "integer", "the revision it reached"),
    need("tool_calls", "array", "the keys of the calls sent again, in order"),
    may("seconds", "number", "how long the seed and the replay took"),
)
SESSION_REPLAY_FAILED = _kind(
    "session_replay_failed", SESSION, _RESOURCES,
    "A relayed server's lost live session could not be rebuilt: a reply of the replay was not the recorded one "
    "(the server does not replay). The call that needed it is refused and the rollout starts over from its "
    "input; an agent of NeMo Gym's that called the server itself fails, and this says why.",
    need("reason", "string", "replay_divergence"), need("detail", "string", "which call replied what"),
)
SESSION_VERIFIED = _kind(
    "session_verified", SESSION, _RESOURCES,
    "The session's final state is verified.",
    need("reward", "number|null", "the reward"), need("status", "string", "the verification status"),
    need("revision", "integer", "the revision verified"), may("final_answer", "string|null", "the answer verified"),
)
SESSION_CLOSED = _kind(
    "session_closed", SESSION, _RESOURCES,
    "The session is closed; its resources are released.",
    may("status", "string", "the verification status, or unverified"), may("reason", "string", "verified or closed"),
    need("revision", "integer", "the final revision"),
)

# ---- a model call (model server, or a trainer's token capture) ---------------------------------

_MODEL = "model server (participants/model/server.py)"
CALL_ACCEPTED = _kind(
    "call_accepted", CALL, f"{_MODEL}; {_CAPTURE}",
    "The model server took custody of a call: it will end completed, cut, failed or linked.",
    need("call_id", "string", "the call"), may("parent_call_id", "string|null", "the call before it in the conversation"),
    may("policy_version", "string|null", "the policy generating it"), may("sampling", "object", "the sampling parameters"),
    may("stream", "boolean", "streamed to the client"), may("replaces", "string", "the cut call it replaces"),
    may("continues", "object", "the cut call whose tokens it continues: call_id, receipt"),
    may("model_call_id", "string", "captured: the trainer's id"), may("source", "string", "captured: nemo_gym"),
    may("request_digest", "string", "sha256 of the request but its presentation options: the same call id "
        "with another request is a conflict"),
    may("instance", "string", "the model server instance that owns the call (engine/ownership.py)"),
)
CALL_COMPLETED = _kind(
    "call_completed", CALL, f"{_MODEL}; {_CAPTURE}",
    "The call's reply is recorded: asked again, this reply is returned and nothing is generated.",
    need("call_id", "string", "the call"), may("disposition", "string", "generated, linked or captured"),
    may("reply", "object", "the assistant message"), may("finish_reason", "string", "stop, length, tool_calls"),
    may("receipt", "object", "token-store receipt of the generated ids and logprobs"),
    may("prompt_receipt", "object", "token-store receipt of the prompt ids"), may("tokens", "integer", "tokens generated"),
    may("usage", "object", "OpenAI usage"), may("upstream_usage", "object|null", "the upstream's own usage"),
    may("segments", "array", "tokens per policy version"), may("policy_version", "string|null", "the policy"),
    may("replaces", "string", "the cut call it replaces"), may("continuation", "object", "continued or regenerated, and why"),
    may("prefix_tokens", "integer", "tokens carried over from the cut"), may("parent_call_id", "string", "captured: its parent"),
    may("model_call_id", "string", "captured: the trainer's id"), may("entry_digest", "string", "captured: its digest"),
    may("source", "string", "captured: nemo_gym"),
)
CALL_CUT = _kind(
    "call_cut", CALL, _MODEL,
    "A checkpoint cut the call at a token boundary; its replacement continues from these tokens.",
    need("call_id", "string", "the call"), may("tokens", "integer", "tokens generated before the cut"),
    may("partial", "object", "the partial message"), may("receipt", "object", "token-store receipt"),
    may("prompt_receipt", "object", "token-store receipt of the prompt"), may("segments", "array", "tokens per policy version"),
    may("policy_version", "string|null", "the policy"),
    may("unsaved", "integer", "tokens generated after the durable prefix the cut kept: generated again"),
)
CALL_FAILED = _kind(
    "call_failed", CALL, f"{_MODEL}; {_CAPTURE}",
    "The call ended without a reply (generation failed, or it was lost with a model server).",
    need("call_id", "string", "the call"), need("error", "object", "code and detail"),
    may("tokens", "integer", "tokens generated before it failed"),
    may("model_call_id", "string", "captured: the trainer's id"), may("source", "string", "captured: nemo_gym"),
)
CALL_EXCLUDED = _kind(
    "call_excluded", CALL, _MODEL,
    "A call refused, recorded, not generated: it arrived while a checkpoint held admission closed, or an "
    "agent continued by replay asked for another call than the one its lineage recorded at that place.",
    need("call_id", "string", "the call"), may("parent_call_id", "string|null", "its parent"),
    need("reason", "string", "admission_closed or agent_divergence"),
    may("diverges_from", "string", "agent_divergence: the recorded call it differs from"),
)
CUSTODY_KINDS = (CALL_ACCEPTED, CALL_COMPLETED, CALL_CUT, CALL_FAILED, CALL_EXCLUDED)

POLICY_VERSION_CHANGED = _kind(
    "policy_version_changed", POLICY, _MODEL,
    "The deployment's policy version changed (config at start, or a weight sync); calls after it are stamped with it.",
    need("policy_version", "string", "the new version"), may("previous", "string|null", "the version before"),
    need("source", "string", "config or weight_sync"), may("instance", "string", "the model server that recorded it"),
)

# ---- a trainer's token capture (NeMo Gym) -----------------------------------------------------

CAPTURE_CALL_BEGUN = _kind(
    "capture_call_begun", CAPTURE, _CAPTURE, "A captured call began (begin_call).",
    need("model_call_id", "string", "the trainer's id"), need("call_id", "string", "rollbook's call id"),
)
CAPTURE_ENTRY_PUT = _kind(
    "capture_entry_put", CAPTURE, _CAPTURE, "A captured call's token entry was put.",
    need("model_call_id", "string", "the trainer's id"), need("call_id", "string", "rollbook's call id"),
    need("entry_digest", "string", "digest of the whole entry"), may("entry", "object", "the entry less its token arrays"),
    may("receipt", "object", "token-store receipt"), may("prompt_receipt", "object", "token-store receipt of the prompt"),
)
CAPTURE_INCOMPLETE = _kind(
    "capture_incomplete", CAPTURE, _CAPTURE, "The capture misses a call: its snapshot is incomplete.",
    may("model_call_id", "string", "the call missed (empty: unknown)"), may("reason", "string", "capture_failed"),
)
CAPTURE_FROZEN = _kind(
    "capture_frozen", CAPTURE, _CAPTURE, "A trainer froze the capture: the snapshot is the stream cut here.",
    need("entries", "integer", "entries in the snapshot"), need("digest", "string", "digest of the entries"),
)
CAPTURE_RETIRED = _kind(
    "capture_retired", CAPTURE, _CAPTURE, "The trainer consumed the snapshot; the evidence stays.",
    need("snapshot_id", "string", "the snapshot"), need("version", "integer", "the stream version it was taken at"),
)
CAPTURE_KINDS = (CAPTURE_CALL_BEGUN, CAPTURE_ENTRY_PUT, CAPTURE_INCOMPLETE, CAPTURE_FROZEN, CAPTURE_RETIRED)

# ---- checkpoints (the coordinator) and each participant's phase (control planes) ---------------

_CK = need("checkpoint_id", "string", "the checkpoint")
CHECKPOINT_STARTED = _kind("checkpoint_started", CHECKPOINT, _COORDINATOR, "A checkpoint begins.",
                           _CK, may("deadline", "number", "seconds since the epoch"),
                           may("span_s", "number", "the deadline's distance from the start, on the coordinator's clock: "
                               "judged from `recorded_at` on the database's"),
                           may("mode", "string", "`online` for a checkpoint that pauses no one; absent: paused"))
CHECKPOINT_PREPARED = _kind("checkpoint_prepared", CHECKPOINT, _COORDINATOR, "Every participant is prepared.",
                            _CK, may("restarts", "array", "[rollout_id, attempt] pairs that restart from their input"))
CHECKPOINT_COMMITTED = _kind(
    "checkpoint_committed", CHECKPOINT, _COORDINATOR,
    "The cut is durable: written only after every participant accepted the commit.",
    _CK, need("position", "integer", "the cut's log position P"), need("scope", "array", "each continued attempt and its boundary"),
    need("digest", "string", "covers the lists and every scoped stream's chain head at P"),
    may("fresh_dispatch", "array", "attempts restarting from input"),
    may("run", "string|null", "the framework's run, whose rollouts are `<run>-<n>`; null: every rollout in the database"),
)
CHECKPOINT_PUBLISHED = _kind("checkpoint_published", CHECKPOINT, _COORDINATOR,
                             "The framework published the checkpoint with its own state; it can be restored.",
                             _CK, may("framework_ref", "object|string|null", "the framework's own state"),
                             may("token_snapshot_ref", "object|string|null", "the token snapshot"))
CHECKPOINT_ABORTED = _kind("checkpoint_aborted", CHECKPOINT, f"{_COORDINATOR}; a server whose lease ran out",
                           "The checkpoint was abandoned; it can never be restored.", _CK, may("reason", "string", "why"))
RESTORE_INSTALLED = _kind(
    "restore_installed", RESTORE, _RESTORE, "A restore was installed (in one append with every fence and start).",
    _CK, need("continued", "integer", "attempts continued"), need("fresh_dispatch", "integer", "attempts restarted from input"),
    may("left_retired", "array", "rollouts of the cut retired since it was taken: left retired, nothing installed"),
)

_PHASE = (_CK, need("from", "string", "the participant's phase before"), need("to", "string", "its phase after"))
PARTICIPANT_PREPARE = _kind("participant_prepare", PARTICIPANT, _CONTROL, "The participant starts preparing.",
                            *_PHASE, may("deadline", "number", "seconds since the epoch, on the participant's clock"))
PARTICIPANT_PREPARED = _kind("participant_prepared", PARTICIPANT, _CONTROL, "The participant is prepared.",
                             *_PHASE, may("counts", "object", "what it holds"), may("restarts", "integer", "restart-only attempts"))
PARTICIPANT_COMMIT = _kind("participant_commit", PARTICIPANT, _CONTROL, "The participant accepted the commit.",
                           *_PHASE, may("scope", "integer", "attempts in the cut"))
PARTICIPANT_RESTORE = _kind("participant_restore", PARTICIPANT, _CONTROL, "The participant installed a restore.", *_PHASE)
PARTICIPANT_RESUME = _kind("participant_resume", PARTICIPANT, _CONTROL, "The participant resumed work.", *_PHASE)
PARTICIPANT_ABORT = _kind("participant_abort", PARTICIPANT, _CONTROL, "The participant abandoned the checkpoint.",
                          *_PHASE, may("reason", "string", "why (a lease that ran out)"))


# ---- server instances (engine/membership.py) ------------------------------------------------------

_INSTANCE_WRITER = "every server process (adapters/membership.py, started by `rollbook serve`)"
INSTANCE_STARTED = _kind(
    "instance_started", INSTANCE, _INSTANCE_WRITER,
    "A server process is listening and joins the deployment; its lease starts now.",
    need("kind", "string", "environment, agent, model or resources"), need("instance", "string", "its instance id"),
    need("address", "string", "the base URL the others reach it at"), need("workers", "integer", "worker processes"),
    need("lease_s", "number", "seconds its membership lasts without a renewal"),
    may("front", "string", "a worker's public address: the front that routes to it (apps/workers.py)"),
    may("parent", "string", "a worker's parent: the process that serves `front` and started it"),
    may("worker", "integer", "a worker's index among its parent's workers"),
)
INSTANCE_RENEWED = _kind("instance_renewed", INSTANCE, _INSTANCE_WRITER,
                         "The instance is alive: its lease runs lease_s from this event's recorded_at.")
INSTANCE_STOPPED = _kind("instance_stopped", INSTANCE, _INSTANCE_WRITER,
                         "The instance shut down cleanly, or its parent saw the worker process end; its work is "
                         "taken over at once, as a dead one's.",
                         may("reason", "string", "why"))
INSTANCE_KINDS = (INSTANCE_STARTED, INSTANCE_RENEWED, INSTANCE_STOPPED)


def checkpoint_phase_kind(phase: str) -> str:
    """The kind a checkpoint's move into `phase` is recorded as (engine/phases.py)."""
    return _cataloged(f"checkpoint_{phase}")


def participant_phase_kind(trigger: str) -> str:
    """The kind a participant's `trigger` is recorded as (engine/phases.py)."""
    return _cataloged(f"participant_{trigger}")


def _cataloged(name: str) -> str:
    if name not in CATALOG:
        raise KeyError(f"{name} is not in the event catalog")
    return name


def reference() -> str:
    """docs/events.md: every kind, its stream, its writer and its payload fields."""
    out = [
        "# Events",
        "",
        "Every kind of event rollbook writes to `rollbook.events` (and so to the `episode_history` view),",
        "generated from `engine/catalog.py` by `python docs/generate_events.py`; do not edit by hand.",
        "Payload fields are read with `data->>'field'`; *required* fields are on every event of the kind.",
        "Events of a stream marked *execution* carry the `rollout_id` and `attempt` columns.",
        "",
        "| kind | stream | written by |",
        "|:--|:--|:--|",
    ]
    for k in CATALOG.values():
        writers = ", ".join(dict.fromkeys(w.split(" (")[0] for w in k.writer.split("; ")))
        out.append(f"| [`{k.name}`](#{k.name}) | `{k.stream.pattern}` | {writers} |")
    for k in CATALOG.values():
        out += ["", f"## {k.name}", "", k.doc, "",
                f"- stream: `{k.stream.pattern}`{' (execution)' if k.stream.execution else ''}",
                f"- written by: {k.writer}", ""]
        if k.fields:
            out += ["| field | type | required | meaning |", "|:--|:--|:--|:--|"]
            out += [f"| `{f.name}` | {f.type.replace('|', ' or ')} | {'yes' if f.required else ''} | {f.doc} |"
                    for f in k.fields]
        else:
            out.append("No payload fields.")
    return "\n".join(out) + "\n"


def json_type_matches(declared: str, value: Any) -> bool:
    """Whether a stored value has one of the declared JSON types (the catalog's tests use it)."""
    names: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    for t in declared.split("|"):
        if t == "null" and value is None:
            return True
        if t in names and isinstance(value, names[t]) and not (t in ("integer", "number") and isinstance(value, bool)):
            return True
    return False
