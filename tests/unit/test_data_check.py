"""A dataset the run cannot use fails before any fleet starts, naming key, file and row or
column (`asyncrl.launch.data_check`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data.prompts import write_rows
from asyncrl.launch.data_check import DataError, check_data, check_files
from asyncrl.launch.run import reward_sources


def _row(source: str = "openai/gsm8k", i: int = 0, **changes) -> dict:
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i},
    }
    return row | changes


def _write(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> str:
    return str(write_rows(rows, path, schema=schema))


def _check(*overrides: str) -> None:
    check_data(load_config(None, list(overrides)), reward_sources())


def test_the_embedded_default_and_a_good_file_pass(tmp_path):
    _check()
    good = _write(tmp_path / "train.parquet", [_row(i=i) for i in range(5)])
    _check(f"data.train_files=[{good}]", f"data.val_files=[{good}]")


def test_a_missing_file_is_named_with_its_key(tmp_path):
    missing = tmp_path / "val.parquet"
    with pytest.raises(DataError, match=rf"^data.val_files: {missing} does not exist$"):
        _check(f"data.val_files=[{missing}]")


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_text("data_source,prompt\n")
    with pytest.raises(DataError, match=rf"^data.train_files: {bad} cannot be read as parquet"):
        _check(f"data.train_files=[{bad}]")


def test_a_truncated_file_or_a_directory_is_named(tmp_path):
    good = Path(_write(tmp_path / "train.parquet", [_row(i=i) for i in range(50)]))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"^data.train_files: {cut} cannot be read as parquet"):
        _check(f"data.train_files=[{cut}]")
    folder = tmp_path / "folder.parquet"
    folder.mkdir()
    with pytest.raises(DataError, match=rf"^data.val_files: {folder} is not a file$"):
        _check(f"data.val_files=[{folder}]")


def test_a_missing_column_is_named_with_the_columns_there(tmp_path):
    rows = [{k: v for k, v in _row().items() if k != "reward_model"}]
    path = _write(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=r"train.parquet: no column 'reward_model' \(it has"):
        _check(f"data.train_files=[{path}]")


def test_an_empty_file_is_named(tmp_path):
    schema = pa.Table.from_pylist([_row()]).schema
    path = _write(tmp_path / "train.parquet", [], schema=schema)
    with pytest.raises(DataError, match=r"train.parquet has no rows$"):
        _check(f"data.train_files=[{path}]")


def test_a_column_of_a_wrong_type_fails_on_its_first_row(tmp_path):
    path = _write(tmp_path / "val.parquet", [_row(i=i, prompt=i) for i in range(3)])
    with pytest.raises(DataError, match=r"^data.val_files: .*val.parquet: row 0: 'prompt' must"):
        _check(f"data.val_files=[{path}]")


def test_a_row_without_a_data_source_is_named_unless_bad_rows_are_skipped(tmp_path):
    path = _write(tmp_path / "train.parquet", [_row(i=0), _row(i=1), _row(None, i=2)])
    with pytest.raises(DataError, match=r"train.parquet: row 2: missing 'data_source'$"):
        _check(f"data.train_files=[{path}]")
    _check(f"data.train_files=[{path}]", "data.skip_bad_rows=true")


def test_an_unknown_data_source_is_named_with_its_file_and_the_known_ones(tmp_path):
    train = _write(tmp_path / "train.parquet", [_row(), _row("mystery/source")])
    val = _write(tmp_path / "val.parquet", [_row("other/source")])
    with pytest.raises(DataError) as e:
        _check(f"data.train_files=[{train}]", f"data.val_files=[{val}]")
    message = str(e.value)
    assert "'mystery/source' (in " + train in message and "'other/source' (in " + val in message
    assert "'openai/gsm8k'" in message and "'asyncrl/arith'" in message  # the registered ones
    assert "reward.custom.path" in message and "\n" not in message


def test_a_custom_reward_scores_every_source(tmp_path):
    train = _write(tmp_path / "train.parquet", [_row("mystery/source")])
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n"
    )
    _check(f"data.train_files=[{train}]", f"reward.custom.path={reward}")


def test_a_reward_model_alone_needs_no_rule_but_one_combined_with_the_rule_does(tmp_path):
    train = _write(tmp_path / "train.parquet", [_row("mystery/source")])
    model = [f"data.train_files=[{train}]", "reward.model.path=/rm"]
    _check(*model, "reward.rule_weight=0")  # the model's score is the whole reward
    with pytest.raises(DataError, match="no reward function for data_source 'mystery/source'"):
        _check(*model)  # rule_weight 1: the rule is part of the reward


def test_a_tasks_sources_are_checked_too():
    with pytest.raises(DataError, match="'asyncrl/arith' \\(in task 'arith'\\)"):
        check_data(load_config(None, []), ["openai/gsm8k"])


def test_check_files_returns_each_source_with_its_files(tmp_path):
    a = _write(tmp_path / "a.parquet", [_row("x"), _row("y")])
    b = _write(tmp_path / "b.parquet", [_row("y")])
    assert check_files("--data", [a, b]) == {"x": [a], "y": [a, b]}


def test_a_data_error_is_a_config_error_so_the_cli_prints_one_line():
    assert issubclass(DataError, ConfigError)


def test_an_agent_name_the_servers_lack_is_named(tmp_path):
    """A server cannot sample a row naming an agent loop it does not have (red-teaming: such an
    evaluation prompt stopped server_0 and the run)."""
    from asyncrl.launch.run import check_eval_data, check_run_data

    good = _write(tmp_path / "good.parquet", [_row(agent_name="tool_agent"), _row(agent_name="")])
    bad = _write(
        tmp_path / "bad.parquet", [_row(agent_name=""), _row(agent_name="nonexistent_loop")]
    )
    check_run_data(load_config(None, [f"data.train_files=[{good}]", f"data.val_files=[{good}]"]))
    with pytest.raises(
        DataError, match=r"data.val_files: .*bad.parquet: agent_name \['nonexistent_loop'\]"
    ):
        check_run_data(load_config(None, [f"data.train_files=[{good}]", f"data.val_files=[{bad}]"]))
    with pytest.raises(DataError, match="--data: .*'single_turn'"):
        check_eval_data([bad], load_config(None, []))


def test_the_launchers_checks_before_start_import_no_torch():
    """`asyncrl launch` checks datasets, rewards and agent-loop names before any fleet starts;
    those checks must not cost a torch import (about 1.1 s here, on the critical path of every
    launch: the fleets start only after them)."""
    import subprocess
    import sys

    code = (
        "import sys; from asyncrl.config import load_config; "
        "from asyncrl.launch.run import check_run_data; check_run_data(load_config()); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
