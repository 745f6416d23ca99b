"""The learner fleet: N ranks under FSDP2, one optimizer step per batch.

Components, wired by `learner.trainer.setup_learner` and driven by `trainer.Learner.train_step`
(fetch_batch, compute_logprobs, compute_advantages, update, broadcast_weights, publish_version),
whose stages every rank runs in step:
- `coordinator`: what a rank asks of the world outside the learner group, behind one interface;
  rank 0's `leader.Leader` talks to the replay, the weight sync (`sync_fleet`), validation and
  the loggers; the other ranks' `Follower` talks to nobody.
- `batch`: the replay's `Batch` message as padded tensors, shared from rank 0 to every rank.
- `fsdp`: process group, model sharding, and full tensors for the weight broadcast.
- `losses`: the value loss and loss aggregation; `corrections`: the configured off-policy
  correction and rejection applied to the whole batch.
- `update`: forward passes and the optimizer step over mini- and micro-batches; its metrics are
  declared in `update_metrics`.
- `checkpoint`: sharded checkpoints with the replay's state, and the final weights.
The advantage estimators, policy losses, off-policy corrections and KL terms are declared in the
core (`asyncrl.algorithms`), because config validation reads their declarations too, and so is
their tensor math (`asyncrl.algorithms.loss_math`, `asyncrl.algorithms.correction_math`,
`asyncrl.algorithms.kl_math`), which the variants import: the core imports no fleet.
"""
