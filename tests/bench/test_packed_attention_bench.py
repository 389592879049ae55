"""bench/packed_attention.py runs its paths at tiny shapes on the CPU, and refuses to pretend without a GPU."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, bench_module
from tests.tiers import without_gpu


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/packed_attention.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_the_cpu_smoke_times_the_buckets_and_the_dense_mask_over_rows_the_documents_fill():
    res = run_script("--cpu-smoke", "--iters", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("2 × 256 tokens"))
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
def test_without_a_gpu_it_says_so_and_exits_2():
    res = run_script()
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr
