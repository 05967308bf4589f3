"""`extension`: what a reply parsed whole by the upstream adds to the partial reply the client was
already streamed. Searched over replies and cut points: the partial plus the extension is the whole
reply, and a whole reply that does not start with the partial is refused, never spliced."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from adapters.openai_wire import merge_delta
from participants.model.backends.openai_compatible import extension

TEXT = st.text(max_size=12)
CALL = st.builds(lambda i, n, a: {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}},
                 st.integers(0, 99), st.text(min_size=1, max_size=8), TEXT)


def streamed(full: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """A partial message a stream of `full` may have reached: its content, the calls before the one
    being streamed whole, and that one cut inside its name or arguments."""
    partial: dict[str, Any] = {}
    calls = full.get("tool_calls") or []
    if not calls:
        content = full["content"] or ""
        merge_delta(partial, {"content": content[: data.draw(st.integers(0, len(content)))]})
        return partial
    merge_delta(partial, {"content": full["content"]})
    upto = data.draw(st.integers(0, len(calls) - 1))
    for i, call in enumerate(calls[: upto + 1]):
        name, args = call["function"]["name"], call["function"]["arguments"]
        if i == upto:
            cut = data.draw(st.integers(1, len(name) + len(args)))
            name, args = name[:cut], args[: max(0, cut - len(name))]
        merge_delta(partial, {"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                              "function": {"name": name, "arguments": args}}]})
    return partial


@given(st.fixed_dictionaries({"content": TEXT, "tool_calls": st.lists(CALL, max_size=3)}), st.data())
def test_the_partial_reply_and_its_extension_are_the_whole_reply(full: dict[str, Any], data: st.DataObject) -> None:
    partial = streamed(full, data)
    delta = extension(partial, full)
    assert delta is not None
    merged = copy.deepcopy(partial)
    merge_delta(merged, delta)
    assert (merged.get("content") or "") == full["content"]
    assert merged.get("tool_calls", []) == full["tool_calls"]


@given(TEXT, TEXT.filter(bool), st.data())
def test_a_whole_reply_that_does_not_start_with_the_partial_one_is_refused(head: str, extra: str, data: st.DataObject) -> None:
    """Input: a parsed reply whose content or tool-call arguments differ from what was streamed."""
    partial = {"content": head + extra}
    assert extension(partial, {"content": head}) is None
    streamed_call = {"id": "c", "type": "function", "function": {"name": "stand", "arguments": head + extra}}
    other = data.draw(TEXT.filter(lambda t: not t.startswith(head + extra)))
    whole = {"content": "", "tool_calls": [{**streamed_call, "function": {"name": "stand", "arguments": other}}]}
    assert extension({"tool_calls": [streamed_call]}, whole) is None
    assert extension({"tool_calls": [streamed_call, streamed_call]}, {"tool_calls": [streamed_call]}) is None
