"""The reward-model fleet: `reward.num_servers` processes, each serving one reward model.

A rollout server sends the responses it finished to one of them as a `ScoreRequest`
(`asyncrl.wire.reward_protocol`) and combines the model's score with its rule reward; a client
(benchmarks, `asyncrl eval`) may ask too. Components:
- scorer (`reward_models.scorers`): the model behind `Scorer.score(items)`, a classifier whose
  logit is the score or a judge whose answer holds it (`reward.model.kind`); `setup_scorer`
  loads it. One bad item scores 0 with its reason; it never fails the others.
- access rules (`reward_models.access`): the run's keyring; rollout servers (any epoch) and
  clients may ask, the learner may not.
- server (`reward_models.server`): a `RewardModelServer` is an
  `asyncrl.wire.router.RouterService` (the same authenticated socket as the replay's, with the
  same outcome counters) whose poll loop takes every request waiting, scores their items
  together in batches and answers each. `run_reward_model_server(spec, cfg, index)` is the
  process's entry point; it serves until a stop signal (`asyncrl.wire.serve`).

Wiring: the entry point builds the scorer, hands it to the server and drives the server's loop
until a stop signal; nothing here imports another fleet or the launch layer.
"""
