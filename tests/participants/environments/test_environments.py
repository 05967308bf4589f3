"""The bundled environments and the scripted policy, pure Python (no database, no HTTP)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from gymnasium.envs.toy_text import blackjack as gym_blackjack
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.scripted_tokenizer import scripted_tokens
from participants.environments import ENVIRONMENTS, Environment, Task, ToolError, get_environment
from participants.environments.base import Trajectory, canonical, roundtrip
from participants.environments.blackjack import export_rng, import_rng, restore_env
from participants.environments.sandbox import SandboxEnvironment, SandboxLimits
from participants.environments.tasks import make_tasks
from participants.model.backends.scripted import scripted_reply

REPLAYABLE = sorted(n for n, cls in ENVIRONMENTS.items() if cls.state_mode in ("stateless", "exported"))
TASKS_PER_ENV = {"workplace": 20, "blackjack": 20, "math": 4, "string_match": 4}


@dataclass
class Run:
    messages: list[dict]
    outputs: list = field(default_factory=list)  # one per tool call, in order
    effects: list = field(default_factory=list)  # one per tool call; None for read-only calls
    boundaries: list[int] = field(default_factory=list)  # len(messages) after each tool result
    state: object = None
    final: str | None = None
    reward: float | None = None


def drive(env: Environment, task: Task, seed: int, run: Run, live: object = None) -> Run:
    """The smallest agent loop: policy -> call_tool -> apply -> tool message, until a final answer."""
    tools = env.tools()
    for _ in range(30):
        reply = scripted_reply(run.messages, tools, seed)
        run.messages.append(reply)
        if not reply.get("tool_calls"):
            run.final = reply["content"]
            break
        assert len(reply["tool_calls"]) == 1  # resuming mid-message is out of scope for this loop
        call = reply["tool_calls"][0]
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        try:
            if live is not None:
                outcome = env.call_live(live, name, args)
            else:
                before = canonical(run.state)
                outcome = env.call_tool(run.state, name, args)
                assert canonical(run.state) == before, "call_tool mutated its state argument"
                if outcome.effect is not None:
                    run.state = env.apply(run.state, outcome.effect)
            output, effect = outcome.output, outcome.effect
        except ToolError as exc:
            output, effect = exc.to_json(), None
        canonical(output), canonical(effect)  # both must be plain JSON
        run.outputs.append(output)
        run.effects.append(effect)
        run.messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(output, sort_keys=True)})
        run.boundaries.append(len(run.messages))
    else:
        pytest.fail("the policy never gave a final answer")
    run.reward = env.verify(task, run.state, Trajectory(run.messages, run.final))
    return run


def play(task: Task, seed: int = 0) -> Run:
    env = SandboxEnvironment(SandboxLimits()) if task.env == "sandbox" else get_environment(task.env)
    run = Run(messages=[{"role": "user", "content": task.prompt}])
    if env.state_mode in ("restart_only", "snapshot"):
        live = env.open_live(task)
        try:
            return drive(env, task, seed, run, live=live)
        finally:
            env.close_live(live)
    run.state = env.initial_state(task)
    return drive(env, task, seed, run)


def resume(task: Task, seed: int, full: Run, k: int) -> Run:
    """Continue ``full`` after its k-th tool call from a state rebuilt out of the logged effects alone."""
    env = get_environment(task.env)  # a fresh instance: nothing may survive in the object
    cut = full.boundaries[k - 1] if k else 1
    logged = roundtrip({"messages": full.messages[:cut], "effects": full.effects[:k]})
    state = roundtrip(env.initial_state(task))
    for effect in logged["effects"]:
        if effect is not None:
            state = env.apply(state, effect)
    run = Run(messages=logged["messages"], outputs=full.outputs[:k], effects=logged["effects"], state=state)
    return drive(env, task, seed, run)


# -- conformance -----------------------------------------------------------------


@pytest.mark.parametrize("env_name", REPLAYABLE)
def test_replay_from_every_step_matches_uninterrupted_run(env_name: str) -> None:
    rewards = set()
    for i, task in enumerate(make_tasks(TASKS_PER_ENV.get(env_name, 4), seed=3, envs=[env_name])):
        full = play(task, seed=i)
        rewards.add(full.reward)
        assert canonical(roundtrip(full.state)) == canonical(full.state)
        for k in range(len(full.effects) + 1):
            resumed = resume(task, i, full, k)
            assert canonical(resumed.outputs) == canonical(full.outputs), (task.task_id, k)
            assert canonical(resumed.messages) == canonical(full.messages), (task.task_id, k)
            assert canonical(resumed.state) == canonical(full.state), (task.task_id, k)
            assert (resumed.final, resumed.reward) == (full.final, full.reward)
    if env_name in ("workplace", "blackjack"):
        assert len(rewards) > 1, rewards


def test_registry_and_task_shapes() -> None:
    assert set(ENVIRONMENTS) >= {"workplace", "blackjack", "math", "string_match", "sandbox"}
    for name, cls in ENVIRONMENTS.items():
        env = get_environment(name)
        assert env.name == name and isinstance(env, cls)
        assert cls.verification == ("wait" if cls.state_mode in ("restart_only", "snapshot") else "replay")
        for tool in env.tools():
            assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
        with pytest.raises(ToolError) as err:
            env.call_tool(env.initial_state(make_tasks(1, 0, [name])[0]), "no_such_tool", {})
        assert err.value.code == "unknown_tool"
    with pytest.raises(ToolError):
        get_environment("chess")


def test_make_tasks_is_deterministic_and_ids_are_stable() -> None:
    tasks = make_tasks(40, seed=7)
    assert [t.to_json() for t in tasks] == [t.to_json() for t in make_tasks(40, seed=7)]
    assert [t.env for t in tasks[:5]] == ["workplace", "blackjack", "math", "sandbox", "workplace"]
    assert len({t.task_id for t in tasks}) == 40
    assert make_tasks(40, seed=8)[0].task_id != tasks[0].task_id
    for t in tasks:
        assert Task.from_json(roundtrip(t.to_json())) == t
    kinds = {t.params["kind"] for t in make_tasks(60, seed=1, envs=["workplace"])}
    assert kinds == {"email_manager", "move_deal", "book_with_owner", "reply_latest", "email_contact"}


def test_rewards_over_a_mix_are_not_constant() -> None:
    rewards = [play(task, seed=7).reward for task in make_tasks(40, seed=7)]
    assert all(isinstance(r, float) for r in rewards)
    assert len(set(rewards)) > 1, rewards


# -- blackjack -------------------------------------------------------------------


def test_blackjack_rng_survives_a_json_roundtrip() -> None:
    env = get_environment("blackjack")
    for seed in range(20):
        state = env.initial_state(make_tasks(1, seed, ["blackjack"])[0])
        live, copied = import_rng(state["rng"]), import_rng(roundtrip(state["rng"]))
        assert [gym_blackjack.draw_card(live) for _ in range(40)] == [gym_blackjack.draw_card(copied) for _ in range(40)]
        assert canonical(export_rng(live)) == canonical(export_rng(copied))
        assert canonical(env.call_tool(state, "stand", {}).effect) == canonical(env.call_tool(roundtrip(state), "stand", {}).effect)


def _hit_until_17(seed: int) -> list[list[int]]:
    """One uninterrupted game on a plain gymnasium env, the reference for the exported one."""
    env = gym_blackjack.BlackjackEnv(sab=True)
    env.reset(seed=seed)
    while gym_blackjack.sum_hand(env.player) < 17:
        _, _, done, _, _ = env.step(1)
        if done:
            return [env.player, env.dealer]
    env.step(0)
    return [env.player, env.dealer]


def test_blackjack_matches_an_uninterrupted_gymnasium_game_and_needs_the_rng() -> None:
    env = get_environment("blackjack")
    diverged = 0
    for seed in range(40):
        state = env.initial_state(Task("blackjack", "t", "", {"seed": seed}))
        # Rebuilt from JSON before every single step, and still the same cards as the live gymnasium env.
        while not state["done"]:
            action = "hit" if gym_blackjack.sum_hand(state["player"]) < 17 else "stand"
            state = env.apply(state, roundtrip(env.call_tool(roundtrip(state), action, {}).effect))
        assert [state["player"], state["dealer"]] == _hit_until_17(seed)
        # Negative control: the same hands without the RNG state (re-seeded instead) deal other cards.
        start = env.initial_state(Task("blackjack", "t", "", {"seed": seed}))
        good, forgetful = restore_env(start), restore_env(start, with_rng=False)
        good.step(0), forgetful.step(0)
        diverged += good.dealer != forgetful.dealer
    assert diverged > 0


def test_blackjack_refuses_moves_after_the_hand_is_over() -> None:
    env = get_environment("blackjack")
    state = env.initial_state(Task("blackjack", "t", "", {"seed": 1}))
    state = env.apply(state, env.call_tool(state, "stand", {}).effect)
    assert state["done"] and state["reward"] in (-1.0, 0.0, 1.0, 1.5)
    with pytest.raises(ToolError) as err:
        env.call_tool(state, "hit", {})
    assert err.value.code == "episode_over"
    assert env.call_tool(state, "look", {}).effect is None


# -- workplace -------------------------------------------------------------------


def _workplace() -> tuple[Environment, Task, dict]:
    env = get_environment("workplace")
    task = make_tasks(1, seed=5, envs=["workplace"])[0]
    return env, task, env.initial_state(task)


def test_workplace_keeps_null_and_empty_string_apart() -> None:
    env, task, state = _workplace()
    phones = [p["phone"] for p in state["tables"]["directory"]["rows"].values()]
    assert "" in phones and None in phones
    assert roundtrip(state) == state and canonical(roundtrip(state)) == canonical(state)
    effects = []
    for args in ({"to": "a@x.example", "subject": "s", "body": "", "cc": ""}, {"to": "b@x.example", "subject": "s", "body": "b"}):
        effects.append(env.call_tool(state, "send_email", args).effect)
        state = env.apply(state, effects[-1])
    sent = state["tables"]["sent"]["rows"]
    assert (sent["s01"]["cc"], sent["s01"]["body"], sent["s02"]["cc"]) == ("", "", None)
    rebuilt = env.initial_state(task)
    for effect in roundtrip(effects):
        rebuilt = env.apply(rebuilt, effect)
    assert canonical(rebuilt) == canonical(state)
    assert rebuilt["tables"]["sent"]["rows"]["s01"]["cc"] == "" and rebuilt["tables"]["sent"]["rows"]["s02"]["cc"] is None


@pytest.mark.parametrize("name,args", [
    ("update_deal", {"deal_id": "D-101", "amount": "lots"}),
    ("update_deal", {"deal_id": "D-101", "seats": True}),
    ("update_deal", {"deal_id": "D-101", "seats": 2.5}),
    ("update_deal", {"deal_id": "D-101", "stage": "maybe"}),
    ("create_event", {"title": "x", "day": "tomorrow", "attendees": []}),
    ("create_event", {"title": "x", "day": "2026-02-30", "attendees": []}),
    ("create_event", {"title": "x", "day": "2026-12-03", "attendees": "a@b.example"}),
    ("send_email", {"to": "a@b.example", "subject": 3, "body": "b"}),
    ("send_email", {"to": "a@b.example", "subject": "s", "body": "b", "bcc": "c@d.example"}),
    ("search_directory", {}),
])
def test_workplace_bad_argument_types_are_refused_without_effect(name: str, args: dict) -> None:
    env, _, state = _workplace()
    before = canonical(state)
    with pytest.raises(ToolError) as err:
        env.call_tool(state, name, args)
    assert err.value.code == "bad_arguments"
    assert canonical(state) == before


def test_workplace_apply_checks_types_and_coerces_nothing_silently() -> None:
    env, _, state = _workplace()
    outcome = env.call_tool(state, "update_deal", {"deal_id": "D-102", "amount": 1200, "seats": 7})
    assert outcome.effect["values"] == {"amount": 1200.0, "seats": 7}
    assert isinstance(env.apply(state, outcome.effect)["tables"]["deals"]["rows"]["D-102"]["amount"], float)
    with pytest.raises(ToolError) as err:
        env.apply(state, {"op": "update", "table": "deals", "row": "D-102", "values": {"seats": "7"}})
    assert err.value.code == "bad_effect"
    with pytest.raises(ToolError) as err:
        env.call_tool(state, "get_deal", {"deal_id": "D-999"})
    assert err.value.code == "not_found"


# -- sandbox ---------------------------------------------------------------------


def test_sandbox_state_is_the_name_of_its_snapshot_and_its_tools_need_the_live_shell() -> None:
    env = get_environment("sandbox")
    task = make_tasks(1, seed=2, envs=["sandbox"])[0]
    state = env.initial_state(task)
    assert env.state_mode == "snapshot" and env.verification == "wait" and state["snapshot"] is None
    assert env.apply(state, {"command": "true", "exit_code": 0, "snapshot": "ab" * 32})["snapshot"] == "ab" * 32
    gone = env.apply(state, {"command": "sleep 9 &", "exit_code": 0, "snapshot": None, "unrestorable": "why"})
    assert gone["snapshot"] is None and gone["unrestorable"] == "why"
    with pytest.raises(ToolError) as err:
        env.call_tool(state, "run", {"command": "true"})
    assert err.value.code == "live_only"


def test_sandbox_live_session_runs_commands_and_keeps_its_shell_state() -> None:
    env = SandboxEnvironment(SandboxLimits())
    task = make_tasks(1, seed=2, envs=["sandbox"])[0]
    handle = env.open_live(task)
    try:
        assert env.call_live(handle, "run", {"command": "X=41; echo hi"}).output == {"output": "hi\n", "exit_code": 0}
        assert env.call_live(handle, "run", {"command": "echo $((X + 1)); cat"}).output["output"] == "42\n"
        bad = env.call_live(handle, "run", {"command": "if then fi"}).output
        assert bad["exit_code"] != 0
        assert env.call_live(handle, "run", {"command": "printf %s $X; false"}).output == {"output": "41", "exit_code": 1}
    finally:
        env.close_live(handle)
    assert handle.process.poll() is not None
    run = play(task)
    assert run.reward == 1.0, run.messages


def test_sandbox_timeout_ends_the_session() -> None:
    env = SandboxEnvironment(SandboxLimits(timeout_s=0.3))
    handle = env.open_live(make_tasks(1, seed=2, envs=["sandbox"])[0])
    try:
        with pytest.raises(ToolError) as err:
            env.call_live(handle, "run", {"command": "sleep 5"})
        assert err.value.code == "timeout"
    finally:
        env.close_live(handle)


# -- scripted policy -------------------------------------------------------------


def test_scripted_reply_is_a_pure_function_of_its_inputs() -> None:
    for task in make_tasks(10, seed=7, envs=["workplace", "blackjack", "math", "string_match", "sandbox"]):
        tools = get_environment(task.env).tools()
        messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": task.prompt}]
        first = json.dumps(scripted_reply(messages, tools, 3))
        assert json.dumps(scripted_reply(roundtrip(messages), roundtrip(tools), 3)) == first
        if tools:
            other = scripted_reply(messages, tools, 4)
            assert other["tool_calls"][0]["id"] != json.loads(first)["tool_calls"][0]["id"]


def test_math_policy_slips_sometimes() -> None:
    task = make_tasks(1, seed=0, envs=["math"])[0]
    env = get_environment("math")
    rewards = [env.verify(task, {}, Trajectory([], scripted_reply([{"role": "user", "content": task.prompt}], [], s)["content"]))
               for s in range(100)]
    assert 5 <= rewards.count(0.0) <= 40


@pytest.mark.parametrize("text", ["", "The answer is 449.", "  a  b\n", "x=1,234;ü  ", "Re: Q3 review"])
def test_scripted_tokens_split_losslessly(text: str) -> None:
    tokens = scripted_tokens(text)
    assert "".join(tokens) == text
    assert all(tokens)


_JSON_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)  # any code point, NUL and lone surrogates
_JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), _JSON_TEXT,
              st.sampled_from([1e-05, 1e-7, 1e16, 0.00001, -0.0, "1e-05", "é", "\u2028"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_JSON_TEXT, inner, max_size=4)),
    max_leaves=25)


def _json_spelling(value: object) -> tuple[str, str]:
    try:
        return "ok", json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:
        return "refused", type(exc).__name__


@settings(max_examples=400, deadline=None)
@given(value=_JSON_VALUES)
def test_canonical_is_json_sorted_compact_ascii_spelling_for_any_value(value: object) -> None:
    """Input: any JSON-like value (non-ASCII text, lone surrogates, NUL, NaN and infinities, integers past
    64 bits, floats json spells with an exponent, strings spelt like them). Task ids are digests of this
    text, so it is json's own, non-ASCII escaped, or json's refusal."""
    try:
        got: tuple[str, str] = ("ok", canonical(value))  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        got = ("refused", type(exc).__name__)
    assert got == _json_spelling(value)


def test_canonical_writes_an_ascii_row_without_json_and_escapes_what_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a NeMo Gym-like row (nulls, floats, nested tools) in ASCII, then the same with an accented
    name: the first is written by the log's fast encoder alone, the second as json escapes it."""
    row = {"responses_create_params": {"input": [{"role": "user", "content": "Reply to Carlos"}], "tools": [
        {"type": "function", "name": "email_send", "strict": None, "parameters": {"type": "object", "x": 1.5}}]},
        "id": 7}
    accented = {**row, "id": "Jos\u00e9"}
    expected = {k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in (("ascii", row), ("accented", accented))}
    assert "\\u00e9" in expected["accented"]
    assert canonical(accented) == expected["accented"]

    def refuse(*_a: object, **_k: object) -> str:
        raise AssertionError("json's encoder was asked to write an ASCII row")

    monkeypatch.setattr("participants.environments.base.json.dumps", refuse)
    assert canonical(row) == expected["ascii"]
