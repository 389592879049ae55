"""Next-token cross-entropy that never holds the whole logits: the decoder body runs once, then the LM head, the
family's final-logit soft-capping and the fp32 cross-entropy run over chunks of the loss-bearing tokens only, each
chunk recomputed in backward, so one chunk's logits and their gradient exist at a time.

Under FSDP2 the LM head belongs to the root unit, whose parameters are all-gathered by the root's forward hooks;
the loss therefore runs as the root's forward for the call (`chunked_loss`): the causal LM is called as a module, so
FSDP's hooks unshard the head while it is used and reduce-scatter its gradient after backward, as with
`model(...).logits`, and module trackers (the dry run's `FSDPMemTracker`) see an ordinary forward.

Under tensor parallel with an untied head the head's weight is split over the vocabulary (loss parallel,
`shardline.parallel.tensor`): each chunk's logits are then a rank's vocabulary columns, and torch's
`loss_parallel` (entered by the caller around forward and backward) computes the cross-entropy across them.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from shardline.data.loader import IGNORE_INDEX


def chunked_cross_entropy_sum(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module,
                              softcap: float | None, chunk_tokens: int, reduction: str = "sum",
                              temperature: float = 1.0) -> torch.Tensor:
    """Summed fp32 cross-entropy of `head(hidden)` ([N, d] → [N, V]), soft-capped as transformers does
    (`tanh(logits / cap) * cap`), against `labels` [N], in chunks of `chunk_tokens` rows; `reduction="none"`: each
    row's cross-entropy [N] instead. With gradients on and more than one chunk, each chunk keeps only its input for
    backward and recomputes its logits there. `temperature`: the logits divided by it first (GRPO's policy at its
    sampling temperature)."""
    recompute = torch.is_grad_enabled() and hidden.shape[0] > chunk_tokens
    parts = []
    # An empty batch still runs one (empty) chunk: every rank must produce a head gradient for FSDP's reduce-scatter.
    for h, y in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
        parts.append(checkpoint(_chunk_loss, h, y, head, softcap, reduction, temperature, use_reentrant=False)
                     if recompute else _chunk_loss(h, y, head, softcap, reduction, temperature))
    total = torch.cat(parts) if reduction == "none" else sum(parts[1:], parts[0])
    return total.to_local() if isinstance(total, DTensor) else total  # loss parallel: the same sum on every peer


def vocabulary_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)`, or under loss parallel (the head's weight split over the vocabulary, inside the root's
    forward) this rank's vocabulary columns of it: a DTensor sharded on the last dimension, never gathered."""
    weight = head.weight
    if isinstance(weight, DTensor) and weight.placements == (Shard(0),):
        return F.linear(DTensor.from_local(hidden, weight.device_mesh, (Replicate(),), run_check=False), weight)
    return head(hidden)


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, softcap: float | None,
                reduction: str = "sum", temperature: float = 1.0) -> torch.Tensor:
    logits = vocabulary_logits(head, hidden)
    if softcap is not None:  # the same three ops, in the same dtype, as the families' own forward
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)


def _loss_forward(self: nn.Module, labels: torch.Tensor, loss_tokens: int, chunk_tokens: int, reduction: str = "sum",
                  temperature: float = 1.0, **model_kwargs) -> torch.Tensor:
    """The causal LM's forward with the chunked loss in place of the logits (bound to the causal LM)."""
    hidden = self.model(**model_kwargs).last_hidden_state.flatten(0, 1)
    targets = labels.flatten()
    if loss_tokens < targets.numel():  # only loss-bearing positions need logits; a static size keeps the host out
        keep = torch.nonzero_static(targets != IGNORE_INDEX, size=loss_tokens).squeeze(1)
        hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    softcap = getattr(self.config, "final_logit_softcapping", None)
    return chunked_cross_entropy_sum(hidden, targets, self.get_output_embeddings(), softcap, chunk_tokens, reduction,
                                     temperature)


def chunked_loss(lm: nn.Module, labels: torch.Tensor, loss_tokens: int, chunk_tokens: int, reduction: str = "sum",
                 temperature: float = 1.0, **model_kwargs: Any) -> torch.Tensor:
    """Call the causal LM `lm` with the chunked loss as its forward: summed fp32 cross-entropy of its next-token
    logits against `labels` ([B, T]; `loss_tokens` of them not IGNORE_INDEX), the body called with `model_kwargs`;
    `reduction="none"`: the cross-entropy of each loss-bearing position [loss_tokens], in their flattened order."""
    before = lm.__dict__.get("forward")
    lm.forward = MethodType(_loss_forward, lm)  # this call only: module hooks (FSDP's root unshard) run around it
    try:
        return lm(labels=labels, loss_tokens=loss_tokens, chunk_tokens=chunk_tokens, reduction=reduction,
                  temperature=temperature, **model_kwargs)
    finally:
        del lm.forward
        if before is not None:
            lm.forward = before
