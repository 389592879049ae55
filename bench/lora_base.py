"""LoRA on the real SmolLM2-135M-Instruct: the frozen base held in bf16 (shardline's layout) and as NF4 (QLoRA,
`model.lora.quantize_base=nf4`: SmolLM2's MLP weights; its 576² attention projections are not a multiple of
torchao's 16,384-element quantum and stay bf16) against fp32 master weights cast to bf16 every step (the layout
before), one process on this CPU, bf16 compute.

The layouts run the same worker on the same prepared data, alternating (A B C A B C), in one session; the old layout
is the same code with `parallel.fsdp.frozen_in_compute_dtype` turned off. Reported per run: the median step time
of steps 3..N, the peak RSS of the training steps (`mem_peak_bytes`), and the first loss (equal for bf16 base and
fp32 masters by construction; NF4's moved by its quantization error).

    .venv/bin/python bench/lora_base.py [--steps 10] [--model .cache/smollm2-135m-instruct] [--tmp DIR]
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

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("bf16-base", "nf4-base", "fp32-masters")


def child(layout: str, spec_path: str) -> int:
    """Run the worker in this process, with the frozen-base cast off for the old layout."""
    from shardline import worker
    from shardline.parallel import fsdp

    if layout == "fp32-masters":
        fsdp.frozen_in_compute_dtype = lambda model, precision: None
    return worker.main(["--spec", spec_path])


def run_one(layout: str, model: Path, root: Path, steps: int, port: int) -> dict:
    from shardline.data.prepare import prepare
    from shardline.rundir import create_run
    from shardline.spec.resolve import load_spec

    spec = load_spec("tiny", [
        f"run.dir={root / 'runs'}", f"data.cache_dir={root / 'prepared'}", f"model.path={model}",
        "model.lora.enabled=true", "train.precision=bf16", "train.seq_len=256", "train.micro_batch_size=4",
        "train.global_batch_size=4", f"train.max_steps={steps}", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_every=1000", "train.eval_examples=0", "data.train_size=400", "data.validation_size=8",
        "data.test_size=1", "parallel.nproc_per_node=1", "observe.metrics_port=null", "observe.report=false",
        "train.peak_tflops=1", *(["model.lora.quantize_base=nf4"] if layout == "nf4-base" else [])])
    spec, run_dir = create_run(spec)
    prepare(spec)  # here, so the measured process only reads the cache
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--child", layout, str(run_dir / "spec.yaml")], cwd=REPO,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    return {"layout": layout, "first_loss": train[0]["loss"],
            "step_s": statistics.median(r["step_time_s"] for r in train[2:]),
            "peak_gib": max(r["mem_peak_bytes"] for r in train) / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2-135m-instruct")
    parser.add_argument("--tmp", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "SPEC"))
    args = parser.parse_args()
    if args.child:
        raise SystemExit(child(*args.child))
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no checkpoint (the real-checkpoint tests fetch it into .cache)")
    root = Path(tempfile.mkdtemp(dir=args.tmp))
    results = [run_one(layout, args.model, root / f"{layout}-{i}", args.steps, 29500 + len(LAYOUTS) * i + j)
               for i in range(2) for j, layout in enumerate(LAYOUTS)]
    for r in results:
        print(f"{r['layout']:13s} first loss {r['first_loss']:.6f}  step {r['step_s']:.3f} s  "
              f"peak RSS {r['peak_gib']:.3f} GiB")
    for key in ("step_s", "peak_gib"):
        old = statistics.mean(r[key] for r in results if r["layout"] == "fp32-masters")
        for layout in ("bf16-base", "nf4-base"):
            new = statistics.mean(r[key] for r in results if r["layout"] == layout)
            print(f"{key}: {layout} / fp32 masters = {new / old:.3f}")


if __name__ == "__main__":
    main()
