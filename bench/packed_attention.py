"""Packed-row attention, forward + backward alone, through shardline's own paths at Llama-3.1-8B head shapes
(32 query heads, 8 KV heads, head dim 128, bf16): the per-document buckets (`_per_document`), one variable-length
flash call (`_varlen`, what long rows take on CUDA) and, for rows of at most 1024 tokens, the dense
block-diagonal mask (`_dense`). Documents of 64–2047 random tokens fill each row (drawn from a fixed seed).

    python bench/packed_attention.py [--rows 4x4096,2x8192,16x1024,16x512] [--iters 10]
    python bench/packed_attention.py --cpu-smoke    # tiny shapes in fp32 on the CPU: buckets and dense only

Prints milliseconds per forward + backward (CUDA events around `--iters` calls after 3 warm-up calls) and each
path's time against the buckets'. Results: bench/RESULTS-gpu.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from shardline.model.document_attention import DENSE_MAX_SEQ, _block_mask, _dense, _per_document, _varlen


def document_lengths(rows: int, seq: int, shortest: int, longest: int, seed: int = 0) -> tuple[int, ...]:
    """Random document lengths filling `rows` rows of `seq` tokens exactly, none crossing a row."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(rows):
        left = seq
        while left:
            n = min(left, int(torch.randint(shortest, longest, (1,), generator=g)))
            lengths.append(n)
            left -= n
    return tuple(lengths)


def timed_ms(fn, iters: int, device: torch.device) -> float:
    """Milliseconds per call of `fn` (forward and backward) after 3 warm-up calls."""
    for i in range(3 + iters):
        if i == 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        fn().float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], smoke: bool) -> dict:
    """Each path this device runs for rows of this length, as a call returning the attention output."""
    rows, seq = q.shape[0], q.shape[2]
    out = {"buckets": lambda: _per_document(q, k, v, lengths, None, True)}
    if q.is_cuda:
        out["varlen"] = lambda: _varlen(q, k, v, lengths, None, True)
    if seq <= DENSE_MAX_SEQ or smoke:
        mask = _block_mask(lengths, rows, seq, q.device)
        out["dense mask"] = lambda: _dense(q, k, v, mask, None, True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4x4096,2x8192,16x1024,16x512", help="ROWSxSEQ shapes, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in fp32 on the CPU (no varlen)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, heads, kv_heads, head_dim, shapes, docs = torch.device("cpu"), torch.float32, 4, 2, 16, \
            [(2, 256)], (16, 128)
    elif torch.cuda.is_available():
        device, dtype, heads, kv_heads, head_dim, docs = torch.device("cuda"), torch.bfloat16, 32, 8, 128, (64, 2048)
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.rows.split(",")]
    else:
        print("bench/packed_attention.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} · torch {torch.__version__}")
    for rows, seq in shapes:
        lengths = document_lengths(rows, seq, *docs)
        torch.manual_seed(0)
        q, k, v = (torch.randn(rows, h, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        times = {name: timed_ms(fn, args.iters, device)
                 for name, fn in paths(q, k, v, lengths, args.cpu_smoke).items()}
        line = " · ".join(f"{name} {ms:.2f} ms ({times['buckets'] / ms:.2f}× the buckets)"
                          for name, ms in times.items())
        print(f"{rows} × {seq} tokens, {len(lengths)} documents: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
