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


# Whole /proc/cpuinfo entries (one processor) as the kernel prints them, for a run created on one host and
# resumed on another. AMX: a Sapphire Rapids Xeon (GCP c3); AVX2 only: a Broadwell Xeon (AWS m4).
CPUINFO_AMX_HOST = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping\t: 8
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht \
syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 \
fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch \
ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq \
rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni \
avx512_bf16 arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg \
avx512_vpopcntdq la57 rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 \
amx_tile amx_int8 arch_capabilities
bogomips\t: 5399.99
"""
CPUINFO_AVX2_HOST = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 79
model name\t: Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz
stepping\t: 1
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni \
pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand \
hypervisor lahf_lm abm 3dnowprefetch cpuid_fault invpcid_single pti fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm \
rdseed adx xsaveopt
bogomips\t: 4600.02
"""


def _host(monkeypatch, cpuinfo: str) -> None:
    """Make this process a CPU-only host whose /proc/cpuinfo reads `cpuinfo` (the parsing stays the real one)."""
    import torch

    import shardline.precision

    class ProcFile:
        def __init__(self, path: str) -> None:
            assert path == "/proc/cpuinfo", path

        def read_text(self, errors: str = "strict") -> str:
            return cpuinfo

    monkeypatch.setattr(shardline.precision, "Path", ProcFile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _spec_yaml_precision(run_dir) -> str:
    return yaml.safe_load((run_dir / "spec.yaml").read_text())["train"]["precision"]


def test_the_run_keeps_the_choice_made_where_it_was_created(tmp_path, monkeypatch):
    """`auto` is decided by the host that creates the run; a resume on a host that would decide otherwise keeps it."""
    for created_on, resumed_on, kept in ((CPUINFO_AMX_HOST, CPUINFO_AVX2_HOST, "bf16"),
                                         (CPUINFO_AVX2_HOST, CPUINFO_AMX_HOST, "fp32")):
        spec = load_spec("tiny", [f"run.dir={tmp_path / kept}"])
        assert spec.train.precision == "auto"  # the embedded default
        _host(monkeypatch, created_on)
        spec, run_dir = create_run(spec)
        assert spec.train.precision == kept and _spec_yaml_precision(run_dir) == kept
        assert read_manifest(run_dir)["precision"]["chosen"] == kept
        _host(monkeypatch, resumed_on)
        assert choose_precision("auto", accelerator=False).precision != kept  # this host alone would choose otherwise
        again, again_dir = create_run(read_spec(run_dir / "spec.yaml"))  # what `shardline train RUN_DIR` does
        assert again_dir == run_dir and again.train.precision == kept and _spec_yaml_precision(run_dir) == kept


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
