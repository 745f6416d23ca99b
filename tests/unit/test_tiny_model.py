"""The embedded tokenizer, chat template, tiny model and warm-start cache."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.data.prompts import render_prompt_ids
from asyncrl.demo.model_cache import TinyModelSpec
from asyncrl.demo.tasks import ArithmeticTask
from asyncrl.demo.tiny_model import (
    ROLE_TOKENS,
    build_tiny_model,
    build_tokenizer,
    prepare_embedded_model,
    warm_start,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize(
    "text", ["12+3=15", "  two  spaces, trailing ", "a\n\nb\nc", "x , y . z 's n't ?!", "~`{}|"]
)
def test_decode_inverts_encode(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one id per character
    assert tokenizer.decode(ids) == text


def test_vocab_and_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 8 + 95 + 1  # specials, printable ASCII, newline
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    )
    for marker in ROLE_TOKENS:
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    assert tokenizer.encode("\t", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_chat_template_renders_roles_and_generation_prompt(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "4 + 5 ="},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = "<|system|>add</s><|user|>1+2=</s><|assistant|>3</s><|user|>4 + 5 =</s><|assistant|>"
    assert text == expected
    ids = render_prompt_ids(tokenizer, messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|system|>")  # no BOS
    assert tokenizer.decode(ids, skip_special_tokens=True) == "add1+2=34 + 5 ="


def test_tiny_model_shape_and_seeding(tokenizer) -> None:
    spec = TinyModelSpec()
    state = torch.random.get_rng_state()
    model = build_tiny_model(tokenizer, spec, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 32
    assert config.vocab_size == len(tokenizer) and not config.tie_word_embeddings
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    again = build_tiny_model(tokenizer, spec, seed=7).state_dict()
    other = build_tiny_model(tokenizer, spec, seed=8).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again[name])
    assert not torch.equal(model.lm_head.weight, other["lm_head.weight"])


def test_save_and_load_through_auto_classes(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    messages = [{"role": "user", "content": "7+8="}]
    ids = render_prompt_ids(loaded_tok, messages)
    assert ids == render_prompt_ids(tokenizer, messages)
    assert loaded_tok.decode(loaded_tok.encode("a b\n1")) == "a b\n1"
    assert loaded_tok.eos_token_id == tokenizer.eos_token_id == loaded.config.eos_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(model.eval()(x).logits, loaded(x).logits)


@pytest.mark.long  # half a minute or more: its own CI step
def test_warm_start_teaches_the_answer_format(tokenizer) -> None:
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    logs: list[str] = []
    warm_start(
        model, tokenizer, ArithmeticTask(), steps=100, seed=0, p_correct=1.0, log=logs.append
    )
    assert len(logs) == 3 and "step 100/100" in logs[-1]
    first_loss, last_loss = (
        float(line.split("loss ")[1].split()[0]) for line in (logs[0], logs[-1])
    )
    assert last_loss < first_loss / 3
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": "3+4="}])
    response: list[int] = []
    with torch.no_grad():
        while len(response) < 3 and tokenizer.eos_token_id not in response:
            logits = model(torch.tensor([prompt + response])).logits
            response.append(int(logits[0, -1].argmax()))
    assert response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response[:-1]).isdigit()


def test_prepare_embedded_model_caches_atomically(tmp_path: Path) -> None:
    task = ArithmeticTask()
    logs: list[str] = []
    path = prepare_embedded_model(tmp_path, task, warmstart_steps=2, seed=0, log=logs.append)
    assert logs  # it trained
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    assert [p for p in tmp_path.iterdir()] == [path]  # no temporary directory left behind

    logs.clear()
    start = time.perf_counter()
    again = prepare_embedded_model(tmp_path, task, warmstart_steps=2, seed=0, log=logs.append)
    assert again == path and not logs and time.perf_counter() - start < 0.5

    other = prepare_embedded_model(tmp_path, task, warmstart_steps=2, seed=1, log=logs.append)
    assert other != path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert render_prompt_ids(tokenizer, [{"role": "user", "content": "1+1="}])[-1] == (
        tokenizer.convert_tokens_to_ids("<|assistant|>")
    )
    assert model.config.num_hidden_layers == TinyModelSpec().num_hidden_layers


def test_the_launcher_finds_a_cached_model_without_importing_the_model_code(tmp_path: Path) -> None:
    """A cache hit costs a hash and a stat: prepare_model never imports tiny_model (torch,
    transformers), and names the very directory prepare_embedded_model built."""
    built = prepare_embedded_model(tmp_path, ArithmeticTask(), warmstart_steps=2, seed=3)
    code = (
        "import sys\n"
        "from asyncrl.config import load_config\n"
        "from asyncrl.launch.fleet import prepare_model\n"
        f"cfg = load_config(None, ['trainer.cache_dir={tmp_path}', 'trainer.warmstart_steps=2',"
        " 'trainer.seed=3'])\n"
        "print(prepare_model(cfg, log=lambda m: print('LOG', m)))\n"
        "print(sorted(m for m in ('transformers', 'asyncrl.demo.tiny_model') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [str(built), "[]"]
