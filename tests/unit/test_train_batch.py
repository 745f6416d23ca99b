"""`learner.batch.from_message`: the replay's flat Batch -> right-padded training tensors."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.wire.samples import Batch
from learner.batch import from_message

PAD = 7


def _batch(prompts: list[list[int]], responses: list[list[int]], seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    b, total = len(prompts), sum(len(r) for r in responses)
    return Batch(
        request_id=1,
        traj_ids=[f"t{i}" for i in range(b)],
        group_ids=[f"g{i // 2}" for i in range(b)],
        data_sources=["s"] * b,
        finish_reasons=["stop"] * b,
        rewards=rng.random(b, dtype=np.float32),
        baseline_rewards=np.full(b, np.nan, np.float32),
        prompt_offsets=np.cumsum([0, *map(len, prompts)]),
        response_offsets=np.cumsum([0, *map(len, responses)]),
        prompt_ids=np.array([t for p in prompts for t in p], np.int32),
        response_ids=np.array([t for r in responses for t in r], np.int32),
        loss_mask=rng.integers(0, 2, total).astype(np.uint8),
        behaviour_logprobs=-rng.random(total, dtype=np.float32),
        versions=rng.integers(0, 5, total).astype(np.int32),
        metric_names=[],
        metric_values=np.zeros(0, np.float32),
        fleet={},
        stale_dropped=0,
    )


def test_a_small_batch_is_padded_as_worked_out_by_hand() -> None:
    msg = _batch([[1, 2], [3]], [[4], [5, 6, 8]])
    msg.loss_mask[:] = [1, 1, 0, 1]
    msg.behaviour_logprobs[:] = [-0.5, -0.25, -0.125, -1.0]
    msg.versions[:] = [3, 1, 2, 4]
    out = from_message(msg, PAD)
    assert out.input_ids.tolist() == [[1, 2, 4, PAD], [3, 5, 6, 8]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert out.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 0, 1]]
    assert out.old_logprobs.tolist() == [[0, 0, -0.5, 0], [0, -0.25, -0.125, -1.0]]
    assert out.versions.tolist() == [[-1, -1, 3, -1], [-1, 1, 2, 4]]
    assert out.group_index.tolist() == [0, 0]
    assert (out.input_ids.dtype, out.attention_mask.dtype) == (torch.int64, torch.int64)
    assert (out.loss_mask.dtype, out.old_logprobs.dtype) == (torch.float32, torch.float32)
    assert (out.versions.dtype, out.group_index.dtype) == (torch.int64, torch.int64)


def _row_by_row(msg: Batch, pad_id: int) -> dict[str, torch.Tensor]:
    """An independent reference: each row's prompt, then its response, then padding."""
    po, ro = msg.prompt_offsets, msg.response_offsets
    rows = []
    for i in range(len(msg.traj_ids)):
        p = msg.prompt_ids[po[i] : po[i + 1]].tolist()
        r = slice(ro[i], ro[i + 1])
        zeros = [0.0] * len(p)
        rows.append(
            {
                "input_ids": p + msg.response_ids[r].tolist(),
                "attention_mask": [1] * (len(p) + r.stop - r.start),
                "loss_mask": zeros + msg.loss_mask[r].astype(float).tolist(),
                "old_logprobs": zeros + msg.behaviour_logprobs[r].tolist(),
                "versions": [-1] * len(p) + msg.versions[r].tolist(),
            }
        )
    width = max(len(row["input_ids"]) for row in rows)
    fill = {"input_ids": pad_id, "attention_mask": 0, "loss_mask": 0.0, "old_logprobs": 0.0,
            "versions": -1}  # fmt: skip
    return {
        name: torch.tensor([row[name] + [value] * (width - len(row[name])) for row in rows])
        for name, value in fill.items()
    }


def test_ragged_rows_with_empty_prompts_or_responses_match_a_row_by_row_reference() -> None:
    rng = np.random.default_rng(1)
    lengths = [(int(rng.integers(0, 9)), int(rng.integers(0, 9))) for _ in range(37)]
    lengths += [(0, 3), (4, 0), (12, 12)]
    prompts = [rng.integers(0, 50, p).tolist() for p, _ in lengths]
    responses = [rng.integers(0, 50, r).tolist() for _, r in lengths]
    msg = _batch(prompts, responses, seed=2)
    out = from_message(msg, PAD)
    for name, expected in _row_by_row(msg, PAD).items():
        got = getattr(out, name)
        assert got.shape == expected.shape, name
        assert torch.equal(got, expected.to(got.dtype)), name
    assert torch.equal(out.rewards, torch.from_numpy(msg.rewards))
    assert out.group_index.tolist() == [i // 2 for i in range(len(lengths))]
