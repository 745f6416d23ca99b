"""The embedded demo, outside the core: it plugs in exactly as a user's package would.

- `tasks`: the arithmetic tasks (`arith`, `arith_tool`) and their reward, declared as
  `asyncrl.tasks` and `asyncrl.rewards` entry points in pyproject.toml.
- `tiny_model`: the character-level tokenizer and small Llama, warm-started on the task (the
  launch layer builds it when `trainer.model_path` is unset); `model_cache` names its cache
  directory without importing torch or transformers, so a cached run starts without them.
- `smollm2`: `asyncrl model import-smollm2`, SmolLM2-135M-Instruct from its GGUF as a Hugging
  Face directory.
No production module imports this package (tests/unit/test_layout.py).
"""
