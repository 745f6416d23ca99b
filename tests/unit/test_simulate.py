"""The pipeline simulator (tools/simulate.py): its invariants, an analytic case, its calibration."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pydantic
import pytest

from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim():
    """tools/simulate.py, imported as its command line does (tools/ first on sys.path: it
    imports tools/sim_weight_updates.py by name)."""
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("simulate", ROOT / "tools" / "simulate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("simulate", None)
    sys.modules.pop("sim_weight_updates", None)
    sys.path.remove(str(ROOT / "tools"))


def long_tailed(sim, engine="static", servers=4, staleness=2, *overrides):
    """Long-tailed lengths on `servers` servers, training padded (`learner.packing=false`)."""
    cfg = load_config(
        overrides=[
            f"rollout.num_servers={servers}",
            "rollout.n=4",
            "data.train_batch_size=6",
            "rollout.max_concurrent_groups=3",
            f"replay.max_staleness={staleness}",
            "rollout.max_new_tokens=96",
            "learner.packing=false",
            *overrides,
        ]
    )
    return sim.Fleet(cfg, sim.Lengths.parse("lognormal:24:1.0"), batching=engine)


def costs(sim, **kw):
    """Costs that are zero except where given (the defaults are a calibration)."""
    zero = {f.name: 0.0 for f in dataclasses.fields(sim.Costs)}
    return sim.Costs(**{**zero, **kw})


COSTS_KW = dict(
    gen_batch_s=0.002,
    gen_step_s=0.003,
    gen_seq_step_s=1e-4,
    train_step_s=0.02,
    train_token_s=2e-4,
    fetch_s=0.002,
    broadcast_s=0.01,
    apply_s=0.005,
    score_s=0.001,
    lease_s=0.004,
    deliver_s=0.005,
    prompt_tokens=7.0,
)


@pytest.mark.parametrize("engine", ["static", "continuous"])
@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_staleness_bound_is_never_exceeded(sim, engine, staleness):
    fleet = long_tailed(sim, engine, staleness=staleness)
    r = sim.simulate(fleet, sim.Costs(**COSTS_KW), steps=40, warmup=5, seed=1)
    assert len(r.staleness_hist) <= staleness + 1
    assert sum(r.staleness_hist) == (40 - 5) * 6 * 4  # every sample after the warm-up, once


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_synchronous_generation_and_training_never_overlap(sim, engine):
    r = sim.simulate(long_tailed(sim, engine, staleness=0), sim.Costs(**COSTS_KW), 30, 5)
    train = [(s, e) for kind, _, s, e in r.spans if kind == "train"]
    gen = [(s, e) for kind, _, s, e in r.spans if kind == "generate"]
    assert train and gen
    for ts, te in train:
        assert all(ge <= ts + 1e-12 or gs >= te - 1e-12 for gs, ge in gen)
    assert r.staleness_hist == [(30 - 5) * 6 * 4]


@pytest.mark.parametrize("staleness", [0, 2])
def test_free_learner_never_makes_a_server_wait(sim, staleness):
    """With no training, sync or latency cost, the one server samples all the time."""
    fleet = dataclasses.replace(
        long_tailed(sim, servers=1, staleness=staleness),
        lengths=sim.Lengths.parse("fixed:32"),
    )
    free = costs(sim, gen_step_s=0.003, gen_seq_step_s=1e-4)
    r = sim.simulate(fleet, free, steps=30, warmup=5)
    assert r.server_idle == pytest.approx(0.0, abs=1e-9)
    assert r.server_pause == 0.0


def test_same_seed_same_result_other_seed_other_result(sim):
    fleet, costs = long_tailed(sim, "continuous"), sim.Costs(**COSTS_KW)
    a, b = (sim.simulate(fleet, costs, 30, 5, seed=7) for _ in range(2))
    c = sim.simulate(fleet, costs, 30, 5, seed=8)
    assert (a.samples_per_s, a.staleness_hist, a.spans) == (
        b.samples_per_s,
        b.staleness_hist,
        b.spans,
    )
    assert c.samples_per_s != a.samples_per_s


@pytest.mark.parametrize(
    ("engine", "t_gen", "t_train"),
    [("static", 0.2, 0.4), ("continuous", 0.4, 0.2), ("continuous", 0.3, 0.3)],
)
def test_async_over_sync_approaches_the_analytic_ratio(sim, engine, t_gen, t_train):
    """One server, fixed lengths, no latencies: a synchronous step takes T_gen + T_train, an
    asynchronous one max(T_gen, T_train)."""
    n, groups, length = 4, 8, 50

    def fleet(staleness):
        cfg = load_config(
            overrides=[
                f"rollout.n={n}",
                f"data.train_batch_size={groups}",
                f"rollout.max_concurrent_groups={groups}",
                f"rollout.max_new_tokens={length}",
                f"replay.max_staleness={staleness}",
            ]
        )
        return sim.Fleet(cfg, sim.Lengths.parse(f"fixed:{length}"), batching=engine)

    tokens = n * groups * (10 + length)
    c = costs(sim, gen_step_s=t_gen / length, train_token_s=t_train / tokens, prompt_tokens=10.0)
    sync = sim.simulate(fleet(0), c, steps=60, warmup=10)
    asyn = sim.simulate(fleet(2), c, steps=60, warmup=10)
    assert sync.samples_per_s == pytest.approx(n * groups / (t_gen + t_train), rel=1e-6)
    ratio = asyn.samples_per_s / sync.samples_per_s
    assert ratio == pytest.approx((t_gen + t_train) / max(t_gen, t_train), rel=0.02)


def test_more_ranks_train_faster(sim):
    slow = dataclasses.replace(sim.Costs(**COSTS_KW), train_token_s=2e-3)
    one = sim.simulate(long_tailed(sim, "static", 8, 0), slow, 20, 4)
    eight = sim.simulate(long_tailed(sim, "static", 8, 0, "learner.world_size=8"), slow, 20, 4)
    assert eight.samples_per_s > 1.5 * one.samples_per_s
    assert eight.learner_idle > one.learner_idle


def test_lengths_are_truncated_and_parsed(sim):
    import random

    lengths = sim.Lengths.parse("lognormal:100:2.0")
    rng = random.Random(0)
    draws = [lengths.sample(rng, max_tokens=128) for _ in range(2000)]
    assert min(draws) >= 1 and max(draws) == 128
    assert sim.Lengths.parse("fixed:7").sample(rng, max_tokens=5) == 5
    with pytest.raises(ValueError, match="lognormal:MEDIAN:SIGMA"):
        sim.Lengths.parse("pareto:2")


def test_expected_max_by_hand(sim):
    # two draws from {1, 2}: the max is 1 only when both are 1 (1/4)
    assert sim.expected_max([1, 2], 2) == pytest.approx(0.25 * 1 + 0.75 * 2)
    assert sim.expected_max([5, 5, 5], 8) == pytest.approx(5.0)


def synthetic_bench(true, length: int, rows: list[int], servers: int = 1) -> dict:
    """A bench_pipeline --json record whose spans and steps follow the `true` costs exactly."""
    spans, steps, t = [], [], 0.0
    for i, b in enumerate(rows * 3):
        dur = true.gen_batch_s + true.gen_step_s * length + true.gen_seq_step_s * b * length
        spans.append(dict(name="generate", proc="s0", ts=10.0 + i, dur=dur, args={"batch": b}))
        spans.append(dict(name="apply_weights", proc="s0", ts=10.5 + i, dur=true.apply_s))
        # the learner's fetch returns once the 2 reward workers scored the batch and it arrived
        arrived = 10.0 + i + dur + true.score_s * math.ceil(b / 2) + true.deliver_s
        spans.append(dict(name="fetch_batch", proc="l0", ts=10.0 + i, dur=arrived - 10.0 - i))
    bcast = true.broadcast_s + true.broadcast_per_server_s * (servers - 1)
    for samples in (8, 16, 32, 64):
        padded = samples * (true.prompt_tokens + length)
        train = true.train_step_s + true.train_token_s * padded
        t += train + bcast + 0.1
        steps.append(
            dict(time=t, samples=samples, step_time_s=train + bcast + 0.1)
            | dict(time_fetch_batch_s=0.1, time_broadcast_weights_s=bcast, time_update_s=1.0)
            | dict(train_tokens_per_s=padded, response_len_mean=length, response_len_max=length)
        )
    config = {"num_servers": servers, "max_staleness": 0, "max_new_tokens": length}
    run = dict(config=config, steps=steps, spans=spans, response_lengths=[length], load_avg=[])
    return {"warmup": 1, "runs": {"sync": run}}


def test_calibration_recovers_the_costs_it_was_given(sim):
    true = costs(
        sim,
        gen_batch_s=0.02,
        gen_step_s=0.003,
        gen_seq_step_s=5e-5,
        train_step_s=0.05,
        train_token_s=2e-4,
        broadcast_s=0.01,
        broadcast_per_server_s=0.004,
        apply_s=0.002,
        score_s=0.0007,
        deliver_s=0.003,
        prompt_tokens=7.0,
    )
    benches = [synthetic_bench(true, 48, [4, 16, 32]), synthetic_bench(true, 96, [8, 32], 3)]
    fitted, report = sim.fit_costs(benches, modes=("sync",))
    latencies = {"lease_s", "fetch_s"}  # from gaps between spans and from async runs
    for name in {f.name for f in dataclasses.fields(sim.Costs)} - latencies:
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert report["generation"]["r2"] == pytest.approx(1.0)


class Reads:
    """A stand-in for a `Config` that records the dotted names of the fields read from it."""

    def __init__(self, node, path: str = "", seen: set[str] | None = None):
        self._node, self._path = node, path
        self.seen = set() if seen is None else seen

    def __getattr__(self, name: str):
        value = getattr(self._node, name)
        if isinstance(value, pydantic.BaseModel):
            return Reads(value, f"{self._path}{name}.", self.seen)
        self.seen.add(self._path + name)
        return value


def test_the_model_reads_exactly_the_config_fields_it_lists(sim):
    from asyncrl.analysis.pipeline_inputs import MODEL_READS

    cfg = Reads(long_tailed(sim, staleness=1).cfg)
    lengths = sim.Lengths.parse("lognormal:24:1.0")
    sim.simulate(sim.Fleet(cfg, lengths, rank_efficiency=0.9), sim.Costs(**COSTS_KW), 20, 4)
    assert cfg.seen == set(MODEL_READS)


def test_the_weight_update_modes_read_the_same_fields_and_the_mode(sim):
    """tools/sim_weight_updates.py (which `sim.mean_mode` runs) takes the mode from the config."""
    from asyncrl.analysis.pipeline_inputs import MODEL_READS

    cfg = Reads(long_tailed(sim, "continuous", 2, 1, "rollout.weight_update_mode=inflight").cfg)
    fleet = sim.Fleet(cfg, sim.Lengths.parse("lognormal:24:1.0"))
    sim.mean_mode(fleet, sim.Costs(**COSTS_KW), sim.RecomputeCosts(), 20, 4, seeds=1)
    assert cfg.seen == {*MODEL_READS, "rollout.weight_update_mode"}


def test_engine_batching_follows_the_config_unless_set():
    from asyncrl.analysis.pipeline_inputs import Fleet, Lengths

    lengths = Lengths.parse("fixed:8")
    for engine, static in (("hf", True), ("vllm", False), ("sglang", False)):
        fleet = Fleet(load_config(overrides=[f"rollout.engine={engine}"]), lengths)
        assert fleet.static_batches is static
    assert not Fleet(load_config(), lengths, batching="continuous").static_batches


def test_predict_reads_a_config_file_then_flags_then_overrides(sim, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  num_servers: 3\n  n: 2\nreward:\n  workers: 4\n")
    argv = ["predict", "--config", str(path), "--n", "4", "reward.workers=5"]
    cfg = sim.predict_config(sim.build_parser().parse_args(argv), staleness=1)
    assert (cfg.rollout.num_servers, cfg.rollout.n, cfg.reward.workers) == (3, 4, 5)
    assert cfg.replay.max_staleness == 1
    # without --config: docs/simulator.md's fleet (64 vLLM servers, 8 ranks, padded training)
    cfg = sim.predict_config(sim.build_parser().parse_args(["predict"]), staleness=0)
    assert (cfg.rollout.num_servers, cfg.learner.world_size, cfg.data.train_batch_size) == (
        64,
        8,
        256,
    )
    assert (cfg.rollout.engine, cfg.learner.packing) == ("vllm", False)
