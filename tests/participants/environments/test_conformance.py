"""The environment conformance suite (apps.conformance) over every registered environment and every
agent kind, on PostgreSQL; through a vLLM-style upstream; and a negative control that breaks one
environment's restore path and shows that the same check fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from adapters.postgres import PostgresEventStore
from apps.conformance import AGENTS, assert_conformant, check_environment, outcome
from participants.agent.server import AgentParticipant
from participants.environments import ENVIRONMENTS
from participants.environments.blackjack import BlackjackEnvironment, export_rng
from testkit.fake_vllm import FakeVLLM

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("agent", sorted(AGENTS))
@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
async def test_every_boundary_checkpoints_crashes_and_restores_to_the_same_end(
    dsn: str, store: PostgresEventStore, env_name: str, agent: str
) -> None:
    summary = await assert_conformant(dsn, store, env_name, AGENTS[agent], f"{env_name}-{agent}".replace("_", "-"))
    assert summary["boundaries"] >= 2


@pytest.mark.parametrize("env_name", ["blackjack", "math"])
async def test_every_boundary_conforms_through_a_vllm_style_upstream(
    dsn: str, store: PostgresEventStore, env_name: str
) -> None:
    """The same check with the openai_compatible backend in front of testkit/fake_vllm.py: token ids,
    logprobs and cut prefixes come from vLLM's fields, and continuations go upstream."""
    async with FakeVLLM(token_latency_s=0.001) as fake:
        summary = await assert_conformant(dsn, store, env_name, AgentParticipant, f"{env_name}-up", upstream=fake.url)
    # Every generation asks for token ids; every chat request streams (a cut call with tools is continued
    # whole on the completions route, then parsed on the derender route, which generates nothing).
    generations = [r for r in fake.requests if "generate_response" not in r]
    assert summary["boundaries"] >= 2 and generations and all(r["return_tokens_as_token_ids"] for r in generations)
    assert all(r["stream"] for r in generations if "messages" in r)


# ---- negative control -------------------------------------------------------------------------


class ForgetfulBlackjack(BlackjackEnvironment):
    """Right live, wrong on restore: replaying an effect drops the deck's RNG state and re-seeds it
    from the task seed, as a rebuild that forgot the RNG would; the live path keeps it."""

    def __init__(self) -> None:
        self._from_call = False

    def call_tool(self, state: Any, name: str, arguments: dict) -> Any:
        out = super().call_tool(state, name, arguments)
        self._from_call = out.effect is not None
        return out

    def apply(self, state: Any, effect: Any) -> Any:
        new = super().apply(state, effect)
        if not self._from_call:
            new["rng"] = export_rng(np.random.default_rng(new["seed"]))
        self._from_call = False
        return new


async def test_the_check_catches_an_environment_that_restores_wrongly(
    dsn: str, store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # get_environment looks the class up here, for the resources server's sessions and its restore alike.
    monkeypatch.setitem(ENVIRONMENTS, "blackjack", ForgetfulBlackjack)
    with pytest.raises(AssertionError, match="blackjack/AgentParticipant boundary"):
        await assert_conformant(dsn, store, "blackjack", AgentParticipant, "broken")
    # The uninterrupted run itself was fine: only a restore goes wrong.
    ref = await outcome(store, "broken-ref", 0)
    assert ref.state == (await outcome(store, "broken-k0", 1)).state


async def test_the_check_catches_it_on_a_log_in_memory_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a plugin runs by default (apps.conformance.check_environment, no PostgreSQL) is no weaker."""
    monkeypatch.setitem(ENVIRONMENTS, "blackjack", ForgetfulBlackjack)
    with pytest.raises(AssertionError, match="blackjack/AgentParticipant boundary"):
        await check_environment("blackjack", "simple")
    assert [s["boundaries"] for s in await check_environment("math")] == [2, 2]  # a sound one passes with both agents
