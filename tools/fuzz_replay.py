"""Fuzz a live replay with mutated messages and say whether it kept its promises.

    python tools/fuzz_replay.py --messages 100000 --seed 1          # the acceptance run
    python tools/fuzz_replay.py --messages 20000 --survive --out crashes/   # every crash kind
    python tools/fuzz_replay.py --send crashes/crash-1.msgpack      # send a saved message again
    python tools/fuzz_replay.py --show-case 1234 --seed 1           # what case 1234 sends

It starts a replay of this checkout in a subprocess, sends mutated messages of every registered
type from many identities (tools/replay_fuzz/, see its docstring), prints progress, then the
final counters, every kind of crash with the message that caused it, the accounting check, a
lease -> samples -> batch round trip, and the replay's RSS growth. Exit status 0 when there was
no crash, every message was answered and accounted for, the round trip worked and RSS grew less
than --max-rss-growth-mb.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # this checkout's asyncrl, and replay_fuzz

import msgpack  # noqa: E402
from replay_fuzz import (  # noqa: E402
    CampaignConfig,
    Case,
    Context,
    Report,
    generate_case,
    run_campaign,
)
from replay_fuzz.campaign import setup_scratch  # noqa: E402


def _progress(report: Report) -> None:
    rate = report.sent / max(report.seconds, 1e-9)
    print(
        f"[{report.fuzzed:>8,} fuzzed] {rate:7,.0f} msg/s  crashes {report.crash_count} "
        f"({len(report.crashes)} kinds)  restarts {report.restarts}  "
        f"unanswered {len(report.unanswered)}  replay RSS {report.rss_end_mb:.1f} MB",
        flush=True,
    )


def _snippet(frames: list[bytes]) -> str:
    if sum(len(f) for f in frames) > 2048:
        return ""
    return "frames = [" + ", ".join(f"bytes.fromhex({f.hex()!r})" for f in frames) + "]"


def print_report(report: Report, out: Path | None) -> None:
    c = report.counters
    print("\n== counters of the last replay process ==")
    print(", ".join(f"{k} {v:g}" for k, v in sorted(c.items()) if v) or "(none: it did not finish)")
    print(f"answers by type: {dict(sorted(report.replies.items()))}")
    print(f"cases by family: {dict(sorted(report.families.items()))}")
    print(
        f"\n== crashes: {report.crash_count} ({len(report.crashes)} kinds, {report.restarts} restarts) =="
    )
    for k, crash in enumerate(report.crashes.values(), 1):
        print(f"\n[{k}] {crash.kind}  x{crash.count}")
        print(f"    first: case {crash.case}: {crash.description}")
        print(f"    error: {crash.error[:300]}")
        if out is not None and crash.message:
            path = out / f"crash-{k}.msgpack"
            path.write_bytes(msgpack.packb(crash.message, use_bin_type=True))
            print(f"    message saved: {path} (python tools/fuzz_replay.py --send {path})")
        snippet = _snippet(crash.message)
        if snippet:
            print(f"    {snippet}")
    print(f"\nunanswered messages: {len(report.unanswered)} {report.unanswered[:5]}")
    print(f"lost in crashes (in flight when the replay died): {report.lost_in_crashes}")
    print(f"skipped (would write outside the scratch directory): {report.skipped_unsafe}")
    print(f"accounting: {'ok' if not report.accounting else '; '.join(report.accounting)}")
    print(f"round trip: {report.round_trip}")
    warm = report.rss_warm_mb
    after_warm = f", {report.rss_end_mb - warm:+.1f} MB after the first tenth" if warm else ""
    print(
        f"replay RSS: {report.rss_start_mb:.1f} MB at start, {warm:.1f} MB after a tenth of the "
        f"messages, {report.rss_end_mb:.1f} MB at the end: growth {report.rss_growth_mb:+.1f} MB "
        f"(bound {report.max_rss_growth_mb:g}){after_warm}; peak {report.rss_peak_mb:.1f} MB"
    )
    rate = report.sent / max(report.seconds, 1e-9)
    print(
        f"{report.fuzzed:,} fuzz messages ({report.sent:,} in all) in {report.seconds:.1f} s "
        f"({rate:,.0f} msg/s); "
        f"scratch: {report.workdir}"
    )
    print("RESULT:", "PASS" if report.ok else "FAIL")


def _show_case(seed: int, index: int) -> None:
    scratch = setup_scratch(Path(tempfile.mkdtemp(prefix="replay-fuzz-show-")))
    ctx = Context(scratch=scratch, run_dir=scratch / "run", n=2, batch_groups=2, capacity_groups=64)
    case = generate_case(seed, index, ctx)
    print(f"case {index} of seed {seed}: {case.family}: {case.description}")
    for frames in case.messages:
        print(_snippet(frames) or f"{len(frames)} frames, {sum(map(len, frames)):,} bytes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    p.add_argument("--out", type=Path, help="write report.json and each crash's message here")
    p.add_argument("--survive", action="store_true", help="record handler exceptions and go on")
    p.add_argument("--max-crashes", type=int, help="stop after this many crashes")
    p.add_argument("--identities", type=int, default=32)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--progress-every", type=int, default=10_000)
    p.add_argument("--send", type=Path, help="send this saved message (and nothing else)")
    p.add_argument("--show-case", type=int, help="print what case N sends, without a replay")
    args = p.parse_args(argv)
    if args.show_case is not None:
        _show_case(args.seed, args.show_case)
        return 0
    cfg = CampaignConfig(
        messages=args.messages,
        seed=args.seed,
        workdir=args.workdir,
        survive=args.survive,
        max_crashes=args.max_crashes,
        identities=args.identities,
        window=args.window,
        max_rss_growth_mb=args.max_rss_growth_mb,
        progress=_progress,
        progress_every=args.progress_every,
    )
    cases = None
    if args.send is not None:
        message = msgpack.unpackb(args.send.read_bytes())
        cases, cfg.messages = [Case(0, "saved", str(args.send), [message])], 1
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    report = run_campaign(cfg, cases)
    print_report(report, args.out)
    if args.out is not None:
        summary = {k: v for k, v in report.__dict__.items() if k != "crashes"}
        summary["crashes"] = {k: {**c.__dict__, "message": None} for k, c in report.crashes.items()}
        summary["ok"] = report.ok
        (args.out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
