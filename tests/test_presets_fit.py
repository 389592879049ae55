"""Every shipped preset fits the device it names, out of the box, with the fastest settings that fit (issue 14).

"The device it names" is the one `shardline plan <preset>` plans for on a machine without a GPU: the GPU of
`launch.profile` for a hub model (an H100 for `generic`), the host for a model built from `model.arch`. The
tests record the plan the CLI itself computes, so they cannot disagree with what a user is shown.
"""

from __future__ import annotations

import pytest
import torch

from shardline.cli import main
from shardline.planning import memory
from shardline.planning.fixes import AC_ORDER
from shardline.planning.memory import MemoryPlan, plan_memory
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec, preset_names

# Memory the planner does not model (allocator fragmentation beyond its runtime constant, compiled kernels'
# workspaces) must not push a preset over: each keeps this share of its device free.
MARGIN = 0.10


TORCH_PRESETS = [n for n in preset_names() if load_spec(n).train.engine == "torch"]
"""The presets shardline's own planner plans; MaxText's TPU preset is planned in tests/launch/test_maxtext.py."""


def spare(plan: MemoryPlan) -> int:
    return plan.capacity_bytes - plan.total_bytes


def fits_with_margin(plan: MemoryPlan) -> bool:
    return spare(plan) >= MARGIN * plan.capacity_bytes


@pytest.fixture
def cli_plan(capsys, monkeypatch):
    """`shardline plan <preset>` on a host without a GPU: (its exit code, output, the plan it computed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def run(name: str) -> tuple[int, str, MemoryPlan]:
        plans: list[MemoryPlan] = []
        planner = memory.plan_memory

        def recording(spec, device=None, **options):  # options: a mixture's imbalance headroom plans too
            plans.append(planner(spec, device, **options))
            return plans[-1]

        with monkeypatch.context() as m:
            m.setattr(memory, "plan_memory", recording)
            code = main(["plan", name])
        return code, capsys.readouterr().out, plans[0]

    return run


def _with(spec: JobSpec, **parallel: object) -> JobSpec:
    data = spec.model_dump(mode="json")
    data["parallel"] |= parallel
    return JobSpec.model_validate(data)


@pytest.mark.parametrize("name", TORCH_PRESETS)
def test_preset_fits_the_device_it_names_with_a_margin(cli_plan, name):
    code, out, plan = cli_plan(name)
    assert code == 0 and "fits:" in out and "does not fit" not in out, out
    assert fits_with_margin(plan), f"{name}: {spare(plan) / 2**30:.1f} GiB spare on {plan.device.name}"


@pytest.mark.parametrize("name", TORCH_PRESETS)
def test_gpu_presets_use_flash_attention_and_compile_and_cpu_presets_sdpa(cli_plan, name):
    plan = cli_plan(name)[2]
    spec = load_spec(name)
    if plan.device.kind == "cuda":
        assert spec.model.attn_implementation == "flash_attention_2"
        # expert parallel does not compile yet (a spec rule refuses parallel.ep > 1 with compile)
        assert spec.parallel.compile or spec.parallel.ep > 1
    else:  # flash-attn needs CUDA; per-document SDPA is the fast path on CPU
        assert spec.model.attn_implementation == "sdpa"


@pytest.mark.parametrize("name", TORCH_PRESETS)
def test_presets_use_the_lightest_activation_checkpointing_that_fits(cli_plan, name):
    """No lighter policy fits with the margin (none < selective < full), nor the same policy on fewer blocks."""
    device = cli_plan(name)[2].device
    spec = load_spec(name)
    p = spec.parallel
    lighter = [_with(spec, activation_checkpointing=ac, activation_checkpointing_every=1)
               for ac in AC_ORDER[:AC_ORDER.index(p.activation_checkpointing)]]
    if p.activation_checkpointing != "none":
        lighter.append(_with(spec, activation_checkpointing_every=2 * p.activation_checkpointing_every))
    for variant in lighter:
        vp = variant.parallel
        assert not fits_with_margin(plan_memory(variant, device)), \
            f"{name}: AC {vp.activation_checkpointing} every {vp.activation_checkpointing_every} fits too"


def test_70b_preset_is_the_reference_job_fully_sharded_on_b200(cli_plan):
    """2 nodes × 8 B200, micro-batch 8, accumulation 8, seq 512; FSDP over all 16 GPUs, since an HSDP
    replica per node (fp32 weights, gradients and AdamW state for 70B over 8 GPUs) does not fit."""
    plan = cli_plan("llama-3.1-70b-fsdp")[2]
    spec = load_spec("llama-3.1-70b-fsdp")
    assert plan.device.name == "B200 180GB"
    assert (spec.launch.nnodes, spec.parallel.nproc_per_node) == (2, 8)
    assert (spec.train.micro_batch_size, spec.grad_accum_steps, spec.train.seq_len) == (8, 8, 512)
    assert spec.parallel.dp_replicate == 1 and plan.dp_shard == 16
    assert not plan_memory(_with(spec, dp_replicate=2), plan.device).fits
