"""engine.catalog's rules on their own: which stream family each kind goes to, what `problems` finds
in a recorded event, and the JSON types a SQL user reads."""

from __future__ import annotations

import pytest

from engine import catalog as ev
from engine.errors import InvalidPayload
from engine.events import GENESIS_HASH, NewEvent, RecordedEvent
from engine.identity import checkpoint_stream, episode_stream, policy_stream, rollout_stream


def test_a_stream_family_is_spelt_by_its_function_with_its_parameters_named() -> None:
    assert (ev.EPISODE.pattern, ev.EPISODE.prefix) == ("episode:<rollout_id>:<attempt>", "episode:")
    assert (ev.CHECKPOINT.pattern, ev.CHECKPOINT.prefix) == ("checkpoint:<checkpoint_id>", "checkpoint:")
    assert (ev.POLICY.pattern, ev.POLICY.prefix) == ("policy", "policy")


def test_a_kind_goes_to_its_family_only() -> None:
    step = ev.CATALOG[ev.EPISODE_STEP]
    assert step.goes_to(episode_stream("r", 0)) and not step.goes_to(rollout_stream("r"))
    policy = ev.CATALOG[ev.POLICY_VERSION_CHANGED]
    assert policy.goes_to(policy_stream())
    assert not policy.goes_to("policy:x") and not policy.goes_to("other")


def test_an_append_of_a_kind_to_another_family_is_refused_and_a_foreign_kind_is_not_checked() -> None:
    ev.check(NewEvent(episode_stream("r", 0), ev.EPISODE_STEP, {}, "r", 0))
    with pytest.raises(InvalidPayload, match="a episode_step event goes to a episode:<rollout_id>:<attempt> stream, not 'x'") as refused:
        ev.check(NewEvent("x", ev.EPISODE_STEP, {}, "r", 0))
    assert refused.value.context == {"kind": ev.EPISODE_STEP, "stream": "x"}
    ev.check(NewEvent("x", "not_ours", {}))


def rec(stream: str, kind: str, data: dict[str, object], rollout: str | None = "r") -> RecordedEvent:
    return RecordedEvent(1, stream, 1, kind, data, rollout, 0 if rollout else None, 1, "t", GENESIS_HASH)


def test_a_conforming_event_has_no_problems() -> None:
    started = rec(checkpoint_stream("k"), ev.CHECKPOINT_STARTED, {"checkpoint_id": "k", "deadline": 1.5}, rollout=None)
    assert ev.problems(started) == []


def test_problems_names_each_departure_from_the_catalog() -> None:
    assert ev.problems(rec("x", "not_ours", {})) == ["not_ours is not in the catalog"]
    bad = rec(rollout_stream("k"), ev.CHECKPOINT_STARTED, {"deadline": "soon", "extra": 1})
    assert ev.problems(bad) == [
        "checkpoint_started: stream 'rollout:k' is not checkpoint:<checkpoint_id>",
        "checkpoint_started: rollout_id/attempt set on a non-execution stream",
        "checkpoint_started: missing required field checkpoint_id",
        "checkpoint_started: field extra is not in the catalog",
        "checkpoint_started: field deadline is a str, not number",
    ]
    missing = rec(episode_stream("r", 0), ev.EPISODE_STEP, {}, rollout=None)
    assert "episode_step: rollout_id/attempt missing" in ev.problems(missing)


@pytest.mark.parametrize("declared, value, matches", [
    ("string", "a", True), ("string", 1, False), ("integer", 1, True), ("integer", True, False),
    ("integer", 1.5, False), ("number", 1.5, True), ("number", 2, True), ("number", False, False),
    ("boolean", True, True), ("object", {}, True), ("array", [], True), ("array", {}, False),
    ("string|null", None, True), ("string", None, False), ("integer|string", "x", True), ("unknown", "x", False),
])
def test_json_types_as_a_sql_user_reads_them(declared: str, value: object, matches: bool) -> None:
    assert ev.json_type_matches(declared, value) is matches


def test_the_phase_kinds_are_cataloged_and_nothing_else_passes() -> None:
    assert ev.checkpoint_phase_kind("committed") == ev.CHECKPOINT_COMMITTED
    assert ev.participant_phase_kind("prepare") == ev.PARTICIPANT_PREPARE
    with pytest.raises(KeyError, match="checkpoint_nowhere is not in the event catalog"):
        ev.checkpoint_phase_kind("nowhere")


def test_the_reference_lists_every_kind_with_its_stream_writer_and_fields() -> None:
    text = ev.reference()
    assert text.startswith("# Events\n") and text.endswith("\n")
    assert f"| [`{ev.EPISODE_STEP}`](#{ev.EPISODE_STEP}) | `episode:<rollout_id>:<attempt>` |" in text
    assert "- stream: `episode:<rollout_id>:<attempt>` (execution)" in text
    assert "- stream: `checkpoint:<checkpoint_id>`\n" in text
    assert "| `checkpoint_id` | string | yes |" in text
    assert "No payload fields." in text  # a kind without fields says so
