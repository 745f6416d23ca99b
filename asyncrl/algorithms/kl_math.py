"""KL terms against the frozen reference policy (pure torch): the per-token estimators (in the
reward or as a loss, the `estimator` of `algorithm.kl_in_reward` / `algorithm.kl_loss`) and the
controllers of the in-reward coefficient (the `fixed` and `adaptive` variants of
`algorithm.kl_in_reward`, `asyncrl.algorithms.kl`). Pure tensor functions and plain state, as
`asyncrl.algorithms.loss_math`.
"""

from __future__ import annotations

import torch

KL_KINDS = {
    "kl": "kl",
    "k1": "kl",
    "abs": "abs",
    "mse": "mse",
    "k2": "mse",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
    # straight-through: the value of the kind before "+", the gradient of k2 (verl's names)
    "kl+": "kl+",
    "k1+": "kl+",
    "abs+": "abs+",
    "low_var_kl+": "low_var_kl+",
    "k3+": "low_var_kl+",
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman's estimators),
    not masked (multiply by the mask):

        kl  / k1:          logp - ref
        abs:               |logp - ref|
        mse / k2:          0.5 (logp - ref)^2
        low_var_kl / k3:   exp(ref - logp) - (ref - logp) - 1,  clamped to [-10, 10]
        <kind>+ (k1+, abs+, k3+ and their long names): the value of <kind>, the gradient of k2
                           k2 - sg[k2] + sg[<kind>]   (straight through)

    As in verl, ref - logp is clamped to [-20, 20] before exp in low_var_kl. Gradients flow
    through logp (used as a loss term) and ref_logp is detached. Why "+": k1 and k3 estimate
    the KL's value without bias, but their expected gradient is not the KL's gradient; k2's is
    (verl PR 2953, `kl_penalty` in verl's core_algos). The gradient of the "+" kinds is k2's
    unclamped, as in verl. verl 0.9.1's `kl_penalty` strips the "+" before it picks the
    estimator, so its "k3+" is this one exactly (value and gradient; read in the 0.9.1 wheel's
    verl/trainer/ppo/core_algos.py; its main branch of 2026-01-29 did not strip it and raised
    NotImplementedError). One departure: verl 0.9.1 also takes "k2+" / "mse+", which are k2
    itself; here they are refused as unknown, since they would name nothing k2 does not.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid: {', '.join(KL_KINDS)}")
    diff = logp - ref_logp.detach()
    canonical = KL_KINDS[kind]
    value = _kl_value(diff, canonical.removesuffix("+"))
    if not canonical.endswith("+"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def _kl_value(diff: torch.Tensor, canonical: str) -> torch.Tensor:
    """The estimator `canonical` (kl, abs, mse, low_var_kl) of diff = logp - ref_logp."""
    if canonical == "kl":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "mse":
        return 0.5 * diff.square()
    x = (-diff).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)


class FixedKLController:
    """A constant KL coefficient; `update` leaves it unchanged. `estimator`: the `kl_penalty`
    kind the penalty uses."""

    def __init__(self, coef: float, estimator: str = "kl") -> None:
        self.value = float(coef)
        self.estimator = estimator

    def update(self, current_kl: float, n_steps: int) -> None:
        """The coefficient is fixed: nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019), steering the KL towards `target`:

    e = clip(current_kl / target - 1, -0.2, 0.2),   coef <- coef (1 + e n_steps / horizon)

    `estimator`: the `kl_penalty` kind the penalty uses.
    """

    def __init__(
        self, init_coef: float, target: float, horizon: float, estimator: str = "kl"
    ) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)
        self.estimator = estimator

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
