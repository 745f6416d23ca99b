"""Drain vs inflight weight updates in the pipeline model (tools/sim_weight_updates.py), their
calibration from a bench_pipeline --modes record (tools/simulate.py), and the benchmark agent
loop that fixes each response's length (tools/bench_agents.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest

from asyncrl.analysis import pipeline_server as ps
from asyncrl.analysis.pipeline_inputs import Costs, Fleet, Lengths
from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tools():
    """(sim_weight_updates, simulate, bench_agents), imported as the scripts import them."""
    sys.path.insert(0, str(ROOT / "tools"))
    names = ("sim_weight_updates", "simulate", "bench_agents")
    yield tuple(_load(n) for n in names)
    for n in names:
        sys.modules.pop(n, None)
    sys.path.remove(str(ROOT / "tools"))


COSTS = Costs(
    gen_batch_s=0.002,
    gen_step_s=0.002,
    gen_seq_step_s=1e-4,
    train_step_s=0.02,
    train_token_s=2e-5,
    fetch_s=0.001,
    broadcast_s=0.005,
    broadcast_per_server_s=0.0,
    apply_s=0.004,
    score_s=0.0005,
    lease_s=0.002,
    deliver_s=0.001,
    prompt_tokens=7.0,
)


def fleet(lengths: str, engine: str = "continuous", staleness: int = 2, *overrides: str):
    """Groups of 4, batches of 4 groups, 8 held per server, training packed (real tokens)."""
    cfg = load_config(
        overrides=[
            "rollout.n=4",
            "data.train_batch_size=4",
            "rollout.max_concurrent_groups=8",
            f"replay.max_staleness={staleness}",
            "rollout.max_new_tokens=256",
            "learner.packing=true",
            *overrides,
        ]
    )
    return Fleet(cfg, Lengths.parse(lengths), batching=engine)


ONE_ROW = ("rollout.n=1", "data.train_batch_size=1", "algorithm.adv_estimator=reinforce_plus_plus")
"""A fleet sampling one row at a time (an estimator without a group baseline takes groups of 1)."""


def both(sw, lengths, engine="continuous", staleness=2, recompute_token_s=0.0):
    """Each weight-update mode on `fleet(lengths, engine, staleness)`: 60 steps, 10 warm-up."""
    recompute = sw.RecomputeCosts(0.0, recompute_token_s)
    return {
        m: sw.simulate_mode(
            fleet(lengths, engine, staleness, f"rollout.weight_update_mode={m}"),
            COSTS,
            recompute,
            steps=60,
            warmup=10,
            seed=0,
        )
        for m in ("drain", "inflight")
    }


@pytest.mark.parametrize("staleness", [0, 2])
def test_equal_lengths_static_batches_drain_equals_inflight(tools, staleness):
    """Rows of a static batch all end together, so waiting for the batch's end (drain) costs
    no throughput against applying mid-batch (inflight, recompute free here)."""
    sw = tools[0]
    r = both(sw, "fixed:40", "static", staleness)
    assert r["inflight"].samples_per_s == pytest.approx(r["drain"].samples_per_s, rel=0.02)
    assert r["inflight"].stall_per_sync_s == pytest.approx(COSTS.apply_s)
    batch_s = COSTS.gen_batch_s + 40 * (COSTS.gen_step_s + 32 * COSTS.gen_seq_step_s)
    assert COSTS.apply_s - 1e-9 <= r["drain"].stall_per_sync_s <= batch_s + COSTS.apply_s


def test_synchronous_runs_are_the_same_in_both_modes(tools):
    """max_staleness=0: a version arrives when nothing is in flight, so the modes coincide."""
    sw = tools[0]
    r = both(sw, "lognormal:24:1.2", "continuous", 0)
    assert r["inflight"].samples_per_s == pytest.approx(r["drain"].samples_per_s, rel=1e-9)
    assert r["inflight"].multi_version_frac == 0.0


def test_long_tail_drain_stalls_on_the_longest_inflight_never_waits(tools):
    sw = tools[0]
    r = both(sw, "lognormal:16:1.2")
    drain, inflight = r["drain"], r["inflight"]
    # inflight: a version holds generation back exactly for its apply, never for a row
    assert inflight.stall_per_sync_s == pytest.approx(COSTS.apply_s, rel=1e-9)
    assert drain.stall_per_sync_s > 5 * COSTS.apply_s  # waits for the longest row in flight
    assert inflight.samples_per_s > 1.2 * drain.samples_per_s
    # drain: every response has one version; inflight: long ones span two or more
    assert drain.multi_version_frac == 0.0
    assert 0.0 < inflight.multi_version_frac < 1.0
    for r_ in (drain, inflight):
        assert sum(r_.staleness_hist) == (60 - 10) * 4 * 4  # oldest token within the bound
        assert len(r_.staleness_hist) <= 3


def test_drain_applies_only_with_nothing_live(tools):
    """Drain: no generation span of a server overlaps one of its applies, and every apply
    starts when that server's generation has stopped."""
    sw = tools[0]
    r = both(sw, "lognormal:16:1.2")["drain"]
    gen = [(s, e) for kind, _, s, e in r.spans if kind == "generate"]
    applies = [(s, e) for kind, _, s, e in r.spans if kind == "apply"]
    assert applies and gen
    for a_start, a_end in applies:
        assert all(ge <= a_start + 1e-12 or gs >= a_end - 1e-12 for gs, ge in gen)


def test_recompute_costs_inflight_throughput(tools):
    sw = tools[0]
    free = both(sw, "lognormal:16:1.2", recompute_token_s=0.0)["inflight"]
    dear = both(sw, "lognormal:16:1.2", recompute_token_s=5e-4)["inflight"]
    assert dear.samples_per_s < 0.9 * free.samples_per_s
    assert dear.stall_per_sync_s == pytest.approx(free.stall_per_sync_s)  # busy, not stall


def test_one_recompute_by_hand(tools):
    """One server, one row of 10 tokens live when a version lands after step 3 (inflight):
    the row costs prefill + 10 steps + apply + recompute of prompt + 3 tokens."""
    sw = tools[0]
    c = dataclasses.replace(
        COSTS, gen_batch_s=0.5, gen_step_s=1.0, gen_seq_step_s=0.0, apply_s=0.25
    )
    f = fleet("fixed:10", "continuous", 1, *ONE_ROW, "rollout.weight_update_mode=inflight")
    s = sw._ModeSimulation(f, c, sw.RecomputeCosts(0.125, 0.0625), seed=0)
    server = s.servers[0]
    seq = sw._Seq(ps.Group(0, server, 1), 10, 10)
    server.queue.append(seq)
    server.active = (
        f.cfg.rollout.max_concurrent_groups
    )  # no lease requests: this row is all it samples
    server.kick()  # decode starts at t=0: prefill 0.5, then steps of 1.0
    s.after(3.0, server.receive, 1)  # lands during step 3 (2.5 .. 3.5)
    ended = []
    server._finish = lambda seqs: ended.extend((s.now, x) for x in seqs)
    while s._events and not ended:
        s.now, _, fn, args = heapq.heappop(s._events)
        fn(*args)
    recompute = 0.125 + 0.0625 * (c.prompt_tokens + 3)
    assert ended[0][0] == pytest.approx(0.5 + 10 * 1.0 + 0.25 + recompute)
    assert seq.versions == 2 and server.version == 1


# ---- calibration from a --modes record ------------------------------------------------------
def modes_bench(true: Costs, length: int = 48) -> dict:
    """A --modes record whose spans and steps follow `true` exactly (training on real tokens)."""
    runs = {}
    for mode in ("drain", "inflight"):
        spans, steps, t = [], [], 0.0
        for i, b in enumerate([4, 16, 32] * 3):
            dur = true.gen_batch_s + true.gen_step_s * length + true.gen_seq_step_s * b * length
            spans.append(dict(name="generate", proc="s0", ts=10.0 + i, dur=dur, args={"batch": b}))
            apply = true.apply_s if mode == "inflight" else 0.3  # drain: the wait, too
            spans.append(dict(name="apply_weights", proc="s0", ts=10.5 + i, dur=apply))
        for samples in (8, 16, 32, 64):
            tokens = samples * (true.prompt_tokens + length)
            train = true.train_step_s + true.train_token_s * tokens
            t += train + true.broadcast_s + 0.1
            steps.append(
                dict(time=t, samples=samples, step_time_s=train + true.broadcast_s + 0.1)
                | dict(time_fetch_batch_s=0.1, time_broadcast_weights_s=true.broadcast_s)
                | dict(time_update_s=1.0, train_tokens_per_s=tokens)
                | dict(response_len_mean=length, response_len_max=4 * length)
            )
        config = {"num_servers": 1, "max_staleness": 2, "max_new_tokens": 4 * length}
        runs[mode] = dict(config=config, steps=steps, spans=spans, response_lengths=[length])
        runs[mode]["load_avg"] = []
    return {"warmup": 1, "runs": runs, "prefill": {"fixed_s": 0.01, "token_s": 3e-5}}


def test_mode_calibration_recovers_what_it_was_given(tools):
    _, simulate, _ = tools
    true = dataclasses.replace(COSTS, gen_batch_s=0.02, train_token_s=3e-4, apply_s=0.003)
    costs, update = simulate.fit_mode_costs(modes_bench(true))
    for name in ("gen_seq_step_s", "train_step_s", "train_token_s"):
        assert getattr(costs, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    # one length: a batch's fixed and per-step costs are only known together
    batch = costs.gen_batch_s + 48 * costs.gen_step_s
    assert batch == pytest.approx(true.gen_batch_s + 48 * true.gen_step_s, rel=1e-6)
    assert costs.apply_s == pytest.approx(0.003)  # the inflight run's applies, not drain's 0.3
    assert costs.prompt_tokens == pytest.approx(true.prompt_tokens)
    assert (update.recompute_s, update.recompute_token_s) == (0.01, 3e-5)
    timed = {"gen_batch_s": 0.5, "gen_step_s": 0.25, "gen_seq_step_s": 0.125}
    costs, _ = simulate.fit_mode_costs(modes_bench(true) | {"decode": timed})
    assert {k: getattr(costs, k) for k in timed} == timed  # the engine's timing wins


# ---- the benchmark agent loop ---------------------------------------------------------------
def test_lognormal_lengths_have_the_asked_median_and_p99(tools):
    agents = tools[2]
    draws = [agents.lognormal_length(32, 512, 10**6, f"{i}/0/") for i in range(20000)]
    assert statistics.median(draws) == pytest.approx(32, rel=0.05)
    p99 = sorted(draws)[int(0.99 * len(draws))]
    assert p99 == pytest.approx(512, rel=0.1)
    assert agents.lognormal_length(32, 512, 40, "7/1/") <= 40
    assert agents.lognormal_length(32, 512, 10**6, "7/1/") == agents.lognormal_length(
        32, 512, 10**6, "7/1/"
    )
    assert agents.lognormal_sigma(32, 512) == pytest.approx(math.log(16) / 2.3263478740408408)


class FakeEngine:
    """Answers every call with max_new_tokens tokens when EOS is ignored, one token otherwise."""

    def __init__(self):
        self.params = []

    async def generate(self, prompt_ids, params):
        from rollout_servers.engines.base import GenerationOutput

        self.params.append(params)
        n = params.max_new_tokens if params.ignore_eos else 1
        return GenerationOutput([5] * n, [-1.0] * n, 0, "length")


def test_agent_samples_the_same_lengths_for_the_same_row(tools, monkeypatch):
    from asyncrl.demo.tiny_model import build_tokenizer
    from asyncrl.wire.protocol import ChatMessage, PromptItem
    from rollout_servers.engines.base import SamplingParams

    agents = tools[2]
    monkeypatch.setenv(agents.LENGTHS_ENV, "8:64")
    tokenizer = build_tokenizer()

    async def group(group_id: str) -> list[int]:
        engine = FakeEngine()
        loop = agents.LognormalLengthAgent(engine, tokenizer, SamplingParams(max_new_tokens=50))
        prompt = PromptItem(group_id, 4, "x", [ChatMessage("user", "1+1")], "2", {})
        results = await asyncio.gather(*(loop.run(prompt) for _ in range(4)))
        assert all(p.ignore_eos for p in engine.params)
        assert not loop._started  # the finished group is forgotten
        return sorted(len(r.response_ids) for r in results)

    a, b = asyncio.run(group("17-aaaa")), asyncio.run(group("17-bbbb"))
    assert a == b  # same row, another lease: the same lengths
    expected = sorted(agents.lognormal_length(8, 64, 50, f"17/{i}/") for i in range(4))
    assert a == expected and max(a) <= 50
    assert asyncio.run(group("18-aaaa")) != a or asyncio.run(group("19-aaaa")) != a


def test_drain_admits_nothing_between_a_versions_arrival_and_its_apply(tools):
    """One server (drain): row A (10 tokens) decodes from t=0, a version lands at t=3, row B
    (2 tokens) queues at t=4. B may start only once A ended (t=10.5) and the version applied
    (0.25): its prefill 0.5 and 2 steps end it at 13.25, sampled by the new version."""
    sw = tools[0]
    c = dataclasses.replace(
        COSTS, gen_batch_s=0.5, gen_step_s=1.0, gen_seq_step_s=0.0, apply_s=0.25
    )
    f = fleet("fixed:10", "continuous", 1, *ONE_ROW, "rollout.weight_update_mode=drain")
    s = sw._ModeSimulation(f, c, sw.RecomputeCosts(), seed=0)
    server = s.servers[0]
    server.active = (
        f.cfg.rollout.max_concurrent_groups
    )  # no lease requests: these rows are all it samples
    a, b = (sw._Seq(ps.Group(i, server, 1), n, n) for i, n in ((0, 10), (1, 2)))
    server.queue.append(a)
    server.kick()
    s.after(3.0, server.receive, 1)
    s.after(4.0, lambda: (server.queue.append(b), server.kick()))
    ended = {}
    server._finish = lambda seqs: ended.update({id(x): s.now for x in seqs})
    while s._events and len(ended) < 2:
        s.now, _, fn, args = heapq.heappop(s._events)
        fn(*args)
    assert ended[id(a)] == pytest.approx(10.5)
    assert ended[id(b)] == pytest.approx(10.5 + 0.25 + 0.5 + 2.0)
    assert (a.group.versions, b.group.versions) == ([0], [1])
    assert s.stalls[0][1] == pytest.approx(10.75 - 3.0)  # arrival to applied
