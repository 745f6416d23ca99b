"""Turn the replay's flat `Batch` message into padded training tensors and share them out.

Rank 0 receives the batch and builds `TrainBatch`; it is broadcast to every learner rank (the
tensors are small next to the model), so every rank can compute advantages and global loss
denominators itself; `learner.update` then gives each rank its share of the rows.
`share_batch` is that broadcast, with rank 0's word on whether there is a batch at all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from asyncrl.wire.samples import Batch


@dataclass
class TrainBatch:
    """Right-padded sequences, every tensor [B, L] aligned to token positions (rewards,
    group_index: [B]). `loss_mask` is 1 on tokens the policy sampled."""

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # int64, 1 on real tokens
    loss_mask: torch.Tensor  # float32
    old_logprobs: torch.Tensor  # float32, behaviour log-probs (0 where not sampled)
    versions: torch.Tensor  # int64, policy version per sampled token (-1 elsewhere)
    rewards: torch.Tensor  # float32 [B]
    group_index: torch.Tensor  # int64 [B]
    baseline_rewards: torch.Tensor  # float32 [B], NaN when no greedy baseline was sampled
    prompt_lengths: torch.Tensor  # int64 [B], tokens before the response (its first turn)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> TrainBatch:
        """The rows at `index` (a new batch; tensors are copies)."""
        return TrainBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def from_message(msg: Batch, pad_id: int) -> TrainBatch:
    """Pack the flat arrays of a Batch into right-padded [B, L] tensors.

    Vectorised: each flat token is scattered to its (row, column) in one indexed assignment
    per tensor, with no Python loop over rows (offsets rise from 0, as `Batch.validate`
    checks)."""
    po = torch.from_numpy(msg.prompt_offsets.astype("int64"))
    ro = torch.from_numpy(msg.response_offsets.astype("int64"))
    b = len(msg.traj_ids)
    n_prompt, n_resp = po[1:] - po[:-1], ro[1:] - ro[:-1]
    lengths = n_prompt + n_resp
    seq_len = int(lengths.max())
    rows = torch.arange(b)
    p_row = torch.repeat_interleave(rows, n_prompt)  # the row of each flat prompt token
    p_col = torch.arange(int(po[-1])) - po[:-1][p_row]
    r_row = torch.repeat_interleave(rows, n_resp)  # the row of each flat response token
    r_col = torch.arange(int(ro[-1])) - ro[:-1][r_row] + n_prompt[r_row]

    def flat(values, dtype: str) -> torch.Tensor:
        return torch.from_numpy(values.astype(dtype))

    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.int64)
    input_ids[p_row, p_col] = flat(msg.prompt_ids, "int64")
    input_ids[r_row, r_col] = flat(msg.response_ids, "int64")
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int64)
    loss_mask = torch.zeros((b, seq_len), dtype=torch.float32)
    loss_mask[r_row, r_col] = flat(msg.loss_mask, "float32")
    old_logprobs = torch.zeros((b, seq_len), dtype=torch.float32)
    old_logprobs[r_row, r_col] = flat(msg.behaviour_logprobs, "float32")
    versions = torch.full((b, seq_len), -1, dtype=torch.int64)
    versions[r_row, r_col] = flat(msg.versions, "int64")
    group_of: dict[str, int] = {}
    group_index = torch.tensor([group_of.setdefault(g, len(group_of)) for g in msg.group_ids])
    return TrainBatch(
        input_ids,
        attention_mask,
        loss_mask,
        old_logprobs,
        versions,
        torch.from_numpy(msg.rewards.copy()),
        group_index,
        torch.from_numpy(msg.baseline_rewards.copy()),
        n_prompt,
    )


def share_batch(
    batch: TrainBatch | None, rank: int, world: int, device: torch.device
) -> TrainBatch | None:
    """Rank 0's `batch` on every rank, on `device` (the other ranks pass None); None on every
    rank when rank 0 has none (the run stops)."""
    go = torch.tensor([1 if (rank != 0 or batch is not None) else 0], device=device)
    if world > 1:
        dist.broadcast(go, 0)
    if not int(go.item()):
        return None
    if world > 1:
        return broadcast_batch(batch, rank, device)
    assert batch is not None
    return batch.to(device)


def broadcast_batch(batch: TrainBatch | None, rank: int, device: torch.device) -> TrainBatch:
    """Share rank 0's batch with every learner rank (default process group)."""
    names = [f.name for f in fields(TrainBatch)]
    if rank == 0:
        assert batch is not None
        shape = torch.tensor(batch.input_ids.shape, dtype=torch.int64, device=device)
    else:
        shape = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(shape, 0)
    b, seq_len = (int(x) for x in shape.cpu())
    out = {}
    for name in names:
        per_row = name in ("rewards", "group_index", "baseline_rewards", "prompt_lengths")
        like = (b,) if per_row else (b, seq_len)
        floats = ("loss_mask", "old_logprobs", "rewards", "baseline_rewards")
        dtype = torch.float32 if name in floats else torch.int64
        t = (
            getattr(batch, name).to(device)
            if rank == 0
            else torch.empty(like, dtype=dtype, device=device)
        )
        dist.broadcast(t, 0)
        out[name] = t
    return TrainBatch(**out)
