"""DPO against TRL's `DPOTrainer`: on the same model, pairs and β, TRL's loss, chosen and rejected rewards,
accuracy and the policy's gradients equal shardline's (fp32), for a full fine-tune (a frozen reference copy) and
LoRA (the reference is the adapters off), every loss TRL and shardline share.

shardline packs each pair as two documents of one row with per-document attention; TRL pads chosen and rejected
rows apart. Equal numbers mean the packing, the per-document attention, the document sums and the loss agree."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from shardline.data.loader import make_batch
from shardline.data.packing import Document, pack
from shardline.data.tokenizer import train_bpe
from shardline.model.build import build_model
from shardline.model.lora import apply_lora
from shardline.spec import ArchSpec, DpoSpec, LoraSpec, ModelSpec
from shardline.training.preference import adapters_off, dpo_losses, pair_logps

VOCAB = 512
BETA = 0.3
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
LORA = LoraSpec(enabled=True, r=4, alpha=8)


def _pairs(seed: int, n: int = 5) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    draw = lambda lo, hi: [int(v) for v in rng.integers(3, VOCAB, rng.integers(lo, hi))]  # noqa: E731
    return [{"prompt_ids": [1, *draw(3, 9)], "chosen_ids": [*draw(2, 7), 2], "rejected_ids": [*draw(2, 7), 2]}
            for _ in range(n)]


def _packed_batch(pairs: list[dict[str, list[int]]]):
    """shardline's batch: each pair one packing unit, chosen then rejected, positions restarting, loss on the
    completions."""
    units = []
    for p in pairs:
        chosen, rejected = p["prompt_ids"] + p["chosen_ids"], p["prompt_ids"] + p["rejected_ids"]
        loss = [0] * len(p["prompt_ids"]) + [1] * len(p["chosen_ids"]) + [0] * len(p["prompt_ids"]) + \
            [1] * len(p["rejected_ids"])
        units.append(Document(ids=np.asarray(chosen + rejected, dtype=np.int32), loss=np.asarray(loss, np.uint8),
                              positions=np.concatenate([np.arange(len(chosen)), np.arange(len(rejected))])))
    rows = pack(units, seq_len=48, pad_id=0)
    assert len(rows.n_real) < len(pairs), "several pairs share a row: the test covers packing"
    return make_batch(rows, np.arange(len(rows.n_real)))


def _models(lora: bool, seed: int = 0):
    """(shardline's policy, shardline's reference or None, TRL's policy, TRL's reference or None) with equal
    weights; the policy moved away from the reference so the log-ratios are not zero."""
    spec = ModelSpec(arch=ArchSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                                   num_heads=4, num_kv_heads=2), init_seed=seed)
    base = build_model(spec, VOCAB, SPECIAL)
    plain = build_model(spec.model_copy(update={"attn_implementation": "eager"}), VOCAB, SPECIAL)
    plain.load_state_dict(base.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    if lora:  # TRL gets the base and the adapter's config: an adapter it adds, whose reference is the adapters off
        ours = apply_lora(base, LORA)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        return ours, None, plain, None
    ref_ours, ref_theirs = copy.deepcopy(base), copy.deepcopy(plain)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    plain.load_state_dict(base.state_dict())
    return base, ref_ours, plain, ref_theirs


def _trl(policy, ref, pairs, loss: str, tmp_path, adapter=None, sft_weight: float = 0.0):
    """TRL's loss and reward metrics on `pairs` (its own collator), gradients left in the policy's parameters; with
    `adapter` (shardline's LoRA model), TRL adds the same LoRA to `policy` and takes the adapter's weights."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = train_bpe(["a b c"], 300)
    mix = {"loss_type": [loss, "sft"], "loss_weights": [1.0, sft_weight]} if sft_weight else {"loss_type": [loss]}
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, **mix, report_to="none",
                     use_cpu=True, bf16=False, per_device_train_batch_size=len(pairs))
    peft_config = None if adapter is None else LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=sorted({n.split(".")[-4] for n, _ in adapter.named_parameters() if "lora_A" in n}))
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok, peft_config=peft_config,
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}]))
    if adapter is not None:
        missing = trainer.model.load_state_dict(adapter.state_dict(), strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
    trainer.model.train()
    inputs = DataCollatorForPreference(pad_token_id=0)(pairs)
    value = trainer.compute_loss(trainer.model, inputs)
    value.backward()
    m = trainer._metrics["train"]
    rewards = {k: m[f"rewards/{k}"][-1] for k in ("chosen", "rejected", "accuracies", "margins")}
    return float(value.detach()), rewards, trainer.model


@pytest.mark.parametrize(("lora", "loss", "chunk", "sft_weight"), [
    (False, "sigmoid", 4096, 0.0), (False, "ipo", None, 0.0), (False, "sigmoid_norm", 4096, 0.0),
    (True, "sigmoid", None, 0.0), (True, "ipo", 4096, 0.0), (False, "sigmoid", None, 0.7), (True, "sigmoid", 4096, 1.0),
])
def test_dpo_equals_trl(lora, loss, chunk, sft_weight, tmp_path):
    """`sft_weight`: TRL's loss_type=[loss, "sft"] with that weight (RPO), shardline's `train.dpo.sft_weight`."""
    pairs = _pairs(seed=7)
    ours, ref_ours, theirs, ref_theirs = _models(lora)
    expected_loss, expected, theirs = _trl(theirs, ref_theirs, pairs, loss, tmp_path, adapter=ours if lora else None,
                                           sft_weight=sft_weight)

    batch = _packed_batch(pairs)
    ours.train()
    with torch.no_grad():
        if lora:
            with adapters_off(ours):
                ref = pair_logps(ours, batch, chunk)
        else:
            ref = pair_logps(ref_ours, batch, chunk)
    policy = pair_logps(ours, batch, chunk)
    losses, chosen, rejected = dpo_losses(policy, ref.chosen, ref.rejected, DpoSpec(beta=BETA, loss=loss))
    total = losses.mean() - sft_weight * policy.chosen.sum() / policy.chosen_tokens.sum()
    total.backward()

    assert losses.numel() == len(pairs)
    assert float(total) == pytest.approx(expected_loss, abs=1e-5)
    assert abs(float(losses.mean()) - np.log(2)) > 1e-3 or loss == "ipo", "the policy differs from the reference"
    assert float(chosen.mean()) == pytest.approx(expected["chosen"], abs=1e-5)
    assert float(rejected.mean()) == pytest.approx(expected["rejected"], abs=1e-5)
    assert float((chosen - rejected).mean()) == pytest.approx(expected["margins"], abs=1e-5)
    assert float((chosen > rejected).float().mean()) == pytest.approx(expected["accuracies"], abs=1e-6)
    assert_same_gradients(ours, theirs, at_least=4 if lora else 10)


def assert_same_gradients(ours, theirs, at_least: int) -> None:
    """Every trainable parameter of `ours` has the gradient of `theirs`'s parameter of the same name."""
    theirs_grads = dict(theirs.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if p.requires_grad:
            other = theirs_grads[name].grad
            assert other is not None and p.grad is not None, name
            torch.testing.assert_close(p.grad, other, atol=2e-5, rtol=1e-3, msg=name)
            compared += 1
    assert compared >= at_least
