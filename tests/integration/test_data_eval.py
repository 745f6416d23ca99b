"""verl-format data and reward functions through the real pipeline, validation during training,
and standalone `asyncrl eval` on the final checkpoint."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration


def _verl_style_parquet(path: Path, data_source: str, too_long_every: int = 0) -> Path:
    """Written the way verl's example preprocessing scripts do: a list of dicts with the
    data_source / prompt / ability / reward_model / extra_info columns, saved with pyarrow.
    `too_long_every`: every so many rows, a prompt longer than the model's context."""
    rows = []
    for i, (a, b) in enumerate((a, b) for a in range(10) for b in range(10)):
        long = too_long_every and i % too_long_every == 0
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": f"{a}+{b}=" * (500 if long else 1)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _run(tmp_path, cache, *overrides):
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={cache}",
            "trainer.warmstart_steps=200",
            "data.train_batch_size=4",
            "rollout.n=4",
            "launch.progress=none",
            *overrides,
        ]
    )
    return launch(cfg)


@pytest.mark.long
def test_verl_parquet_and_a_misbehaving_custom_reward(tmp_path, model_cache):
    data = _verl_style_parquet(tmp_path / "train.parquet", "my_source")
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        textwrap.dedent("""
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            a = extra_info["index"] // 10  # the first operand of the question
            if a == 0:
                raise RuntimeError("a reward function with a bug")
            if a == 1:
                time.sleep(3600)  # hangs
            if a == 2:
                return float("nan")
            return {"score": float(solution_str.strip() == ground_truth), "a": float(a)}
    """)
    )
    run_dir = _run(
        tmp_path,
        model_cache,
        f"data.train_files=[{data}]",
        "trainer.total_steps=6",
        f"reward.custom.path={reward}",
        "reward.timeout_s=1.0",
        "trainer.save_final=false",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))  # the run went on
    assert 0 < max(r["reward_mean"] for r in rows) <= 1
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())
    for kind in ("exception", "timeout", "non_finite"):
        assert stats.get(f"reward_{kind}", 0) > 0, f"no {kind} counted: {stats}"


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_a_row_no_server_can_sample_is_given_up_written_down_and_the_run_goes_on(
    tmp_path, model_cache
):
    """Every fifth row is longer than the model's context (no data.max_prompt_length filters
    it): each of its groups fails on a server, which reports it; the replay leases the row
    again, to the other server, gives it up at replay.max_group_failures and names it in
    failed_groups.jsonl, and the run trains on the others without a server restart."""
    data = _verl_style_parquet(tmp_path / "train.parquet", "my_source", too_long_every=5)
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    run_dir = _run(
        tmp_path,
        model_cache,
        f"data.train_files=[{data}]",
        "trainer.total_steps=6",
        f"reward.custom.path={reward}",
        "replay.max_group_failures=2",
        "rollout.num_servers=2",
        "trainer.save_final=false",
    )
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))
    replay = json.loads((run_dir / "stats" / "replay.json").read_text())
    servers = [json.loads((run_dir / "stats" / f"server_{i}.json").read_text()) for i in (0, 1)]
    failed = read_jsonl(run_dir / "failed_groups.jsonl")
    assert replay["rows_given_up"] == len(failed) >= 1, (replay, servers)
    assert replay["groups_failed"] <= sum(s["client_groups_reported_failed"] for s in servers)
    assert replay.get("server_epochs_replaced", 0) == 0
    for record in failed:
        assert record["failures"] == 2 and "leaves no room to sample" in record["error"]
    # each row given up failed once on each server: the first failure's server did not get it
    # back (the replay logs every failure it retries, and the give-up names the last server)
    first: dict[str, str] = {}
    log_text = (run_dir / "logs" / "replay.log").read_text()
    for server, row in re.findall(r"server_(\d) could not sample group (\d+)-", log_text):
        first.setdefault(row, server)
    for record in failed:
        row = record["group_id"].split("-")[0]
        assert first[row] != str(record["server_id"]), (row, first[row], record)


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_validation_then_eval_of_the_final_checkpoint(tmp_path, model_cache):
    run_dir = _run(
        tmp_path,
        model_cache,
        "trainer.total_steps=20",
        "trainer.val_every=10",
        "trainer.logger=[console,jsonl,wandb]",
    )
    val = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/mean_score" in r]
    assert [r["step"] for r in val] == [10, 20]
    assert val[-1]["val/num_prompts"] == 100
    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert offline and offline[0].stat().st_size > 0

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "asyncrl.launch.cli", "data", "arith", "--output", str(data)],
        check=True,
    )
    # the overrides after --data (as the README writes it), the results in the eval's run dir
    subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "eval",
            "--data",
            str(data / "val.parquet"),
            f"trainer.model_path={run_dir / 'final'}",
            f"trainer.run_dir={tmp_path / 'eval_run'}",
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    [out] = (tmp_path / "eval_run" / "eval").glob("eval-*.json")
    assert not (tmp_path / "eval_results.json").exists()
    result = json.loads(out.read_text())
    # greedy on the same 100 questions and the same weights: equal up to batch numerics
    assert abs(result["mean_score"] - val[-1]["val/mean_score"]) <= 0.03
