"""Log-probs (and entropies) of target tokens straight from the final hidden states, in chunks
of tokens, so that no [tokens x vocabulary] float32 copy of the logits ever exists.

The full path (`learner.forward`, `chunked=False`) takes the model's logits [M, V], makes a
float32 copy, divides it by the temperature into a second one, takes the log-softmax into a
third, and keeps them for the backward: 8 GiB each for 16k tokens and a 128k vocabulary.
`chunked_logprobs` applies the output head itself, `chunk` tokens at a time:

    forward, per chunk:  z = (h W^T + b) in the compute dtype -> float32 -> / T
                         log p(target) = z_target - logsumexp(z);  entropy(z)
    backward, per chunk: recompute z, then with p = softmax(z)
                         dlogp/dz_j = [j = target] - p_j,   dH/dz_j = -p_j (z_j - sum_v p_v z_v)
                         dL/dlogits = (g_logp dlogp/dz + g_H dH/dz) / T   (in the compute dtype)
                         dL/dh = dL/dlogits W,   dL/dW += dL/dlogits^T h,   dL/db += sum dL/dlogits

Only the [M] outputs and the inputs (h, W, b, targets) are kept between forward and backward,
and at most one chunk's logits live at a time. The arithmetic is the full path's: the same
matmul in the same dtype (autocast's when it is on, else the promoted dtype of h and W; FSDP2's
`MixedPrecisionPolicy` hands both in bf16), the same float32 log-softmax, the entropy by the
same `learner.losses.entropy_from_logits`. It differs from the full path only by float32
rounding (tests/unit/test_chunked_logprobs.py: within 1e-5), and in bf16 by the weight
gradient being summed over chunks in float32 where the full path's single matmul rounds once.
The entropy carries a gradient only when asked (`entropy_grad`, an entropy bonus); otherwise
it is a detached statistic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from learner.losses import entropy_from_logits

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""The default chunk: as many tokens as fill 256 MiB of float32 logits (523 tokens of a 128k
vocabulary, 1,365 of SmolLM2's 49k). Forward and backward hold up to about six chunk-sized
buffers at a time (tools/bench_logprob_memory.py: ~1.5 GiB whatever the micro-batch); a chunk
this size still gives the matmul hundreds of rows."""


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose float32 logits fill `DEFAULT_CHUNK_BYTES`."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the model's own output head would compute its logits in: autocast's when
    autocast is on for this device, else the promoted dtype of its inputs."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets) [M], entropy [M] or None), float32, under softmax((hidden W^T + b) / T).

    hidden [M, H], weight [V, H] (the output head's), bias [V] or None, targets [M]. Chunks
    of `chunk_tokens` (default `default_chunk_tokens(V)`). The entropy is differentiable
    only with `entropy_grad`."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden [M, H] and targets [M], got {hidden.shape}, {targets.shape}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    dtype = compute_dtype(hidden, weight)
    logp, entropy = _ChunkedHeadLogprobs.apply(
        hidden,
        weight,
        bias,
        targets,
        float(temperature),
        chunk,
        dtype,
        with_entropy,
        with_entropy and entropy_grad,
    )
    return logp, entropy if with_entropy else None


def _cast_once(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias in the matmul's dtype, cast once for every chunk (a no-op
    under FSDP2's bf16 policy; a [V, H] copy per pass under autocast with fp32 weights)."""
    return weight.to(dtype), bias.to(dtype) if bias is not None else None


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    temperature: float,
) -> torch.Tensor:
    """float32 logits / T of one chunk, the matmul in `dtype` (autocast off: it is cast by
    hand, as autocast would)."""
    with torch.autocast(hidden.device.type, enabled=False):
        b = bias.to(dtype) if bias is not None else None
        z = F.linear(hidden.to(dtype), weight.to(dtype), b).float()
    if temperature != 1.0:  # (dividing by 1 is exact: skip the pass)
        z = z / temperature
    return z


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """The chunked head (see the module docstring); outputs (logp [M], entropy [M] or [0])."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        dtype: torch.dtype,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        w, b = _cast_once(weight, bias, dtype)
        for s in range(0, m, chunk):
            z = _chunk_logits(hidden[s : s + chunk], w, b, dtype, temperature)
            t = targets[s : s + chunk, None]
            logp[s : s + chunk] = (z.gather(-1, t) - torch.logsumexp(z, -1, keepdim=True))[:, 0]
            if with_entropy:
                entropy[s : s + chunk] = entropy_from_logits(z)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        """(Gradients arrive materialized: zeros for an output the loss did not use.)"""
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # summed over chunks in float32, cast to the weight's (bias's) dtype once at the end
        f32 = torch.float32
        grad_w = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=f32, device=bias.device) if need_b else None
        with_entropy_grad = ctx.entropy_grad
        w, b = _cast_once(weight, bias, dtype)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, w, b, dtype, temperature)
            p = torch.softmax(z, dim=-1)
            if with_entropy_grad:
                # dH/dz_j = -p_j (z_j - E_p[z]), shifted by the max as entropy_from_logits is;
                # a -inf logit (p = 0) contributes nothing
                shifted = torch.where(p > 0, z - z.amax(dim=-1, keepdim=True), 0.0)
            del z
            g = grad_logp[s : s + chunk, None]
            dz = p * -g
            dz.scatter_add_(-1, targets[s : s + chunk, None], g)
            if with_entropy_grad:
                mean = (p * shifted).sum(-1, keepdim=True)
                dz -= grad_entropy[s : s + chunk, None] * p * (shifted - mean)
            del p
            if temperature != 1.0:
                dz = dz / temperature
            with torch.autocast(hidden.device.type, enabled=False):
                d_logits = dz.to(dtype)
                del dz
                if grad_h is not None:
                    grad_h[s : s + chunk] = (d_logits @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (d_logits.T @ h.to(dtype)).float()
            if grad_b is not None:
                grad_b += d_logits.float().sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None
