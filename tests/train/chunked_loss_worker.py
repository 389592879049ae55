"""Process for tests/train/test_chunked_loss.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=2 tests/train/chunked_loss_worker.py OUT

For each layout (plain; tied embeddings, whose head gradient is the embedding's; tied embeddings + LoRA + full
activation checkpointing) and each `train.loss_chunk_tokens` (None: the whole logits; 7: chunked), builds the tiny
model as the Trainer does (meta → LoRA → parallelize → materialize), takes one SGD step on a prompt-masked batch of
its rank's own rows with the spec's `loss_chunk_tokens`, and rank 0 saves the summed loss over ranks, the full
parameters after the step and the largest number of rows the LM head's output had on it (the whole logits: B·T)
to OUT/results.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardline.data.loader import make_batch
from shardline.data.packing import Document, pack
from shardline.model.build import build_model, causal_lm
from shardline.model.lora import apply_lora
from shardline.model.sharded_load import materialize
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.parallel.mesh import distributed
from shardline.spec import ParallelSpec
from shardline.spec.resolve import load_spec
from shardline.training.loss import token_loss_sum
from shardline.worker import exit_without_teardown

ARCH = ["model.arch.vocab_size=501", "model.arch.hidden_size=64", "model.arch.intermediate_size=128",
        "model.arch.num_layers=2", "model.arch.num_heads=4", "model.arch.num_kv_heads=2",
        "model.attn_implementation=eager"]
LAYOUTS = {"plain": [], "tied": ["model.arch.tie_embeddings=true"],
           "tied+lora+ac": ["model.arch.tie_embeddings=true", "model.lora.enabled=true", "model.lora.r=4",
                            "parallel.activation_checkpointing=full"]}


def _batch(rank: int):
    rng = np.random.default_rng(rank)
    docs = [Document(ids=rng.integers(3, 501, n).tolist(), n_prompt=n // 2) for n in (40, 24, 17, 30, 50)]
    rows = pack(docs, 64, pad_id=0)
    return make_batch(rows, np.arange(len(rows.n_real)))


def _one_step(overrides: list[str], chunk: int | None, rank: int) -> tuple[float, dict, int]:
    spec = load_spec("tiny", [*ARCH, *overrides, f"train.loss_chunk_tokens={chunk or 0}"])
    model = build_model(spec.model, 501, {}, device="meta")
    if spec.model.lora.enabled:
        model = apply_lora(model, spec.model.lora)
    mesh = device_mesh(ParallelSpec(), dist.get_world_size(), "cpu")
    model = parallelize(model, mesh, spec.parallel, "fp32")
    materialize(model, spec.model, torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    rows: list[int] = []
    head = causal_lm(model).get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(out.shape[:-1].numel()))
    loss = token_loss_sum(model, _batch(rank), spec.train.loss_chunk_tokens)
    loss.backward()
    optimizer.step()
    head.remove()
    total = loss.detach().clone()
    dist.all_reduce(total)
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters() if p.requires_grad}
    return float(total), state, max(rows)


def main(out: Path) -> None:
    with distributed() as ctx:
        results = {(name, chunk): _one_step(overrides, chunk, ctx.rank)
                   for name, overrides in LAYOUTS.items() for chunk in (None, 7)}
        if ctx.rank == 0:
            torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
