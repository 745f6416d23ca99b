"""Every config the project ships loads and validates, and the files and code it names exist:
a renamed key, tool file or agent breaks a test here, not a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_the_project_ships_its_configs():
    assert {"default.yaml", "tool_demo.yaml", "search_agent.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_config_loads_and_names_what_exists(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name files relative to the checkout
    cfg = load_config(str(path))
    rc = cfg.rollout
    for tools in (rc.tool_agent.tool_config, rc.openai.agent_kwargs.get("tool_config")):
        assert not tools or (ROOT / tools).is_file(), tools
    if rc.openai.enabled:
        from rollout_servers.agents.openai_agent import load_agent
        from rollout_servers.agents.search_agent import toolset

        assert callable(load_agent(rc.openai.agent))
        if "tool_config" in rc.openai.agent_kwargs:
            assert toolset(rc.openai.agent_kwargs["tool_config"]).schemas
