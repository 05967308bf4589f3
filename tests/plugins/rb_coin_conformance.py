"""rb_coin's own test of its environment against rollbook's conformance suite, as the package would ship it.

Nothing here needs PostgreSQL or rollbook's test folder: `apps.conformance.check_environment` runs the
four servers in process on a log in memory. tests/participants/environments/test_plugins.py installs rb_coin and runs
this file with pytest from a folder outside rollbook.
"""

from __future__ import annotations

import asyncio

import pytest

from apps.conformance import AGENTS, check_environment


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_coin_ends_as_an_uninterrupted_run_from_every_boundary(agent: str) -> None:
    (summary,) = asyncio.run(check_environment("coin", agent))
    assert summary["boundaries"] == 2 and summary["reward"] == 1.0
