"""`shardline plan` with `train.float8` (issue 57): a GPU without FP8 tensor cores is refused by name, and the step
time counts the float8 block matmuls at the device's FP8 peak (the dry run's float8 step:
tests/train/test_dry_run.py)."""

from __future__ import annotations

import pytest

from shardline.errors import SpecError
from shardline.hardware import match_device
from shardline.planning.cost import estimate_step
from shardline.planning.memory import float8_block_linears, model_shape, plan_memory
from shardline.planning.step_time import step_time
from shardline.spec.resolve import load_spec

FULL_8B = ["model.lora.enabled=false", "train.precision=bf16"]


@pytest.mark.parametrize("device", ["a100", "a10g", "t4", "v100"])
def test_float8_on_a_gpu_below_sm_8_9_is_refused_by_name(device):
    spec = load_spec("llama-3.1-8b-lora", [*FULL_8B, "train.float8=rowwise"])
    with pytest.raises(SpecError, match=f"{match_device(device).name} has no FP8 tensor cores") as e:
        plan_memory(spec, device)
    assert e.value.where == "train.float8" and "train.float8=none" in e.value.fix


def test_float8_on_ada_hopper_and_blackwell_plans():
    for device in ("l4", "l40s", "rtx4090", "h100", "h200", "b200"):
        plan_memory(load_spec("tiny", ["train.precision=bf16", "train.float8=tensorwise"]), device)


def test_step_time_counts_the_float8_block_matmuls_at_the_fp8_peak():
    """The block linears' three matmuls (6 FLOPs per weight and token) move from the bf16 peak to the FP8 one;
    attention, the output projection and the rest stay at bf16's."""
    spec = load_spec("llama-3.1-8b-lora", [*FULL_8B, "train.float8=tensorwise"])
    h100 = match_device("h100")
    bf16 = step_time(spec, h100.bf16_tflops)
    fp8 = step_time(spec, h100.bf16_tflops, fp8_tflops=h100.fp8_tflops)
    shape = model_shape(spec.model)
    weights = shape.layers * sum(i * o for i, o in float8_block_linears(shape, "tensorwise"))
    tokens = spec.train.global_batch_size * spec.train.seq_len
    rate = spec.world_size * spec.cost.assumed_mfu * 1e12
    moved = 6 * weights * tokens
    assert fp8.compute_s == pytest.approx(bf16.compute_s - moved / (rate * h100.bf16_tflops)
                                          + moved / (rate * h100.fp8_tflops), rel=1e-12)
    seconds, source, _ = estimate_step(spec, "cuda", h100.name)
    assert seconds == pytest.approx(fp8.seconds) and "FP8 peak, 1979 TFLOP/s" in source
    # no float8, or a stated peak: nothing moves
    assert estimate_step(load_spec("llama-3.1-8b-lora", FULL_8B), "cuda", h100.name)[0] == pytest.approx(bf16.seconds)
    stated = load_spec("llama-3.1-8b-lora", [*FULL_8B, "train.float8=tensorwise", "train.peak_tflops=989"])
    assert "FP8" not in estimate_step(stated, "cuda", h100.name)[1]
