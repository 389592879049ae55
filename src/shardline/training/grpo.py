"""Group relative policy optimisation's objective (`train.objective: grpo`): advantages and the clipped loss.

Each prompt's G completions (`shardline.training.rollout`) are scored by the reward; a completion's advantage is
its reward minus its group's mean, divided by the group's (or the batch's) standard deviation plus 1e-4. Every
completion token t then carries −min(r_t·A, clip(r_t, 1 − ε, 1 + ε_high)·A) with r_t = π(t)/π_old(t), plus
β·r_t·KL_t to the reference (k3: KL_t = exp(ref − logp) − (ref − logp) − 1; the factor r_t, 1 in value, makes the
KL's gradient the unbiased reverse KL's: TRL's default `use_bias_correction_kl`). The policy's log-probabilities
are taken at the sampling temperature. One optimizer step per sampled batch (TRL's `num_iterations=1`) makes π_old
the policy itself (detached): r_t = 1 in value, and the clip matters only to a caller passing other `old`
log-probabilities.

These are TRL's `GRPOTrainer` formulas of the same names (`loss_type`, `scale_rewards`, `epsilon`,
`epsilon_high`, `beta`); `tests/train/test_grpo_oracle.py` holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline.spec import GrpoSpec

METRICS = ("completions", "reward", "reward_std", "zero_std", "solved", "scored", "completion_tokens",
           "truncated", "kl", "clipped", "sampled", "sampled_zero_std")
"""The summed per-completion quantities a step reduces over ranks, `completions` first: `reward_std` sums each
completion's group std (a mean of group stds), `zero_std` counts completions whose group had no reward spread (no
learning signal), `solved` the completions the task's own check passed among the `scored` ones it judged,
`truncated` those cut at `max_new_tokens`, `kl` and `clipped` per-token sums over `completion_tokens`;
`sampled` and `sampled_zero_std` count the completions sampled, and those without spread, before
`oversample`'s selection kept `completions` of them."""


def group_advantages(rewards: torch.Tensor, generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (rewards of the whole global batch, each prompt's `generations` consecutive),
    and its group's reward std."""
    grouped = rewards.view(-1, generations)
    mean = grouped.mean(dim=1).repeat_interleave(generations)
    group_std = grouped.std(dim=1).repeat_interleave(generations)
    std = rewards.std().expand_as(rewards) if scale == "batch" else group_std
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return advantages, group_std


def most_informative(rewards: list[float], generations: int, keep: int) -> list[int]:
    """Dynamic sampling (`GrpoSpec.oversample`): the completions (indices, in sampled order) of the `keep` groups,
    each `generations` consecutive rewards, whose rewards spread most; equal spreads keep the first sampled."""
    spread = torch.tensor(rewards, dtype=torch.float64).view(-1, generations).std(dim=1).tolist()
    groups = sorted(sorted(range(len(spread)), key=lambda i: (-spread[i], i))[:keep])
    return [k * generations + j for k in groups for j in range(generations)]


def without_spread(rewards: list[float], generations: int) -> int:
    """Completions whose group's rewards are all equal (no advantage: no learning signal); a rank's groups are its
    own, so its rewards alone count its share."""
    grouped = torch.tensor(rewards, dtype=torch.float64).view(-1, generations)
    return int((grouped.std(dim=1) < 1e-6).sum()) * generations


@dataclass
class TokenTerms:
    """Per completion token of a micro-batch (flattened order): the loss term and what its metrics need."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    clipped: torch.Tensor


def token_terms(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                advantages: torch.Tensor, spec: GrpoSpec) -> TokenTerms:
    """The clipped surrogate (+ β·KL) of each completion token; `advantages` already per token."""
    ratio = torch.exp(logp - old_logp)
    high = spec.epsilon_high if spec.epsilon_high is not None else spec.epsilon
    clipped_ratio = torch.clamp(ratio, 1 - spec.epsilon, 1 + high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = None
    if spec.beta:
        assert ref_logp is not None, "beta > 0 needs the reference log-probabilities"
        gap = ref_logp - logp
        kl = torch.exp(gap) - gap - 1
        loss = loss + spec.beta * kl * ratio  # the ratio makes its gradient the unbiased reverse KL's
    clipped = ((ratio < 1 - spec.epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    return TokenTerms(loss, kl, clipped)


@dataclass
class Normalisers:
    """The global batch's counts a micro-batch's loss is divided by (`GrpoSpec.loss`)."""

    tokens: float
    """Completion tokens of the global batch (dapo)."""
    completions: float
    """Completions of the global batch (grpo, dr_grpo)."""
    micro_batches: float
    """Micro-batches of the global batch, all ranks' (bnpo: a mean of each micro-batch's token mean)."""


def reduce_loss(terms: TokenTerms, documents: torch.Tensor, n_documents: int, norm: Normalisers,
                spec: GrpoSpec) -> torch.Tensor:
    """This micro-batch's share of the step's loss: the step's loss is the sum of every micro-batch's on every
    rank, which FSDP's gradient average over ranks undoes (the caller multiplies by the ranks)."""
    total = terms.loss.sum()
    if spec.loss == "dapo":
        return total / norm.tokens
    if spec.loss == "dr_grpo":
        return total / (norm.completions * spec.max_new_tokens)
    if spec.loss == "bnpo":
        return total / max(terms.loss.numel(), 1) / norm.micro_batches
    sums = torch.zeros(max(n_documents, 1), dtype=terms.loss.dtype, device=terms.loss.device)
    sums = sums.index_add(0, documents, terms.loss)
    counts = torch.bincount(documents, minlength=max(n_documents, 1)).clamp(min=1).to(sums.dtype)
    return (sums / counts).sum() / norm.completions  # grpo: each completion's mean, then the mean


def mean_metrics(sums: torch.Tensor) -> dict[str, float]:
    """`METRICS` as means: per completion, per completion token (`kl`, `clipped`), per judged completion
    (`solved`), and the mean completion length."""
    values = dict(zip(METRICS, sums.tolist(), strict=True))
    completions = max(values["completions"], 1.0)
    tokens = max(values["completion_tokens"], 1.0)
    out = {"completions": int(values["completions"])}
    for name in ("reward", "reward_std", "zero_std", "truncated"):
        out[name] = values[name] / completions
    out["completion_length"] = values["completion_tokens"] / completions
    out["kl"] = values["kl"] / tokens
    out["clipped"] = values["clipped"] / tokens
    if values["scored"]:
        out["solved"] = values["solved"] / values["scored"]
    if values["sampled"] > values["completions"]:  # oversampled: the share the selection had to replace
        out["sampled_zero_std"] = values["sampled_zero_std"] / values["sampled"]
    return out
