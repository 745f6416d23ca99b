"""The launch layer: the only code that imports the fleets; it wires them and watches them.

- `cli`: the `asyncrl` command (launch, serve, eval, data, model, plot).
- `run`: `launch` and `serve`, which check the run's data, prepare a run, start the fleets
  with the configured backend and watch them until the end or the first failure.
- `fleet`: what both backends share (the `Fleet` they return, the run directory, the model,
  each process's environment, how a failure is raised).
- `restarts`: the watch loop, and the rules by which it restarts rollout and reward-model
  servers that die (`ServerRestarts`).
- `failures`: which process died first, and which deaths followed it (the failure report).
- `local`: the fleets as child processes; `ray_cluster` (with `ray_placement`, `ray_actors`
  and `ray_connect`): as Ray actors.
- `worker`: every fleet process's entry point, dispatching a role to its fleet.
- `progress`: the live progress line.
"""
