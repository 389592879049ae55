"""Judging AdamW steps against torch's own AdamW without depending on the CPU's summation order.

Adam's first step moves a weight by lr·g/(|g|+eps) ≈ ±lr whatever the gradient's size, so where two computations
of one gradient disagree in the last bits and the gradient is near zero, its sign can differ and the weight moves
by up to 2·lr: which elements do so depends on the CPU's kernels (AVX2 and AVX-512 sum in other orders). The
checks here therefore split what is exact from what is not:

- gradients are compared through the first moments (m = (1−β1)·g), tightly;
- second moments are compared through their root, √(v/(1−β2)) = |g| on a first step, with the same tolerance, so a
  wrong β2 (or a missing square) fails although it cancels out of the first update;
- the update is judged by replaying torch's AdamW on the project's *own* gradients (recovered from its moments),
  so only the optimizer is under test and the comparison is exact to rounding;
- where only the weights of two computations are at hand, the update is judged where the gradient is far above
  the disagreement between the two computations, and bounded by what Adam can move elsewhere.
"""

from __future__ import annotations

import torch

BETAS = (0.9, 0.95)
EPS = 1e-8
GRAD_ATOL = 1e-6
"""Absolute agreement of two fp32 computations of one gradient (other kernels, ranks or reduction orders) on these
tiny models: a gradient element is a sum of a few thousand products of O(1) terms, each sum carrying ~1e-7 relative
error (fp32 eps 1.2e-7) of its largest partial sums; 1e-6 leaves a margin of ~10."""
CERTAIN_SIGN = 100 * GRAD_ATOL
"""A gradient this far from zero has the same sign in every computation: its Adam step is the same everywhere."""


def gradient_from_first_moments(m_now: torch.Tensor, m_before: torch.Tensor | None) -> torch.Tensor:
    """The gradient an AdamW step took, from its first moment before and after: m' = β1·m + (1−β1)·g."""
    b1 = BETAS[0]
    before = torch.zeros_like(m_now) if m_before is None else m_before
    return (m_now - b1 * before) / (1 - b1)


def assert_second_moment_is_the_squared_gradient(v: torch.Tensor, grad: torch.Tensor, what: str) -> None:
    """After one step v = (1−β2)·g²: its root, rescaled, is |g| to the gradients' own tolerance."""
    torch.testing.assert_close((v / (1 - BETAS[1])).sqrt(), grad.abs(), atol=GRAD_ATOL, rtol=1e-4,
                               msg=lambda m: f"{what} second moment: {m}")


def replay_adamw(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lrs: list[float],
                 weight_decay: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """torch's AdamW, run from `params` on the given gradients (one dict per step) at the given learning rates, with
    decay on matrices only (as shardline groups them); returns the weights and second moments after the last step."""
    live = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    groups = [{"params": [p for p in live.values() if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in live.values() if p.ndim < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lrs[0], betas=BETAS, eps=EPS)
    for step_grads, lr in zip(grads, lrs, strict=True):
        for group in adamw.param_groups:
            group["lr"] = lr
        for k, p in live.items():
            p.grad = step_grads[k].clone()
        adamw.step()
    return ({k: p.detach() for k, p in live.items()},
            {k: adamw.state[p]["exp_avg_sq"] for k, p in live.items()})


def assert_same_adam_step(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor, lr: float, what: str) -> None:
    """Two computations of one AdamW step from the same weights, whose gradients agree to GRAD_ATOL: where |g| is
    above CERTAIN_SIGN the steps agree to 1e-3 of lr (lr·eps·Δg/g² is far smaller); elsewhere a weight may move
    either way, but never further than one step of Adam (|Δ| ≤ lr) on each side."""
    diff = (got - want).abs()
    certain = grad.abs() > CERTAIN_SIGN
    worst_certain = diff[certain].max() if certain.any() else torch.zeros(())
    assert worst_certain <= lr * 1e-3, (what, float(worst_certain), int(certain.sum()))
    assert diff.max() <= 2 * lr * 1.01, (what, float(diff.max()))
