"""Weights from the learner to the rollout servers: the sync a learner drives (sync), the
transports it chooses between, the receiving side (receiver), the tensor layout they agree on,
the process group joins (group, sealed_store), shared-memory segments (shm), the delivery probe
and LoRA adapters."""
