"""rollbook's Responses-to-chat conversion against NeMo Gym 0.7.0's own, on requests hypothesis makes.

`/v1/responses` and the relay's rows turn a Responses request into chat messages with
`adapters.openai_wire`; NeMo Gym's vllm_model does it with `nemo_gym.responses_converter`. Both must
hand a vLLM the same conversation. Each example is a batch of requests (instructions, string or item
input: system, developer, user and assistant messages with text parts, images in user messages,
reasoning items, function calls and their outputs, function tools, tool choices, output limits,
reasoning effort and summary),
each one NeMo Gym's request model admits; NeMo Gym's converter runs on the batch in its own Python
(3.13, the cached NeMo Gym environment), ours here. Where NeMo Gym keeps a message's text parts as a
list, vLLM joins them with a newline for a chat template that takes text, so the comparison does
too; a message with an image keeps its parts on both sides. A request one side refuses, the other
must refuse.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from adapters.openai_wire import ResponsesRequest
from engine.errors import UnsupportedParameter
from testkit.nemo_gym_collector import gym_venv

CONVERT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming as Params
from nemo_gym.responses_converter import ResponsesConverter
converter = ResponsesConverter(return_token_id_information=False, uses_reasoning_parser=False)
out = []
for request in json.load(sys.stdin):
    try:
        chat = converter.responses_to_chat_completion_create_params(Params.model_validate(request))
        out.append({"chat": chat.model_dump(mode="json", exclude_none=True)})
    except Exception as exc:
        out.append({"refused": type(exc).__name__ + ": " + str(exc)[:200]})
print(json.dumps(out))
"""

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
parts = st.lists(st.builds(lambda t, k: {"type": k, "text": t}, text, st.just("input_text")), min_size=1, max_size=3)
image = st.builds(lambda u, d: {"type": "input_image", "image_url": u, "detail": d},  # NeMo Gym requires a detail
                  st.sampled_from(["data:image/png;base64,AAAA", "https://example.invalid/a.png"]),
                  st.sampled_from(["auto", "low", "high"]))
with_images = st.lists(st.one_of(parts.map(lambda p: p[0]), image), min_size=1, max_size=3)
call_ids = st.sampled_from(["c1", "c2", "call_x"])
names = st.sampled_from(["add", "look", "send_email"])
items = st.one_of(
    st.builds(lambda r, c: {"type": "message", "role": r, "content": c}, st.sampled_from(["system", "developer", "user"]),
              st.one_of(text, parts)),
    st.builds(lambda c: {"role": "user", "content": c}, st.one_of(text, parts, with_images)),
    st.builds(lambda ts: {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": t} for t in ts]},
              st.lists(text, max_size=2)),
    st.builds(lambda t: {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                         "content": [{"type": "output_text", "text": t, "annotations": []}]}, text),
    st.builds(lambda i, n, a: {"type": "function_call", "call_id": i, "name": n, "arguments": a}, call_ids, names,
              st.sampled_from(["{}", '{"a": 2}'])),
    st.builds(lambda i, o: {"type": "function_call_output", "call_id": i, "output": o}, call_ids, text),
)
tools = st.lists(st.builds(lambda n, strict: {"type": "function", "name": n, "strict": strict,
                                             "parameters": {"type": "object", "properties": {}}}, names, st.booleans()),
                 max_size=2, unique_by=lambda t: t["name"])
requests = st.fixed_dictionaries({"input": st.one_of(text.filter(bool), st.lists(items, min_size=1, max_size=6))},
                                 optional={"instructions": text.filter(bool), "tools": tools,
                                           "tool_choice": st.sampled_from(["auto", "none", "required"]),
                                           "max_output_tokens": st.integers(1, 64),
                                           "reasoning": st.fixed_dictionaries(
                                               {"effort": st.sampled_from([None, "low", "high"])},
                                               optional={"summary": st.sampled_from([None, "auto"])})})


def nemo_gym_converts(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run([str(gym_venv() / "bin" / "python"), "-c", CONVERT], input=json.dumps(batch),
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def as_vllm_reads(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list) and all(p.get("type") == "text" for p in content):
        message = {**message, "content": "\n".join(p["text"] for p in content)}
    return {k: v for k, v in message.items() if v is not None}


def ours(request: dict[str, Any]) -> dict[str, Any]:
    try:
        chat = ResponsesRequest.model_validate(request).chat_request().backend_request()
    except UnsupportedParameter as exc:
        return {"refused": exc.detail}
    return {"chat": chat}


@pytest.mark.timeout(600)
# No shrinking: each step runs NeMo Gym's Python again; a failure names the request it failed on.
@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(requests, min_size=40, max_size=40))
def test_a_vllm_gets_the_conversation_nemo_gym_would_give_it(batch: list[dict[str, Any]]) -> None:
    for request, theirs in zip(batch, nemo_gym_converts(batch), strict=True):
        mine = ours(request)
        assert ("refused" in mine) == ("refused" in theirs), (request, mine, theirs)
        if "chat" not in mine:
            continue
        got, want = mine["chat"], theirs["chat"]
        assert [as_vllm_reads(m) for m in got["messages"]] == [as_vllm_reads(m) for m in want["messages"]], request
        assert got.get("tools") == want.get("tools") and got.get("max_tokens") == want.get("max_tokens"), request
        assert got.get("tool_choice") == want.get("tool_choice"), request
        assert got.get("reasoning_effort") == want.get("reasoning_effort"), request
