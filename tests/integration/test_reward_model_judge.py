"""SmolLM2-135M-Instruct as a generative judge (`reward.model.kind=judge`), served by the
reward-model server and asked by the rollout servers' client over a real socket: with the
default template, answer prefix ("Score:") and regex, every answer holds a score.

135M parameters judge sums poorly, so nothing here asserts that right answers score higher
(the figures are printed); what is checked is the path a judge takes: template, chat template,
generation, parsing, batching, the wire. Marked `smollm2`: it runs in CI's vLLM/SmolLM2 step,
which installs the model (`pytest -m "vllm or smollm2"`)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from asyncrl.config.reward import RewardModelConfig
from asyncrl.wire.auth import new_secret, role_key
from asyncrl.wire.protocol import ChatMessage
from asyncrl.wire.reward_protocol import ScoreItem
from asyncrl.wire.sockets import free_port, tcp_address
from reward_models.scorers import setup_scorer
from reward_models.server import RewardModelServer
from rollout_servers.rewards.model_client import RewardModelClient

pytestmark = [pytest.mark.integration, pytest.mark.smollm2]


def _sums(n: int, seed: int = 0) -> tuple[list[ScoreItem], list[bool]]:
    """`n` answers to two-number sums, every other one wrong."""
    rng, items, right = random.Random(seed), [], []
    for i in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        answer = a + b if i % 2 == 0 else a + b + rng.choice([-3, -1, 2, 7])
        question = [ChatMessage("user", f"What is {a} + {b}?")]
        items.append(ScoreItem(question, f"{a} + {b} = {answer}.", "sums", str(a + b)))
        right.append(i % 2 == 0)
    return items, right


async def test_smollm2_judges_over_the_wire_and_every_answer_holds_a_score(smollm2_dir):
    cfg = RewardModelConfig(path=str(smollm2_dir), kind="judge", max_new_tokens=4, max_batch=8)
    secret, address = new_secret(), tcp_address("127.0.0.1", free_port())
    server = RewardModelServer(setup_scorer(cfg, "cpu"), cfg.max_batch, address, secret, 1)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    client = RewardModelClient([address], role_key(secret, "server_0"), 600.0, 300.0)
    client.start()
    try:
        items, right = _sums(8)
        scored = await asyncio.gather(*(client.score(item) for item in items))
    finally:
        client.close()
        stop.set()
        thread.join(timeout=60)
        server.close()

    assert [error for _, error in scored] == [""] * len(items), scored
    stats = server.stats()
    assert stats["items"] == len(items) and stats["score_errors"] == 0
    assert stats["requests"] == 1  # the client's one turn: one request
    good = [s for (s, _), r in zip(scored, right, strict=True) if r]
    bad = [s for (s, _), r in zip(scored, right, strict=True) if not r]
    print(f"judge: right answers {sum(good) / len(good):.2f}, wrong {sum(bad) / len(bad):.2f}")
