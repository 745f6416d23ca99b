"""The code judge: a program's plan, scope, harness, formats and values, run in the sandbox
(judge) and scored (reward)."""
