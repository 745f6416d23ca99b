"""Reward functions, chosen by a row's `data_source`, computed next to the agent loop.

A reward function has verl's signature, `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict` (a dict carries `score` plus extra metrics), and is called with
keyword arguments, as verl calls it. Built-ins, by data_source:

- `gsm8k_reward_fn` ("openai/gsm8k", "gsm8k"): the last `#### N` of the response against the
  ground truth, compared as numbers.
- `math_reward_fn` (MATH-style sources): the last `\\boxed{...}` against the ground truth, by
  symbolic equivalence (math-verify).
- `code_reward` (code sources; see `code/reward.py`): a row's tests (HumanEval, MBPP,
  stdin/stdout, functional) run in the server's sandbox, judged by trusted code the candidate
  cannot reach. Called directly with the signature above it runs a sandbox of its own.

A user's function is loaded from a file with `load_custom_reward` and then scores every row.
`computer.RewardComputer` calls them, never on the event loop.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.data.gsm8k import gsm8k_final_answer, same_number
from asyncrl.registry import Registry

log = logging.getLogger("asyncrl.rewards")

RewardFn = Callable[..., "float | dict[str, float]"]
FnRef = tuple[str, str, str]
"""How a worker finds a function: ("module", module, qualname) or ("path", file, name)."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


# ---- built-in reward functions ---------------------------------------------------------------
def gsm8k_reward_fn(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
) -> float:
    """1.0 when the last `#### N` equals the ground truth as a number, `format_score` when a
    `#### N` is there but wrong, 0.0 without one (verl's gsm8k rule; `1,000`, `$5`, `-3`, `2.50`
    are all read)."""
    answer = gsm8k_final_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if same_number(answer, ground_truth) else format_score


def last_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces kept), `\\fbox{...}` or `\\boxed N`."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if not text.startswith("{", start):
        token = re.match(r"[^\s$]+", text[start:])
        return token.group(0) if token else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return None  # unbalanced: the response was cut off inside the box


def math_equal(answer: str, ground_truth: str) -> bool:
    """Whether two final answers are mathematically the same (`\\frac{1}{2}` = `0.5`,
    `2\\sqrt{2}` = `\\sqrt{8}`), by math-verify's parse and verify."""
    from math_verify import parse, verify

    if answer.strip() == ground_truth.strip():
        return True
    # math-verify times itself out with SIGALRM, which only the main thread may use; elsewhere
    # the caller's own timeout (the worker pool's) is the bound
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${ground_truth}$", parsing_timeout=limit)
    pred = parse(f"${answer}$", parsing_timeout=limit)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=limit))


def math_reward_fn(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
) -> float:
    """1.0 when the last boxed answer is equivalent to the ground truth (itself boxed or not),
    `format_score` when a boxed answer is there but wrong, else 0.0."""
    answer = last_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    truth = last_boxed_answer(ground_truth) or ground_truth
    return 1.0 if math_equal(answer, truth) else format_score


REWARD_FNS: Registry[RewardFn] = Registry("reward function", "asyncrl.rewards")
"""data_source -> reward function (verl's names for the same datasets); packages add theirs
with `asyncrl.rewards` entry points (the embedded task does, see pyproject.toml)."""
for _source in ("openai/gsm8k", "gsm8k"):
    REWARD_FNS.register(_source, gsm8k_reward_fn)
for _source in (
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
):
    REWARD_FNS.register(_source, math_reward_fn)
for _source in ("code", "codecontests", "apps", "codeforces", "taco", "humaneval", "mbpp"):
    REWARD_FNS.register(_source, "rollout_servers.rewards.code.reward:code_reward")

register_reward = REWARD_FNS.register
"""`@register_reward("my_source")` over a module-level verl-signature function (the worker
processes import it by module and name, so lambdas and closures do not work)."""


def load_custom_reward(path: str | Path, name: str = "compute_score") -> RewardFn:
    """The function `name` from the Python file at `path` (verl's custom_reward_function).

    Raises FileNotFoundError, AttributeError or TypeError with a message naming the file and
    function; an error inside the file propagates as it is.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"custom reward file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"asyncrl_custom_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom reward file {str(path)!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"custom reward file {str(path)!r} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {str(path)!r} is not callable")
    return fn
