"""Training runs of a real checkpoint through the CLI, on a user's JSONL text-to-SQL file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardline.data.prepare import PreparedData
from shardline.tasks.text_to_sql.generate import generate_splits
from tests.conftest import REPO, only_run


def user_sql_file(directory: Path) -> Path:
    """A user's text-to-SQL file: question / context (CREATE TABLE only, no rows) / answer, no database ids."""
    path = directory / "sql.jsonl"
    splits = generate_splits(7, 48, 8, 8)
    with path.open("w") as f:
        for ex in (e for split in splits.values() for e in split):
            f.write(json.dumps({"question": ex.question, "context": ex.context, "answer": ex.answer}) + "\n")
    return path


def run_sets(model: Path, data: Path, root: Path, nproc: int, *extra: str) -> list[str]:
    """`--set` arguments of a small run of `model` on `data` under `root` (one row per rank and step)."""
    values = [f"run.dir={root / 'runs'}", f"data.cache_dir={root / 'prepared'}",
              f"model.path={model}", f"data.path={data}", "data.task=text_to_sql", "data.train_size=null",
              "data.validation_size=8", "data.test_size=8", "train.seq_len=384", "train.micro_batch_size=1",
              "train.global_batch_size=2", "train.lr=1e-4", "train.log_every=1", "train.eval_examples=0",
              "train.peak_tflops=1", f"parallel.nproc_per_node={nproc}", "observe.metrics_port=null",
              "observe.report=false", *extra]
    return [a for v in values for a in ("--set", v)]


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "shardline.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def export(run_dir: Path, out: Path, *flags: str) -> Path:
    """`shardline export` in this process (its imports are paid already): the launch is what costs, not the verb."""
    from shardline.cli import main

    assert main(["export", str(run_dir), "--out", str(out), *flags]) == 0
    return out


def train_run(model: Path, data: Path, root: Path, nproc: int, *extra: str) -> Path:
    cli("train", *run_sets(model, data, root, nproc, *extra))
    return only_run(root / "runs")


def prepared_of(run_dir: Path) -> PreparedData:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return PreparedData(run_dir.parents[1] / "prepared" / manifest["dataset_version"])
