"""bench/packed_attention.py runs its paths at tiny shapes on the CPU, and refuses to pretend without a GPU."""

from __future__ import annotations

from tests.conftest import bench_module
from tests.tiers import without_gpu


def test_the_cpu_smoke_times_the_buckets_and_the_dense_mask_over_rows_the_documents_fill(capsys):
    assert bench_module("packed_attention").main(["--cpu-smoke", "--iters", "2"]) == 0  # in this process: no imports
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("2 × 256 tokens"))
    assert "buckets" in line and "(1.00× the buckets)" in line and "dense mask" in line and "varlen" not in line


def test_documents_fill_each_row_exactly_within_the_lengths_asked_for():
    lengths = bench_module("packed_attention").document_lengths(4, 4096, 64, 2048)
    ends, total = set(), 0
    for n in lengths:
        total += n
        ends.add(total)
    assert {4096, 8192, 12288, 16384} <= ends and total == 4 * 4096  # no document crosses a row
    assert all(n < 2048 for n in lengths) and len(lengths) > 4


@without_gpu("the refusal is the no-GPU side")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert bench_module("packed_attention").main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
