"""The whole pipeline with real processes and sockets: 2 rollout servers, a 2-rank FSDP2
learner, the replay, gloo weight broadcast, on a tiny model."""

import json
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl
from asyncrl.weights.shm import SHM_DIR

pytestmark = pytest.mark.integration

STEPS = 4


def _run(tmp_path: Path, cache: Path, max_staleness: int, extra: list[str]) -> Path:
    cfg = load_config(
        overrides=[
            *extra,
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={cache}",
            "trainer.warmstart_steps=100",
            f"trainer.total_steps={STEPS}",
            "trainer.log_samples=true",
            "learner.weight_checksum=true",
            "learner.world_size=2",
            "learner.micro_batch_size=8",
            "rollout.num_servers=2",
            "rollout.n=4",
            "rollout.max_concurrent_groups=4",
            "data.train_batch_size=4",
            f"replay.max_staleness={max_staleness}",
            "learner.bucket_mb=0.25",
            "launch.progress=none",
            "launch.startup_timeout_s=120",
        ]
    )
    return launch(cfg)


BF16 = [
    "learner.dtype=bfloat16",
    "rollout.dtype=bfloat16",  # weights go out in bf16, half the bytes
    "learner.max_tokens_per_micro_batch=64",
    "learner.warmup_steps=2",
    "learner.lr=3e-4",
]


LORA = ["learner.lora.rank=4", "learner.lr=5e-3"]  # adapters on two FSDP ranks, synced alone
INFLIGHT = ["rollout.weight_update_mode=inflight"]  # versions land between decode steps
GLOO = ["launch.weight_transport=gloo"]  # the wire transport, forced (one host picks shm)


def assert_transports(run_dir: Path, transport: str) -> None:
    """Every server joined the weight sync over `transport`, and no process of the run left a
    /dev/shm segment (a live process's is another test's)."""
    joined = [r for r in read_jsonl(run_dir / "sync_members.jsonl") if r["event"] == "joined"]
    assert joined and {r["transport"] for r in joined} == {transport}
    left = [p.name for p in SHM_DIR.glob("asyncrl-ws-*") if not _alive(p.name.split("-")[2])]
    assert not left, f"the run left /dev/shm segments: {left}"


def _alive(pid: str) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize(
    ("max_staleness", "extra"),
    [  # one case in the default tier; the others (half a minute each) in the `long` tier
        pytest.param(0, [], marks=pytest.mark.long),
        (2, []),
        *(pytest.param(2, x, marks=pytest.mark.long) for x in (BF16, LORA, INFLIGHT, GLOO)),
    ],
    ids=["sync", "async", "async-bf16", "async-lora", "async-inflight", "async-gloo"],
)
def test_two_servers_two_rank_learner(tmp_path, model_cache, max_staleness, extra):
    run_dir = _run(tmp_path, model_cache, max_staleness, extra)

    assert_transports(run_dir, "gloo" if extra is GLOO else "shm")  # one host: shm by default

    metrics = read_jsonl(run_dir / "metrics.jsonl")  # versions advance, a line per step
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    # what the pipeline is doing, every step: fleet, replay, latency, staleness histogram
    for m in metrics[1:]:
        for key in (
            "server_idle_ratio",
            "generation_pause_s",
            "replay_groups_ready",
            "replay_groups_in_flight",
            "traj_latency_p50_s",
            "traj_latency_p99_s",
            "train_tokens_per_s",
            "weight_sync_s",
            "response_len_p50",
            "versions_per_sample",
            "multi_version_frac",
        ):
            assert key in m, f"metric {key} missing"
        assert 0.0 <= m["server_idle_ratio"] <= 1.0
        assert m["traj_latency_p50_s"] <= m["traj_latency_p99_s"]
        assert sum(m["staleness_hist"]) == m["samples"]
        assert len(m["staleness_hist"]) <= max_staleness + 1
    spans = {p.stem: read_jsonl(p) for p in (run_dir / "trace").glob("*.jsonl")}
    assert {"learner_0", "server_0", "server_1"} <= spans.keys()
    assert {"fetch_batch", "update", "broadcast_weights"} <= {s["name"] for s in spans["learner_0"]}
    assert any(s["name"] == "generate" for s in spans["server_0"] + spans["server_1"])
    assert any(s["name"] == "apply_weights" for s in spans["server_0"])

    # after each sync every server's weights equal the learner's (and the initial ones did too)
    learner = {r["version"]: r["checksum"] for r in read_jsonl(run_dir / "weights_learner.jsonl")}
    assert sorted(learner) == list(range(0, STEPS + 1))
    assert learner[STEPS] != learner[0]  # training really changed the weights
    for i in range(2):
        server = {
            r["version"]: r["checksum"] for r in read_jsonl(run_dir / f"weights_server_{i}.jsonl")
        }
        if extra is LORA:  # the adapters applied (an engine has none before the first sync)
            assert server.pop(0) is None and learner.get(0) is not None
            server[0] = learner[0]
        assert server == learner, f"server {i} weights differ from the learner's"

    # no trained token broke the staleness bound; no trajectory trained twice
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == STEPS
    used = Counter()
    for s in samples:
        assert all(s["learner_version"] - v <= max_staleness for v in s["oldest_versions"])
        used.update(s["traj_ids"])
    assert used and max(used.values()) == 1
    if max_staleness == 0:
        assert all(v == s["learner_version"] for s in samples for v in s["oldest_versions"])

    # every trajectory was acknowledged exactly once: nothing duplicated, nothing left unacked
    stats = json.loads((run_dir / "stats" / "replay.json").read_text())
    servers = [json.loads((run_dir / "stats" / f"server_{i}.json").read_text()) for i in range(2)]
    assert stats["duplicates"] == 0
    assert sum(s.get("client_ack_accepted", 0) for s in servers) == stats["accepted"]
    assert sum(s["client_sent"] for s in servers) == stats["accepted"] + stats.get("late", 0)
    assert all(s["unacked_at_exit"] == 0 for s in servers)
    # (with max_staleness=0 one server may get every lease: the other then reports zeros)
    assert stats["accepted"] >= len(used)

    # the learning rate follows the schedule: warmup (lr/3, 2lr/3), then constant
    if "learner.warmup_steps=2" in extra:
        lrs = [m["lr"] for m in metrics]
        assert lrs == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4][:STEPS])
    else:
        assert len({m["lr"] for m in metrics}) == 1

    # the final weights are an ordinary Hugging Face model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.long
def test_the_embedded_default_learns_with_a_bf16_learner(tmp_path, model_cache):
    """The default as shipped, with learner.dtype=bfloat16 (fp32 engine), run through the
    Python entry point (`asyncrl.run`: a loaded `Config` changed in Python, plus overrides): the reward
    rises as in fp32 (~0.30 -> ~0.77 over the first 200 steps)."""
    import asyncrl

    steps = 200
    cfg = load_config()  # configs/default.yaml; a bare Config() has the library's defaults
    cfg.trainer.total_steps = steps  # assignments are validated as the YAML is
    cfg.trainer.cache_dir = str(model_cache)
    result = asyncrl.run(
        cfg,
        [f"trainer.run_dir={tmp_path / 'run'}", "learner.dtype=bfloat16", "launch.progress=none"],
    )
    run_dir, rows = result.run_dir, result.metrics
    assert run_dir == tmp_path / "run" and result.final == rows[-1]
    assert_transports(run_dir, "shm")  # the default, on one host
    assert len(rows) == steps
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-20:]) / 20
    assert last > 0.55 and last - first > 0.25, f"reward {first:.3f} -> {last:.3f}"


@pytest.mark.long
def test_hf_server_updates_weights_in_flight(tmp_path, model_cache):
    """`weight_update_mode=inflight` at max_staleness=1 through the whole pipeline: versions
    land between decode steps of running requests, so some trajectories span two versions, and
    no trained sample's oldest token breaks the bound. (Per-token exactness against each
    version's forward: tests/unit/test_inflight.py, with the real weight broadcast.)"""
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={model_cache}",
            "trainer.warmstart_steps=0",  # an untrained model answers long: versions land mid-way
            "trainer.total_steps=6",
            "trainer.log_samples=true",
            "rollout.weight_update_mode=inflight",
            # one sequence at a time: generating a batch outlasts a learner step, so the server
            # is always busy and each version finds a request in flight
            "rollout.hf.max_batch_size=1",
            "rollout.max_new_tokens=200",
            "rollout.n=4",
            "rollout.max_concurrent_groups=2",
            "data.train_batch_size=8",
            "replay.max_staleness=1",
            "launch.progress=none",
            "launch.startup_timeout_s=120",
        ]
    )
    run_dir = launch(cfg)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, 7))
    assert any(m["multi_version_frac"] > 0 for m in metrics), metrics
    assert all(m["staleness_max"] <= 1 for m in metrics)
    for s in read_jsonl(run_dir / "samples.jsonl"):
        assert all(s["learner_version"] - v <= 1 for v in s["oldest_versions"]), s
