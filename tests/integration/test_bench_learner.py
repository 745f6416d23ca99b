"""tools/bench_learner.py runs end to end on a tiny random model: every learner configuration
(padded, packed, bf16, checkpointing, offload, LoRA) and the bare model's floor train in a
process of their own, and the weight sync reaches a receiver process in both dtypes, next to its
copy floor. Speed figures are checked for presence and sign only (their size depends on the
machine); token counts and the FLOPs of an update against the formula worked out here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    "fp32-padded",
    "bf16-padded",
    "fp32-packed-rows",
    "fp32-packed",
    "bf16-packed",
    "bf16-ckpt",
    "bf16-offload",
    "bf16-lora",
    "bare",
]


@pytest.mark.long  # half a minute or more: its own CI step
def test_bench_learner_reports_every_configuration_and_the_sync(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_learner.py"), "--tiny", "--threads", "1"]
    cmd += ["--peak-tflops", "2"]
    done = subprocess.run(
        [*cmd, "--sync-reps", "2", "--json", str(out)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert list(report["configs"]) == CONFIGS
    batch, flops = report["batch"], report["batch"]["flops"]
    # the tiny shape's linear weights: 2 layers of q, k, v, o (64 x 64, 32 x 64 twice, 64 x 64)
    # and the MLP (3 x 64 x 128), and the LM head (512 x 64, tied to the embedding)
    assert flops == {"params": 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128) + 512 * 64,
                     "layers": 2, "hidden": 64}  # fmt: skip
    for name, result in report["configs"].items():
        assert "error" not in result, (name, result)
        assert result["tokens_per_s"] > 0 and result["peak_rss_mb"] > 0, name
        assert result["peak_mem_mib"] == result["peak_rss_mb"]  # on CPU
        attention = result.get("attention_sq", batch["attention_sq"])
        tokens = result["real_tokens"]
        assert result["flops_per_update"] == 6 * flops["params"] * tokens + 6 * 2 * 64 * attention
        mfu = result["flops_per_update"] / result["seconds_per_update"] / 2e12
        assert abs(result["mfu"] - mfu) <= 1e-9 * mfu, name
        if name != "bare":
            assert tokens == batch["real_tokens"]
            assert result["recompute_micro_batches"] <= result["micro_batches"]
    # the floor trains the same tokens end to end (a last token alone has no target) as dense
    # rows of 64 tokens, 4 to a micro-batch of 256 (--tiny)
    bare = report["configs"]["bare"]
    assert batch["real_tokens"] - 1 <= bare["real_tokens"] <= batch["real_tokens"]
    full, rest = divmod(bare["real_tokens"], 64)
    assert bare["attention_sq"] == full * 64**2 + rest**2
    assert bare["micro_batches"] == (full + 3) // 4 + (rest > 0)
    padded, packed = report["configs"]["fp32-padded"], report["configs"]["fp32-packed"]
    rows = report["configs"]["fp32-packed-rows"]
    assert padded["computed_tokens"] == report["batch"]["padded_tokens"] > packed["real_tokens"]
    # whole packed rows compute every real token; shared prompts save the group's copies
    assert rows["computed_tokens"] == packed["real_tokens"] > packed["computed_tokens"]
    derived = report["derived"]
    assert derived["packed_over_padded"] > 0
    for key in ("packed_over_bare", "padded_over_bare"):
        assert derived[f"{key}_tokens_per_s"] > 0 and derived[f"{key}_peak_mem"] > 0
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


@pytest.mark.long  # half a minute or more: its own CI step
def test_a_run_cut_short_keeps_the_configurations_it_measured(tmp_path):
    """As tools/gpu_check.sh's timeout cuts it: SIGINT to the whole process group."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_learner.py"), "--tiny", "--threads", "1"]
    cmd += ["--configs", "bare,fp32-padded,fp32-packed", "--sync-dtypes", "", "--json", str(out)]
    # SIGINT's default action, whatever pytest inherited: a test run started in the background
    # by a script ignores SIGINT (POSIX), and the bench would then run to its end
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 150
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # long before the two padded and packed runs end
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    report = json.loads(out.read_text())
    assert report["partial"] is True and list(report["configs"]) == ["bare"]
    assert report["configs"]["bare"]["tokens_per_s"] > 0
