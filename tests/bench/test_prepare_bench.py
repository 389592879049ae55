"""bench/prepare.py at tiny size: shardline prepare and datasets.map both run, on the same conversations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # three child processes, one of them datasets.map's worker pool

SCRIPT = REPO / "bench" / "prepare.py"
ROWS = 300


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("prepare-bench")
    res = subprocess.run([sys.executable, str(SCRIPT), "--rows", str(ROWS), "--num-proc", "2", "--memory-limit-gb",
                          "4", "--tmp", str(tmp), "--json", str(tmp / "out.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text()), res.stdout


def test_both_contenders_prepare_the_same_conversations_at_a_positive_rate(bench):
    doc, stdout = bench
    ours, theirs = doc["shardline"], doc["datasets_map"]
    assert ours["completed"] and theirs["completed"]
    assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0
    assert ours["rows_read"] == ours["examples"] == theirs["conversations"] == ROWS
    assert ours["conversations"] == theirs["conversations"], ours["dropped"]  # nothing dropped at seq 1024
    assert "shardline prepare" in stdout and "datasets.map(batched=True, num_proc=2)" in stdout


def test_ratio_is_named_after_its_baseline_and_versions_are_reported(bench):
    doc, stdout = bench
    assert doc["baseline"] == "datasets.map(batched=True, num_proc=2)"
    assert doc["ratio_vs_datasets_map"] == pytest.approx(
        doc["shardline"]["tokens_per_s"] / doc["datasets_map"]["tokens_per_s"])
    assert "ratio vs datasets.map(batched=True, num_proc=2):" in stdout
    versions = doc["machine"]["versions"]
    assert all(versions[p] for p in ("torch", "transformers", "tokenizers", "datasets"))
    assert doc["machine"]["cores"] >= 1 and f"datasets {versions['datasets']}" in stdout


def test_peak_memory_is_measured_and_the_memory_limited_run_reports_its_outcome(bench):
    doc, stdout = bench
    for r in (doc["shardline"], doc["datasets_map"]):
        assert r["peak_rss_bytes"] > 0 and r["peak_tree_pss_bytes"] > 0
    limited = doc["memory_limited"]
    assert limited["completed"], limited.get("error")  # 4 GiB is ample for 300 rows
    assert limited["conversations"] == ROWS and limited["peak_rss_bytes"] > 0
    assert doc["source_bytes"] > 0 and "memory limit 4 GiB (RLIMIT_DATA)" in stdout
