"""torchtitan as a throughput contender on CPU: its Trainer, Llama3 model, FSDP2 parallelize_fn, loss, AdamW and
LR schedule, fed pre-tokenized packed rows from a .npy file. Prints one JSON line.

    /tmp/peers-venv/bin/python bench/peers/torchtitan_contender.py --rows rows.npy --steps 40 --threads 2 [--nproc 2]
        [--labels labels.npy]

Run it with the peer venv's python (torch 2.13.0+cpu, torchtitan 0.3.0, triton); it needs nothing from shardline.
It relaunches itself under torch.distributed.run with --nproc processes (default 2) of --threads/--nproc
threads each (gloo), like shardline's 2 processes x 1 thread.

torchtitan 0.3.0 cannot run on a CPU-only torch as shipped (see FINDINGS.md): its tools/utils.py falls back to
device_type "cuda" when no accelerator is found and the Trainer calls torch.cuda.set_device. This script applies
the smallest patch that gets past that, before any other torchtitan module is imported: torchtitan's device type is
"cpu" (so its process group is gloo) and its device module is torch.cpu plus no-op memory-stat stubs. Everything
else in the training step is torchtitan's own code.

Two more patches, each the same computation torchtitan asks for: FSDP2 is told to reduce-scatter with a plain SUM
(torchtitan sets gradient_divide_factor 1.0, which FSDP2 sends as ReduceOp.PREMUL_SUM(1.0), and gloo has no
PREMUL_SUM), and torch.distributed.set_timeout (a PyTorch-nightly API torchtitan 0.3.0 calls after step 1; absent
from torch 2.13.0) is aliased to torch.distributed.distributed_c10d._set_pg_timeout. parallelism.spmd_backend is
"partial_dtensor" (plain FSDP2 over the data-parallel mesh, the classic torchtitan path); the 0.3.0 default
"spmd_types" failed at fully_shard ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD
mesh ... Got plain tensor for parameter 'weight'"); set TITAN_SPMD_BACKEND to try another.

Model: torchtitan's Llama3Model built with the bench shape (dim 512, 8 layers, 8 heads / 8 kv heads, FFN hidden
1376, vocab 2048, RoPE theta 10000, untied embeddings, seq 512). Differences from shardline's HF Llama: torchtitan
fuses wq/wk/wv into one wqkv linear, uses ComplexRoPE and its own init, and computes the loss with
ChunkedLossWrapper(CrossEntropyLoss) (sum / global valid tokens), as its llama3 configs do.

Attention: plain causal SDPA over the whole packed row, NO document masking. torchtitan 0.3.0's language-model
attention configs offer only document-masked backends, and neither trains on CPU: flex (its default) fails in
backward with "FlexAttention does not support backward on CPU", varlen has no CPU kernel
(aten::_flash_attention_forward). So the SDPA inner attention (which torchtitan keeps for Flux) is put in by hand,
and --positions is refused.

Data: --rows int token ids [n, seq]; --labels (optional, same shape, HF style: unshifted, -100 = no loss; default
the rows themselves) are shifted here into next-token targets, last position ignored. Rank r takes rows r, r+world,
...; local batch 4 rows, global batch 8 rows, one micro-batch per rank per step (bench/throughput.yaml). bf16 FSDP2
mixed precision (param bf16, reduce fp32), fp32 master weights, no activation checkpointing, no compile (SDPA path),
lr 1e-3 with 5 warmup steps then cosine, AdamW(0.9, 0.95, wd 0.1), clip 1.0.

Timing: the first 3 steps are left out (as bench/throughput.py does); tokens_per_s counts every input token of the
timed steps (rows x seq), loss_tokens_per_s the targets that are not -100.
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
GLOBAL_BATCH = 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=Path, required=True, help=".npy of int token ids, shape [n, seq]")
    p.add_argument("--labels", type=Path, help=".npy, same shape, unshifted labels with -100 where no loss")
    p.add_argument("--positions", type=Path, help="refused: document masking cannot train on CPU in torchtitan")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2, help="threads in total, split over the processes")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> None:
    if args.steps <= WARMUP:
        sys.exit(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.positions is not None:
        sys.exit("torchtitan contender: --positions (document masking) needs flex or varlen attention, which cannot "
                 "train on CPU (flex: no CPU backward; varlen: no CPU kernel)")
    per_proc = max(1, args.threads // args.nproc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(Path(__file__).resolve()), "--rows", str(args.rows.resolve()), "--steps", str(args.steps),
               "--threads", str(per_proc), "--lr", str(args.lr), "--worker-out", str(out)]
        if args.labels is not None:
            cmd += ["--labels", str(args.labels.resolve())]
        env = dict(os.environ, OMP_NUM_THREADS=str(per_proc), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=sys.stderr)
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"torchtitan contender failed (exit {proc.returncode})")
        print(out.read_text().strip())


# ---------------------------------------------------------------- worker (one per rank, under torch.distributed.run)


def patch_torchtitan_for_cpu() -> None:
    """torchtitan.tools.utils: device_type 'cpu' (not its 'cuda' fallback) and a torch.cpu-based device module."""
    import types

    import torch
    import torch._utils as tu

    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        tu._get_available_device_type = original

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    class CpuDeviceModule(types.SimpleNamespace):
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

    cpu = CpuDeviceModule(
        set_device=lambda *a, **k: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda *a, **k: "cpu", get_device_properties=lambda *a, **k: types.SimpleNamespace(
            total_memory=total), memory_stats=lambda *a, **k: {}, reset_peak_memory_stats=lambda *a, **k: None,
        empty_cache=lambda: None, synchronize=lambda *a, **k: None,
    )
    assert tt_utils.device_type == "cpu", tt_utils.device_type
    tt_utils.device_module = cpu

    # torchtitan 0.3.0 targets PyTorch nightly: after step 1 it calls torch.distributed.set_timeout, which torch
    # 2.13.0 does not have; its private predecessor does the same for gloo groups.
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    patch_torchtitan_for_cpu()

    from dataclasses import dataclass

    import torch.distributed as dist
    import torchtitan
    from torch.utils.data import IterableDataset
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )
    from torchtitan.trainer import Trainer

    rows = np.load(args.rows).astype(np.int64)
    n, seq = rows.shape
    labels = np.load(args.labels).astype(np.int64) if args.labels else rows.copy()
    targets = np.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]

    class RowsDataset(IterableDataset):
        def __init__(self, rank: int, world: int):
            self.order = list(range(rank, n, world))
            self.i = 0
            self.valid: list[int] = []

        def __iter__(self):
            while True:
                r = self.order[self.i % len(self.order)]
                self.i += 1
                self.valid.append(int((targets[r] != -100).sum()))
                yield {"input": torch.from_numpy(rows[r])}, torch.from_numpy(targets[r])

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    datasets: list[RowsDataset] = []

    class NpyRowsLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size,
                     snapshot_every_n_steps=None, **kwargs):
            ds = RowsDataset(dp_rank, dp_world_size)
            datasets.append(ds)
            super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                             num_workers=0)

    class NoTokenizer(BaseTokenizer):
        """The rows are already token ids; torchtitan's Trainer still builds a tokenizer and hands it on."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, tokenizer_path=None, **kwargs):
            super().__init__()

        def encode(self, *a, **k):
            raise NotImplementedError

        def decode(self, *a, **k):
            raise NotImplementedError

        def get_vocab_size(self):
            return 2048

    dim, n_heads, n_layers, ffn, vocab = 512, 8, 8, 1376, 2048
    model_cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_heads, hidden_dim=ffn,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq, theta=10000.0, scaling="none"),
            attn_backend="flex",
        ),
    )
    for _, _, parent, attr in list(model_cfg.traverse(FlexAttention.Config)):  # causal SDPA: see the docstring
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    spec = model_registry("debugmodel")
    spec.model = model_cfg
    spec.flavor = "bench-512x8"

    dump = tempfile.mkdtemp(prefix="titan-")
    config = Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=dump,
        dump_folder=dump,
        model_spec=spec,
        tokenizer=NoTokenizer.Config(),
        dataloader=NpyRowsLoader.Config(),
        optimizer=default_adamw(lr=args.lr, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5, decay_type="cosine", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=LOCAL_BATCH, global_batch_size=GLOBAL_BATCH, seq_len=seq,
                                steps=args.steps, max_norm=1.0, dtype="float32", mixed_precision_param="bfloat16",
                                mixed_precision_reduce="float32", disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend=os.environ.get("TITAN_SPMD_BACKEND", "partial_dtensor")),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )

    trainer = config.build()
    # torchtitan turns FSDP's gradient division off (set_gradient_divide_factor(1.0): the loss is already divided
    # by the global token count), which FSDP2 reduce-scatters as ReduceOp.PREMUL_SUM(1.0): gloo has no PREMUL_SUM.
    # A plain SUM is the same reduction; FSDP2's own switch for it:
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    stamps: list[float] = []
    losses: list[float] = []
    step_fn, log_fn = trainer.train_step, trainer.metrics_processor.log

    profile_step = int(os.environ.get("TITAN_PROFILE_STEP", "0"))  # debugging aid: op table of one step, rank 0

    def timed_step(it):
        if len(stamps) + 1 == profile_step:
            with torch.profiler.profile() as prof:
                step_fn(it)
            if dist.get_rank() == 0:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
        else:
            step_fn(it)
        stamps.append(time.perf_counter())

    def capture_log(step, global_avg_loss, *a, **k):
        losses.append(float(global_avg_loss))
        return log_fn(step, global_avg_loss, *a, **k)

    trainer.train_step = timed_step
    trainer.metrics_processor.log = capture_log
    try:
        trainer.train()
    finally:
        trainer.close()

    per_step = LOCAL_BATCH * trainer.gradient_accumulation_steps
    valid = datasets[0].valid
    counts = torch.tensor([sum(valid[WARMUP * per_step:args.steps * per_step]),
                           (args.steps - WARMUP) * per_step * seq], dtype=torch.float64)
    dist.all_reduce(counts)
    wall = stamps[-1] - stamps[WARMUP - 1]
    if dist.get_rank() == 0:
        result = {
            "tokens_per_s": counts[1].item() / wall, "loss_tokens_per_s": counts[0].item() / wall,
            "first_loss": losses[0], "last_loss": losses[-1], "steps": args.steps, "timed_steps": args.steps - WARMUP,
            "world": dist.get_world_size(), "threads_per_proc": args.threads,
            "attention": "sdpa causal",
            "torchtitan": torchtitan.__version__, "torch": torch.__version__,
            "step_s": [round(b - a, 4) for a, b in zip(stamps, stamps[1:], strict=False)],
        }
        args.worker_out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if a.worker_out is not None:
        worker(a)
    else:
        launch(a)
