"""Checkpoint cost: how long training stalls for a sync vs an async DCP save, and how long a restore takes.

For each model (the `tiny` preset, 4.2M params, and a ~300M-parameter Llama), in one process with one
gloo rank (world 1, bf16 mixed precision, fp32 master weights + AdamW state in the checkpoint):

  baseline      mean `train_step()` time over a few steps after warm-up
  sync save     trainer with `checkpoint.async_save=false`: wall time of `save_checkpoint()` — training
                is stalled for the whole save (state dict, write, fsync, COMMITTED marker)
  async save    trainer with `checkpoint.async_save=true`: the time `save_checkpoint()` blocks the
                training thread (state dict + staging into a CPU copy), then `train_step()` + `poll()`
                until the background save is committed; the extra time those steps took versus the
                baseline counts as stall too (the background writer competes for the same cores).
                total stall = staging + extra step time. background write = the committed event's
                `save_s` (save start → commit, quantised to the step boundary where `poll()` commits)
                and, precisely, save start → the future completing.
  restore       a fresh trainer: wall time of `load_checkpoint(step)` (model + optimizer + counters + RNG),
                checked against a checksum of the saved weights. The files were just written, so they
                are read from the page cache.
  size          bytes of the committed checkpoint directory

The goal: async total stall ≤ 0.1 × sync save. On a 2-core CPU machine the "extra step time" term is
real contention (background serialisation/writing vs the training matmuls), not measurement noise alone.

    .venv/bin/python bench/checkpoint.py [--models tiny,300m] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path

MODELS: dict[str, list[str]] = {
    "tiny": [],  # the preset's own architecture
    "300m": ["model.arch.hidden_size=1024", "model.arch.intermediate_size=2816", "model.arch.num_layers=24",
             "model.arch.num_heads=16", "model.arch.num_kv_heads=16", "model.arch.vocab_size=2048"],
}
COMMON = [
    "parallel.nproc_per_node=1", "train.precision=bf16", "train.peak_tflops=1", "train.seq_len=128",
    "train.micro_batch_size=2", "train.global_batch_size=2", "data.train_size=300", "data.validation_size=10",
    "data.test_size=0", "train.eval_examples=0",
]
MAX_STEPS_WHILE_WRITING = 200  # safety net: a background save that never finishes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(model: str, ctx, tmp: Path, run_id: str, async_save: bool):
    from rich.console import Console

    from shardline.data.prepare import prepare
    from shardline.rundir import create_run
    from shardline.spec.resolve import load_spec
    from shardline.training.trainer import Trainer

    overrides = [f"run.dir={tmp / 'runs'}", f"data.cache_dir={tmp / 'prepared'}", f"run.id={run_id}",
                 f"checkpoint.async_save={str(async_save).lower()}", *COMMON, *MODELS[model]]
    spec, run_dir = create_run(load_spec("tiny", overrides))
    return Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))


def step_times(trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return times


def weights_checksum(trainer) -> float:
    total = 0.0
    for p in trainer.model.parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        total += float(local.double().sum())
    return total


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def free(trainer) -> None:
    trainer.checkpointer.wait()
    del trainer
    gc.collect()


def bench_model(model: str, ctx, tmp: Path, warmup: int, steps: int) -> dict:
    out: dict = {"model": model}
    print(f"[{model}] sync trainer", flush=True)

    # ---- sync save --------------------------------------------------------------------------------
    trainer = make_trainer(model, ctx, tmp, f"{model}-sync", async_save=False)
    out["params"] = trainer.params.total
    step_times(trainer, warmup)
    out["sync_baseline_step_s"] = statistics.fmean(step_times(trainer, steps))
    start = time.perf_counter()
    trainer.save_checkpoint()
    out["sync_save_s"] = time.perf_counter() - start
    saved_step, checksum = trainer.step, weights_checksum(trainer)
    sync_dir = Path(trainer.checkpointer.store.path(saved_step))
    out["checkpoint_mb"] = dir_bytes(sync_dir) / 1e6
    free(trainer)

    # ---- async save -------------------------------------------------------------------------------
    print(f"[{model}] async trainer", flush=True)
    trainer = make_trainer(model, ctx, tmp, f"{model}-async", async_save=True)
    ck = trainer.checkpointer
    step_times(trainer, warmup)
    baseline = statistics.fmean(step_times(trainer, steps))
    out["baseline_step_s"] = baseline
    finished: dict[str, float] = {}
    start = time.perf_counter()
    trainer.save_checkpoint()
    out["async_staging_s"] = time.perf_counter() - start
    if ck.pending is not None:  # None only if it somehow committed already (it cannot: commit needs poll)
        ck.pending.future.add_done_callback(lambda _f: finished.setdefault("t", time.perf_counter()))
    during: list[float] = []
    while ck.pending is not None:
        t0 = time.perf_counter()
        trainer.train_step()
        ck.poll()
        during.append(time.perf_counter() - t0)
        if len(during) >= MAX_STEPS_WHILE_WRITING:
            ck.wait()
            break
    committed = [e for e in ck.events if e["event"] == "checkpoint_committed"]
    out["steps_while_writing"] = len(during)
    out["step_times_while_writing_s"] = during
    out["async_extra_step_s"] = sum(t - baseline for t in during)
    out["async_total_stall_s"] = out["async_staging_s"] + out["async_extra_step_s"]
    out["background_write_s"] = committed[-1]["save_s"] if committed else None
    out["background_write_precise_s"] = finished["t"] - start if "t" in finished else None
    out["after_step_s"] = statistics.fmean(step_times(trainer, steps))  # baseline drift check
    out["ratio_async_stall_vs_sync"] = out["async_total_stall_s"] / out["sync_save_s"]
    free(trainer)

    # ---- restore ----------------------------------------------------------------------------------
    print(f"[{model}] restore", flush=True)
    trainer = make_trainer(model, ctx, tmp, f"{model}-sync", async_save=False)
    start = time.perf_counter()
    trainer.load_checkpoint(saved_step)
    out["restore_s"] = time.perf_counter() - start
    restored = weights_checksum(trainer)
    out["restore_matches"] = trainer.step == saved_step and abs(restored - checksum) <= 1e-9 * max(1.0, abs(checksum))
    free(trainer)
    return out


def print_table(results: list[dict]) -> None:
    head = (f"{'model':<6} {'params':>8} {'ckpt MB':>8} {'sync save':>10} {'async stage':>12} {'async stall':>12} "
            f"{'bg write':>9} {'restore':>8} {'stall/sync':>11}")
    print("\n" + head)
    print("-" * len(head))
    for r in results:
        ratio = r["ratio_async_stall_vs_sync"]
        bg = r["background_write_s"]
        print(f"{r['model']:<6} {r['params'] / 1e6:7.1f}M {r['checkpoint_mb']:8.1f} {r['sync_save_s']:9.2f}s "
              f"{r['async_staging_s']:11.2f}s {r['async_total_stall_s']:11.2f}s "
              f"{(f'{bg:.2f}s' if bg is not None else '-'):>9} {r['restore_s']:7.2f}s {ratio:10.3f}×  "
              f"{'goal met' if ratio <= 0.1 else 'goal NOT met'}")
    print()
    for r in results:
        during = ", ".join(f"{t:.2f}" for t in r["step_times_while_writing_s"])
        precise = r["background_write_precise_s"]
        precise = f"{precise:.2f}s" if precise is not None else "?"
        print(f"{r['model']}: baseline step {r['baseline_step_s']:.3f}s (after the save {r['after_step_s']:.3f}s); "
              f"{r['steps_while_writing']} step(s) while writing [{during}]s → extra {r['async_extra_step_s']:+.2f}s; "
              f"background save finished {precise} after it started; restore "
              f"{'matches' if r['restore_matches'] else 'DOES NOT match'} the saved weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,300m", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each baseline")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each baseline")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir, local disk)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        os.environ[k] = v
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    from shardline.parallel.mesh import distributed

    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, distributed() as ctx:
        for model in models:
            results.append(bench_model(model, ctx, Path(tmp), args.warmup, args.steps))
            gc.collect()
    machine = (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
               f"{torch.get_num_threads()} torch threads, local disk ({args.dir or tempfile.gettempdir()})")
    print(f"\ncheckpoint cost, 1 gloo rank, bf16 mixed precision, AdamW, seq 128 × batch 2; torch {torch.__version__}; "
          f"{machine}")
    print("async stall = staging on the training thread + extra step time while the background save runs; on this "
          "machine that includes CPU contention from the background writer on the same cores")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "machine": machine, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
