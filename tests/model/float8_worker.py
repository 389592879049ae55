"""Processes for tests/model/test_float8.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=2 tests/model/float8_worker.py OUT

FSDP2 over the ranks (gloo) with float8 block linears: for bf16, tensorwise and rowwise, the same tiny Llama trained
5 steps, each rank on its half of every batch; rank 0 writes `losses.json` (the mean loss over ranks per step) and
the type of a block's sharded parameter. Also the tiny model and batches test_float8.py trains in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.parallel.mesh import distributed
from shardline.spec import ParallelSpec
from shardline.worker import exit_without_teardown

STEPS = 5
VOCAB = 256


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def affine_batches(n: int) -> list[torch.Tensor]:
    """Rows of an affine sequence x → (5x + 3) mod V from random starts: learnable, so the loss falls far."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (8, 1), generator=g)
        steps = [x]
        for _ in range(63):
            steps.append((5 * steps[-1] + 3) % VOCAB)
        rows.append(torch.cat(steps, dim=1))
    return rows


def main(out: Path) -> None:
    with distributed() as ctx:
        found: dict[str, object] = {}
        for recipe in ("none", "tensorwise", "rowwise"):
            model, spec = tiny_llama(), ParallelSpec()
            parallelize(model, device_mesh(spec, ctx.world, "cpu"), spec, "bf16", recipe)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses = []
            for ids in affine_batches(STEPS):
                half = ids.shape[0] // ctx.world
                ids = ids[half * ctx.rank: half * (ctx.rank + 1)]
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / ctx.world)
            found[recipe] = {"losses": losses, "param": type(next(model.model.layers[0].parameters())).__name__,
                             "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules())}
        if ctx.rank == 0:
            (out / "losses.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
