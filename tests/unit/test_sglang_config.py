"""`rollout.engine=sglang` and `rollout.sglang.*`: what the config accepts and what it refuses
(options that would break the behaviour log-prob invariant or are not built for SGLang yet),
without sglang installed."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from learner.delivery import wants_probe


def test_sglang_engine_and_its_options_load():
    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.sglang.max_total_tokens=4096",
            "rollout.sglang.max_running_requests=32",
            "rollout.gpu_memory_fraction=0.7",
            "rollout.sglang.disable_radix_cache=true",
        ],
    )
    options = cfg.rollout.sglang
    assert cfg.rollout.engine == "sglang" and cfg.rollout.dtype == "float32"
    assert (options.max_total_tokens, options.max_running_requests) == (4096, 32)
    assert cfg.rollout.gpu_memory_fraction == 0.7 and options.disable_radix_cache
    assert wants_probe(cfg)  # the SGLang engine checks the delivery probe


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.gpu_memory_fraction=1.5", "rollout.gpu_memory_fraction"),
        ("rollout.sglang.mem_fraction_static=0.7", "renamed: use rollout.gpu_memory_fraction"),
        ("rollout.sglang.max_total_tokens=0", "rollout.sglang.max_total_tokens"),
        ("rollout.sglang.max_running_requests=0", "rollout.sglang.max_running_requests"),
        ("rollout.sglang.top_k=5", "unknown key"),
        ("rollout.engine=sglng", "rollout.engine"),
    ],
)
def test_bad_sglang_options_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.engine=sglang", override])


def test_top_p_is_refused_with_sglang():
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.9 with rollout.engine=sglang"):
        load_config(None, ["rollout.engine=sglang", "rollout.top_p=0.9"])
    assert load_config(None, ["rollout.engine=hf", "rollout.top_p=0.9"]).rollout.top_p == 0.9


def test_what_sglang_does_not_do_is_refused():
    inflight = ["rollout.engine=sglang", "rollout.weight_update_mode=inflight"]
    assert load_config(None, inflight).rollout.inflight_kv == "recompute"
    with pytest.raises(ConfigError, match="inflight_kv=keep with rollout.engine=sglang"):
        load_config(None, [*inflight, "rollout.inflight_kv=keep"])
    with pytest.raises(ConfigError, match="learner.lora.rank=8 with rollout.engine=sglang"):
        load_config(None, ["rollout.engine=sglang", "learner.lora.rank=8"])


def test_the_cpu_install_script_without_its_kernel_folder_fails_naming_where_it_looked(tmp_path):
    """tools/install_sglang_cpu.sh stops before installing anything when the folder it is
    pointed at lacks the kernel wheel, and says where it looked."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tools" / "install_sglang_cpu.sh"
    env = {**os.environ, "ASYNCRL_SGLANG_CPU_DIR": str(tmp_path), "PYTHON": "false"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    for place in (str(tmp_path), "../shared/sglang-cpu", "/work/shared/sglang-cpu"):
        assert place in done.stderr
    assert "sglang_kernel_cpu-0.4.6.post1" in done.stderr


def test_a_cpu_without_avx512_bf16_is_refused_before_sglang_starts():
    """CI's AVX-512 machine without bf16 lost the whole test process to SGLang's SIGQUIT; the
    engine now refuses such a CPU by name instead."""
    from rollout_servers.engines.sglang import check_cpu_can_run_sglang

    zen4 = "flags\t\t: avx2 avx512f avx512_bf16\n"
    check_cpu_can_run_sglang("float32", zen4)
    with pytest.raises(RuntimeError, match="lack avx512_bf16"):
        check_cpu_can_run_sglang("float32", "flags\t\t: avx2 avx512f avx512bw\n")
    with pytest.raises(RuntimeError, match="lack avx512f, avx512_bf16"):
        check_cpu_can_run_sglang("bfloat16", "flags\t\t: avx avx2 fma\n")


def test_a_float32_model_on_an_amx_cpu_is_refused_naming_rollout_dtype():
    """On an AMX CPU SGLang takes its AMX kernels, whose rmsnorm has no float32: the scheduler
    died and SGLang SIGQUIT pytest (seen on this project's AVX-512 + AMX machine)."""
    from rollout_servers.engines.sglang import check_cpu_can_run_sglang

    sapphire = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    check_cpu_can_run_sglang("bfloat16", sapphire)
    with pytest.raises(RuntimeError, match="rollout.dtype=float32"):
        check_cpu_can_run_sglang("float32", sapphire)
