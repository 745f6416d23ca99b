"""The replay fleet: one service between the rollout servers and the learner.

Components (one module each), wired by `service.ReplayService` in one single-threaded loop:
- `prompts`: a `PromptSource` of verl-schema rows, turned into prompt leases (`PromptItem`).
- `admission`: `AdmissionController`, how many leases a server at version s may start now
  (staleness rule, capacity back-pressure, and a fair share of the window while several
  servers ask).
- `leases`: `LeaseDesk`, what one grant holds (evaluation prompts first, then training prompts,
  expired leases re-issued first) and the prompt stream's position for resume.
- `buffer`: `GroupBuffer`, the samples of each lease kept together, deduplicated, and handed to
  the learner as whole groups no older than `replay.max_staleness` versions.
- `eval_jobs`: evaluation prompts, leased before training ones, and their scores.
- `fleet_stats`: what the replay tells the learner about the servers per batch.
- `counters`: the counters it reports and logs.
- `service`: the ZeroMQ ROUTER loop and `run_replay`, the process entry point.
"""
