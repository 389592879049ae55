"""GRPO against TRL's `GRPOTrainer`: on the same model, completions, advantages and old (sampling-time)
log-probabilities, TRL's `_compute_loss` equals shardline's loss and the policy's gradients equal (fp32), for every
loss TRL and shardline share, the clip on both sides, a sampling temperature, and the KL to the reference (LoRA's
adapters off). TRL's group advantages from the same rewards equal shardline's for each `scale_rewards`.

shardline packs each prompt and completion as one document of a row with per-document attention; TRL left-pads
the prompts and right-pads the completions. Equal numbers mean the packing, the document order, the per-token
log-probabilities at the temperature and the loss normalisation agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardline.data.tokenizer import train_bpe
from shardline.spec import GrpoSpec
from shardline.training.grpo import Normalisers, group_advantages, reduce_loss, token_terms
from shardline.training.preference import adapters_off, document_targets
from shardline.training.rollout import rollout_batches
from tests.train.test_dpo_oracle import LORA, VOCAB, _models, assert_same_gradients

G = 4
MAX_NEW = 9


def _rollouts(seed: int, prompts: int = 2):
    rng = np.random.default_rng(seed)
    draw = lambda lo, hi: [int(v) for v in rng.integers(3, VOCAB, rng.integers(lo, hi))]  # noqa: E731
    prompt_ids = [[1, *draw(3, 9)] for _ in range(prompts)]
    completions = []
    for _ in range(prompts * G):
        body = draw(1, MAX_NEW)
        completions.append(body + [2] if len(body) < MAX_NEW and rng.random() < 0.7 else draw(MAX_NEW, MAX_NEW + 1))
    return [p for p in prompt_ids for _ in range(G)], completions


def _trl_inputs(prompts, completions):
    width = max(len(p) for p in prompts)
    length = max(len(c) for c in completions)
    n = len(prompts)
    prompt_ids, prompt_mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    completion_ids, completion_mask = torch.zeros(n, length, dtype=torch.long), torch.zeros(n, length, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[i, width - len(p):], prompt_mask[i, width - len(p):] = torch.tensor(p), 1  # left padding
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = torch.tensor(c), 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask}


def _trainer(policy, spec: GrpoSpec, n: int, tmp_path, adapter=None):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=n, num_generations=G, max_completion_length=spec.max_new_tokens,
                      temperature=spec.temperature, beta=spec.beta, epsilon=spec.epsilon,
                      epsilon_high=spec.epsilon_high, loss_type=spec.loss, scale_rewards=spec.scale_rewards)
    peft_config = None if adapter is None else LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=sorted({n.split(".")[-4] for n, _ in adapter.named_parameters() if "lora_A" in n}))
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "a b"}] * n), processing_class=train_bpe(
                              ["a b c"], 300), peft_config=peft_config)
    if adapter is not None:
        missing = trainer.model.load_state_dict(adapter.state_dict(), strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop: one micro-batch per step here
    return trainer


@pytest.mark.parametrize(("lora", "loss", "temperature", "beta", "epsilon_high", "chunk"), [
    (False, "dapo", 1.0, 0.0, None, 4096), (False, "grpo", 0.7, 0.0, 0.28, None),
    (False, "bnpo", 1.0, 0.0, None, None), (False, "dr_grpo", 1.3, 0.0, None, 4096),
    (True, "dapo", 0.9, 0.05, 0.28, 4096), (True, "grpo", 1.0, 0.1, None, None),
])
def test_grpo_loss_and_gradients_equal_trl(lora, loss, temperature, beta, epsilon_high, chunk, tmp_path):
    spec = GrpoSpec(num_generations=G, temperature=temperature, max_new_tokens=MAX_NEW, beta=beta, epsilon=0.2,
                    epsilon_high=epsilon_high, loss=loss)
    prompts, completions = _rollouts(seed=3)
    n = len(completions)
    ours, _, theirs, _ = _models(lora)
    trainer = _trainer(theirs, spec, n, tmp_path, adapter=ours if lora else None)
    inputs = _trl_inputs(prompts, completions)
    gen = torch.Generator().manual_seed(5)
    inputs["advantages"] = torch.randn(n, generator=gen)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, keep)
        # sampling-time log-probabilities off the current ones by up to ±0.35: ratios clipped on both sides
        inputs["old_per_token_logps"] = current + 0.35 * (2 * torch.rand(current.shape, generator=gen) - 1)
        if beta:
            with trainer.model.disable_adapter():
                inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, input_ids, attention, keep)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()

    # two micro-batches, each packed (several completions share a row); bnpo's mean is per micro-batch: TRL's one
    micro = n if loss == "bnpo" else n // 2
    batches = rollout_batches(prompts, completions, micro, seq_len=40, pad=0)
    assert any(len(b.batch.spans.real) > 2 for b in batches), "packing puts several completions in one row"
    norm = Normalisers(tokens=float(sum(len(c) for c in completions)), completions=float(n),
                       micro_batches=float(len(batches)))
    mask = inputs["completion_mask"].bool()
    total = torch.zeros(())
    clipped = 0
    ours.train()
    for part in batches:
        documents, n_documents = document_targets(part.batch)
        order = torch.from_numpy(part.completions)
        old = torch.cat([inputs["old_per_token_logps"][i][mask[i]] for i in order.tolist()])
        ref = None
        if beta:
            with torch.no_grad(), adapters_off(ours):
                ref = -_token_losses(ours, part.batch, chunk, temperature)

        logp = -_token_losses(ours, part.batch, chunk, temperature)
        terms = token_terms(logp, old, ref, inputs["advantages"][order][documents], spec)
        value = reduce_loss(terms, documents, n_documents, norm, spec)
        value.backward()
        total += value.detach()
        clipped += int(terms.clipped.sum())

    assert clipped > 0, "some ratios are clipped: the clip is exercised"
    assert float(total) == pytest.approx(float(expected), abs=2e-6, rel=1e-5)
    assert_same_gradients(ours, trainer.model, at_least=4 if lora else 10)


def _token_losses(model, batch, chunk, temperature):
    from shardline.training.loss import token_losses

    return token_losses(model, batch, chunk, temperature)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trls(scale, tmp_path):
    """TRL's `_generate_and_score_completions` arithmetic, as in its source, on rewards with a zero-std group."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.1, 0.1, 0.0, 1.1, 0.1, 0.1, 0.1, 0.1, 0.0, 1.1, 1.1, 0.0])
    ours, group_std = group_advantages(rewards, G, scale)
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) if scale != "batch" else \
        nanstd(rewards).expand_as(rewards)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    torch.testing.assert_close(ours, expected)
    assert float(group_std[4:8].abs().max()) == 0.0


def test_dynamic_sampling_keeps_the_groups_whose_rewards_spread_most():
    """`train.grpo.oversample`: DAPO keeps the groups whose rewards are not all equal (verl's `filter_groups`: std >
    0); at a fixed cost per step the groups with the largest spread are kept, equal spreads the first sampled."""
    from shardline.training.grpo import most_informative, without_spread

    groups = [[1.1] * 4, [1.1, 1.1, 1.1, 0.1], [0.0] * 4, [1.1, 0.1, 0.0, 1.1], [0.1, 1.1, 1.1, 1.1]]
    rewards = [r for group in groups for r in group]
    assert without_spread(rewards, 4) == 8  # groups 0 and 2
    assert most_informative(rewards, 4, 2) == [*range(4, 8), *range(12, 16)]  # group 3, then 1 before its equal 4
    assert most_informative(rewards, 4, 4) == [*range(0, 8), *range(12, 20)]  # every spread group, then group 0
    assert most_informative(rewards, 4, 5) == list(range(20))
