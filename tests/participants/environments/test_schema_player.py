"""The scripted stand-in model's play of any server's tools, from their schemas alone
(participants/environments/players.py `SCHEMA`), on the tool schemas NeMo Gym 0.7.0's own example
rows offer (copied below from their `data/example.jsonl`) and on schemas hypothesis makes.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from participants.environments.players import SCHEMA, SCHEMA_CALLS, Answer, Call, Step
from participants.model.backends.scripted import players, scripted_reply

# example_multi_step's and math_advanced_calculations' tools, as their rows offer them (chat form).
SYNONYMS = [{"type": "function", "function": {"name": "get_synonym_value", "parameters": {
    "type": "object", "properties": {"synonym": {"type": "string"}}, "required": ["synonym"]}}},
            {"type": "function", "function": {"name": "extract_synonym_values", "parameters": {
                "type": "object", "properties": {"synonym_values": {"type": "array", "items": {"type": "integer"}}},
                "required": ["synonym_values"]}}}]
CALCULATOR = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
              for name in ("multiply", "divide", "add", "subtract")] + [
    {"type": "function", "function": {"name": "pi", "parameters": {"type": "object", "properties": {}}}}]


def test_each_offered_tool_is_called_once_with_arguments_from_its_schema_and_the_prompt_then_it_answers() -> None:
    prompt = "What is the value of the synonym 'Blazing' times 3?"
    first = SCHEMA.move(prompt, [], SYNONYMS, 0)
    assert first == Call("get_synonym_value", {"synonym": "Blazing"})
    second = SCHEMA.move(prompt, [Step("get_synonym_value", {"synonym": "Blazing"}, {"synonym_value": 711})], SYNONYMS, 0)
    assert second == Call("extract_synonym_values", {"synonym_values": [3]})
    done = SCHEMA.move(prompt, [Step("get_synonym_value", {}, 711), Step("extract_synonym_values", {}, {"ok": True})],
                       SYNONYMS, 0)
    assert done == Answer('{"ok": true}')


def test_it_stops_after_a_few_calls_and_says_what_a_refusal_said() -> None:
    history = [Step(f"t{i}", {}, {"v": i}) for i in range(SCHEMA_CALLS)]
    assert isinstance(SCHEMA.move("add 2 and 5", history, CALCULATOR, 0), Answer)
    assert SCHEMA.move("x", [Step("multiply", {}, {"error": "bad", "message": "no"})], CALCULATOR[:1], 0) == \
        Answer("I could not finish: no.")
    assert SCHEMA.move("add 2 and 5", [], CALCULATOR, 0) == Call("multiply", {"a": 2.0, "b": 2.0})


def test_it_plays_only_what_no_environments_own_player_recognises() -> None:
    """A request with Workplace's tools is the Workplace player's; one with tools nobody knows is
    SCHEMA's when it is registered (by a NeMo Gym server), and one with no tools is never its."""
    assert SCHEMA.recognizes({"get_synonym_value"}, "p") and not SCHEMA.recognizes(set(), "p")
    order = [p.priority for p in players()]
    assert order == sorted(order)
    reply = scripted_reply([{"role": "user", "content": "Send 'x' to Ann."}], [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in ("send_email", "update_deal")], 0)
    assert reply.get("tool_calls") is None or reply["tool_calls"][0]["function"]["name"] in ("send_email", "update_deal")


def schemas() -> st.SearchStrategy[Any]:
    leaf = st.one_of(st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "number"}),
                     st.just({"type": "boolean"}), st.just({"type": ["null", "string"]}),
                     st.lists(st.text(max_size=5), min_size=1, max_size=3).map(lambda e: {"enum": e}),
                     st.just({}), st.just("not a schema"))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda i: {"type": "array", "items": i}, inner),
        st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=4).map(
            lambda p: {"type": "object", "properties": p, "required": list(p)[:2]}),
        st.lists(inner, min_size=1, max_size=2).map(lambda o: {"anyOf": o})), max_leaves=12)


@given(parameters=schemas(), prompt=st.text(max_size=60))
def test_any_schema_gets_json_arguments_without_an_error(parameters: Any, prompt: str) -> None:
    """Input: any schema hypothesis builds (nested arrays, objects, enums, anyOf, a schema that is not an
    object), and any prompt: the call's arguments are a JSON object, and the same inputs give the same call."""
    tools = [{"type": "function", "function": {"name": "t", "parameters": parameters}}]
    move = SCHEMA.move(prompt, [], tools, 0)
    assert isinstance(move, Call) and isinstance(move.arguments, dict)
    json.dumps(move.arguments)
    assert SCHEMA.move(prompt, [], tools, 0) == move


SOKOBAN = ("You are a Sokoban-solving assistant. Reply with exactly one move each turn using one of <action>Up</action>, "
           "<action>Down</action>, <action>Left</action>, or <action>Right</action>.")  # grl_sokoban's example row


def test_instructions_that_show_a_tagged_reply_format_are_answered_in_it_turn_by_turn() -> None:
    """Input: grl_sokoban's system message (no tools), over three turns of its gymnasium agent; then a
    prompt that shows no tagged format, which gets the last resort's answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SOKOBAN}, {"role": "user", "content": "Solve it."}]
    moves = []
    for _ in range(3):
        reply = scripted_reply(messages, [], 1)
        moves.append(reply["content"])
        messages += [reply, {"role": "user", "content": "#__P#\n"}]
    assert moves == ["<action>Down</action>", "<action>Left</action>", "<action>Right</action>"]
    assert "<" not in scripted_reply([{"role": "user", "content": "Tell me a story."}], [], 1)["content"]


def test_a_tools_parameters_that_refer_to_their_definitions_get_arguments_of_them() -> None:
    """Input: parameters as pydantic writes them for a nested model (`$ref` into `$defs`)."""
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "required": ["room"], "properties": {"room": {"$ref": "#/$defs/Room"}},
        "$defs": {"Room": {"type": "object", "required": ["floor", "view"],
                           "properties": {"floor": {"type": "integer"}, "view": {"type": "boolean"}}}}}}}
    move = SCHEMA.move("Book a room on floor 3.", [], [tool], 0)
    assert move == Call("book", {"room": {"floor": 3, "view": False}})
