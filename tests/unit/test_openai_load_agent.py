"""`rollout.openai.agent` is read by `asyncrl.registry.import_object`, the one way an import path
becomes an object; every refusal names the config key."""

from __future__ import annotations

import pytest

from rollout_servers.agents.openai_agent import agent_row, load_agent


def test_load_agent_returns_the_function():
    assert load_agent("rollout_servers.agents.openai_agent:agent_row") is agent_row


@pytest.mark.parametrize(
    "path, why",
    [
        ("no_such_package.agents:run", "cannot import 'no_such_package.agents'"),
        ("rollout_servers.agents.openai_agent:no_such_fn", "has no 'no_such_fn'"),
        ("rollout_servers.agents.openai_agent", "not an import path"),
        ("rollout_servers.agents.openai_agent:METRIC_KEYS", "is not a function"),
    ],
)
def test_load_agent_refusals_name_the_key(path, why):
    with pytest.raises(ValueError, match="rollout.openai.agent=") as e:
        load_agent(path)
    assert why in str(e.value)
