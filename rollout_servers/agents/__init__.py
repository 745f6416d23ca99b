"""Agent loops: one prompt in, one trajectory out (`base.AgentLoop`).

`single_turn` samples one answer; `tool_agent` runs multi-turn conversations with the `tools`
the model calls and the `interactions` that answer as the user. `registry.AGENT_LOOPS` names the
loops and `registry.AgentLoopRouter` hands each row to the loop it names.
"""
