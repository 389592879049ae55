"""bench/random_init.py at a tiny shape: it times the random init on 1 and on 3 threads and finds them bit-equal."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_the_random_init_bench_times_each_thread_count_and_compares_the_weights():
    res = subprocess.run([sys.executable, "bench/random_init.py", "--layers", "1", "--hidden", "64",
                          "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "1000",
                          "--threads", "1,3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    one, three = (line for line in res.stdout.splitlines() if "thread(s):" in line)
    assert one.startswith("1 thread(s):") and "the reference" in one
    assert three.startswith("3 thread(s):") and "bit-equal" in three
