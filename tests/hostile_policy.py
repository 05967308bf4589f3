"""A policy that attacks: the model under training as the adversary it is in RL.

`HostileBackend` answers like the scripted policy (participants/model/backends/scripted.py) except for a task
whose prompt is `hostile_task(...)`: its replies are the scripted attack, one assistant message per
turn, then a final answer. Everything else on the wire (token ids, logprobs, custody records) is the
scripted backend's, so the attack reaches the agent exactly as a real model's reply would.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from participants.environments.base import Task
from participants.model.backends.scripted import ScriptedBackend

MARK = "HOSTILE "


def hostile_task(base: Task, replies: list[dict[str, Any]]) -> Task:
    """`base` (its environment and tools) played by a model whose turns are `replies`."""
    return replace(base, task_id=f"{base.task_id}-hostile", prompt=MARK + json.dumps(replies))


def tool_call(name: Any, arguments: Any, call_id: str = "call_attack") -> dict[str, Any]:
    """An assistant turn with one tool call; `name` and `arguments` are sent as they are, hostile or not."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


class HostileBackend(ScriptedBackend):
    def reply(self, request: dict[str, Any]) -> dict[str, Any]:
        messages = list(request.get("messages") or [])
        prompt = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
        if not prompt.startswith(MARK):
            return super().reply(request)
        script = json.loads(prompt.removeprefix(MARK))
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        return dict(script[turn]) if turn < len(script) else {"role": "assistant", "content": "done"}
