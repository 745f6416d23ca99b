"""`data.task=arith_chat` (the real-model demo's task): rows in the verl schema, registered as a
task and a reward, and a reward that only the right last number earns."""

from __future__ import annotations

import itertools

from asyncrl.config import load_config
from asyncrl.data.prompts import setup_task
from asyncrl.demo.chat_tasks import ARITH_CHAT_SOURCE, arith_chat_score, last_integer
from rollout_servers.rewards.functions import REWARD_FNS


def test_the_task_is_registered_and_asks_in_english():
    cfg = load_config(None, ["data.task=arith_chat", "data.task_max_operand=9"])
    task = setup_task(cfg.data)
    rows = list(itertools.islice(task.rows(), 50))
    assert all(r["data_source"] == ARITH_CHAT_SOURCE for r in rows)
    a, b = rows[0]["extra_info"]["a"], rows[0]["extra_info"]["b"]
    assert rows[0]["prompt"] == [
        {"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}
    ]
    assert rows[0]["reward_model"]["ground_truth"] == str(a + b)
    assert len(task.val_rows()) == 100
    assert REWARD_FNS.resolve(ARITH_CHAT_SOURCE)(ARITH_CHAT_SOURCE, "7 + 5 = 12", "12") == 1.0


def test_only_the_last_integer_counts():
    assert last_integer("7 + 5 = 12.") == "12"
    assert last_integer("The answer is 1,012") == "1012"
    assert last_integer("no digits") is None
    assert last_integer("-3") == "-3" and last_integer("007") == "7"
    assert arith_chat_score(ARITH_CHAT_SOURCE, "12", "12") == 1.0
    assert arith_chat_score(ARITH_CHAT_SOURCE, "It is 12, or maybe 13", "12") == 0.0
    # listing every candidate earns nothing unless the right one happens to come last
    assert arith_chat_score(ARITH_CHAT_SOURCE, " ".join(map(str, range(19))), "12") == 0.0
    assert arith_chat_score(ARITH_CHAT_SOURCE, "twelve", "12") == 0.0
    assert arith_chat_score(ARITH_CHAT_SOURCE, "", "12") == 0.0
