"""The replay fleet: one service between the rollout servers and the learner.

Components (one module each), built by `components.setup_replay_components` and driven by
`service.ReplayService` in one single-threaded loop:
- `prompts`: a `PromptSource` of verl-schema rows, turned into prompt leases (`PromptItem`).
- `admission`: `AdmissionController`, how many leases a server at version s may start now
  (staleness rule, capacity back-pressure, and a fair share of the window while several
  servers ask).
- `leases`: `LeaseDesk`, what one grant holds (evaluation prompts first, then training prompts,
  expired leases re-issued first) and the prompt stream's position for resume.
- `buffer`: `GroupBuffer`, the samples of each lease kept together and deduplicated.
- `intake`: `SampleIntake`, where each arriving sample goes (its group or evaluation job) and
  the status it is acknowledged with.
- `sample_checks`: `check_trajectory`, whether a sample can be trained on (every sample is
  checked before it is kept, for training or evaluation).
- `group_filter`: `GroupFilter`, DAPO's dynamic sampling: a group whose samples all score
  alike (`replay.filter_groups`) is dropped as it completes, its slot freed for another lease.
- `batches`: `BatchDesk`, the buffer's ready groups handed to the learner as whole groups no
  older than `replay.max_staleness` versions.
- `eval_jobs`: evaluation prompts, leased before training ones, and their scores.
- `health`: `FleetHealth`, which server epochs are alive (heartbeats, silence, the learner's
  word).
- `fleet_stats`: what the replay tells the learner about the servers per batch.
- `access`: `AccessRules`, who signed a message, whether its role may send it, where a
  checkpoint may be written.
- the service is an `asyncrl.wire.router.RouterService` (shared with the reward-model fleet):
  the authenticated ROUTER socket that applies them and takes every message to exactly one outcome.
- `held`: requests not answerable yet, one typed queue per kind, answered when an event that
  may free them is counted.
- `checkpoint`: the replay's whole state in a checkpoint (`ReplayState`), one MessagePack file.
- `counters`: the counters it reports and logs.
- `components`: the components above as one typed set, and `setup_replay_components`.
- `service`: the ZeroMQ ROUTER loop, `setup_replay_service`, and `run_replay`, the process
  entry point.
"""
