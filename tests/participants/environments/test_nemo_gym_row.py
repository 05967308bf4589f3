"""A NeMo Gym row as NeMo Gym's own agent puts it to the model: messages apart, sampling kept."""

from __future__ import annotations

import pytest

from participants.environments import ToolError
from participants.environments.nemo_gym_row import row_messages, row_sampling


def row(**params: object) -> dict[str, object]:
    return {"responses_create_params": params}


def test_the_input_becomes_the_chat_messages_vllm_model_would_send() -> None:
    """Input: instructions, a developer, a system, a user (text parts) and an assistant message, with a
    function call and its output among them. The instructions and the leading system and developer
    messages become one system message, as NeMo Gym's converter makes them (a chat template takes one);
    the call and its output an assistant tool call and a tool message; text parts joined as vLLM joins them."""
    r = row(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use the tools."},
        {"type": "message", "role": "system", "content": "Today is Thursday."},
        {"role": "user", "content": [{"type": "input_text", "text": "Reply to Carlos"}, {"type": "input_text", "text": "now"}]},
        {"type": "function_call", "name": "email_search_emails", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "[]"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ])
    assert row_messages(r) == [
        {"role": "system", "content": "Be brief.\n\nUse the tools.\n\nToday is Thursday."},
        {"role": "user", "content": "Reply to Carlos\nnow"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "email_search_emails", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "[]"},
        {"role": "assistant", "content": "Done."}]
    assert row_messages(row(input="What is 2 + 3?")) == [{"role": "user", "content": "What is 2 + 3?"}]


def test_a_part_no_chat_message_holds_is_refused_naming_it() -> None:
    """Input: a user message holding a file part (a chat message has no file part)."""
    r = row(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}])
    with pytest.raises(ToolError, match=r"input\[0\].*'input_file'"):
        row_messages(r)


def test_a_row_with_no_input_is_refused_saying_its_agent_writes_the_prompt() -> None:
    """Input: scicode's row shape, `responses_create_params.input` an empty list."""
    with pytest.raises(ToolError, match="input is empty") as refused:
        row_messages(row(input=[]))
    assert refused.value.code == "bad_row"


def test_an_image_row_and_its_reasoning_reach_the_model_as_nemo_gym_sends_them() -> None:
    """Input: circle_click's shape (a user message with text and an image) after a reasoning item and
    an answer: the image stays a chat image part beside its text, the reasoning opens the assistant
    turn in think tags."""
    r = row(input=[{"role": "system", "content": "Click the circle."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Where is it?"},
                                                {"type": "input_image", "image_url": "data:image/png;base64,AA",
                                                 "detail": "high"}]},
                   {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "left side"}]},
                   {"role": "assistant", "content": "(3, 4)"},
                   {"role": "user", "content": "Again."}])
    assert row_messages(r) == [
        {"role": "system", "content": "Click the circle."},
        {"role": "user", "content": [{"type": "text", "text": "Where is it?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                         "detail": "high"}}]},
        {"role": "assistant", "content": "<think>left side</think>(3, 4)"},
        {"role": "user", "content": "Again."}]


def test_sampling_parameters_take_their_chat_names() -> None:
    """Input: every sampling field a Responses request may carry, a forced function and unset ones."""
    assert row_sampling(row(temperature=0.7, top_p=0.9, max_output_tokens=256, parallel_tool_calls=False,
                            tool_choice={"type": "function", "name": "email_reply_email"}, metadata={"a": 1})) == {
        "temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "email_reply_email"}}}
    assert row_sampling(row(tool_choice="required", temperature=None)) == {"tool_choice": "required"}
