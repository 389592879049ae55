"""The hardware catalogue: one entry per accelerator, one matching rule, and every consumer agreeing on it."""

import ast
from pathlib import Path

import pytest
import torch

import shardline
from shardline.hardware import ACCELERATORS, GPUS, match_device
from shardline.model.flops import table_peak_tflops
from shardline.network_profiles import PROFILES
from shardline.ops.checks.gpucheck import expected_peaks
from shardline.planning.cost import device_key, price_table
from shardline.planning.devices import MiB, cuda_device, device_names, get_device
from tests.conftest import small_spec

# `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader` as printed on real machines (public logs,
# job outputs and test fixtures), with the catalogue entry each must resolve to.
NVIDIA_SMI = [
    ("NVIDIA H100 80GB HBM3", 81559, "h100"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H100 NVL", 95830, "h100-nvl"),
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA H200 NVL", 143771, "h200-nvl"),
    ("NVIDIA B200", 183359, "b200"),
    ("NVIDIA B300 SXM6 AC", 275040, "b300"),
    ("NVIDIA GB200", 189471, "gb200"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb"),
    ("NVIDIA L40S", 46068, "l40s"),
    ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA A10G", 23028, "a10g"),
    ("Tesla T4", 15360, "t4"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx4090"),
    ("NVIDIA GeForce RTX 3090", 24576, "rtx3090"),
]
NOT_CATALOGUED = ["NVIDIA GeForce RTX 4080", "Tesla P100-PCIE-16GB", "NVIDIA L40", "NVIDIA A10", "cpu", ""]
# The GPU each machine type of the network profiles carries, as nvidia-smi names it.
PROFILE_GPUS = {"a3-high": "NVIDIA H100 80GB HBM3", "a3-mega": "NVIDIA H100 80GB HBM3", "a3-ultra": "NVIDIA H200",
                "a4": "NVIDIA B200"}
TMP = Path("/tmp")


def test_an_l40s_is_an_l40s_not_an_l4():
    # The planner used to take the first substring match: "l4" in "nvidia l40s" planned a 48 GB card as 24 GB.
    assert match_device("NVIDIA L40S").key == "l40s"
    assert cuda_device("NVIDIA L40S", 0).memory_bytes == 46068 * MiB
    assert get_device("NVIDIA L40S").memory_bytes > get_device("l4").memory_bytes
    assert table_peak_tflops("NVIDIA L40S", torch.bfloat16) > table_peak_tflops("NVIDIA L4", torch.bfloat16)
    assert device_key("NVIDIA L40S") == "l40s"


@pytest.mark.parametrize("name, mib, key", NVIDIA_SMI)
def test_nvidia_smi_names_resolve_to_their_entry_with_the_memory_nvidia_smi_reports(name, mib, key):
    gpu = match_device(name)
    assert gpu is not None and gpu.key == key
    assert gpu.memory_mib == mib


@pytest.mark.parametrize("name", NOT_CATALOGUED)
def test_uncatalogued_names_resolve_to_nothing(name):
    assert match_device(name) is None


def test_keys_display_names_and_gke_labels_resolve_to_their_own_entry():
    for gpu in ACCELERATORS:
        assert match_device(gpu.key) is gpu and match_device(gpu.name) is gpu
        assert match_device(gpu.key.upper()) is gpu
    assert len({gpu.key for gpu in ACCELERATORS}) == len(ACCELERATORS)
    patterns = [frozenset(p) for gpu in ACCELERATORS for p in gpu.patterns]
    assert len(set(patterns)) == len(patterns)  # two entries with one pattern would be a tie
    assert match_device("nvidia-tesla-a100").key == "a100-40gb"  # GKE's label for the 40GB A100


def test_peaks_are_dense_and_ordered():
    for gpu in ACCELERATORS:
        assert gpu.fp32_tflops > 0 and gpu.hbm_gbps > 0 and gpu.memory_mib > 0
        if gpu.bf16_tflops is not None and gpu.kind == "gpu":  # a TPU has no TF32: fp32 runs as bf16 passes
            assert gpu.bf16_tflops == pytest.approx(2 * gpu.fp32_tflops, rel=0.02), gpu.key  # tf32 = bf16 / 2
        if gpu.fp8_tflops is not None:
            assert gpu.fp8_tflops == pytest.approx(2 * gpu.bf16_tflops, rel=0.02), gpu.key


@pytest.mark.parametrize("name", [n for n, _, _ in NVIDIA_SMI] + [g.key for g in GPUS] + NOT_CATALOGUED)
def test_every_consumer_resolves_the_same_entry(name):
    gpu = match_device(name)
    planned = cuda_device(name, 123 * MiB)
    table = price_table(small_spec(TMP))
    if gpu is None:
        assert planned.memory_bytes == 123 * MiB and planned.name == name
        assert table_peak_tflops(name, torch.bfloat16) is None and expected_peaks(name) == (None, None)
        assert device_key(name) is None
        return
    assert (planned.name, planned.memory_bytes) == (gpu.name, gpu.memory_bytes)
    assert get_device(name).memory_bytes == gpu.memory_bytes
    assert table_peak_tflops(name, torch.bfloat16) == gpu.bf16_tflops
    assert table_peak_tflops(name, torch.float32) == gpu.fp32_tflops
    assert expected_peaks(name) == (gpu.bf16_tflops, gpu.hbm_gbps)
    assert device_key(name) == gpu.key
    assert table.get(gpu.key) == (gpu.prices.row() if gpu.prices else None)
    # the planner's device label leads back to the same entry (cost and peaks of `shardline plan` use it)
    assert match_device(planned.name) is gpu


def test_network_profiles_name_the_gpu_their_machines_carry():
    assert PROFILES["generic"].gpu is None
    for name, smi_name in PROFILE_GPUS.items():
        assert PROFILES[name].gpu is match_device(smi_name), name
    assert {n for n, p in PROFILES.items() if p.accelerator} == set(PROFILE_GPUS)


def test_the_planner_offers_every_catalogued_gpu():
    assert device_names() == [*(g.key for g in GPUS), "cpu"]
    assert {"h100", "h200", "b200", "a100", "l4", "cpu"} <= set(device_names())  # the historical --device values


# ---- one source of truth: no GPU table outside hardware.py ----------------------------------------------
def _distinctive_numbers() -> set[float]:
    """Catalogue peaks and memory totals unlikely to appear in code by chance (≥ 100, not a multiple of 100)."""
    values = {v for g in ACCELERATORS for v in (g.bf16_tflops, g.fp32_tflops, g.fp8_tflops, g.memory_mib)
              if v is not None}
    return {float(v) for v in values if v >= 100 and v % 100
            and not (float(v).is_integer() and int(v) & (int(v) - 1) == 0)}  # powers of two are sizes, not facts
    # (a TPU's 16384 / 32768 MiB of HBM is also Llama 405B's hidden size)


def gpu_tables(source: str) -> list[str]:
    """Where `source` hard-codes GPU facts: a literal dict/tuple/list naming two or more catalogued GPUs (a
    table keyed by GPU), or a number that is a catalogue peak or memory total."""
    numbers, found = _distinctive_numbers(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float) and float(node.value) in numbers:
            found.append(f"line {node.lineno}: {node.value}")
        if isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)):
            elements = [e for e in (node.keys + node.values if isinstance(node, ast.Dict) else node.elts) if e]
            named = {gpu.key for e in elements for c in [e, *getattr(e, "elts", [])]
                     if isinstance(c, ast.Constant) and isinstance(c.value, str) and (gpu := match_device(c.value))}
            if len(named) >= 2:
                found.append(f"line {node.lineno}: a table of {', '.join(sorted(named))}")
    return found


def test_the_table_detector_finds_the_tables_this_catalogue_replaced():
    old_planner = 'GPUS = {"b200": ("B200 180GB", 183_359), "h100": ("H100 80GB", 81_559)}'
    old_flops = 'PEAK_TFLOPS = (("H200", 1.0, 2.0), ("H100 PCIe", 3.0, 4.0))'
    old_cost = 'PRICES = {"h100": {"spot": 3.72}, "l4": {"spot": 0.31}}'
    old_peak = "def peak(name):\n    return 989.0 if 'H100' in name else None"
    for source in (old_planner, old_flops, old_cost, old_peak):
        assert gpu_tables(source), source
    assert not gpu_tables('profile = {"accelerator": "nvidia-h100-80gb", "gpus_per_node": 8}')


def test_no_module_but_the_catalogue_defines_gpu_facts():
    src = Path(shardline.__file__).parent
    offenders = {str(path.relative_to(src)): found for path in sorted(src.rglob("*.py"))
                 if path.name != "hardware.py" and (found := gpu_tables(path.read_text()))}
    assert offenders == {}, "GPU facts belong in hardware.py; import them from there"


def test_the_catalogue_is_the_bottom_layer():
    tree = ast.parse((Path(shardline.__file__).parent / "hardware.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("shardline")}


def test_on_a_cpu_host_hub_models_are_planned_for_the_profiles_gpu(capsys, monkeypatch):
    from shardline.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for profile, label in (("a4", "B200 180GB"), ("a3-ultra", "H200 141GB"), ("generic", "H100 80GB")):
        main(["plan", "llama-3.1-8b-lora", "--set", f"launch.profile={profile}"])
        assert f"per-device memory on {label} " in capsys.readouterr().out, profile
