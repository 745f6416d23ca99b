"""The embedded reward model: a tiny sequence classifier that prefers right answers to `arith`.

It lets a run learn the embedded task without the rule reward (`reward.rule_weight=0`,
`reward.model.path=<this directory>`): the reward-model server scores each response with this
model's single logit. Nothing is downloaded: `prepare_reward_model` builds a randomly
initialised `LlamaForSequenceClassification` on the embedded policy's tokenizer, trains it for a
few hundred supervised steps on (correct, wrong) answers to the task's questions and saves a
plain Hugging Face directory that `AutoModelForSequenceClassification.from_pretrained` loads.

Training, and why it departs from a plain classifier fit:
1. Every text is rendered exactly as the reward-model server renders a rollout: the tokenizer's
   chat template over the prompt messages plus `{"role": "assistant", "content": response}`, so
   the model is trained on the very ids it will score (`render_scored`).
2. Loss: binary cross-entropy on the logit, each batch half correct and half wrong answers to
   the same prompts. Chosen over a pairwise Bradley-Terry loss because it fixes the logit's
   offset: a positive score means "probably right", so the score means the same thing mixed
   with a rule reward (`reward.rule_weight`) or fed to an estimator without a group baseline,
   while the balanced pairs still teach the ranking that the held-out accuracy measures.
   (Measured with only near wrong answers: neither loss learned in 300 steps, so the choice
   was not decided by speed.)
3. An auxiliary next-token loss on the correct answers, read through the tied input embedding
   (nothing extra is saved), meant to give the body a dense signal to compute the sum (as the
   embedded policy's warm-start learns it). Its gain is not established: over seeds 0-3 of
   the test's recipe (500 steps of 16 prompts) held-out accuracy was 0.74-0.98 with it and
   0.76-1.00 without; what made training learn at all was point 4.
4. Three quarters of the wrong answers are any other number in range, a quarter the policy's
   own noise (off by 1 or 2, as `ArithmeticTask.demonstration` makes them): the far ones give
   a gradient early, the near ones are what the held-out accuracy and a warm-started policy
   present. Measured over seeds 0-7 at 400 steps of 16 prompts: only near wrong answers
   never learned in 300 steps; half far gave held-out accuracy 0.60-0.93, three quarters
   far 0.78-1.00. A third of the far ones are the right answer with a digit written before
   or after it (see `far_wrong`): that costs a little (0.73-0.98 at 400 steps) and closes an
   opening for reward hacking.
5. One torch thread while training: the model is so small that intra-op threads cost more
   than they give, and on 2 shared cores they made a 14 s build take over 5 minutes.

Invariant: the cache directory for one (spec, task, steps, seed) exists only when complete
(written to a temporary sibling and renamed into place), as for the embedded policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerBase

from asyncrl.demo.tasks import ArithmeticTask
from asyncrl.demo.tiny_model import build_tokenizer

FORMAT_VERSION = 2
"""Bump when the tokenizer, template, model or training recipe changes: old caches go stale."""

EVAL_SEED_OFFSET = 1_000_003
"""The held-out prompts' stream is seeded apart from the training stream's."""


@dataclass(frozen=True)
class RewardModelSpec:
    """Shape and training recipe of the embedded reward model (measured on 2 shared cores)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    batch_prompts: int = 32
    """Prompts per step; each gives one correct and one wrong text."""
    lr: float = 1e-3
    """Peak learning rate (linear warm-up, then cosine decay to a tenth)."""
    warmup_steps: int = 20
    aux_weight: float = 1.0
    """Weight of the auxiliary next-token loss on correct answers (point 3 of the docstring)."""
    p_far_wrong: float = 0.75
    """Share of training wrong answers drawn from the whole range rather than off by 1 or 2."""


def reward_model_key(
    task: ArithmeticTask, steps: int, seed: int, spec: RewardModelSpec
) -> dict[str, Any]:
    """Everything that determines the cached directory's contents."""
    return {
        "kind": "reward_model",
        "format": FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "task": dataclasses.asdict(task),
        "steps": steps,
        "seed": seed,
    }


def reward_model_dir(cache_dir: str | Path, key: dict[str, Any]) -> Path:
    """The directory of the reward model built for `key` (it exists only once complete)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"tiny-rm-{digest}"


def build_reward_model(
    tokenizer: PreTrainedTokenizerBase, spec: RewardModelSpec, seed: int
) -> LlamaForSequenceClassification:
    """A randomly initialised float32 one-label Llama classifier with `pad_token_id` set (so
    Hugging Face scores each text at its last non-padding token), seeded without touching the
    caller's global RNG state."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.num_labels = 1  # a settable property; LlamaConfig's typed signature lacks it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps `to` with functools.wraps(Module.to), which mypy reads unbound
        return LlamaForSequenceClassification(config).to(torch.float32)  # type: ignore[arg-type]


def render_scored(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], response: str
) -> list[int]:
    """The ids the reward-model server scores for `response` to `messages`: the chat template
    over the messages plus the response as an assistant message."""
    rendered: Any = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": response}], tokenize=True
    )
    if not isinstance(rendered, list):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


def near_wrong(rng: random.Random, correct: int) -> int:
    """A wrong answer as the warm-started policy makes them: off by 1 or 2, never negative
    (the noise of `ArithmeticTask.demonstration`)."""
    answer = max(0, correct + rng.choice([-2, -1, 1, 2]))
    return answer + 1 if answer == correct else answer


def far_wrong(rng: random.Random, correct: int, largest: int) -> int:
    """Any wrong answer in 0..largest + 1, or (one time in three) the right answer with a digit
    written before or after it (`77`, `70`, `17` for 7): without these, the right digits
    followed by more digits scored above zero half the time, an opening for reward hacking."""
    if rng.random() < 1 / 3:
        digit = str(rng.randint(0, 9))
        return int(digit + str(correct) if rng.random() < 0.5 else str(correct) + digit)
    answer = rng.randint(0, largest)
    return answer + 1 if answer == correct else answer


@dataclass
class PairBatch:
    """Texts of one step: row 2i is prompt i's correct answer, row 2i + 1 a wrong one."""

    input_ids: torch.Tensor  # (2n, length), right-padded with the pad id
    attention_mask: torch.Tensor  # (2n, length), 1 on real tokens
    labels: torch.Tensor  # (2n,) float: 1.0 correct, 0.0 wrong
    answer_mask: torch.Tensor  # (2n, length): 1 on the answer's tokens and its end token


def pair_batch(
    task: ArithmeticTask,
    tokenizer: PreTrainedTokenizerBase,
    rng: random.Random,
    prompts: int,
    p_far_wrong: float,
) -> PairBatch:
    """`prompts` random questions of `task`, each rendered with its correct answer and a wrong
    one (far w.p. `p_far_wrong`, else near)."""
    rows: list[tuple[list[int], int]] = []
    for _ in range(prompts):
        a, b = rng.randint(0, task.max_operand), rng.randint(0, task.max_operand)
        messages = task.row(a, b)["prompt"]
        prompt_len = len(render_scored(tokenizer, messages, "")) - 1  # all but the end token
        if rng.random() < p_far_wrong:
            wrong = far_wrong(rng, a + b, 2 * task.max_operand)
        else:
            wrong = near_wrong(rng, a + b)
        for answer in (a + b, wrong):
            rows.append((render_scored(tokenizer, messages, str(answer)), prompt_len))
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    answer_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        answer_mask[i, prompt_len : len(ids)] = 1
    labels = torch.tensor([1.0, 0.0] * prompts)
    return PairBatch(input_ids, attention_mask, labels, answer_mask)


def training_loss(
    model: LlamaForSequenceClassification, batch: PairBatch, aux_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, classification loss) of one batch.

    The logit is read at each row's last real token, as Hugging Face's forward does with
    right padding; the auxiliary loss predicts the correct rows' answer tokens (and end token)
    from the body's hidden states through the tied input embedding.
    """
    hidden = model.model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask
    ).last_hidden_state
    last = batch.attention_mask.sum(dim=1) - 1
    logits = model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    if aux_weight == 0.0:
        return bce, bce
    correct = batch.labels > 0.5
    lm_logits = hidden[correct, :-1] @ model.model.embed_tokens.weight.T
    targets = batch.input_ids[correct, 1:]
    weights = batch.answer_mask[correct, 1:].float()
    nll = torch.nn.functional.cross_entropy(
        lm_logits.reshape(-1, lm_logits.size(-1)), targets.reshape(-1), reduction="none"
    )
    aux = (nll * weights.reshape(-1)).sum() / weights.sum()
    return bce + aux_weight * aux, bce


def train_reward_model(
    model: LlamaForSequenceClassification,
    tokenizer: PreTrainedTokenizerBase,
    task: ArithmeticTask,
    steps: int,
    seed: int,
    spec: RewardModelSpec,
    log: Callable[[str], None] = print,
) -> None:
    """`steps` AdamW steps on `pair_batch`es (fp32, on CPU), in place; the learning rate warms
    up linearly, then decays by a cosine to a tenth of its peak."""
    if steps <= 0:
        return
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # point 5 of the module docstring
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for step in range(steps):
                batch = pair_batch(task, tokenizer, rng, spec.batch_prompts, spec.p_far_wrong)
                loss, bce = training_loss(model, batch, spec.aux_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                if step % 50 == 0 or step == steps - 1:
                    elapsed = time.perf_counter() - start
                    log(
                        f"reward-model step {step + 1}/{steps} loss {loss.item():.4f} "
                        f"bce {bce.item():.4f} {elapsed:.1f}s"
                    )
    finally:
        torch.set_num_threads(threads)
    model.eval()


@torch.inference_mode()
def heldout_accuracy(
    model: LlamaForSequenceClassification,
    tokenizer: PreTrainedTokenizerBase,
    task: ArithmeticTask,
    seed: int,
    prompts: int = 400,
) -> tuple[float, float]:
    """(share of fresh prompts where score(correct) > score(near wrong), mean logit gap).

    Fresh prompts come from a stream seeded apart from training's; the wrong answers are all
    near ones (the policy's noise), the hard case. Scores come from the model's own forward
    (the path `AutoModelForSequenceClassification` users and the reward-model server take).
    The embedded task has only (max_operand + 1)^2 questions, so these prompts are questions
    the model has seen, with answers drawn afresh.
    """
    rng = random.Random(seed + EVAL_SEED_OFFSET)
    batch = pair_batch(task, tokenizer, rng, prompts, p_far_wrong=0.0)
    was_training = model.training
    model.eval()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    model.train(was_training)
    gap = logits[0::2, 0] - logits[1::2, 0]
    return float((gap > 0).float().mean()), float(gap.mean())


def prepare_reward_model(
    cache_dir: str | Path,
    task: ArithmeticTask,
    steps: int,
    seed: int,
    log: Callable[[str], None] = print,
    spec: RewardModelSpec = RewardModelSpec(),  # noqa: B008 (frozen, so a shared default is safe)
) -> Path:
    """The trained embedded reward model as a Hugging Face directory, built once and cached.

    A hit returns at once without retraining; a miss builds, trains, measures the held-out
    accuracy (logged and saved as `asyncrl_reward_model.json` beside the weights) and renames a
    finished temporary directory into place (if two processes race, the first rename wins).
    """
    cache_dir = Path(cache_dir)
    key = reward_model_key(task, steps, seed, spec)
    final = reward_model_dir(cache_dir, key)
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_reward_model(tokenizer, spec, seed)
    start = time.perf_counter()
    train_reward_model(model, tokenizer, task, steps, seed, spec, log)
    train_s = time.perf_counter() - start
    accuracy, gap = heldout_accuracy(model, tokenizer, task, seed)
    log(f"reward model: held-out accuracy {accuracy:.3f}, mean logit gap {gap:.2f}")
    report = {"key": key, "heldout_accuracy": accuracy, "mean_gap": gap, "train_s": train_s}
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "asyncrl_reward_model.json").write_text(json.dumps(report, indent=1))
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent builder finishing first is the only benign case
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m asyncrl.demo.reward_model --out DIR [--steps N] [--seed S] [--cache-dir C]`:
    the model is built in (or taken from) the cache, then copied to DIR, a plain Hugging Face
    directory for `reward.model.path=DIR`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the model to")
    parser.add_argument("--steps", type=int, default=600, help="supervised steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9, help="the arith task's operands")
    parser.add_argument("--cache-dir", default=".asyncrl_cache", help="trainer.cache_dir")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "asyncrl_reward_model.json").is_file():
        parser.error(f"--out {out} is not empty and holds no reward model: choose another")
    path = prepare_reward_model(
        args.cache_dir, ArithmeticTask(max_operand=args.max_operand), args.steps, args.seed
    )
    shutil.copytree(path, out, dirs_exist_ok=True)
    report = json.loads((out / "asyncrl_reward_model.json").read_text())
    print(
        f"{out}: held-out accuracy {report['heldout_accuracy']:.3f}, "
        f"mean logit gap {report['mean_gap']:.2f}, trained in {report['train_s']:.1f}s"
    )


if __name__ == "__main__":
    main()
