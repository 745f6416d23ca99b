"""The delivery probe as a typed pair (log-probs, tolerance): one wire form, and the engine's
check against it (`rollout_servers.engines.base.check_delivery`)."""

import pytest
import torch

from asyncrl.weights.probe import PROBE_LEN, DeliveryProbe, probe_ids
from rollout_servers.engines.base import DeliveryError, check_delivery


class _Scorer:
    """An engine as the check sees it: log-probs of the probe ids, or None (cannot score)."""

    def __init__(self, logprobs: torch.Tensor | None):
        self.logprobs = logprobs
        self.asked: list[list[int]] = []

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor | None:
        self.asked.append(ids)
        return self.logprobs


def test_the_wire_form_is_the_log_probs_then_the_tolerance_and_comes_back_typed():
    probe = DeliveryProbe(torch.linspace(-3, -1, PROBE_LEN - 1, dtype=torch.float64), 0.5)
    wire = probe.to_wire()
    assert wire.dtype == torch.float32 and wire.shape == (PROBE_LEN,)
    assert wire[-1].item() == 0.5 and torch.equal(wire[:-1], probe.logprobs.float())
    back = DeliveryProbe.from_wire(wire)
    assert torch.equal(back.logprobs, probe.logprobs.float()) and back.tolerance == 0.5
    # vLLM's worker hands the wire form to its server as a list of floats
    listed = DeliveryProbe.from_wire(torch.tensor(wire.tolist()))
    assert torch.equal(listed.logprobs, back.logprobs) and listed.tolerance == back.tolerance


def test_a_probe_of_the_wrong_length_is_refused_both_ways():
    with pytest.raises(ValueError, match=f"{PROBE_LEN - 1} log-probs, got 3"):
        DeliveryProbe(torch.zeros(3), 0.1).to_wire()
    with pytest.raises(ValueError, match=f"{PROBE_LEN} floats, got {PROBE_LEN - 1}"):
        DeliveryProbe.from_wire(torch.zeros(PROBE_LEN - 1))


def test_the_engine_passes_within_the_tolerance_and_fails_past_it():
    learner = -torch.arange(1.0, PROBE_LEN)
    probe = DeliveryProbe(learner, tolerance=0.1)
    close = _Scorer(learner + 0.05)
    check_delivery(close, 3, probe, vocab=50)  # type: ignore[arg-type]
    assert close.asked == [probe_ids(50)]
    with pytest.raises(DeliveryError, match=r"version 3 .* by 0\.2 on average > 0\.1"):
        check_delivery(_Scorer(learner + 0.2), 3, probe, vocab=50)  # type: ignore[arg-type]
    lost = _Scorer(torch.full_like(learner, float("nan")))
    with pytest.raises(DeliveryError):  # NaN is no match either
        check_delivery(lost, 3, probe, vocab=50)  # type: ignore[arg-type]
    check_delivery(_Scorer(None), 3, probe, vocab=50)  # type: ignore[arg-type]  # cannot score
    check_delivery(_Scorer(learner + 9), 3, None, vocab=50)  # type: ignore[arg-type]  # no probe
