"""Random init of a Llama-shaped model's weights (`materialize` with `model.init_seed`, the path a run without
`model.path` takes, e.g. the benchmark protocols) on one thread against torch's intra-op thread count, on the CPU.

    .venv/bin/python bench/random_init.py [--layers 2] [--hidden 4096] [--intermediate 14336] [--vocab 128256]
                                          [--threads 1,4]

Defaults: Llama-3.1-8B's shapes at 2 of its 32 layers (1.5·10⁹ parameters: its embedding and head weigh most). Prints
seconds and draws per second for each thread count, the ratio to one thread, and that the weights are bit-equal.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from shardline.model.build import build_model
from shardline.model.sharded_load import materialize
from shardline.spec.resolve import load_spec


def timed_init(spec, vocab: int, threads: int) -> tuple[float, torch.nn.Module]:
    torch.set_num_threads(threads)
    model = build_model(spec.model, vocab, {}, device="meta")
    start = time.perf_counter()
    materialize(model, spec.model, torch.device("cpu"))
    return time.perf_counter() - start, model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="comma-separated thread counts")
    args = ap.parse_args(argv)
    spec = load_spec("tiny", [f"model.arch.vocab_size={args.vocab}", f"model.arch.hidden_size={args.hidden}",
                              f"model.arch.intermediate_size={args.intermediate}",
                              f"model.arch.num_layers={args.layers}", f"model.arch.num_heads={args.heads}",
                              f"model.arch.num_kv_heads={args.kv_heads}"])
    first, differs = None, False
    for threads in (int(n) for n in args.threads.split(",")):
        seconds, model = timed_init(spec, args.vocab, threads)
        params = sum(p.numel() for p in model.parameters())
        weights = [p.detach() for p in model.parameters()]
        if first is None:
            first, base = weights, seconds
            same = "the reference"
        else:
            equal = all(torch.equal(a, b) for a, b in zip(first, weights, strict=True))
            differs |= not equal
            same = "bit-equal" if equal else "DIFFERENT"
        print(f"{threads} thread(s): {seconds:.2f} s for {params / 1e9:.2f}e9 parameters "
              f"({params / seconds / 1e6:,.0f} M/s), {base / seconds:.2f}× one thread's speed · {same}")
        del model
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
