"""The heap trim a CPU worker runs every `TRIM_EVERY` steps returns free heap pages to the OS, against glibc itself:
a process with the CPU workers' malloc settings frees most of 96 MiB of sub-1-MiB blocks below one that stays
alive (the heap cannot shrink from its top), and its resident size falls only when the trimmer runs."""

import subprocess
import sys

import torch

from shardline.training.heap import HeapTrimmer

CHILD = """
import ctypes, torch
from shardline.training.heap import HeapTrimmer, TRIM_EVERY
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
blocks = [torch.ones(64 * 1024) for _ in range(384)]   # 384 × 256 KiB, touched
blocks = blocks[-1:]                                    # free all but the last: holes below a live block
before = rss()
trimmer = HeapTrimmer(torch.device("cpu"))
trimmer.after_step(TRIM_EVERY - 1)                      # not a trim step
between = rss()
trimmer.after_step(TRIM_EVERY)
print(before, between, rss())
"""


def test_the_trimmer_returns_the_heaps_free_pages_on_its_steps_only():
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
           "MALLOC_TOP_PAD_": str(512 << 20), "PATH": "/usr/bin:/bin"}  # engines.torchrun.CPU_MALLOC_ENV
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True)
    before, between, after = map(int, out.stdout.split())
    assert before - between < 8, (before, between)  # MiB: off its step, nothing is returned
    assert before - after > 72, (before, between, after)  # most of the 96 MiB of holes


def test_no_trim_on_a_gpu_worker():
    assert HeapTrimmer(torch.device("meta")).trim is None and HeapTrimmer(torch.device("cpu")).trim is not None
