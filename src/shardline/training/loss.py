"""The training loss of a batch on the (sharded) model: summed next-token cross-entropy, or each position's, over
the loss-bearing tokens, with the document spans passed to the attention, the loss computed in chunks where the
family allows it, and a mixture of experts' router auxiliary loss; and the part of a batch each rank computes it on
(tensor and context parallel). Every objective's loss and the validation loss are built on these."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardline.data.loader import IGNORE_INDEX, Batch
from shardline.model import moe
from shardline.model.build import causal_lm
from shardline.model.document_attention import (
    DENSE_MASKS,
    HOST_OFFSETS,
    NAME,
    WHOLE_ROWS,
    HostOffsets,
    dense_masks,
    mask_placeholder,
    uses_dense_mask,
    whole_rows,
)
from shardline.model.families import is_tested, layer_windows
from shardline.parallel.context import context_parallel_batch, shard_batch
from shardline.parallel.tensor import loss_context
from shardline.training.chunked_loss import chunked_loss


def takes_chunked_loss(config, chunk_tokens: int | None) -> bool:
    """Whether `token_loss_sum` computes the loss in chunks (`shardline.training.chunked_loss`): `chunk_tokens` set
    (`train.loss_chunk_tokens` > 0) and a family of `shardline.model.families`, whose causal LM head is known (a
    linear map, Gemma 2's final-logit cap). Any other family's forward may do more to its logits (Granite scales
    them), so its loss comes from its whole `.logits`: the trainer says so at setup."""
    return bool(chunk_tokens) and is_tested(config)


def token_loss_sum(model: nn.Module, batch: Batch, chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over loss-bearing positions, in fp32.

    `chunk_tokens` (`train.loss_chunk_tokens`): the LM head and the loss over chunks of that many loss-bearing
    tokens (`shardline.training.chunked_loss`); None or 0: over the model's whole `.logits`, as transformers
    computes them, also for a family outside `shardline.model.families` (its head may do more than a linear
    map and Gemma 2's cap: `takes_chunked_loss`). The batch's document spans go to the model as varlen keywords:
    document-masked attention reads them (`flash_attention_2`, shardline's per-document SDPA); `eager` ignores them
    and masks from the positions.

    A mixture of experts with its router auxiliary loss on (`shardline.model.moe`) adds, while gradients are on,
    coef · aux · `batch.n_loss_tokens` (aux over this batch's real tokens): the step's loss is then transformers'
    `cross-entropy + coef · aux`; with `train.router_z_loss_coef` it adds coef · z · `batch.n_loss_tokens` too."""
    lm = causal_lm(model)
    aux = moe.aux_loss_coefficient(lm.config) if torch.is_grad_enabled() else 0.0
    z = moe.z_loss_coefficient(lm.config) if torch.is_grad_enabled() else 0.0
    with moe.router_logits(lm, record=aux > 0 or z > 0) as routed:
        loss = _token_loss(model, batch, chunk_tokens, "sum")
    if aux:
        loss = loss + moe.aux_loss_term(lm, routed, batch.spans, batch.input_ids.shape, batch.n_loss_tokens)
    if z:
        loss = loss + moe.z_loss_term(lm, routed, batch.spans, batch.input_ids.shape, batch.n_loss_tokens)
    return loss


def token_losses(model: nn.Module, batch: Batch, chunk_tokens: int | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    """`token_loss_sum`'s terms: the fp32 cross-entropy of each loss-bearing position of `batch`, in flattened
    order ([batch.n_loss_tokens]); minus each is the log-probability of that target (of the logits divided by
    `temperature`: GRPO's policy at its sampling temperature)."""
    return _token_loss(model, batch, chunk_tokens, "none", temperature)


def _token_loss(model: nn.Module, batch: Batch, chunk_tokens: int | None, reduction: str,
                temperature: float = 1.0) -> torch.Tensor:
    attention, device = getattr(model.config, "_attn_implementation", ""), batch.input_ids.device
    if batch.spans is None:
        spans = {}
    elif "flash" in attention:  # flash reads the varlen offsets on the device
        spans = batch.spans.model_kwargs(device)
    else:  # shardline's attention reads them on the host
        spans = {HOST_OFFSETS: HostOffsets(batch.spans.cu_seqlens)}
    rows, seq = batch.input_ids.shape
    lm = causal_lm(model)
    if spans and attention == NAME:
        spans["attention_mask"] = mask_placeholder(rows, device)  # the attention reads spans: transformers builds none
        # Plain causal rows, or masks built before the forward (on whole rows only for layers with a shorter window):
        # the attention then reads no span offsets on the host, so a compiled block does not break
        whole = spans[WHOLE_ROWS] = whole_rows(batch.spans, rows)
        if uses_dense_mask(seq, device):
            windows = layer_windows(lm.config)
            needed = not whole or any(w and w < seq for w in windows)
            if needed and (masks := dense_masks(batch.spans, rows, seq, device, windows)) is not None:
                spans[DENSE_MASKS] = masks
    spans.update(moe.forward_kwargs(lm.config))  # a mixture of experts: no aux loss of transformers' own here
    if chunk_tokens and takes_chunked_loss(lm.config, chunk_tokens):  # (chunk_tokens: narrowed for the call)
        return chunked_loss(lm, batch.labels, batch.n_loss_tokens, chunk_tokens, reduction, temperature,
                            input_ids=batch.input_ids, position_ids=batch.position_ids, **spans)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, **spans).logits.flatten(0, 1).float()
    labels = batch.labels.flatten()
    if temperature != 1.0:
        logits = logits / temperature
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    return losses if reduction == "sum" else losses[labels != IGNORE_INDEX]


@contextlib.contextmanager
def rank_part(model: nn.Module, batch: Batch, cp_mesh: DeviceMesh | None) -> Iterator[Batch]:
    """The part of `batch` this rank computes the loss of, inside the contexts its forward and backward need:
    loss parallel (tensor parallel), this rank's tokens and their attention masks (context parallel)."""
    part, shard = shard_batch(batch, cp_mesh) if cp_mesh is not None else (batch, None)
    with loss_context(model), context_parallel_batch(shard) if shard is not None else contextlib.nullcontext():
        yield part
