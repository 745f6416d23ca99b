"""`asyncrl eval`'s arguments: `--data` takes several files, yet the overrides and a config
typed after it reach the config, in order, and a run with nowhere to write is refused at once."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError
from asyncrl.launch.cli import _move_config_args_out_of_data, build_parser, main


def _parsed(*argv: str):
    ns = build_parser().parse_args(["eval", *argv])
    _move_config_args_out_of_data(ns)
    return ns


def test_overrides_after_data_are_overrides():
    ns = _parsed("--data", "a.parquet", "b.parquet", "trainer.model_path=m", "rollout.n=2")
    assert ns.data == ["a.parquet", "b.parquet"]
    assert ns.args == ["trainer.model_path=m", "rollout.n=2"]


def test_a_config_after_data_is_the_config_and_overrides_keep_their_order():
    ns = _parsed("rollout.n=3", "--data", "a.parquet", "configs/gsm8k.yaml", "rollout.n=2")
    assert ns.data == ["a.parquet"]
    assert ns.args == ["configs/gsm8k.yaml", "rollout.n=3", "rollout.n=2"]


def test_a_data_path_with_an_equals_sign_stays_data():
    ns = _parsed("--data", "data/split=test/x.parquet")
    assert ns.data == ["data/split=test/x.parquet"]


def test_data_naming_no_file_is_refused():
    with pytest.raises(ConfigError, match="names no data file"):
        _parsed("--data", "trainer.model_path=m")


def test_an_address_without_a_run_dir_needs_an_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ASYNCRL_RUN_SECRET", "x" * 64)
    data = tmp_path / "x.parquet"
    code = main(["eval", "--data", str(data), "--address", "tcp://127.0.0.1:1"])
    assert code == 2
    assert "--output" in capsys.readouterr().err
