"""An agent session's opening, from its task (participants/agent/session.py)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from participants.agent.session import RunRequest, fresh_session
from participants.environments import ENVIRONMENTS, Task
from participants.environments.nemo_gym_relay import GymServer, register


def test_a_row_the_chat_form_cannot_hold_is_the_callers_bad_input_with_its_code_not_an_internal_error() -> None:
    """Input: a NeMo Gym row whose user message holds a file part (a chat message holds no file)."""
    register([GymServer("gym_pictures", "resources_servers.image_tools.app", "replay")])
    try:
        _refused_as_bad_input()
    finally:
        ENVIRONMENTS.pop("gym_pictures")  # the registry is the process's: other tests read every environment in it


def _refused_as_bad_input() -> None:
    row = {"responses_create_params": {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in it?"},
                                     {"type": "input_file", "file_id": "file-1"}]}]}}
    req = RunRequest(task=Task("gym_pictures", "0", "What is in it?", {"row": row}).to_json(), seed=1)
    with pytest.raises(InvalidRequest) as refused:
        fresh_session(("pictures", 0), 0, req)
    assert refused.value.status == 400 and refused.value.context["task_error"] == "bad_row"
    assert "input_file" in refused.value.detail and "task 0 of gym_pictures" in refused.value.detail
