"""torchtune as a throughput contender on CPU: its stock `full_finetune_distributed` recipe (its file run as
__main__ under torch.distributed.run, as `tune run` does), its llama3 component builder, FSDP2 sharding,
CEWithChunkedOutputLoss, padded/packed collate and cosine LR schedule, fed pre-tokenized rows from a .npy file
through a small dataset component. Prints one JSON line.

    /tmp/peers-venv/bin/python bench/peers/torchtune_contender.py --rows rows.npy --steps 40 --threads 2 [--nproc 2]
        [--labels labels.npy] [--positions positions.npy] [--dtype bf16|fp32]

Run it with the peer venv's python (torch 2.13.0+cpu, torchtune 0.6.1, torchao 0.11.0: torchtune 0.6.1 does not
import with torchao >= 0.12, which moved torchao.dtypes.nf4tensor). It needs nothing from shardline. The recipe
runs unmodified (`device: cpu`, gloo); this file only supplies what a recipe config names by `_component_` and that
torchtune has no pre-tokenized form of: a dataset over the .npy rows, a tokenizer stand-in (the rows are already
ids; the recipe only reads pad_id) and a metric logger that timestamps each step. It also writes the random initial
checkpoint the recipe insists on loading (FullModelTorchTuneCheckpointer, a plain torch.save of the model's
state dict, seed 0).

Model: torchtune.models.llama3.llama3(vocab_size=2048, num_layers=8, num_heads=8, num_kv_heads=8, embed_dim=512,
max_seq_len=512, intermediate_dim=1376, rope_base=10000): the bench shape exactly (separate q/k/v/o projections,
untied output, RMSNorm eps 1e-5). Precision: torchtune has no mixed precision; `dtype: bf16` (default here, the
recipe's own default) is pure bf16 (bf16 parameters, gradients and AdamW states, no fp32 master copy), unlike
shardline's bf16 compute over fp32 master weights. `--dtype fp32` is full fp32.

Attention: without --positions, each row is one causal sequence (padded_collate_sft, SDPA is_causal, no document
masking). With --positions (HF-style position ids restarting at 0 per document), rows are handed over in torchtune's
packed format (input_pos, seq_lens) and `packed: True` makes the recipe use padded_collate_packed: on CPU (flex
attention is CUDA-only in torchtune) that is a dense [b, s, s] block-causal boolean mask through SDPA.

Data: --rows int ids [n, seq]; --labels optional HF-style unshifted labels (-100 = no loss; default the rows); the
recipe shifts them. Global step = 8 rows (batch_size 4 per rank x 2 ranks, no gradient accumulation), rows taken in
order (shuffle off), cycling if --steps needs more. lr 1e-3, 5 warmup steps then cosine, AdamW(0.9, 0.95, wd 0.1),
clip 1.0, no activation checkpointing, no compile.

Timing: the first 3 steps are left out (as bench/throughput.py does); tokens_per_s counts every input token of the
timed steps (rows x seq), loss_tokens_per_s the shifted targets that are not -100.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 3
LOCAL_BATCH = 4
GLOBAL_BATCH = 8  # rows per optimizer step, as bench/throughput.yaml; accumulation makes up the rest
ROWS_ENV, METRICS_ENV, RECIPE_ENV = "TT_CONTENDER_ROWS", "TT_CONTENDER_METRICS", "TT_CONTENDER_RECIPE"
SHAPE = dict(vocab_size=2048, num_layers=8, num_heads=8, num_kv_heads=8, embed_dim=512, max_seq_len=512,
             intermediate_dim=1376, rope_base=10000)


# ------------------------------------------------------------- components the recipe config names (imported by it)


def rows_dataset(tokenizer, steps: int, global_batch: int, packed: bool = False):
    """Map-style dataset over the .npy rows named in $TT_CONTENDER_ROWS (a JSON of paths), steps x global_batch long."""
    import numpy as np
    from torch.utils.data import Dataset

    paths = json.loads(os.environ[ROWS_ENV])
    rows = np.load(paths["rows"]).astype(np.int64)
    labels = np.load(paths["labels"]).astype(np.int64) if paths.get("labels") else rows
    positions = np.load(paths["positions"]).astype(np.int64) if paths.get("positions") else None

    class Rows(Dataset):
        def __len__(self):
            return steps * global_batch

        def __getitem__(self, i):
            r = i % len(rows)
            item = {"tokens": rows[r].tolist(), "labels": labels[r].tolist()}
            if packed:
                pos = positions[r]
                starts = [j for j in range(len(pos)) if pos[j] == 0 or j == 0] + [len(pos)]
                import torch

                item = {"tokens": torch.from_numpy(rows[r]), "labels": torch.from_numpy(labels[r]),
                        "input_pos": torch.from_numpy(pos),
                        "seq_lens": torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)])}
            return item

    return Rows()


class IdsTokenizer:
    """The rows are already token ids; the recipe only reads pad_id (for the padding collate)."""

    pad_id = 0
    eos_id = 1
    bos_id = 2
    max_seq_len = 512


def ids_tokenizer(**kwargs):
    return IdsTokenizer()


class StepStampLogger:
    """torchtune MetricLogger: one JSON line per logged step (loss, the recipe's own tokens/s) with a timestamp."""

    def __init__(self, **kwargs):
        self.f = open(os.environ[METRICS_ENV], "a")  # noqa: SIM115 - closed in close(), the recipe's logger protocol

    def log(self, name, data, step):
        self.log_dict({name: data}, step)

    def log_config(self, config):
        pass

    def log_dict(self, payload, step):
        rec = {k: float(v) for k, v in payload.items()}
        rec.update(step=step, time=time.perf_counter())
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()

    def __del__(self):
        if not self.f.closed:
            self.f.close()


# ---------------------------------------------------------------------------------------------------- launcher


def write_config(tmp: Path, args, seq: int) -> Path:
    ckpt = tmp / "init"
    ckpt.mkdir()
    import torch
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    torch.save(llama3(**SHAPE).state_dict(), ckpt / "model.pt")
    packed = args.positions is not None
    nproc = args.nproc
    cfg = f"""
output_dir: {tmp / 'out'}
seed: 0
shuffle: False
device: cpu
dtype: {args.dtype}
tokenizer:
  _component_: torchtune_contender.ids_tokenizer
dataset:
  _component_: torchtune_contender.rows_dataset
  steps: {args.steps}
  global_batch: {GLOBAL_BATCH}
  packed: {packed}
model:
  _component_: torchtune.models.llama3.llama3
""" + "".join(f"  {k}: {v}\n" for k, v in SHAPE.items()) + f"""
checkpointer:
  _component_: torchtune.training.FullModelTorchTuneCheckpointer
  checkpoint_dir: {ckpt}
  checkpoint_files: [model.pt]
  output_dir: {tmp / 'out'}
  model_type: LLAMA3
resume_from_checkpoint: False
batch_size: {LOCAL_BATCH}
epochs: 1
max_steps_per_epoch: {args.steps}
gradient_accumulation_steps: {GLOBAL_BATCH // (LOCAL_BATCH * nproc)}
optimizer:
  _component_: torch.optim.AdamW
  lr: {args.lr}
  betas: [0.9, 0.95]
  eps: 1.0e-8
  weight_decay: 0.1
  fused: False
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 5
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
clip_grad_norm: 1.0
compile: False
optimizer_in_bwd: False
enable_activation_checkpointing: False
enable_activation_offloading: False
metric_logger:
  _component_: torchtune_contender.StepStampLogger
log_every_n_steps: 1
log_peak_memory_stats: False
profiler:
  enabled: False
"""
    path = tmp / "config.yaml"
    path.write_text(cfg)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=Path, required=True, help=".npy of int token ids, shape [n, seq]")
    p.add_argument("--labels", type=Path, help=".npy, same shape, unshifted labels with -100 where no loss")
    p.add_argument("--positions", type=Path, help=".npy, same shape, per-document position ids (packed masks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2, help="threads in total, split over the processes")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = p.parse_args()
    if args.steps <= WARMUP:
        sys.exit(f"--steps must be more than the {WARMUP} warm-up steps")
    per_proc = max(1, args.threads // args.nproc)

    import numpy as np

    rows = np.load(args.rows)
    n, seq = rows.shape
    assert seq == SHAPE["max_seq_len"], f"rows must be {SHAPE['max_seq_len']} tokens long, got {seq}"
    labels = np.load(args.labels) if args.labels else rows
    targets = np.full(labels.shape, -100, dtype=np.int64)
    targets[:, :-1] = labels[:, 1:]
    global_batch = GLOBAL_BATCH

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        config = write_config(tmp, args, seq)
        metrics = tmp / "metrics.jsonl"
        paths = {k: str(getattr(args, k).resolve()) for k in ("rows", "labels", "positions") if getattr(args, k)}
        env = dict(os.environ, OMP_NUM_THREADS=str(per_proc), TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
                   **{ROWS_ENV: json.dumps(paths), METRICS_ENV: str(metrics)})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(Path(__file__).resolve()), "--config", str(config)]
        env[RECIPE_ENV] = "full_finetune_distributed"
        proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=sys.stderr)
        if proc.returncode != 0 or not metrics.exists():
            sys.exit(f"torchtune contender failed (exit {proc.returncode})")
        recs = [json.loads(line) for line in metrics.read_text().splitlines()]

    import torchtune

    wall = recs[-1]["time"] - recs[WARMUP - 1]["time"]
    timed = range(WARMUP, len(recs))
    loss_tokens = sum(int((targets[[(s * global_batch + j) % n for j in range(global_batch)]] != -100).sum())
                      for s in timed)
    print(json.dumps({
        "tokens_per_s": len(timed) * global_batch * seq / wall, "loss_tokens_per_s": loss_tokens / wall,
        "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"], "steps": len(recs), "timed_steps": len(timed),
        "world": args.nproc, "threads_per_proc": per_proc, "dtype": args.dtype,
        "attention": "packed block-causal dense mask (sdpa)" if args.positions else "sdpa causal",
        "recipe_tokens_per_second_per_gpu_last": recs[-1].get("tokens_per_second_per_gpu"),
        "torchtune": torchtune.__version__,
        "step_s": [round(b["time"] - a["time"], 4) for a, b in zip(recs, recs[1:], strict=False)],
    }))


def run_recipe() -> None:
    """One rank (under torch.distributed.run): torchtune's recipe file as __main__, after two CPU patches.

    1. full_finetune_distributed.py (0.6.1) calls training.get_memory_stats on rank 0 after building the model without
    the `device.type != "cpu"` guard that full_finetune_single_device.py has, and get_memory_stats raises
    "Logging memory stats is not supported on CPU devices". On CPU it now returns no stats (and
    log_memory_stats skips empty stats).
    2. Its train() starts with training.cleanup_before_training(): gc.collect(), then torch.cpu.empty_cache() and
    torch.cpu.reset_peak_memory_stats(), which torch.cpu does not have (AttributeError). On CPU: gc.collect() only.
    """
    import gc
    import runpy

    import torchtune
    from torchtune import training

    get_memory_stats = training.get_memory_stats

    def memory_stats_or_none(device, reset_stats=True):
        return {} if device.type == "cpu" else get_memory_stats(device, reset_stats)

    log_memory_stats = training.log_memory_stats
    training.get_memory_stats = memory_stats_or_none
    training.log_memory_stats = lambda stats, *a, **k: log_memory_stats(stats, *a, **k) if stats else None
    training.cleanup_before_training = gc.collect
    recipe = Path(torchtune.__file__).parent.parent / "recipes" / f"{os.environ[RECIPE_ENV]}.py"  # as tune run
    sys.argv = [str(recipe), *sys.argv[1:]]
    runpy.run_path(str(recipe), run_name="__main__")


if __name__ == "__main__":
    if os.environ.get(RECIPE_ENV):
        run_recipe()
    else:
        main()
