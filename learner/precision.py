"""`learner.dtype` made concrete for the device the learner runs on, before anything uses it.

bf16 autocast is fast only where the hardware has bf16 arithmetic: every CUDA GPU the learner
supports, and CPUs with AVX512_BF16 or AMX (x86) or the BF16 extension (Arm). Elsewhere oneDNN
emulates it, and a CPU learner in bf16 is many times slower than in fp32: SmolLM2-135M's
forward+backward ran 4 tokens/s in bf16 against 100 in fp32 on an AVX2-only EPYC, where an
AVX-512-BF16 EPYC ran bf16 2.5x faster than fp32 (`python tools/bench_learner.py --configs
fp32-packed,bf16-packed` measures a machine). So:

- `auto` becomes `bfloat16` on CUDA and on a CPU with native bf16, else `float32`;
- an explicit `bfloat16` is kept (numerics are the user's choice) with a warning on a CPU
  without native bf16, which names the fix.
"""

from __future__ import annotations

import logging
import platform

import torch

from asyncrl.config import Config
from asyncrl.cpu import cpu_flags

log = logging.getLogger("asyncrl.learner")

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo `flags` that give an x86 CPU bf16 arithmetic (oneDNN uses either)."""
ARM_BF16_FEATURE = "bf16"
"""The /proc/cpuinfo `Features` entry of an Arm CPU with the BF16 extension."""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes in bf16 natively, from /proc/cpuinfo's text (`cpuinfo` in
    tests); None when that cannot be read (not Linux), which callers treat as "no"."""
    words = cpu_flags(cpuinfo)
    if words is None:
        return None
    return any(f in words for f in X86_BF16_FLAGS) or ARM_BF16_FEATURE in words


def resolve_dtype(requested: str, device: torch.device, cpuinfo: str | None = None) -> str:
    """The compute dtype for `requested` (`learner.dtype`) on `device`, logged once; see the
    module docstring for the rule."""
    if device.type != "cpu":
        if requested != "auto":
            return requested
        log.info("learner.dtype=auto -> bfloat16 on %s", device)
        return "bfloat16"
    native = cpu_has_native_bf16(cpuinfo)
    where = f"this CPU ({platform.machine()}, torch capability {cpu_capability()})"
    if requested == "auto":
        chosen = "bfloat16" if native else "float32"
        why = "has" if native else "has no (or did not show)"
        log.info("learner.dtype=auto -> %s: %s %s native bf16", chosen, where, why)
        return chosen
    if requested == "bfloat16" and not native:
        log.warning(
            "learner.dtype=bfloat16 on %s without native bf16 (no %s in /proc/cpuinfo): "
            "autocast emulates bf16 there, many times slower than float32 (4 against 100 "
            "tokens/s for SmolLM2-135M on an AVX2 CPU); set learner.dtype=float32 or auto",
            where,
            "/".join((*X86_BF16_FLAGS, ARM_BF16_FEATURE)),
        )
    return requested


def cpu_capability() -> str:
    """torch's name for the vector ISA its CPU kernels use here ("AVX2", "AVX512", ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def with_concrete_dtype(cfg: Config, device: torch.device) -> Config:
    """`cfg` with `learner.dtype` resolved for `device` (a copy when it changes)."""
    concrete = resolve_dtype(cfg.learner.dtype, device)
    if concrete == cfg.learner.dtype:
        return cfg
    learner = cfg.learner.model_copy(update={"dtype": concrete})
    return cfg.model_copy(update={"learner": learner})
