"""Context parallel (`parallel.cp`): each packed row's tokens split over the `cp` ranks of a group, for rows too
long for one device's activations. torch's experimental context-parallel machinery does the distributed part:

- the batch (tokens, labels, position ids) is split with `_context_parallel_shard` and torch's head-tail load
  balancer (rank r holds chunks r and 2·cp−1−r of 2·cp, so causal work is even over the group);
- attention all-gathers the keys and values of the whole row (torch's `_ContextParallel` flex style: an all-gather
  forward, a reduce-scatter of their gradients backward; not a ring) and each rank attends with its own queries;
- the mask is the per-document causal mask of packed rows, on global token indices (the load balancer's order
  mapped back), with the layer's sliding window: on CUDA torch's `flex_attention` with `_create_cp_block_mask`,
  elsewhere one masked SDPA call over [T/cp, T] (CPU has no flex backward).

Everything else (embeddings, norms, MLP, the loss) runs on the rank's tokens unchanged; rotary embeddings read
the sharded position ids, which keep each token's place in its document. FSDP shards over data-parallel × cp ranks,
so the gradients of a group's token shards are summed by the same reduce-scatter.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _create_cp_block_mask,
)
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
from torch.distributed.tensor.parallel import parallelize_module

from shardline.data.loader import IGNORE_INDEX, Batch
from shardline.errors import SpecError
from shardline.model.document_attention import attention_replaced
from shardline.model.families import family_of


def check_context_parallel(config, cp: int) -> None:
    """Named errors for the attention context parallel cannot compute (checked on the real model config)."""
    if cp > 1 and family_of(config).experts:
        raise SpecError("parallel.cp", f"{family_of(config).name} is a mixture of experts, which shardline does not "
                        "run with context parallel yet (its router auxiliary loss would count each rank's tokens "
                        "alone)", "set parallel.cp=1 for this model (FSDP shards the experts; parallel.ep splits "
                        "them over ranks)")
    if cp > 1 and getattr(config, "attn_logit_softcapping", None):
        raise SpecError("parallel.cp", f"{family_of(config).name} soft-caps its attention scores, which the "
                        "context-parallel attention does not compute", "set parallel.cp=1 for this model")
    if cp > 1 and getattr(config, "attention_dropout", 0.0):
        raise SpecError("parallel.cp", f"the model's attention_dropout is {config.attention_dropout}, which the "
                        "context-parallel attention does not apply (it would train without it, silently)",
                        "set parallel.cp=1, or attention_dropout to 0 in the model's config.json")


@dataclass
class ContextShard:
    """One micro-batch's split over the context-parallel group: what attention needs to mask it."""

    mesh: DeviceMesh
    documents: torch.Tensor
    """[B, T] document index of every token of the whole rows (a document starts where its position is 0)."""
    queries: torch.Tensor
    """[T/cp] global index of each of this rank's tokens (the load balancer's order)."""
    keys: torch.Tensor
    """[T] global index of each all-gathered key (every rank's tokens, rank after rank)."""
    balancer: _HeadTailLoadBalancer
    masks: dict = field(default_factory=dict)

    def dense_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, T/cp, T]: query i sees key j of its own document with j ≤ i (and i − j < window)."""
        if window not in self.masks:
            q, k = self.queries[:, None], self.keys[None, :]
            docs = self.documents
            keep = (docs[:, q] == docs[:, k]) & (k <= q)
            if window is not None:
                keep &= q - k < window
            self.masks[window] = keep[:, None]
        return self.masks[window]

    def block_mask(self, window: int | None):
        """flex attention's block mask of the same rule for this rank's queries (torch rewrites the indices)."""
        if window not in self.masks:
            docs = self.documents

            def rule(b, h, q, k):
                keep = (docs[b, q] == docs[b, k]) & (k <= q)
                return keep & (q - k < window) if window is not None else keep

            rows, seq = docs.shape
            self.masks[window] = _create_cp_block_mask(rule, rows, 1, seq, seq, self.mesh, self.balancer)
        return self.masks[window]


def context_parallel_batch(shard: ContextShard) -> contextlib.AbstractContextManager[None]:
    """The model's attention inside attends over `shard` (`context_parallel_attention`): its forward and backward
    both run in here."""
    return attention_replaced(functools.partial(_attend, shard=shard))


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None, scaling: float | None,
            *, shard: ContextShard) -> torch.Tensor:
    return context_parallel_attention(query, key, value, shard, window, scaling)


def shard_batch(batch: Batch, mesh: DeviceMesh) -> tuple[Batch, ContextShard]:
    """This rank's part of `batch` (its tokens, labels and position ids, load-balanced; its own count of
    loss-bearing tokens) and the ContextShard its attention masks come from."""
    rows, seq = batch.input_ids.shape
    cp = mesh.size()
    if seq % (2 * cp):
        raise SpecError("parallel.cp", f"a batch of {seq}-token rows does not split into 2 × {cp} equal chunks",
                        f"use rows of a multiple of {2 * cp} tokens")
    device = batch.input_ids.device
    balancer = _HeadTailLoadBalancer(seq, cp, device)
    index = torch.arange(seq, device=device).expand(rows, seq)
    ids, labels, positions, local_index = _context_parallel_shard(
        mesh, [batch.input_ids, batch.labels, batch.position_ids, index], [1, 1, 1, 1], balancer)
    keys = balancer._generate_indices(restore=False)[0]
    documents = (batch.position_ids == 0).cumsum(1)
    shard = ContextShard(mesh, documents, local_index[0], keys, balancer)
    loss_tokens = int((labels != IGNORE_INDEX).sum())  # the chunked loss's static size: one host sync
    return Batch(ids, labels, positions, loss_tokens, int(ids.numel()), None), shard


class _GlobalKeys(nn.Module):
    """Attention of this rank's queries over the whole row's keys and values, which torch's context-parallel
    style all-gathers before `forward` (and whose gradients it reduce-scatters)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: ContextShard,
                window: int | None, scaling: float | None) -> torch.Tensor:
        gqa = key.shape[1] != query.shape[1]
        if query.device.type == "cuda":
            block = shard.block_mask(window)
            return _compiled_flex()(query, key, value, block_mask=block, scale=scaling, enable_gqa=gqa)
        if gqa:  # the masked SDPA call materialises [T/cp, T] scores on CPU either way
            key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=shard.dense_mask(window), scale=scaling)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _attention_for(mesh: DeviceMesh) -> nn.Module:
    return parallelize_module(_GlobalKeys(), mesh,
                              _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))


@torch.compiler.disable  # per-batch masks and module caches: compiled blocks run around this (flex compiles itself)
def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: ContextShard,
                               window: int | None, scaling: float | None) -> torch.Tensor:
    """[B, H, T/cp, D] queries, keys and values of this rank's tokens → [B, T/cp, H, D], as HF attention returns."""
    out = _attention_for(shard.mesh)(query, key, value, shard, window, scaling)
    return out.transpose(1, 2).contiguous()
