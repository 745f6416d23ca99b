"""Prompt datasets in the verl parquet schema: preparing them, inspecting them, reading them.

Users arrive with parquet files written by verl's preprocessing scripts, so the schema is
verl's: `data_source` (picks the reward function), `prompt` (chat messages, or a plain string),
`ability`, `reward_model` (`style`, `ground_truth`) and `extra_info`.

- `write_rows` writes any list of such rows (`asyncrl.data.gsm8k` prepares GSM8K with it).
- `render_prompt_ids` is the one way a prompt becomes token ids (the chat template).
- `inspect_parquet` is what `asyncrl data inspect` prints: a quick look before a long run.
- `PromptReader` is the endless, seeded, resumable row stream the replay leases prompts from.
- A `Task` is a row stream made by code instead of files (the embedded demo task is one); tasks
  are registered in `TASKS` and picked by `data.task` when no `data.train_files` are given.
- `asyncrl.data.rows` checks a row against the schema (`validate_row`) and turns it into the
  lease of one group (`row_to_prompt_item`), for training and evaluation alike; its names are
  importable from here too.

Invariants of `PromptReader`:
- Every row it yields passed `validate_row` (and the length policy when one is set); bad rows are
  found when the reader is built, never halfway through a run.
- The stream is a pure function of (files, weights, seed, shuffle) and the position; `state()`
  captures the position, so a reader restored with `load_state` continues with exactly the rows
  the original would have yielded next: a resumed run neither repeats nor skips prompts.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.data.rows import BadRowError, prompt_messages, validate_row
from asyncrl.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("asyncrl.data.prompts")


class PromptTooLongError(ValueError):
    """A prompt over `max_prompt_length` under the "fail" policy; names file, row and length."""


def write_rows(
    rows: Sequence[dict[str, Any]], path: str | Path, schema: pa.Schema | None = None
) -> Path:
    """Write verl-schema rows to a parquet file (types inferred unless `schema` is given).

    The file appears complete or not at all (written beside it, then renamed), so a reader
    never sees half a dataset. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(list(rows), schema=schema), tmp)
    os.replace(tmp, path)
    return path


# ---- prompts -> token ids -------------------------------------------------------------------
def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> list[int]:
    """The chat template applied to `messages` with the generation prompt, as a flat id list
    (what the engine sees for a prompt; agent loops, the warm-start and evaluation all use it).

    transformers 5 returns a `BatchEncoding` from `apply_chat_template(tokenize=True)` while
    older versions return a list; this normalises both so callers never see the difference.
    """
    rendered: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(rendered, list):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


def prompt_length(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase | None) -> int:
    """Prompt size: tokens after the chat template (the ids the engine sees) with a tokenizer,
    tokens of the joined contents for a tokenizer without a template, else characters."""
    if tokenizer is None:
        return sum(len(m["content"]) for m in messages)
    if getattr(tokenizer, "chat_template", None):
        return len(render_prompt_ids(tokenizer, messages))
    return len(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


# ---- inspect --------------------------------------------------------------------------------
def inspect_parquet(
    path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None, num_rows: int = 3
) -> str:
    """What `asyncrl data inspect FILE` prints: row count, column types, rows per data_source,
    the prompt-length distribution and the first `num_rows` prompts as the model will see them.
    Malformed prompts are counted, not fatal: this is the tool to find them with."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    lines = [f"file: {path}", f"rows: {table.num_rows}", "columns:"]
    lines += [f"  {field.name}: {field.type}" for field in table.schema]
    sources = Counter(str(r.get("data_source")) for r in rows)
    lines.append("data_source:")
    lines += [f"  {name}: {n}" for name, n in sources.most_common()]
    lengths, bad = [], 0
    for r in rows:
        try:
            lengths.append(prompt_length(prompt_messages(r.get("prompt")), tokenizer))
        except ValueError:
            bad += 1
    unit = "tokens" if tokenizer is not None else "characters"
    if lengths:
        p50, p90 = np.percentile(lengths, [50, 90])
        lines.append(
            f"prompt length ({unit}): min {min(lengths)}  p50 {p50:.0f}  p90 {p90:.0f}  "
            f"max {max(lengths)}"
        )
    if bad:
        lines.append(f"malformed prompts: {bad}")
    for i, r in enumerate(rows[:num_rows]):
        truth = (r.get("reward_model") or {}).get("ground_truth")
        lines.append(f"--- row {i} (data_source={r.get('data_source')}, ground_truth={truth!r})")
        lines.append(_render(r.get("prompt"), tokenizer))
    return "\n".join(lines)


def _render(prompt: Any, tokenizer: PreTrainedTokenizerBase | None) -> str:
    try:
        messages = prompt_messages(prompt)
    except ValueError as e:
        return f"<malformed prompt: {e}>"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


# ---- reader ---------------------------------------------------------------------------------
class PromptReader:
    """An endless, seeded, resumable stream of validated rows from one or more parquet files.

    Order: with `weights=None` the files are one dataset (verl's concatenation) and each epoch
    is a fresh permutation of all its rows. With `weights`, each next row's file is drawn with
    those probabilities, and each file runs its own epochs, each reshuffled from the seed.
    `shuffle=False` keeps file order and row order in every epoch.

    Bad rows raise `BadRowError` at construction, or with `skip_bad_rows` are skipped and
    counted. With a tokenizer and `max_prompt_length`, longer prompts are dropped and counted
    (`too_long="filter"`) or raise `PromptTooLongError` (`"fail"`). `counters` holds the tallies.
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        weights: Sequence[float] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        skip_bad_rows: bool = False,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_prompt_length: int | None = None,
        too_long: Literal["filter", "fail"] = "filter",
    ) -> None:
        if not files:
            raise ValueError("PromptReader needs at least one parquet file")
        if too_long not in ("filter", "fail"):
            raise ValueError(f"too_long must be 'filter' or 'fail', got {too_long!r}")
        if max_prompt_length is not None and tokenizer is None:
            raise ValueError("max_prompt_length needs a tokenizer to measure prompts in tokens")
        self.files = [str(f) for f in files]
        self.seed, self.shuffle = seed, shuffle
        self.counters: Counter[str] = Counter()
        self._tables: list[pa.Table] = []
        valid: list[np.ndarray] = []
        for f in self.files:
            table = pq.read_table(f)
            before = Counter(self.counters)
            keep = self._scan(table, f, skip_bad_rows, tokenizer, max_prompt_length, too_long)
            if len(keep) == 0:
                dropped = self.counters - before
                raise ValueError(
                    f"{f}: none of its {table.num_rows} rows is usable ({dropped['bad_rows']} "
                    f"bad, {dropped['too_long']} over max_prompt_length={max_prompt_length})"
                )
            self._tables.append(table)
            valid.append(keep)
        if weights is None:
            self._weights = None
            self._pools = [
                np.stack(
                    [
                        np.concatenate([np.full(len(v), i) for i, v in enumerate(valid)]),
                        np.concatenate(valid),
                    ],
                    axis=1,
                )
            ]
        else:
            self._weights = _normalise_weights(weights, len(self.files))
            self._pools = [np.stack([np.full(len(v), i), v], axis=1) for i, v in enumerate(valid)]
        self._mix = np.random.default_rng(seed)
        self._epochs = [0] * len(self._pools)
        self._positions = [0] * len(self._pools)
        self._orders = [self._order(p, 0) for p in range(len(self._pools))]
        self._served = 0
        log.info("prompt reader: %s", self.summary())

    def _scan(
        self,
        table: pa.Table,
        file: str,
        skip_bad_rows: bool,
        tokenizer: PreTrainedTokenizerBase | None,
        max_prompt_length: int | None,
        too_long: str,
    ) -> np.ndarray:
        keep, index = [], 0
        for batch in table.to_batches(max_chunksize=4096):
            for row in batch.to_pylist():
                try:
                    messages = validate_row(row, file, index)
                except BadRowError as e:
                    if not skip_bad_rows:
                        raise
                    self.counters["bad_rows"] += 1
                    if self.counters["bad_rows"] <= 3:
                        log.warning("skipping %s", e)
                    index += 1
                    continue
                if max_prompt_length is not None:
                    n = prompt_length(messages, tokenizer)
                    if n > max_prompt_length:
                        if too_long == "fail":
                            raise PromptTooLongError(
                                f"{file}: row {index}: prompt is {n} tokens, over "
                                f"max_prompt_length={max_prompt_length}"
                            )
                        self.counters["too_long"] += 1
                        index += 1
                        continue
                keep.append(index)
                index += 1
        self.counters["rows"] += len(keep)
        return np.asarray(keep, dtype=np.int64)

    def summary(self) -> str:
        """One line for the log: usable rows, skipped bad rows, filtered long prompts."""
        c = self.counters
        return (
            f"{c['rows']} rows from {len(self.files)} file(s), {c['bad_rows']} bad rows skipped, "
            f"{c['too_long']} over max_prompt_length filtered"
        )

    def _order(self, pool: int, epoch: int) -> np.ndarray:
        n = len(self._pools[pool])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, pool, epoch]).permutation(n)

    def __iter__(self) -> PromptReader:
        return self

    def __next__(self) -> dict[str, Any]:
        pool = 0
        if self._weights is not None:
            pool = int(self._mix.choice(len(self._pools), p=self._weights))
        if self._positions[pool] == len(self._pools[pool]):
            self._epochs[pool] += 1
            self._positions[pool] = 0
            self._orders[pool] = self._order(pool, self._epochs[pool])
        file_index, row_index = self._pools[pool][self._orders[pool][self._positions[pool]]]
        self._positions[pool] += 1
        self._served += 1
        return self._tables[file_index].slice(int(row_index), 1).to_pylist()[0]

    def state(self) -> dict[str, Any]:
        """The position in the stream, JSON-serialisable (store it with a checkpoint)."""
        return {
            "files": [Path(f).name for f in self.files],
            "pool_sizes": [len(p) for p in self._pools],
            "epochs": list(self._epochs),
            "positions": list(self._positions),
            "mix_rng": self._mix.bit_generator.state,
            "served": self._served,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the reader must be built from the same files and settings.

        Raises ValueError when the files or their usable row counts differ: continuing a
        different dataset from a saved position would silently repeat or skip prompts.
        """
        mine = {
            "files": [Path(f).name for f in self.files],
            "pool_sizes": self.state()["pool_sizes"],
        }
        for key, value in mine.items():
            if list(state.get(key, [])) != value:
                raise ValueError(
                    f"prompt reader state does not fit these files: {key} was "
                    f"{state.get(key)!r}, now {value!r}"
                )
        self._epochs = [int(e) for e in state["epochs"]]
        self._positions = [int(p) for p in state["positions"]]
        self._mix.bit_generator.state = state["mix_rng"]
        self._served = int(state["served"])
        self._orders = [self._order(p, e) for p, e in enumerate(self._epochs)]


def _normalise_weights(weights: Sequence[float], num_files: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_files,):
        raise ValueError(f"{len(weights)} weights for {num_files} files: give one per file")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return w / w.sum()


# ---- tasks: rows made by code ------------------------------------------------------------------
class Task(Protocol):
    """Rows generated by code: an endless, seeded training stream and a fixed validation set."""

    def rows(self) -> Iterator[dict[str, Any]]:
        """An endless stream of verl-schema rows, a pure function of the task's seed."""
        ...

    def val_rows(self) -> list[dict[str, Any]]:
        """The validation rows, in a fixed order."""
        ...


TaskFactory = Callable[[Any], Task]
"""Called with the run's `DataConfig` (seed, and the task's own options)."""

TASKS: Registry[TaskFactory] = Registry("task", "asyncrl.tasks")
"""Tasks by name, for `data.task`. The embedded demo registers `arith` and `arith_tool` through
the `asyncrl.tasks` entry points (pyproject.toml), as any package would."""


def setup_task(data_cfg: Any) -> Task:
    """The task `data_cfg.task` names (a registered name or `package.module:factory`)."""
    return TASKS.resolve(data_cfg.task)(data_cfg)
