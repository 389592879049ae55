"""train.precision: auto — bf16 where the hardware multiplies it natively, fp32 where a CPU would emulate it."""

from __future__ import annotations

import yaml

from shardline.precision import choose_precision, cpu_bf16_feature, emulated_bf16_warning
from shardline.rundir import create_run, read_manifest, read_spec
from shardline.spec.resolve import load_spec

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
COOPER_LAKE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_bf16_feature(AVX2_ONLY) is None and cpu_bf16_feature(GRAVITON2) is None
    assert cpu_bf16_feature(SAPPHIRE_RAPIDS) == "amx_bf16"
    assert cpu_bf16_feature(COOPER_LAKE) == "avx512_bf16"
    assert cpu_bf16_feature(GRAVITON3) == "bf16"
    assert cpu_bf16_feature("") is None


def test_auto_is_fp32_only_on_a_cpu_that_would_emulate_bf16():
    emulating = choose_precision("auto", accelerator=False, cpuinfo=AVX2_ONLY)
    assert emulating.precision == "fp32" and "no native bf16 matmul" in emulating.reason
    for native in (SAPPHIRE_RAPIDS, COOPER_LAKE, GRAVITON3):
        assert choose_precision("auto", accelerator=False, cpuinfo=native).precision == "bf16"
    assert choose_precision("auto", accelerator=True, cpuinfo=AVX2_ONLY).precision == "bf16"  # a GPU node's CPU
    # an explicit choice is honoured everywhere; bf16 on an emulating CPU says what it costs, once
    assert choose_precision("bf16", accelerator=False, cpuinfo=AVX2_ONLY).precision == "bf16"
    assert "13× slower" in emulated_bf16_warning("bf16", accelerator=False, cpuinfo=AVX2_ONLY)
    assert emulated_bf16_warning("bf16", accelerator=False, cpuinfo=SAPPHIRE_RAPIDS) is None
    assert emulated_bf16_warning("bf16", accelerator=True, cpuinfo=AVX2_ONLY) is None
    assert emulated_bf16_warning("fp32", accelerator=False, cpuinfo=AVX2_ONLY) is None


def test_the_run_keeps_the_choice_made_where_it_was_created(tmp_path):
    spec = load_spec("tiny", [f"run.dir={tmp_path}"])
    assert spec.train.precision == "auto"  # the embedded default
    expected = choose_precision("auto", accelerator=False)  # this machine's CPU decides
    spec, run_dir = create_run(spec)
    assert spec.train.precision == expected.precision
    assert yaml.safe_load((run_dir / "spec.yaml").read_text())["train"]["precision"] == expected.precision
    assert read_manifest(run_dir)["precision"] == {"chosen": expected.precision, "reason": expected.reason}
    # a resume reads spec.yaml: the concrete value, not auto, so other hardware cannot flip it
    again, _ = create_run(read_spec(run_dir / "spec.yaml"))
    assert again.train.precision == expected.precision


def test_auto_is_fp32_on_gpus_without_bf16_tensor_cores_and_the_planner_agrees():
    """T4 and V100 have no bf16 tensor cores (the catalogue gives them no bf16 peak): bf16 would be emulated."""
    from shardline.planning.devices import get_device, planned_precision
    from tests.conftest import run_cli

    slow = choose_precision("auto", accelerator=True, native_bf16=False)
    assert slow.precision == "fp32" and "T4, V100" in slow.reason
    assert choose_precision("bf16", accelerator=True, native_bf16=False).precision == "bf16"  # asked for
    assert [planned_precision("auto", get_device(d)) for d in ("t4", "v100", "v100-16gb", "a100", "h100", "l4")] == [
        "fp32", "fp32", "fp32", "bf16", "bf16", "bf16"]
    assert get_device("Tesla V100-SXM2-16GB").memory_bytes == 16_384 * 2**20
    out = run_cli("plan", "tiny", "--device", "t4", timeout=120)
    assert " · fp32 · " in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
