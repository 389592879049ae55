"""Peak memory of the loss part of a training step (LM head, cross-entropy, their backward): whole logits against
shardline's chunked loss, for a Llama 3.1 8B-sized head, on fake tensors (nothing is allocated).

    .venv/bin/python bench/chunked_loss.py [--tokens 8192] [--hidden 4096] [--vocab 128256] [--chunks 4096 1024]

The head and the hidden states are bf16 (the compute dtype under FSDP's bf16 policy), the cross-entropy fp32, as
in training. Memory is measured by torch's `MemTracker` under `FakeTensorMode`, as the dry run measures a step;
"peak" counts everything live (head weight and gradient, hidden states and their gradient), "loss part" is the
peak less those inputs and gradients, which both paths hold.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from shardline.planning.simulation.fake_world import fake_tensor_mode
from shardline.training.chunked_loss import chunked_cross_entropy_sum

GIB = 2**30


def _whole(hidden, labels, head):
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum")


def peak_bytes(tokens: int, hidden_size: int, vocab: int, chunk: int | None) -> int:
    with fake_tensor_mode():
        weight = torch.randn(vocab, hidden_size, dtype=torch.bfloat16, requires_grad=True)
        head = partial(F.linear, weight=weight)  # a function: MemTracker refuses a module called once per chunk
        hidden = torch.randn(tokens, hidden_size, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        tracker = MemTracker()
        tracker.track_external(weight, hidden, labels)
        with tracker:
            loss = _whole(hidden, labels, head) if chunk is None else \
                chunked_cross_entropy_sum(hidden, labels, head, None, chunk)
            loss.backward()
        return sum(s.get("Total", 0) for s in tracker.get_tracker_snapshot("peak").values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunks", type=int, nargs="+", default=[4096, 1024])
    a = p.parse_args()
    inputs = 2 * (2 * a.vocab * a.hidden + 2 * a.tokens * a.hidden)  # bf16 head, hidden and their gradients
    print(f"loss part of one step: {a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab}, bf16 head, fp32 loss; "
          f"torch {torch.__version__}, MemTracker on fake tensors")
    print("| loss | peak GiB | loss part GiB | × smaller (loss part) |\n|---|---:|---:|---:|")
    whole = peak_bytes(a.tokens, a.hidden, a.vocab, None)
    print(f"| whole logits | {whole / GIB:.2f} | {(whole - inputs) / GIB:.2f} | 1.0 |")
    for chunk in a.chunks:
        peak = peak_bytes(a.tokens, a.hidden, a.vocab, chunk)
        print(f"| chunked, {chunk} tokens | {peak / GIB:.2f} | {(peak - inputs) / GIB:.2f} | "
              f"{(whole - inputs) / (peak - inputs):.1f} |")


if __name__ == "__main__":
    main()
