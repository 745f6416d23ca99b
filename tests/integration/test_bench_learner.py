"""tools/bench_learner.py runs end to end on a tiny random model: every learner configuration
(padded, packed, bf16, checkpointing, offload, LoRA) trains in a process of its own, and the weight
sync reaches a receiver process in both dtypes, next to its copy floor. Figures are checked
for presence and sign only: their size depends on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    "fp32-padded",
    "fp32-packed-rows",
    "fp32-packed",
    "bf16-packed",
    "bf16-ckpt",
    "bf16-offload",
    "bf16-lora",
]


def test_bench_learner_reports_every_configuration_and_the_sync(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_learner.py"), "--tiny", "--threads", "1"]
    done = subprocess.run(
        [*cmd, "--sync-reps", "2", "--json", str(out)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert list(report["configs"]) == CONFIGS
    for name, result in report["configs"].items():
        assert "error" not in result, (name, result)
        assert result["tokens_per_s"] > 0 and result["peak_rss_mb"] > 0, name
        assert result["real_tokens"] == report["batch"]["real_tokens"]
    padded, packed = report["configs"]["fp32-padded"], report["configs"]["fp32-packed"]
    rows = report["configs"]["fp32-packed-rows"]
    assert padded["computed_tokens"] == report["batch"]["padded_tokens"] > packed["real_tokens"]
    # whole packed rows compute every real token; shared prompts save the group's copies
    assert rows["computed_tokens"] == packed["real_tokens"] > packed["computed_tokens"]
    derived = report["derived"]
    assert derived["packed_over_padded"] > 0
    assert "ckpt_rss_saved_mb" in derived
    lora = derived["lora_sync"]
    assert 0 < lora["adapter_bytes"] < lora["full_bytes"] and lora["ratio"] < 0.5
    assert derived["packed_vs_padded_logprobs"]["max"] < 1e-4  # the same model, two layouts
    assert 0 < derived["bf16_vs_fp32_logprobs"]["mean"] < 0.05
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        sync = report["sync"][dtype]
        assert sync["ratio"] > 0 and sync["sync_s"] > 0 and sync["floor_s"] > 0
        assert sync["bytes"] % itemsize == 0 and sync["params"] > 0
    assert report["sync"]["float32"]["bytes"] == 2 * report["sync"]["bfloat16"]["bytes"]
