"""The whole pipeline with `rollout.engine=sglang` (SGLang's CPU engine here): replay, an SGLang
rollout server, the FSDP learner and the gloo weight broadcast into the server, on the tiny
model.

At max_staleness=0 every trained token was sampled by exactly the weights the learner holds,
so the learner's k3 KL to the behaviour log-probs measures the engine's weights against the
learner's at every version (logits on every trained token, not one fixed prompt). The runs and
their checks are shared with vLLM (engine_cases.py).
"""

from __future__ import annotations

import pytest
from engine_cases import check_trains_on_policy, check_updates_weights_in_flight

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

SGLANG = ["rollout.engine=sglang", "rollout.sglang.max_total_tokens=8192"]


def test_sglang_server_trains_on_policy(tmp_path):
    check_trains_on_policy(tmp_path, SGLANG, max_mismatch_kl=1e-4)


def test_sglang_server_updates_weights_in_flight(tmp_path):
    """`weight_update_mode=inflight` at max_staleness=1 through the whole pipeline: every version
    is applied and no trained sample's oldest token breaks the bound. Whether a version finds
    requests in flight depends on the run being generation-bound, which on two shared cores is
    chance, so spanning is checked where it is forced: test_sglang_engine's in-flight test
    (every token's version and log-prob)."""
    # slow generation: versions find requests
    check_updates_weights_in_flight(tmp_path, SGLANG, "rollout.sglang.max_running_requests=2")
