"""What `tools/bench_learner.py` prints: the batch, each configuration's figures, the derived
ratios against their targets, and the weight sync's table (kept apart from the tool so that
each file stays readable)."""

from __future__ import annotations


def report(
    model_what: str, stats: dict, results: dict, derived: dict, sync: dict, args, peak
) -> None:
    w = stats["whole_batch"]
    print(f"\nmodel: {model_what}")
    print(
        f"batch of {w['batch_rows']} samples: response tokens median {w['response_median']:.0f}, "
        f"p99 {w['response_p99']:.0f}, max {w['response_max']}; prompt median "
        f"{w['prompt_median']:.0f}; longest row {w['longest_row']}"
    )
    print(
        f"trained: its first {stats['rows']} rows (response median "
        f"{stats['rows_response_median']:.0f}, max {stats['rows_response_max']}); real tokens "
        f"{stats['real_tokens']}, padded tokens {stats['rows']} x {w['longest_row']} = "
        f"{stats['padded_tokens']}, padding waste {stats['padding_waste']:.1%}"
    )
    memory = "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB"
    head = f"{'config':<18}{'tokens/s':>10}{'s/update':>10}{memory:>14}{'micro':>7}"
    print(f"\n{head}{'computed tokens':>17}{'TFLOP/s':>9}{'MFU':>7}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<18}  FAILED: {r['error']}")
            continue
        mfu = f"{r['mfu']:>7.1%}" if "mfu" in r else f"{'-':>7}"
        print(
            f"{name:<18}{r['tokens_per_s']:>10.1f}{r['seconds_per_update']:>10.2f}"
            f"{r['peak_mem_mib']:>14.0f}{r['micro_batches']:>7}{r['computed_tokens']:>17}"
            f"{r['tflops_per_s']:>9.3g}{mfu}"
        )
    print("(tokens/s: the batch's real tokens per second; computed: what the forwards ran on)")
    print(
        "(FLOPs per update = 6 x N x tokens + 6 x layers x hidden x sum(len^2): N "
        f"{stats['flops']['params']:,} linear weights; len: each sample's length, a dense "
        f"row's for bare; MFU against {f'{peak:.0f} TFLOP/s' if peak else 'no peak given'})"
    )
    for key, label, target in (
        ("packed_over_bare", "bf16-packed", " (targets: >= 0.9x, <= 1.1x on a GPU)"),
        ("padded_over_bare", "bf16-padded", ""),
    ):
        if f"{key}_tokens_per_s" in derived:
            print(
                f"{label} / bare: tokens/s {derived[f'{key}_tokens_per_s']:.2f}x, peak memory "
                f"{derived[f'{key}_peak_mem']:.2f}x{target}"
            )
    if "bf16_packed_over_padded" in derived:
        print(f"packed / padded tokens/s (bf16): {derived['bf16_packed_over_padded']:.2f}x")
    if "bf16-offload" in results and args.device == "cpu":
        print("note: bf16-offload on a CPU learner: parameters already live in host memory; the")
        print("      figure is the CPUOffloadPolicy's own overhead, not a GPU memory saving")
    if "rows_over_padded" in derived:
        print(f"packed rows / padded tokens/s (fp32): {derived['rows_over_padded']:.2f}x")
    if "packed_over_padded" in derived:
        print(
            f"packed (shared prompts) / padded tokens/s (fp32): "
            f"{derived['packed_over_padded']:.2f}x (target >= 2x)"
        )
    if "ckpt_rss_saved_mb" in derived:
        print(
            f"activation checkpointing: peak RSS {-derived['ckpt_rss_saved_mb']:+.0f} MiB "
            f"({-derived['ckpt_rss_saved_frac']:+.1%}) vs bf16-packed"
        )
    if "lora_sync" in derived:
        d = derived["lora_sync"]
        print(
            f"LoRA rank 16 sync: {d['adapter_bytes'] / 2**20:.1f} MiB of adapters per version, "
            f"{d['ratio']:.1%} of a full version's {d['full_bytes'] / 2**20:.0f} MiB (float32)"
        )
    for key, label in (
        ("bf16_vs_fp32_logprobs", "bf16 vs fp32 log-probs"),
        ("packed_vs_padded_logprobs", "packed vs padded fp32 log-probs"),
    ):
        if derived.get(key):
            d = derived[key]
            print(f"{label} (response tokens): mean abs diff {d['mean']:.2e}, max {d['max']:.2e}")
    if sync and "error" not in sync:
        report_sync(sync)


def report_sync(sync: dict) -> None:
    """The weight sync's table: bytes, seconds and the copy floor per dtype."""
    print("\nweight sync, learner -> 1 receiver, gloo loopback (median of reps):")
    print(
        f"{'dtype':<10}{'MiB':>8}{'sync s':>9}{'floor s':>9}{'ratio':>7}"
        f"{'sync GB/s':>11}{'floor GB/s':>12}{'gather s':>10}{'apply s':>9}"
    )
    for dtype, r in sync.items():
        gb = r["bytes"] / 1e9
        print(
            f"{dtype:<10}{r['bytes'] / 2**20:>8.0f}{r['sync_s']:>9.3f}{r['floor_s']:>9.3f}"
            f"{r['ratio']:>6.2f}x{gb / r['sync_s']:>11.2f}{gb / r['floor_s']:>12.2f}"
            f"{r['gather_s']:>10.3f}{r['apply_s']:>9.3f}"
        )
    dup = next(iter(sync.values()))["tied_duplicate_names"]
    if dup:
        print(f"note: tied weights are sent twice ({', '.join(dup)} alias another tensor)")
    print("target: sync / floor <= 2x; gather = iter_full_tensors alone (inside sync; the cast")
    print("        to the engine's dtype happens while packing);")
    print("apply = the receiver's copy into its model (after sync, not counted in it)")
