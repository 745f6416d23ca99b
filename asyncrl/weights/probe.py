"""The delivery probe: what a version computes, as the learner says, for the engine to check.

With each version (when `learner.delivery_check` is on) learner rank 0 sends its log-probs of a
fixed token sequence (`probe_ids`) under that version, and how close the engine's must come
(`learner.delivery` makes it). The engine scores the same ids after applying the version and
fails loudly when they differ (`rollout_servers.engines.base.check_delivery`): an engine that
keeps sampling an old policy (an update applied to a copy, a stale adapter or cache) cannot go
unnoticed.

Producer and checker hold a `DeliveryProbe`; only the transport sees its wire form, one float32
vector (`to_wire`, `from_wire`: the weight sync broadcasts it as one collective, and vLLM's
worker hands it to its server as a list of floats).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_LEN = 16
"""Probe ids scored; also the length of the wire form (PROBE_LEN - 1 log-probs: each id after
the first, given the ones before it; then the tolerance)."""


def probe_ids(vocab_size: int) -> list[int]:
    """The fixed token ids both sides score for the delivery probe."""
    return [(7 * i + 3) % vocab_size for i in range(PROBE_LEN)]


@dataclass(frozen=True, eq=False)  # a tensor field has no one truth value to compare by
class DeliveryProbe:
    """The learner's log-probs of `probe_ids` under one version, and the tolerance they hold to."""

    logprobs: torch.Tensor
    """float32 [PROBE_LEN - 1]: the log-prob of each probe id after the first, given the ones
    before it, at temperature 1 (what `Engine.probe_logprobs` returns for the same ids)."""
    tolerance: float
    """Largest mean absolute difference from the engine's log-probs that still counts as the
    same policy (it depends on both sides' precision: `learner.delivery`)."""

    def to_wire(self) -> torch.Tensor:
        """float32 [PROBE_LEN] on the CPU: the log-probs, then the tolerance."""
        logprobs = self.logprobs.detach().float().reshape(-1).cpu()
        if logprobs.numel() != PROBE_LEN - 1:
            raise ValueError(
                f"a delivery probe has {PROBE_LEN - 1} log-probs, got {logprobs.numel()}"
            )
        return torch.cat([logprobs, torch.tensor([self.tolerance], dtype=torch.float32)])

    @classmethod
    def from_wire(cls, wire: torch.Tensor) -> DeliveryProbe:
        """The probe whose `to_wire` is `wire` (on any device; the probe's tensor is on the CPU)."""
        flat = wire.detach().float().reshape(-1).cpu()
        if flat.numel() != PROBE_LEN:
            raise ValueError(
                f"a delivery probe's wire form has {PROBE_LEN} floats, got {flat.numel()}"
            )
        return cls(flat[:-1].clone(), float(flat[-1]))
