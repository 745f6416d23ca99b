"""The datasets of a run, checked before any fleet starts.

A dataset the run cannot use fails here, in the launcher, with one line naming the config key,
the file and, where one is to blame, the row or column, instead of as a traceback from inside
the replay or the learner, or as a run that trains to the end on a reward of 0 (a data_source
with no reward function scores 0 on every sample).

What is checked, reading each file's metadata, its first row and its `data_source` column
(the replay and the learner read the files in full; this does not do it again):
1. the file exists and is parquet;
2. it has the columns every row needs (`REQUIRED_COLUMNS`) and at least one row;
3. its first row fits the schema (`asyncrl.data.rows.validate_row`, as the replay checks every row;
   a column of the wrong type fails here) - for training files only without
   `data.skip_bad_rows`, under which bad rows are the replay's to skip and count;
4. no row lacks a `data_source` (with the same exception);
5. every data_source has a reward function, unless `reward.custom.path` scores every row;
6. every `agent_name` (an optional column) names an agent loop the servers have
   (`check_agent_names`: a server cannot sample a prompt naming another one).
Without files, the task's sources are checked (its first training row and its validation rows).
A bad value in a later row is found by the replay's `PromptReader` when it is built, before the
first lease, and named by file and row in its log, which the launcher's report shows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from asyncrl.config import Config, ConfigError
from asyncrl.config.reward import scored_by_the_model_alone
from asyncrl.data.prompts import setup_task
from asyncrl.data.rows import BadRowError, validate_row

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
"""What every row needs (DESIGN.md's Data section; the other columns are optional)."""


class DataError(ConfigError):
    """A dataset the run cannot use; the message names the config key and the file (and the row
    or column where one is to blame)."""


def check_data(cfg: Config, reward_sources: Collection[str]) -> None:
    """Check `data.train_files` and `data.val_files` (or the task `data.task` where they are
    empty), and that every data_source in them is in `reward_sources` (the registered reward
    functions) unless a custom reward scores every row. Raises DataError."""
    data = cfg.data
    found = check_files("data.train_files", data.train_files, data.skip_bad_rows)
    for source, files in check_files("data.val_files", data.val_files).items():
        found.setdefault(source, []).extend(files)
    if not (data.train_files and data.val_files):
        task = setup_task(data)
        rows = ([] if data.train_files else [next(iter(task.rows()))]) + (
            [] if data.val_files else task.val_rows()
        )
        for source in {str(r.get("data_source")) for r in rows}:
            found.setdefault(source, []).append(f"task {data.task!r}")
    model_alone = scored_by_the_model_alone(cfg.reward)
    check_rewards(found, reward_sources, cfg.reward.custom.path, model_alone)


def check_files(
    key: str, files: Sequence[str], skip_bad_rows: bool = False
) -> dict[str, list[str]]:
    """Check each parquet file (`key` is how errors name the list: a config key, a flag);
    returns each data_source found -> the files it is in."""
    found: dict[str, list[str]] = {}
    for path in files:
        for source in check_parquet(key, path, skip_bad_rows):
            found.setdefault(source, []).append(path)
    return found


def check_parquet(key: str, path: str, skip_bad_rows: bool = False) -> list[str]:
    """Checks 1 to 4 of the module docstring on one file; its data sources, sorted."""
    where = f"{key}: {path}"
    if not Path(path).is_file():
        raise DataError(f"{where} {'is not a file' if Path(path).exists() else 'does not exist'}")
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{where} cannot be read as parquet: {e}") from None
    with parquet:
        columns = parquet.schema_arrow.names
        missing = [c for c in REQUIRED_COLUMNS if c not in columns]
        if missing:
            raise DataError(
                f"{where}: no column {', '.join(map(repr, missing))} (it has {columns}; every "
                f"row needs {list(REQUIRED_COLUMNS)})"
            )
        if parquet.metadata.num_rows == 0:
            raise DataError(f"{where} has no rows")
        if not skip_bad_rows:  # a column of a wrong type fails on its first row
            first = next(parquet.iter_batches(batch_size=1)).to_pylist()[0]
            try:
                validate_row(first, path, 0)
            except BadRowError as e:
                raise DataError(f"{key}: {e}") from None
        column = parquet.read(columns=["data_source"]).column(0)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{where}: column 'data_source' holds {column.type}, not strings")
    if column.null_count and not skip_bad_rows:
        row = pc.index(pc.is_null(column), True).as_py()
        raise DataError(f"{where}: row {row}: missing 'data_source'")
    return sorted(pc.unique(column.drop_null()).to_pylist())


def check_agent_names(key: str, files: Sequence[str], known: Collection[str]) -> None:
    """DataError naming the file and the agent_name values that are no known agent loop (an
    empty value means the configured default)."""
    for path in files:
        with pq.ParquetFile(path) as parquet:
            if "agent_name" not in parquet.schema_arrow.names:
                continue
            column = parquet.read(columns=["agent_name"]).column(0)
        names = {str(n) for n in pc.unique(column.drop_null()).to_pylist()} - {""}
        if unknown := sorted(names - set(known)):
            raise DataError(
                f"{key}: {path}: agent_name {unknown} is no agent loop of the servers; "
                f"registered are {sorted(known)}"
            )


def check_rewards(
    found: dict[str, list[str]],
    reward_sources: Collection[str],
    custom_path: str | None,
    model_alone: bool = False,
) -> None:
    """DataError naming every data_source of `found` without a reward function (and where it
    is), and the registered ones; nothing when a custom reward (`custom_path`) scores them, or
    when the reward model's score is the whole reward (`model_alone`)."""
    if custom_path is not None or model_alone:
        return
    unknown = sorted(set(found) - set(reward_sources))
    if unknown:
        where = "; ".join(f"{s!r} (in {', '.join(dict.fromkeys(found[s]))})" for s in unknown)
        raise DataError(
            f"no reward function for data_source {where}: registered are "
            f"{sorted(reward_sources)}; register one (an `asyncrl.rewards` entry point or "
            "rollout_servers.rewards.functions.register_reward) or set reward.custom.path"
        )
