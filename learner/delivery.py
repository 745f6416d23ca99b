"""The learner's half of the delivery probe (`asyncrl.weights.probe`): its log-probs of the probe
ids under the version it is about to send, and how close the engine's must come."""

from __future__ import annotations

import torch

from asyncrl.config import Config, LearnerConfig
from asyncrl.weights.probe import DeliveryProbe, probe_ids
from learner.batch import TrainBatch
from learner.forward import layout_of, policy_forward
from learner.fsdp import hf_config

FP32_TOLERANCE = 1e-4
"""Mean absolute log-prob difference allowed when learner and engine both compute in fp32."""
LOW_PRECISION_TOLERANCE = 0.5
"""... when either computes in bf16/fp16: their rounding alone moved the probe's mean by up to
0.063 (a bf16 learner against an fp32 engine, the embedded model), which is also about what
one version changes. So in low precision the check catches an engine stuck on an old policy
once the policy has moved away from it, not within one version as in fp32."""


def wants_probe(cfg: Config) -> bool:
    """Whether versions carry the probe: asked for, and the engine checks it (hf, vLLM and
    SGLang do; an engine that could not would cost every learner rank a forward per version for
    nothing)."""
    return cfg.learner.delivery_check and cfg.rollout.engine in ("hf", "vllm", "sglang")


def delivery_probe(
    model: torch.nn.Module, lc: LearnerConfig, engine_dtype: str, device: torch.device
) -> DeliveryProbe:
    """The policy's log-probs of the probe ids after the first, and the tolerance its precision
    and the engine's allow. A forward of the policy: under FSDP every rank must call it, in
    step."""
    ids = torch.tensor([probe_ids(hf_config(model).vocab_size)])
    n = ids.shape[1]
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(1, n, dtype=torch.int64),
        loss_mask=(torch.arange(n) > 0).float()[None],
        old_logprobs=torch.zeros(1, n),
        versions=torch.zeros(1, n, dtype=torch.int64),
        rewards=torch.zeros(1),
        group_index=torch.zeros(1, dtype=torch.int64),
        baseline_rewards=torch.full((1,), float("nan")),
        prompt_lengths=torch.ones(1, dtype=torch.int64),
    ).to(device)
    training = model.training
    model.eval()  # no dropout (LoRA's included): the engine samples without it
    with torch.no_grad():
        logprobs = policy_forward(model, batch, 1.0, False, layout_of(lc, device))[0][0]
    model.train(training)
    exact = lc.dtype == "float32" and engine_dtype == "float32"
    tolerance = FP32_TOLERANCE if exact else LOW_PRECISION_TOLERANCE
    return DeliveryProbe(logprobs.float().cpu(), tolerance)
