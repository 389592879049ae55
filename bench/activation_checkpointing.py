"""Activation checkpointing: memory saved vs time paid, per policy, on the same model and batch.

Each policy trains bench/throughput.yaml (Llama hidden 512, 8 layers, seq 512) for a few steps in a
fresh single process (peak memory is a process-lifetime maximum), with a micro-batch large enough that
activations matter. Prints step time and peak memory (CUDA max allocated, or peak RSS on CPU) against
the `none` baseline of the same invocation.

    .venv/bin/python bench/activation_checkpointing.py [--steps 8] [--micro-batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPEC = Path(__file__).resolve().parent / "throughput.yaml"
POLICIES = {  # name -> overrides
    "none": ["parallel.activation_checkpointing=none"],
    "selective": ["parallel.activation_checkpointing=selective"],
    "full every 2nd block": ["parallel.activation_checkpointing=full", "parallel.activation_checkpointing_every=2"],
    "full": ["parallel.activation_checkpointing=full"],
}
WARMUP = 3


def run_policy(overrides: list[str], steps: int, micro: int, workdir: Path) -> dict:
    sets = [f"run.dir={workdir / 'runs'}", f"data.cache_dir={workdir.parent / 'prepared'}",
            f"train.max_steps={steps}", f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
            "train.log_every=1000", *overrides]
    cmd = [sys.executable, "-m", "shardline.cli", "train", str(SPEC), "--nproc", "1"]
    subprocess.run(cmd + [a for s in sets for a in ("--set", s)], check=True, capture_output=True,
                   env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    metrics = next((workdir / "runs").glob("*/metrics.jsonl"))
    train = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    return {"step_time_s": statistics.fmean(r["step_time_s"] for r in train[WARMUP:]),
            "mem_peak_bytes": max(r["mem_peak_bytes"] for r in train)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in POLICIES.items():
            results[name] = run_policy(overrides, args.steps, args.micro_batch, Path(tmp) / name.replace(" ", "-"))
    base = results["none"]
    print(f"\nactivation checkpointing, micro-batch {args.micro_batch} × seq 512, 1 process, bf16")
    print(f"{'policy':24} {'step s':>8} {'× time':>8} {'peak GiB':>9} {'saved GiB':>10}")
    for name, r in results.items():
        saved = (base["mem_peak_bytes"] - r["mem_peak_bytes"]) / 2**30
        print(f"{name:24} {r['step_time_s']:8.2f} {r['step_time_s'] / base['step_time_s']:8.2f} "
              f"{r['mem_peak_bytes'] / 2**30:9.2f} {saved:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
