"""The learner fleet: N ranks under FSDP2, one optimizer step per batch.

Components, wired by `trainer.Learner` and driven by its `train_step` (fetch_batch,
compute_logprobs, compute_advantages, update, broadcast_weights, publish_version):
- `batch`: the replay's `Batch` message as padded tensors, shared from rank 0 to every rank.
- `fsdp`: process group, model sharding, and full tensors for the weight broadcast.
- `losses`: policy losses (PPO, GSPO, decoupled PPO), off-policy corrections, the value loss,
  loss aggregation and KL terms (pure tensor functions).
- `update`: forward passes and the optimizer step over mini- and micro-batches.
The advantage estimators are declared in the core (`asyncrl.advantages`), because config
validation and the rollout servers read their declarations too.
"""
