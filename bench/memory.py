"""Host memory of loading a ~1B-parameter Llama checkpoint with 2 ranks: shardline's sharded load vs `from_pretrained`.

  shardline        meta build → `fully_shard` → `materialize` (each rank reads only its rows; the Trainer's path)
  from_pretrained  `AutoModelForCausalLM.from_pretrained(dtype=float32)` in every rank, then `fully_shard`
                   (what shardline did before)

Both run under `torchrun --standalone` on CPU (gloo) through tests/model/sharded_load_worker.py, on a random
checkpoint written there (hidden 2048, intermediate 5632, 16 heads, vocab 32000; sharded safetensors + index).
Reported per rank: RSS before loading (interpreter, torch, transformers, process group), peak RSS after loading
(`ru_maxrss`), what loading added, peak RSS after one forward on 32 tokens (FSDP's all-gathers), load wall
time; and the max |logit difference| between the two loads.

    .venv/bin/python bench/memory.py [--layers 19] [--dtype bf16|fp32] [--nproc 2] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "model" / "sharded_load_worker.py"
MODES = {"shardline": [], "from_pretrained": ["--from-pretrained"]}


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout


def measure(ckpt: Path, out: Path, mode: str, nproc: int) -> list[dict]:
    out.mkdir()
    run("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER), "load", str(out),
        "--spec", json.dumps({"path": str(ckpt)}), *MODES[mode])
    return [json.loads((out / f"rank-{r}-0.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=19)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tmp", default=None, help="where the checkpoint is written (default: the system temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        ckpt = Path(tmp) / "llama"
        params = json.loads(run(str(WORKER), "write", str(ckpt), "--layers", str(args.layers), "--dtype", args.dtype))
        fp32 = 4 * params["params"]
        files = sorted(ckpt.glob("*.safetensors"))
        print(f"checkpoint: {params['params'] / 1e9:.3f}B params, {args.dtype}, {len(files)} files, "
              f"{sum(f.stat().st_size for f in files) / 1e9:.2f} GB; one fp32 copy = {fp32 / 1e9:.2f} GB; "
              f"{args.nproc} ranks")
        reports = {mode: measure(ckpt, Path(tmp) / mode, mode, args.nproc) for mode in MODES}
        logits = [torch.load(Path(tmp) / mode / "logits-0.pt") for mode in MODES]
    diff = (logits[0] - logits[1]).abs().max().item()

    def gb(x: float) -> str:
        return f"{x / 1e9:.2f}"

    print("| loader | RSS before load | peak RSS after load | % of one fp32 copy | added by loading "
          "| peak RSS after 1 forward | load time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, ranks in reports.items():
        for r in ranks:
            peak = r["peak_rss_bytes"]
            print(f"| {mode} (rank {r['rank']}) | {gb(r['rss_before_bytes'])} GB | **{gb(peak)} GB** | "
                  f"{peak / fp32:.0%} | {gb(peak - r['rss_before_bytes'])} GB | "
                  f"{gb(r['peak_rss_after_forward_bytes'])} GB | {r['load_s']:.1f} s |")
    ours, theirs = (max(r["peak_rss_bytes"] for r in reports[m]) for m in MODES)
    print(f"\npeak RSS per rank, shardline / from_pretrained = {ours / theirs:.2f}; "
          f"max |logit difference| = {diff:.1e}")


if __name__ == "__main__":
    main()
