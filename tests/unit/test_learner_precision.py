"""learner.dtype made concrete per device: `auto` picks bf16 only where the hardware computes it,
and an explicit bf16 on a CPU that would emulate it is kept with a warning naming the fix."""

import logging

import pytest
import torch

from asyncrl.config import Config
from learner.precision import cpu_has_native_bf16, resolve_dtype, with_concrete_dtype

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nmodel name\t: AMD EPYC\n"
AVX512_BF16_EPYC = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
ARM_BF16 = "Features\t: fp asimd sve bf16 i8mm\n"
ARM_NO_BF16 = "Features\t: fp asimd crc32\n"
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "cpuinfo, native",
    [
        (AVX2_EPYC, False),
        (AVX512_BF16_EPYC, True),
        (SAPPHIRE_RAPIDS, True),
        (ARM_BF16, True),
        (ARM_NO_BF16, False),
        ("model name\t: mentions avx512_bf16 but not as a flag\n", False),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert cpu_has_native_bf16(cpuinfo) is native


def test_auto_is_bf16_on_cuda_and_where_the_cpu_has_it_else_fp32(caplog):
    caplog.set_level(logging.INFO, "asyncrl.learner")
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert "learner.dtype=auto -> bfloat16 on cuda:0" in caplog.text
    assert resolve_dtype("auto", CPU, AVX512_BF16_EPYC) == "bfloat16"
    assert resolve_dtype("auto", CPU, AVX2_EPYC) == "float32"
    assert "learner.dtype=auto -> float32" in caplog.text


def test_explicit_dtypes_are_kept_and_emulated_bf16_is_warned_about(caplog):
    caplog.set_level(logging.INFO, "asyncrl.learner")
    assert resolve_dtype("float32", CPU, AVX512_BF16_EPYC) == "float32"
    assert resolve_dtype("bfloat16", CPU, AVX512_BF16_EPYC) == "bfloat16"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert resolve_dtype("bfloat16", CPU, AVX2_EPYC) == "bfloat16"
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "without native bf16" in warning.getMessage()
    assert "learner.dtype=float32 or auto" in warning.getMessage()


def test_the_config_the_learner_uses_carries_the_concrete_dtype():
    cfg = Config.model_validate({"learner": {"dtype": "auto"}})
    concrete = with_concrete_dtype(cfg, CPU)
    assert concrete.learner.dtype in ("float32", "bfloat16")
    assert cfg.learner.dtype == "auto"  # the user's config is not changed in place
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert concrete.learner.dtype == expected
    fixed = Config.model_validate({"learner": {"dtype": "float32"}})
    assert with_concrete_dtype(fixed, CPU) is fixed
