"""`asyncrl eval`'s arguments: `--data` takes several files, yet the overrides and a config
typed after it reach the config, in order, and a run with nowhere to write is refused at once.
`--run-dir RUN` without `--address` scores RUN's weights: its final ones, unless its latest
checkpoint is newer (a finished run resumed to go further), else that checkpoint's (exported as
a Hugging Face directory), else a clear refusal; the whole path, a
real run through the CLI included, is in tests/integration/test_eval_run_dir.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.checkpoints import PARTS, TRAINER_FILE, final_step, write_final_step
from asyncrl.config import ConfigError, config_to_yaml, load_config
from asyncrl.launch.cli import build_parser, main
from asyncrl.launch.eval_command import _move_config_args_out_of_data
from asyncrl.launch.eval_weights import export_checkpoint, run_weights
from asyncrl.launch.fleet import prepare_model
from learner.checkpoint import save_final_weights, save_sharded
from learner.lora import add_adapters, lora_layers


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


# ---- --run-dir without --address: the run's own weights (issue 40, finding 4) ----------------


def _run_dir(tmp_path: Path, *parts: str) -> Path:
    """A run directory as a launch leaves it (config.yaml of the embedded default, its model
    not warm-started), holding `parts`: "final" and/or checkpoints "step_N"."""
    run = tmp_path / "runs" / "20261129-000000"
    cfg = load_config(None, ["trainer.warmstart_steps=0", f"trainer.cache_dir={tmp_path / 'c'}"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    for part in parts:
        if part == "final":
            (run / "final").mkdir()
            (run / "final" / "config.json").write_text("{}")
            continue
        for name in PARTS:
            (run / "checkpoints" / part / name).parent.mkdir(parents=True, exist_ok=True)
            (run / "checkpoints" / part / name).write_text("x")
    return run


def test_a_finished_run_is_scored_on_its_final_weights(tmp_path):
    run = _run_dir(tmp_path, "step_10", "final")
    weights = run_weights(run)
    assert (weights.path, weights.step) == (run / "final", None)
    assert "final weights" in weights.describe()


def test_a_run_without_final_weights_is_scored_on_its_latest_checkpoint(tmp_path):
    run = _run_dir(tmp_path, "step_10", "step_20")
    (run / "checkpoints" / "step_30.partial").mkdir()  # never finished: not a checkpoint
    weights = run_weights(run)
    assert (weights.path, weights.step) == (run / "checkpoints" / "step_20", 20)
    assert "latest checkpoint, step 20" in weights.describe()


@pytest.mark.parametrize("final_at", [40, 120])
def test_a_resumed_run_is_scored_on_final_only_when_no_checkpoint_is_newer(tmp_path, final_at):
    """A run finished at step 40 (final/ written), then resumed with trainer.total_steps=200
    and interrupted at step 120: final/ is still step 40's, and the eval scored it as "the
    run's final weights". final/ at step 120 (the resumed run got there and finished) wins."""
    run = _run_dir(tmp_path, "step_40", "final", "step_120")
    write_final_step(run / "final", final_at)
    weights = run_weights(run)
    if final_at == 40:
        assert (weights.path, weights.step) == (run / "checkpoints" / "step_120", 120)
        assert "latest checkpoint, step 120" in weights.describe()
        assert "resumed after it finished" in weights.describe()
    else:
        assert (weights.path, weights.step) == (run / "final", None)


@pytest.mark.parametrize("final_newer", [False, True])
def test_final_weights_recording_no_step_are_dated_by_time(tmp_path, final_newer):
    """final/ written before its step was recorded: older than the newest checkpoint's
    trainer.json (a resume wrote it since), the checkpoint is scored; newer, final/."""
    run = _run_dir(tmp_path, "final", "step_120")
    checkpoint_time = 1_000_000
    final_time = checkpoint_time + (10 if final_newer else -10)
    os.utime(run / "checkpoints" / "step_120" / TRAINER_FILE, (checkpoint_time,) * 2)
    os.utime(run / "final" / "config.json", (final_time,) * 2)
    weights = run_weights(run)
    assert weights.step == (None if final_newer else 120)


def test_final_weights_record_their_step(tmp_path):
    cfg = load_config(None, ["trainer.warmstart_steps=0", f"trainer.cache_dir={tmp_path / 'c'}"])
    base = prepare_model(cfg, log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    out = tmp_path / "final"
    save_final_weights(out, model, cfg.learner.lora, base, rank=0, step=40)
    assert final_step(out) == 40 and (out / "config.json").is_file()


def test_a_run_without_weights_is_refused_naming_what_it_lacks(tmp_path, capsys):
    """Before, the eval started a fleet on the model the run started from and scored it as if
    it were the run's (0.55 for a run whose weights scored 0.87)."""
    run = _run_dir(tmp_path)
    data = tmp_path / "x.parquet"
    assert main(["eval", "--data", str(data), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "has no weights to evaluate" in err and "save_every" in err
    assert not (run / "eval").exists()


@pytest.mark.parametrize(
    "given", ["configs/gsm8k.yaml", "trainer.model_path=m", "trainer.run_dir=r"]
)
def test_a_run_dir_decides_the_config_the_model_and_where_results_go(tmp_path, capsys, given):
    run = _run_dir(tmp_path, "final")
    assert main(["eval", "--data", str(tmp_path / "x.parquet"), given, "--run-dir", str(run)]) == 2
    assert "--run-dir" in capsys.readouterr().err


def test_a_checkpoint_is_exported_as_the_runs_model_with_the_trained_weights(tmp_path):
    """The learner's checkpoint (its sharded model and optimizer state, written as the learner
    writes it) becomes a Hugging Face directory that loads the trained weights, every tensor
    equal, the tokenizer beside them."""
    cfg = load_config(None, ["trainer.warmstart_steps=0", f"trainer.cache_dir={tmp_path / 'c'}"])
    base = prepare_model(cfg, log=lambda _: None)
    trained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_7"
    save_sharded(checkpoint, trained, torch.optim.AdamW(trained.parameters()))
    out = export_checkpoint(checkpoint, cfg, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    want = trained.state_dict()
    assert exported.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(exported[name], t, rtol=0, atol=0, msg=name)
    assert (out / "tokenizer_config.json").is_file()


def test_a_lora_checkpoint_is_exported_with_its_adapters_merged(tmp_path):
    """A LoRA run's checkpoint holds the frozen base and the adapters; its export is the merged
    model, W0 + alpha / rank x B A on each adapted layer (computed here from the parts), every
    other weight the base's, as the run's RUN/final would be."""
    cfg = load_config(
        None,
        [
            "trainer.warmstart_steps=0",
            f"trainer.cache_dir={tmp_path / 'c'}",
            "learner.lora.rank=4",
            "learner.lora.alpha=8",
        ],
    )
    base = prepare_model(cfg, log=lambda _: None)
    adapted = add_adapters(AutoModelForCausalLM.from_pretrained(base), cfg.learner.lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)  # B starts at zero: no change without this
    checkpoint = tmp_path / "run" / "checkpoints" / "step_3"
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    save_sharded(checkpoint, adapted, torch.optim.AdamW(trainable))
    out = export_checkpoint(checkpoint, cfg, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    layers = dict(lora_layers(adapted))
    assert layers
    for name, want in plain.items():
        layer = layers.get(name.removesuffix(".weight"))
        if layer is not None:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            want = want + (8 / 4) * b.detach() @ a.detach()
        torch.testing.assert_close(exported[name], want, msg=name)
