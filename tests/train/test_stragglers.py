"""The straggler view: every rank's own step time reaches the train records and the report, naming the slow rank."""

import os
import subprocess
import sys

import pytest
from PIL import Image

from shardline.resilience.stragglers import straggler_fields
from tests.conftest import REPO, only_run, read_metrics, small_overrides

SLOW_S = 0.3


def test_fields_name_the_slowest_rank_against_the_median_and_one_rank_has_none():
    assert straggler_fields([0.10, 0.40, 0.20]) == {"step_time_max_s": 0.40, "step_time_median_s": 0.20,
                                                    "slowest_rank": 1}
    assert straggler_fields([0.5, 0.5])["slowest_rank"] == 0 and straggler_fields([0.3]) == {}


@pytest.mark.slow
def test_a_rank_slowed_every_step_is_the_slowest_rank_in_the_records_and_the_report(tmp_path):
    sets = [*small_overrides(tmp_path / "runs"), "parallel.nproc_per_node=2", "train.precision=fp32",
            "train.max_steps=5", "observe.metrics_port=null", "observe.report=true"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               SHARDLINE_FAULT=f"train_step:rank=1:action=slow:seconds={SLOW_S}")
    proc = subprocess.run([sys.executable, "-m", "shardline.cli", "train", "tiny",
                           *[a for kv in sets for a in ("--set", kv)]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run(tmp_path / "runs")
    records = read_metrics(run_dir, "train")
    steady = records[1:]  # step 1: ranks leave setup at different times and FSDP initialises lazily
    assert [r["slowest_rank"] for r in steady] == [1] * 4  # an ordering, every step
    for r in steady:
        assert r["step_time_max_s"] >= SLOW_S, r  # rank 1's own time holds its whole sleep
    # 2 ranks: the median is their mean, so the slow one is half its delay above it (SLOW_S / 2 plus half the ranks'
    # compute difference, which a loaded 2-core machine makes noisy); had rank 0 counted its wait for rank 1 in the
    # step's collectives as its own time, the gap would be ~0. Over the steady steps, against the midpoint SLOW_S / 4:
    gaps = [r["step_time_max_s"] - r["step_time_median_s"] for r in steady]
    assert sum(gaps) / len(gaps) >= SLOW_S / 4, gaps
    # rank 0's step (its wall time, waits included) lasts as long as rank 1's own time: ~0 behind it, where a step
    # time without the wait would be SLOW_S behind; against their midpoint, over the steady steps
    behind = [r["step_time_max_s"] - r["step_time_s"] for r in steady]
    assert sum(behind) / len(behind) <= SLOW_S / 2, behind
    page = (run_dir / "report" / "index.html").read_text()
    assert "stragglers.png" in page and "Per-rank step time" in page
    with Image.open(run_dir / "report" / "stragglers.png") as im:
        assert len(im.getcolors(1 << 20) or []) > 20
