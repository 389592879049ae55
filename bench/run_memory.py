"""Resident memory of every worker through a long run of the embedded default (issue 38: does it stay flat?).

Starts `shardline train` (no spec: the tiny preset, 2 processes) with `train.max_steps` raised, samples each
worker's VmRSS and VmHWM from /proc every `--every-s` seconds beside the step the run has recorded, and prints one
row per `--rows-every` steps (GiB, rank by rank) and the RSS range after warm-up at the end. The step line's `mem`
is VmHWM, a peak that never falls; VmRSS is what the process holds now.

    .venv/bin/python bench/run_memory.py [--steps 3000] [--rows-every 100] [--warmup 300] [--tmp DIR] [--set K=V]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def status_bytes(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def workers(run: Path) -> list[int]:
    """torchrun's children, `python -u -m shardline.worker …` (torchrun's own command line has no `-u`)."""
    out = subprocess.run(["pgrep", "-f", "--", f"-u -m shardline.worker --spec {run}/spec.yaml"], capture_output=True,
                         text=True)
    return sorted(int(p) for p in out.stdout.split())


def last_step(run: Path) -> int:
    step = 0
    try:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "train":
                step = record["step"]
    except (OSError, json.JSONDecodeError):
        pass
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rows-every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=300, help="steps before the flatness is judged")
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tmp", type=Path, default=None)
    args = ap.parse_args()
    root = args.tmp or Path(tempfile.mkdtemp(prefix="run-memory-"))
    sets = [f"run.dir={root}", f"train.max_steps={args.steps}", *args.set]
    cmd = [sys.executable, "-m", "shardline.cli", "train", *[a for kv in sets for a in ("--set", kv)]]
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=(root / "train.log").open("w"), stderr=subprocess.STDOUT)
    samples: list[tuple[int, list[int], list[int]]] = []  # step, VmRSS per rank, VmHWM per rank
    printed = 0
    print("| step | VmRSS GiB (rank 0 / 1) | VmHWM GiB |\n|---:|---|---|", flush=True)
    while proc.poll() is None:
        time.sleep(args.every_s)
        run = next((p.parent for p in root.glob("*/spec.yaml")), None)
        pids = workers(run) if run else []
        rss = [status_bytes(p, "VmRSS") for p in pids]
        hwm = [status_bytes(p, "VmHWM") for p in pids]
        if not pids or None in rss or None in hwm:
            continue
        step = last_step(run)
        samples.append((step, rss, hwm))
        if step >= printed + args.rows_every:
            printed = step // args.rows_every * args.rows_every
            print(f"| {step} | {' / '.join(f'{b / GiB:.2f}' for b in rss)} | "
                  f"{' / '.join(f'{b / GiB:.2f}' for b in hwm)} |", flush=True)
    settled = [max(rss) for step, rss, _ in samples if step >= args.warmup]
    print(f"exit {proc.returncode}; {len(samples)} samples; after step {args.warmup}: the larger rank's RSS "
          f"{min(settled) / GiB:.2f}–{max(settled) / GiB:.2f} GiB" if settled else f"exit {proc.returncode}")


if __name__ == "__main__":
    main()
