"""Rewards computed beside the agent loop: reward functions by data_source (functions), the
workers that run them (workers, computer), reward-model clients, combination and DAPO's overlong
shaping, and the sandboxed code judge (code/)."""
