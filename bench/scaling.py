"""How shardline's cost grows: tokens/s, MFU and HFU versus sequence length and model width, in one run.

Each point trains bench/throughput.yaml (Llama, 8 layers, packed rows of the generated text-to-SQL set,
bf16, 2 processes × 1 thread) for a few steps with one thing changed: `train.seq_len` (256 … 2048, hidden
512) or the width (hidden 256 … 1024, seq 512; intermediate ≈ 2.7 × hidden, head dim 64). The same global
batch in tokens per step throughout (rows × seq_len = 4,096), so only the shape changes. Prints a table,
writes the JSON and a plot (PNG):

    .venv/bin/python bench/scaling.py [--steps 12] [--json out.json] [--plot out.png]

Columns: attention share = the attention term's part of the model FLOPs (from MFU minus its causal-half
twin: the two differ by half the attention term); HFU counts what the kernels execute (padding, the
per-document attention spans rounded to 32 tokens on CPU).
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
WARMUP = 3
TOKENS_PER_STEP = 4096


def _shape(seq: int, hidden: int) -> list[str]:
    rows = TOKENS_PER_STEP // seq
    return [f"train.seq_len={seq}", f"model.arch.max_position_embeddings={max(seq, 512)}",
            f"train.global_batch_size={rows}", f"train.micro_batch_size={max(rows // 2, 1)}",
            f"model.arch.hidden_size={hidden}", f"model.arch.intermediate_size={round(hidden * 2.6875)}",
            f"model.arch.num_heads={hidden // 64}", f"model.arch.num_kv_heads={hidden // 64}"]


POINTS = {  # label → (seq_len, hidden)
    **{f"seq {s}": (s, 512) for s in (256, 512, 1024, 2048)},
    **{f"hidden {h}": (512, h) for h in (256, 768, 1024)},
}


def run_point(seq: int, hidden: int, steps: int, workdir: Path, prepared: Path) -> dict:
    sets = [f"run.dir={workdir / 'runs'}", f"data.cache_dir={prepared}", f"train.max_steps={steps}",
            "train.log_every=1000", "train.eval_every=100000", "train.eval_examples=0", *_shape(seq, hidden)]
    cmd = [sys.executable, "-m", "shardline.cli", "train", str(SPEC), "--nproc", "2"]
    done = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if done.returncode != 0:
        raise SystemExit(f"seq {seq} hidden {hidden} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    metrics = next((workdir / "runs").glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][WARMUP:]
    mfu = statistics.fmean(r["mfu"] for r in train)
    causal = statistics.fmean(r["mfu_causal"] for r in train)
    return {"seq_len": seq, "hidden": hidden, "tokens_per_s": statistics.fmean(r["tokens_per_s_per_device"] * 2
                                                                              for r in train),
            "tflops_per_device": statistics.fmean(r["tflops_per_device"] for r in train), "mfu": mfu,
            "hfu": statistics.fmean(r["hfu"] for r in train), "attention_share": 2 * (mfu - causal) / mfu,
            "step_time_s": statistics.fmean(r["step_time_s"] for r in train)}


def plot(results: dict[str, dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    for ax, key, label in ((fig.add_subplot(1, 2, 1), "seq_len", "sequence length (hidden 512)"),
                           (fig.add_subplot(1, 2, 2), "hidden", "hidden size (seq 512)")):
        points = [r for name, r in results.items() if name.startswith("seq" if key == "seq_len" else "hidden")
                  or (r["seq_len"] == 512 and r["hidden"] == 512)]
        points.sort(key=lambda r: r[key])
        xs = [r[key] for r in points]
        ax.plot(xs, [100 * r["mfu"] for r in points], "o-", label="MFU % (model FLOPs)")
        ax.plot(xs, [100 * r["hfu"] for r in points], "s--", label="HFU % (executed)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("% of the per-rank bf16 matmul probe")
        twin = ax.twinx()
        twin.plot(xs, [r["tokens_per_s"] for r in points], "^:", color="gray", label="tokens/s")
        twin.set_ylabel("tokens/s (2 ranks)")
        ax.legend(loc="lower left", fontsize=8)
    fig.suptitle("shardline on this machine: cost versus shape (bench/scaling.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, default=Path("bench/scaling.png"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (seq, hidden) in POINTS.items():
            print(f"… {name}", flush=True)
            results[name] = run_point(seq, hidden, args.steps, Path(tmp) / name.replace(" ", "-"),
                                      Path(tmp) / "prepared")
    print(f"\n{'point':12} {'tok/s':>8} {'TFLOP/s/dev':>12} {'MFU':>6} {'HFU':>6} {'attn share':>11} {'step s':>7}")
    for name, r in results.items():
        print(f"{name:12} {r['tokens_per_s']:8,.0f} {r['tflops_per_device']:12.3f} {100 * r['mfu']:5.1f}% "
              f"{100 * r['hfu']:5.1f}% {100 * r['attention_share']:10.1f}% {r['step_time_s']:7.2f}")
    plot(results, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
