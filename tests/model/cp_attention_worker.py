"""torchrun worker for tests/model/test_context_parallel.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=2 tests/model/cp_attention_worker.py OUT.json

Packed rows of documents of every size; for each (sliding window, GQA) case, shardline's per-document attention
on whole rows (one process's view, the oracle tests/model/test_document_attention.py checks against transformers)
against context-parallel attention on this rank's load-balanced tokens: outputs and the gradients of q, k and v at
this rank's tokens. Rank 0 writes the largest differences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardline.data.loader import make_batch
from shardline.data.packing import Document, pack
from shardline.model.document_attention import document_sdpa
from shardline.parallel.context import context_parallel_attention, shard_batch
from shardline.worker import exit_without_teardown

SEQ, HEADS, DIM = 256, 4, 8


def _batch():
    rng = np.random.default_rng(0)
    lengths = [200, 56, 17, 90, 31, 118, 256, 3, 60, 41, 9, 100]
    docs = [Document(ids=rng.integers(3, 200, n).tolist(), n_prompt=n // 2) for n in lengths]
    rows = pack(docs, SEQ, pad_id=0)
    return make_batch(rows, np.arange(len(rows.n_real)))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    batch = _batch()
    part, shard = shard_batch(batch, mesh)
    mine = shard.queries
    assert torch.equal(part.position_ids, batch.position_ids[:, mine])  # rotary reads each token's own position
    diffs = {}
    for window in (None, 24):
        for kv_heads in (HEADS, 2):
            torch.manual_seed(1)
            rows = batch.input_ids.shape[0]
            q = torch.randn(rows, HEADS, SEQ, DIM, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(rows, kv_heads, SEQ, DIM, dtype=torch.float64, requires_grad=True) for _ in range(2))
            weight = torch.randn(rows, SEQ, HEADS, DIM, dtype=torch.float64)
            ref, _ = document_sdpa(None, q, k, v, None, sliding_window=window, **batch.spans.model_kwargs(q.device))
            (ref * weight).sum().backward()
            ql, kl, vl = (x.detach()[:, :, mine].clone().requires_grad_() for x in (q, k, v))
            got = context_parallel_attention(ql, kl, vl, shard, window, None)
            (got * weight[:, mine]).sum().backward()
            case = f"window={window} kv_heads={kv_heads}"
            diffs[case] = {"out": float((got - ref[:, mine]).detach().abs().max()),
                           **{f"grad_{n}": float((local.grad - full.grad[:, :, mine]).abs().max())
                              for n, local, full in (("q", ql, q), ("k", kl, k), ("v", vl, v))}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)
