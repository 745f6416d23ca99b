"""The RL mathematics shared by the learner and its tools: advantage estimators (estimators,
advantages) and policy losses (policy_losses)."""
