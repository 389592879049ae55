"""Every objective × precision × fine-tune the spec allows trains a step: SFT, DPO and GRPO (with a KL, so its
reference runs), in fp32 and bf16, LoRA and full, on one in-process rank through FSDP2 — what a run does before its
first step (`Trainer.begin`: DPO's step-0 validation, a precomputed reference, GRPO's prompts), then one
`train_step` with a finite loss that moves the trainable weights, and under LoRA only the adapters.

bf16 is the subject: FSDP2 casts the bf16 gradients to the fp32 trainable weights with the dtypes it fixed at the
model's first forward, which with LoRA is the reference's, adapters off (issue 52: that step crashed). The 2-rank
launches of bf16 LoRA are in test_dpo_end_to_end.py and test_grpo_end_to_end.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from rich.console import Console
from torch.distributed.tensor import DTensor

from shardline.data.prepare import prepare
from shardline.training.trainer import Trainer
from tests.conftest import small_spec

OBJECTIVES = {
    "sft": [],
    "dpo": ["train.objective=dpo", "train.dpo.beta=0.2"],
    "grpo": ["train.objective=grpo", "train.grpo.beta=0.1", "train.grpo.num_generations=4",
             "train.grpo.max_new_tokens=8", f"train.grpo.reward={__name__}:letters"],
}
FINE_TUNES = {"lora": ["model.lora.enabled=true", "model.lora.r=4"], "full": []}


def letters(prompts, completions, **columns):
    """GRPO's reward here: a random model's samples differ in it, so the advantages and the gradient are not 0."""
    return [len(set(c.lower()) & set("abcdefghijklmnopqrstuvwxyz")) / 26 for c in completions]


@pytest.fixture(scope="module")
def preference_data(session_dir):
    """The generated text-to-SQL set drawn as preference pairs (DPO's rows), prepared once for the module."""
    return prepare(small_spec(session_dir, *OBJECTIVES["dpo"]))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole value (a block left gathered after a no-grad forward holds plain tensors)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("fine_tune", sorted(FINE_TUNES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_trains_a_step_in_each_precision_with_lora_or_a_full_fine_tune(
        ctx, tmp_path, prepared, preference_data, objective, precision, fine_tune):
    spec = small_spec(tmp_path, f"train.precision={precision}", "train.peak_tflops=1", "checkpoint.async_save=false",
                      *OBJECTIVES[objective], *FINE_TUNES[fine_tune])
    data = preference_data if objective == "dpo" else prepared
    trainer = Trainer(spec, ctx, data, tmp_path / "run", Console(quiet=True))
    trainer.begin()
    before = _weights(trainer.model)
    record = trainer.train_step()
    after = _weights(trainer.model)

    assert math.isfinite(record.loss) and record.grad_norm > 0, record
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed, "no weight moved"
    if fine_tune == "lora":
        assert all("lora_" in name for name in changed), sorted(changed)
        assert {name for name in before if "lora_B" in name} <= changed  # every adapter had a gradient
        assert all(after[name].dtype == torch.float32 for name in changed)  # fp32 masters of the adapters
    if objective == "dpo":  # the policy is the reference at the first step: Δ = 0
        assert record.preference["pairs"] > 0
        assert record.loss == pytest.approx(math.log(2), abs=1e-5)
    if objective == "grpo":
        assert record.grpo["completions"] == spec.train.global_batch_size
        assert record.grpo["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting weights


def test_the_adapters_off_reference_leaves_the_adapters_trainable_in_blocks_kept_gathered(ctx, tmp_path,
                                                                                       preference_data):
    """`parallel.reshard_after_forward: false` keeps a block's gathered weights registered after the no-grad
    reference forward: peft's re-enabling then marked those trainable and left the sharded adapters frozen, so the
    step's gradient norm read 0 (clipping off) though the adapters trained; in any precision."""
    spec = small_spec(tmp_path, "train.precision=fp32", "train.peak_tflops=1", "parallel.reshard_after_forward=false",
                      *OBJECTIVES["dpo"], *FINE_TUNES["lora"])
    trainer = Trainer(spec, ctx, preference_data, tmp_path / "run", Console(quiet=True))
    trainer.begin()
    record = trainer.train_step()
    assert record.grad_norm > 0
    adapters = [(name, p) for name, p in trainer.model.named_parameters() if "lora_" in name]
    assert adapters and all(p.requires_grad for _, p in adapters)
