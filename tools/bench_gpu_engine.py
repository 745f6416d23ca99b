"""The transformers engine's tokens/s next to bare `generate`, on CUDA (or the CPU), same model,
same prompts, same rows.

    python tools/bench_gpu_engine.py [--device cuda] [--models tiny,smollm2-shape]
                                     [--rows 1,32] [--prompt-len 64] [--max-new-tokens 64]
                                     [--rounds 2] [--json OUT.json]

For each model and each number of rows R:
1. `hf_engine`: asyncrl's `HFEngine` (`rollout_servers.engines.hf`), R requests submitted at
   once, each sampling exactly `--max-new-tokens` tokens (`ignore_eos`), with the behaviour
   log-prob of every token, as a rollout server uses it;
2. `generate`: the same model loaded by transformers with the same dtype and attention kernel,
   `model.generate` on the same R prompts as one batch, sampling the same number of tokens
   (`min_new_tokens`; no log-probs kept: the floor a bare user of transformers gets).
Each figure is the best of `--rounds` timed rounds after a warm-up round (CUDA kernels and
allocator warmed); `ms_per_step` is seconds / max_new_tokens, the cost of one decode step of all
R rows, so R=1 against R=32 shows how flat a step's cost is in its rows (on a GPU it is nearly
flat for small models, which is what makes drained weight updates costly: `bench_update_modes.py`).

Models (`--models`, comma-separated): `tiny`, the embedded default's shape
(`asyncrl.demo.model_cache.TinyModelSpec`, float32 as `rollout.dtype` defaults); `smollm2-shape`,
a randomly initialised Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
vocab 49,152; bfloat16), which measures speed as well as the real weights do and needs no
download; or a Hugging Face model directory. Random weights sample any token, so lengths are
fixed with `ignore_eos` on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's asyncrl and rollout_servers

SMOLLM2_SHAPE: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
"""SmolLM2-135M-Instruct's config.json, the fields that decide its speed."""


def default_dtype(model: str) -> str:
    """float32 for the embedded tiny model (the rollout default), bfloat16 for bigger ones."""
    return "float32" if model == "tiny" else "bfloat16"


def build_model(name: str, dtype: str, into: Path, seed: int = 0) -> Path:
    """A model directory for `name`: `tiny`, `smollm2-shape` (both random-init, written under
    `into`) or an existing Hugging Face directory, returned as is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.dtypes import torch_dtype

    if name not in ("tiny", "smollm2-shape"):
        if not (Path(name) / "config.json").is_file():
            raise SystemExit(f"--models: {name!r} is neither tiny, smollm2-shape nor a model dir")
        return Path(name)
    out = into / f"{name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    if name == "tiny":
        from asyncrl.demo.model_cache import TinyModelSpec
        from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer

        model = build_tiny_model(build_tokenizer(), TinyModelSpec(), seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE))
    model.to(torch_dtype(dtype)).save_pretrained(out)  # type: ignore[arg-type]
    return out


def make_prompts(model_dir: Path, rows: int, length: int, seed: int) -> list[list[int]]:
    """`rows` prompts of `length` random ids, none of them a special id (ids < 8)."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab, (rows, length), generator=gen).tolist()


@dataclass
class Figure:
    model: str
    dtype: str
    impl: str
    """hf_engine or generate."""
    rows: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ms_per_step: float
    """seconds of one decode step of all rows (seconds / max_new_tokens, prefill included)."""


def best_of(run_once, rounds: int) -> tuple[float, int]:
    """Best (seconds, tokens) of `rounds` timed calls of `run_once()` after one warm-up call."""
    run_once()
    best: tuple[float, int] | None = None
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = run_once()
        took = time.perf_counter() - start
        if best is None or tokens / took > best[1] / best[0]:
            best = (took, tokens)
    assert best is not None
    return best


def bench_hf_engine(model_dir, device, dtype, prompts, max_new, rounds, seed):
    """(seconds, tokens): every prompt submitted to one `HFEngine` at once."""
    from rollout_servers.engines.base import SamplingParams
    from rollout_servers.engines.hf import HFEngine

    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
    engine = HFEngine(model_dir, device=device, max_batch_size=len(prompts), seed=seed, dtype=dtype)
    loop = asyncio.new_event_loop()

    async def all_at_once() -> int:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return sum(len(o.token_ids) for o in outs)

    try:
        return best_of(lambda: loop.run_until_complete(all_at_once()), rounds)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def bench_generate(model_dir, device, dtype, prompts, max_new, rounds, seed):
    """(seconds, tokens): `model.generate` on every prompt as one batch (equal lengths: no
    padding), sampling exactly `max_new` tokens each."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.dtypes import torch_dtype
    from rollout_servers.engines.hf import ATTN_IMPLEMENTATION

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype(dtype), attn_implementation=ATTN_IMPLEMENTATION
    ).to(device)
    model.eval()
    ids = torch.tensor(prompts, device=device)
    torch.manual_seed(seed)

    def once() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=model.config.pad_token_id or 0,
            )
        if ids.is_cuda:
            torch.cuda.synchronize()
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    return best_of(once, rounds)


def run(args, save: Callable[[list[Figure]], object]) -> list[Figure]:
    """Every model x rows x impl; `save` gets the figures so far after each one (a run cut
    short by a timeout keeps what it measured)."""
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-engine-") as tmp:
        for name in args.models.split(","):
            dtype = args.dtype or default_dtype(name)
            model_dir = build_model(name, dtype, Path(tmp), args.seed)
            for rows in [int(r) for r in args.rows.split(",")]:
                prompts = make_prompts(model_dir, rows, args.prompt_len, args.seed)
                for impl, bench in (("hf_engine", bench_hf_engine), ("generate", bench_generate)):
                    took, tokens = bench(
                        model_dir,
                        args.device,
                        dtype,
                        prompts,
                        args.max_new_tokens,
                        args.rounds,
                        args.seed,
                    )
                    free_cuda_cache()
                    fig = Figure(
                        Path(name).name,
                        dtype,
                        impl,
                        rows,
                        tokens,
                        round(took, 4),
                        round(tokens / took, 1),
                        round(1000 * took / args.max_new_tokens, 3),
                    )
                    print(
                        f"{fig.model} {dtype} rows={rows} {impl}: {tokens} tokens in {took:.3f}s"
                        f" = {fig.tokens_per_s:.0f} tokens/s, {fig.ms_per_step:.2f} ms/step",
                        flush=True,
                    )
                    figures.append(fig)
                    save(figures)
    return figures


def free_cuda_cache() -> None:
    """Hand the last bench's cached CUDA blocks back, so the next one starts alike."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratios(figures: list[Figure]) -> dict[str, float]:
    """hf_engine tokens/s over generate's, per model and rows."""
    by = {(f.model, f.rows, f.impl): f.tokens_per_s for f in figures}
    return {
        f"{model} rows={rows}": round(tps / by[(model, rows, "generate")], 3)
        for (model, rows, impl), tps in by.items()
        if impl == "hf_engine" and (model, rows, "generate") in by
    }


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--models", default="tiny,smollm2-shape")
    parser.add_argument("--dtype", default=None, help="default: float32 for tiny, else bfloat16")
    parser.add_argument("--rows", default="1,32", help="comma-separated row counts")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no CUDA device (use --device cpu)")
    started = time.perf_counter()

    def save(figures: list[Figure]) -> dict:
        report = {
            "device": device_name(args.device),
            "torch": torch.__version__,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "results": [asdict(f) for f in figures],
            "hf_engine_over_generate": ratios(figures),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return report

    report = save(run(args, save))
    for key, ratio in report["hf_engine_over_generate"].items():
        print(f"hf_engine / generate tokens/s, {key}: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
