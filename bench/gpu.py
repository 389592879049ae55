"""One GPU, Llama-3.1-8B layer shapes: attention backends, training tok/s/GPU and MFU (eager vs compile),
async vs sync checkpoint stall, and gpucheck with real NVML — next to torchtitan's published 8B figures.

Model: Hugging Face LlamaForCausalLM from a LlamaConfig with Llama-3.1-8B's shapes (hidden 4096, intermediate
14336, 32 heads, 8 KV heads, vocab 128256, rope theta 500000), random init, bf16 weights on the GPU, as many of
the 32 decoder layers as fit in its memory (`--layers` to choose), seq 8192 × batch 1, random token ids.
Training step: forward with labels, backward, grad-norm clip 1.0, AdamW(fused=True) (moments bf16 like the
weights), zero_grad. One process, world 1, no FSDP.

Sections (`--sections`, all by default); warm-up steps are never timed; GPU time comes from CUDA events after
`torch.cuda.synchronize()`, stalls from the wall clock (they are host-side blocking):
  gpucheck    shardline's `check_rank` on this GPU: bf16 matmul burn-in against the catalogue peak, memory
              copy bandwidth, NVML readings (nvidia-ml-py) and what they flag
  attention   causal attention forward + backward alone at the model's shapes (B × 32 heads × T × 128, 8 KV
              heads): SDPA restricted to its flash backend, to its cuDNN backend, and flash-attn's
              flash_attn_func (FlashAttention-2) when that package is installed
  train       the training step with each attention backend, eager: tok/s/GPU, MFU, peak memory
  compile     every decoder layer torch.compile'd in place (per block, after activation checkpointing: the
              torchtitan order shardline's parallelize uses), with the faster SDPA backend of `train`;
              compile time reported apart
  checkpoint  torch.distributed.checkpoint of model + AdamW state with FileSystemWriter (shardline's writer):
              the stall of a sync `dcp.save` vs a `dcp.async_save` (staging on the training thread + the extra
              time of the steps run while the background write is in flight), world-1 process group

MFU = tok/s × FLOPs/token ÷ the device's dense bf16 peak (FLOPs/token = 6·N + 12·L·d·T from
shardline.model.flops; the peak from the hardware catalogue). Fewer than 32 layers give more tok/s, so the run
also reports "8B-equivalent" tok/s/GPU: the same FLOP/s spent on the 32-layer model. Those two, not raw tok/s,
compare with torchtitan (TORCHTITAN_8B), under the caveats the run prints.

    .venv/bin/python bench/gpu.py --json bench/gpu.json          # on a GPU machine, a few minutes
    .venv/bin/python bench/gpu.py --cpu-smoke --steps 2          # the same code, tiny shapes on CPU (tests)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.attention import SDPBackend, sdpa_kernel

EXIT_NO_GPU = 2
SECTIONS = ("gpucheck", "attention", "train", "compile", "checkpoint")
ATTENTION = ("sdpa_flash", "sdpa_cudnn", "flash_attention_2")
MAX_STEPS_WHILE_WRITING = 500  # safety net: a background save that never finishes
GIB = 2**30
FLOPS_FORMULA = ("shardline.model.flops.flops_per_token: 6·N_trainable + 4·N_frozen + 12·L·d·T per token "
                 "(each row one T-token document; no causal halving, as torchtitan)")

# torchtitan's published Llama 3.1 8B figures: benchmarks/llama3_h100_202412_torchtitan.md (the same tables as
# docs/performance.md since 2025), Table 1 "1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size
# 2, global batch size 16. Selective activation checkpointing." seq 8192 is torchtitan's llama3_8b training
# config (the table does not state it). Grand Teton hosts, 8× H100 96GB HBM2e with NVLink at the 500 W power
# limit; torch 1963fc8 (2024-12-23), torchtitan 9dec370.
TORCHTITAN_8B = {
    "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md), Table 1",
    "model": "Llama 3.1 8B (32 layers), torchtitan's own model code",
    "parallelism": "FSDP2 on 8 GPUs (1 node), local batch 2, global batch 16, seq 8192, selective AC, bf16",
    "hardware": "H100 96GB HBM2e at 500 W (Grand Teton), NVLink",
    "tokens_per_s_per_gpu": {"eager": 5762, "compile": 6667},
    "memory_gib": {"eager": 82.4, "compile": 77.0},
    "stated_mfu": "33% to 39%, against the H100 SXM peak (their footnote: their part's real peak is lower)",
}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    """Decoder layers of the full model (a run may use fewer)."""
    rope_theta: float = 500_000.0


LLAMA_8B = Shape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128_256, layers=32)
SMOKE = Shape(hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=512, layers=2)

# Memory model behind the default `--layers` (bytes). Weights, grads and both AdamW moments are bf16: 8 per
# param. Kept for backward per token per layer (HF's eager Llama block): two RMSNorms (fp32 upcast 4·d + bf16
# output 2·d each), the q/k/v input, SDPA's q, k, v and output, the o_proj input, the MLP input → 26·d; gate,
# up, silu(gate), their product → 8·i. Selective AC keeps matmul and attention outputs (~10·d + 4·i), full AC
# the block input (2·d); both also hold one recomputed block at a time. The loss: bf16 logits, their fp32 copy,
# log-softmax and its gradient → 12·vocab per token. Activations × ACT_SAFETY; MARGIN of the device and
# MARGIN_BYTES stay free (CUDA context, cuBLAS/cuDNN workspaces, fragmentation). A step that still runs out of
# memory backs off by a layer or more and tries again.
STATE_BYTES_PER_PARAM = 8
ACT_SAFETY = 1.25
MARGIN = 0.10
MARGIN_BYTES = 2 * GIB


@dataclass(frozen=True)
class Run:
    shape: Shape
    seq: int
    batch: int
    ac: str
    steps: int
    warmup: int
    device: torch.device

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Bench:
    """The model under test, its optimizer, one training step, and the numbers MFU needs."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], torch.Tensor]
    layers: int
    flops_per_token: float = 0.0
    flops_per_token_full: float = 0.0
    peak_tflops: float = 0.0


# ---- model and memory ---------------------------------------------------------------------------------------
def llama_config(shape: Shape, layers: int, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=seq, rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )


def param_counts(shape: Shape, layers: int, seq: int):
    """shardline's ParamCounts of the model with `layers` layers, built on the meta device (allocates nothing)."""
    from transformers import AutoModelForCausalLM

    from shardline.model.flops import count_params

    with torch.device("meta"):
        return count_params(AutoModelForCausalLM.from_config(llama_config(shape, layers, seq), dtype=torch.bfloat16))


def model_flops_per_token(shape: Shape, layers: int, seq: int) -> float:
    from shardline.model.flops import flops_per_token

    return flops_per_token(param_counts(shape, layers, seq), layers, shape.hidden, seq)


def auto_layers(run: Run, free: int, total: int) -> tuple[int, dict]:
    """As many layers as the memory model above fits in `free` bytes of a `total`-byte device (1 at least)."""
    shape = run.shape
    one, two = param_counts(shape, 1, run.seq).total, param_counts(shape, 2, run.seq).total
    per_layer, rest = two - one, 2 * one - two
    d, i = shape.hidden, shape.intermediate
    block = 26 * d + 8 * i
    kept = ACT_SAFETY * {"none": block, "selective": 10 * d + 4 * i, "full": 2 * d}[run.ac]
    transient = 0.0 if run.ac == "none" else ACT_SAFETY * block
    budget = (free - MARGIN * total - MARGIN_BYTES - STATE_BYTES_PER_PARAM * rest
              - run.tokens * (12 * shape.vocab + transient))
    fits = math.floor(budget / (STATE_BYTES_PER_PARAM * per_layer + run.tokens * kept))
    return max(1, min(shape.layers, fits)), {"free_gib": free / GIB, "total_gib": total / GIB,
                                             "params_per_layer": per_layer, "params_outside_layers": rest,
                                             "estimated_layers": fits}


def build(run: Run, layers: int) -> Bench:
    from transformers import AutoModelForCausalLM

    from shardline.parallel.fsdp import apply_activation_checkpointing
    from shardline.spec import ParallelSpec

    torch.manual_seed(0)
    with torch.device(run.device):
        model = AutoModelForCausalLM.from_config(llama_config(run.shape, layers, run.seq), dtype=torch.bfloat16)
    apply_activation_checkpointing(model, ParallelSpec(activation_checkpointing=run.ac))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)
    ids = torch.randint(0, run.shape.vocab, (run.batch, run.seq), device=run.device,
                        generator=torch.Generator(device=run.device).manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Bench(model, optimizer, step, layers)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fit(run: Run, layers: int, auto: bool) -> tuple[Bench, list[str]]:
    """Build the model and run one step; with `auto`, on running out of memory, retry with fewer layers."""
    backed_off: list[str] = []
    while True:
        bench = None
        try:
            bench = build(run, layers)
            wall(bench.step, run.device)
            return bench, backed_off
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or a cuBLAS/cuDNN workspace that did not fit
            if "out of memory" not in str(e).lower():
                raise
            if not auto or layers == 1:
                raise SystemExit(f"out of memory with {layers} layers at seq {run.seq} × batch {run.batch} "
                                 f"({short(e)}): pass a smaller --layers, --seq or --batch, or --ac selective") from e
        del bench  # the exception and its frames are gone here, so the memory can be returned
        release(run.device)
        backed_off.append(f"{layers} layers ran out of memory")
        layers -= max(1, layers // 8)


def peak_flops(device: torch.device) -> tuple[float, str]:
    """The device's dense bf16 peak (TFLOP/s) and where it comes from: the catalogue, else a matmul probe."""
    from shardline.hardware import match_device
    from shardline.model.flops import probe_matmul_tflops, table_peak_tflops

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak_tflops(name, torch.bfloat16)
        if peak is not None:
            return peak, f"hardware catalogue: {match_device(name).name} dense bf16"
        return (probe_matmul_tflops(torch.bfloat16, device, n=8192, seconds=2.0),
                f"measured bf16 matmul probe ({name} is not in the hardware catalogue)")
    return (probe_matmul_tflops(torch.bfloat16, device, n=512, seconds=0.3),
            f"measured CPU bf16 matmul probe, {torch.get_num_threads()} threads (stand-in: no GPU)")


def reference() -> dict:
    """TORCHTITAN_8B plus its MFU by this script's formula (32 layers, seq 8192) and the catalogue's H100 peak."""
    from shardline.hardware import match_device

    per_token = model_flops_per_token(LLAMA_8B, LLAMA_8B.layers, 8192)
    h100 = match_device("h100")
    return TORCHTITAN_8B | {
        "flops_per_token": per_token, "mfu_peak": f"{h100.name} dense bf16, {h100.bf16_tflops:.0f} TFLOP/s",
        "mfu": {k: v * per_token / 1e12 / h100.bf16_tflops for k, v in TORCHTITAN_8B["tokens_per_s_per_gpu"].items()}}


# ---- timing -----------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds for `steps` back-to-back calls: CUDA events around them on a GPU, the wall clock on CPU."""
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def wall(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, the device drained before and after (what the training thread waits)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def short(error: BaseException, why: list[str] | None = None) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}" + (f" ({'; '.join(why)})" if why else "")


@contextlib.contextmanager
def sdpa_reasons() -> Iterator[list[str]]:
    """The warnings in which SDPA says why a backend could not run (the list is filled in on exit)."""
    reasons: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield reasons
        finally:
            reasons += sorted({str(w.message).strip().splitlines()[0][:200] for w in caught
                               if "kernel" in str(w.message).lower()})


def attention_context(name: str) -> contextlib.AbstractContextManager:
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([backends[name]]) if name in backends else contextlib.nullcontext()


def flash_attn_version() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def unavailable(name: str, device: torch.device) -> dict | None:
    """Why `name` cannot run here, or None."""
    if name != "flash_attention_2":
        return None
    if flash_attn_version() is None:
        return {"status": "not installed"}
    return None if device.type == "cuda" else {"status": "CUDA only"}


# ---- sections ---------------------------------------------------------------------------------------------
def gpucheck_section(device: torch.device, seconds: float) -> dict:
    """shardline's own per-rank check of this device; NVML through nvidia-ml-py where it is installed."""
    from shardline.ops.checks.gpucheck import EXIT_NO_GPU as GPUCHECK_NO_GPU
    from shardline.ops.checks.gpucheck import check_rank, exit_code, result_document, summarize
    from shardline.spec.resolve import load_spec

    spec = load_spec("tiny", [f"launch.gpucheck.seconds={seconds}"])
    result = check_rank(spec, 0, device)
    summary = summarize([result], spec)
    code = exit_code(summary)
    meaning = {0: "passed", 1: "a check failed", GPUCHECK_NO_GPU: "no GPU: CPU probe only"}.get(code, "?")
    release(device)
    return result_document([result], summary) | {"exit_code": code, "exit_code_meaning": meaning}


def attention_section(run: Run) -> dict:
    """Causal attention forward + backward alone, per backend, at the model's head shapes."""
    shape, b, t = run.shape, run.batch, run.seq
    head = shape.hidden // shape.heads
    gen = torch.Generator(device=run.device).manual_seed(0)
    q, k, v = (torch.randn(b, n, t, head, device=run.device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for n in (shape.heads, shape.kv_heads, shape.kv_heads))
    grad_out = torch.randn_like(q)
    # FlashAttention's benchmark convention: 4·B·H·T²·D forward, halved by the causal mask, backward 2.5× forward.
    flops = 4 * b * shape.heads * t * t * head / 2 * 3.5
    out: dict = {"shape": f"B{b} × {shape.heads} heads ({shape.kv_heads} KV) × T{t} × D{head}, causal, bf16",
                 "flops_convention": "4·B·H·T²·D / 2 (causal) × 3.5 (forward + backward)"}

    def sdpa(name: str) -> Callable[[], object]:
        def run_sdpa():
            with attention_context(name):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(o, (q, k, v), grad_out)
        return run_sdpa

    def flash_attn_2() -> Callable[[], object]:
        from flash_attn import flash_attn_func  # takes (B, T, H, D) and GQA as is

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = grad_out.transpose(1, 2).contiguous()

        def run_fa2():
            torch.autograd.grad(flash_attn_func(qt, kt, vt, causal=True), (qt, kt, vt), gt)
        return run_fa2

    for name in ATTENTION:
        if (why_not := unavailable(name, run.device)) is not None:
            out[name] = why_not
            continue
        try:
            with sdpa_reasons() as why:
                fn = flash_attn_2() if name == "flash_attention_2" else sdpa(name)
                timed(fn, run.warmup, run.device)
                seconds = timed(fn, run.steps, run.device) / run.steps
            out[name] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
        except Exception as e:  # a backend this GPU or torch build cannot run: say why, measure the rest
            out[name] = {"error": short(e, why)}
    return out


def throughput(run: Run, bench: Bench, name: str) -> dict:
    """tok/s/GPU, MFU and peak memory of the training step under attention backend `name`."""
    with attention_context(name):
        timed(bench.step, run.warmup, run.device)
        if run.cuda:
            torch.cuda.reset_peak_memory_stats(run.device)
        seconds = timed(bench.step, run.steps, run.device) / run.steps
        loss = float(bench.step())
    tok_s = run.tokens / seconds
    achieved = tok_s * bench.flops_per_token / 1e12
    out = {"step_s": seconds, "tokens_per_s_per_gpu": tok_s, "achieved_tflops": achieved,
           "mfu": achieved / bench.peak_tflops,
           "tokens_per_s_8b_equivalent": tok_s * bench.flops_per_token / bench.flops_per_token_full, "loss": loss}
    if run.cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(run.device) / GIB
    return out


def train_section(run: Run, bench: Bench) -> dict:
    out: dict = {}
    for name in ATTENTION:
        if (why_not := unavailable(name, run.device)) is not None:
            out[name] = why_not
            continue
        try:
            with sdpa_reasons() as why:
                if name == "flash_attention_2":
                    bench.model.set_attn_implementation("flash_attention_2")
                out[name] = throughput(run, bench, name)
        except Exception as e:
            out[name] = {"error": short(e, why)}
        finally:
            if name == "flash_attention_2":
                bench.model.set_attn_implementation("sdpa")
            bench.optimizer.zero_grad(set_to_none=True)  # a step that failed half-way leaves gradients behind
            release(run.device)
    return out


def compile_section(run: Run, bench: Bench, backend: str, eager_step_s: float | None) -> dict:
    """Every decoder layer compiled in place, then the same measurement as `train`."""
    from torch._dynamo.utils import counters

    from shardline.model.build import decoder_layers

    for layer in decoder_layers(bench.model):
        layer.compile()
    with attention_context(backend):
        first = wall(bench.step, run.device)  # tracing and inductor compilation happen in this step
    out = {"attention": backend, "first_step_s": first}
    if eager_step_s is not None:
        out["compile_s"] = max(0.0, first - eager_step_s)
    out |= throughput(run, bench, backend)
    # One graph serves every layer; more mean recompiles (past torch._dynamo's limit a layer runs eager).
    out["dynamo_unique_graphs"] = counters["stats"].get("unique_graphs")
    return out


def tensor_bytes(tree: object) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def host_available_bytes() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def checkpoint_section(run: Run, bench: Bench, root: Path) -> dict:
    """Training stall of a sync `dcp.save` vs a `dcp.async_save` of model + optimizer state."""
    model_sd, optim_sd = get_state_dict(bench.model, bench.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    nbytes = tensor_bytes(state)
    out: dict = {"state_gb": nbytes / 1e9, "dir": str(root), "writer": "FileSystemWriter, as shardline's"}
    disk, ram = shutil.disk_usage(root).free, host_available_bytes()
    if disk < 1.2 * nbytes:
        return out | {"skipped": f"{disk / 1e9:.1f} GB free in {root}, the checkpoint takes {nbytes / 1e9:.1f} GB: "
                                 "pass --ckpt-dir on a larger volume"}
    if ram is not None and ram < 1.2 * nbytes:
        return out | {"skipped": f"{ram / 1e9:.1f} GB of host memory available; async staging copies "
                                 f"{nbytes / 1e9:.1f} GB into it"}
    baseline = statistics.median(wall(bench.step, run.device) for _ in range(max(3, min(run.steps, 5))))
    out["baseline_step_s"] = baseline

    sync_dir = root / "sync"
    out["sync_stall_s"] = wall(lambda: dcp.save(state, storage_writer=FileSystemWriter(sync_dir)), run.device)
    out["written_gb"] = sum(f.stat().st_size for f in sync_dir.rglob("*") if f.is_file()) / 1e9
    shutil.rmtree(sync_dir)

    group = dist.new_group(backend="gloo")  # background saves talk on their own group, as shardline's do
    sync(run.device)
    start = time.perf_counter()
    response = dcp.async_save(state, storage_writer=FileSystemWriter(root / "async"), process_group=group)
    out["async_staging_s"] = time.perf_counter() - start
    future = getattr(response, "upload_completion", response)
    finished: dict[str, float] = {}
    future.add_done_callback(lambda _f: finished.setdefault("t", time.perf_counter()))
    during: list[float] = []
    while not future.done() and len(during) < MAX_STEPS_WHILE_WRITING:
        during.append(wall(bench.step, run.device))
    future.result()
    out["background_write_s"] = finished.get("t", time.perf_counter()) - start
    out["steps_while_writing"] = len(during)
    out["async_extra_step_s"] = sum(t - baseline for t in during)
    # Below zero only by noise (steps that happened to run faster than the baseline): not a negative stall.
    out["async_stall_s"] = out["async_staging_s"] + max(0.0, out["async_extra_step_s"])
    out["ratio_async_vs_sync"] = out["async_stall_s"] / out["sync_stall_s"]
    shutil.rmtree(root / "async")
    dist.destroy_process_group(group)
    return out


@contextlib.contextmanager
def world_of_one(device: torch.device, store_dir: Path) -> Iterator[None]:
    """A one-process group from a FileStore (no port to pick): gloo, plus NCCL for CUDA tensors on a GPU."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.FileStore(str(store_dir / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_sections(args: argparse.Namespace, run: Run, r: dict) -> None:
    """Fit the model, then train, compile and checkpoint on it (in this order: compiling is in place)."""
    layers, auto = args.layers, False
    if layers is None and not run.cuda:
        layers = run.shape.layers
    elif layers is None:
        release(run.device)
        layers, r["layers_estimate"] = auto_layers(run, *torch.cuda.mem_get_info(run.device))
        auto = True
    bench, backed_off = fit(run, layers, auto)
    r["layers"] = bench.layers
    r["layers_source"] = "--layers" if not auto else "; ".join(["auto: the memory model, then one step", *backed_off])
    from shardline.model.flops import count_params

    counts = count_params(bench.model)
    r["params"] = asdict(counts) | {"total": counts.total}
    bench.flops_per_token = model_flops_per_token(run.shape, bench.layers, run.seq)
    bench.flops_per_token_full = model_flops_per_token(run.shape, run.shape.layers, run.seq)
    bench.peak_tflops, source = peak_flops(run.device)
    r |= {"flops_per_token": bench.flops_per_token, "flops_per_token_full_model": bench.flops_per_token_full,
          "flops_formula": FLOPS_FORMULA, "peak_tflops": bench.peak_tflops, "peak_source": source,
          "reference": reference()}
    if "train" in args.sections:
        r["train"] = train_section(run, bench)
    if "compile" in args.sections and not run.cuda:
        r["compile"] = {"skipped": "not run with --cpu-smoke: compiling for CPU takes longer than the smoke run"}
    elif "compile" in args.sections:
        eager = {n: e for n, e in (r.get("train") or {}).items() if "step_s" in e and n.startswith("sdpa")}
        backend = min(eager, key=lambda n: eager[n]["step_s"]) if eager else "sdpa_flash"
        try:
            r["compile"] = compile_section(run, bench, backend, eager[backend]["step_s"] if eager else None)
        except Exception as e:
            r["compile"] = {"attention": backend, "error": short(e)}
        release(run.device)
    if "checkpoint" in args.sections:
        with tempfile.TemporaryDirectory(dir=args.ckpt_dir, prefix="shardline-gpu-bench-") as tmp, \
                world_of_one(run.device, Path(tmp)):
            try:
                r["checkpoint"] = checkpoint_section(run, bench, Path(tmp))
            except Exception as e:
                r["checkpoint"] = {"error": short(e)}
    del bench
    release(run.device)


# ---- report -----------------------------------------------------------------------------------------------
def caveats(r: dict) -> list[str]:
    notes = ["one GPU, one process, no FSDP: torchtitan's figures are FSDP2 on 8 GPUs (parameter all-gathers and "
             "gradient reduce-scatters overlapped with compute); FSDP on one GPU is not measured here"]
    if r.get("layers") and r["layers"] < r["shape"]["layers"]:
        notes.append(f"{r['layers']} of {r['shape']['layers']} layers: raw tok/s/GPU is above the full model's; "
                     "compare MFU and the 8B-equivalent tok/s (the same FLOP/s on 32 layers)")
    return notes + [
        f"batch {r['batch']}, activation checkpointing '{r['ac']}'; torchtitan: local batch 2, selective AC "
        "(recomputation is not counted in MFU, so AC lowers it)",
        "bf16 weights and bf16 AdamW moments, the optimizer stepping every parameter on this GPU; torchtitan keeps "
        "fp32 master weights and each of its 8 GPUs steps 1/8 of them",
        "Hugging Face LlamaForCausalLM on random tokens vs torchtitan's own Llama code on C4",
        "torchtitan's H100 is the 96GB HBM2e part at 500 W; MFU here is against this device's catalogue peak",
    ]


def status(entry: dict | None) -> str:
    entry = entry or {}
    return entry.get("status") or entry.get("error") or entry.get("skipped") or "not run"


def print_report(r: dict) -> None:
    print(f"\n{r['title']}")
    print(f"device {r['device']}; torch {r['torch']}, CUDA {r['cuda']}, cuDNN {r['cudnn']}, transformers "
          f"{r['transformers']}, flash-attn {r['flash_attn'] or 'not installed'}")
    if "flops_per_token" in r:
        print(f"{r['layers']} layers ({r['layers_source']}); FLOPs/token {r['flops_per_token']:.3e}, full model "
              f"{r['flops_per_token_full_model']:.3e} ({r['flops_formula']}); peak {r['peak_tflops']:.4g} "
              f"TFLOP/s ({r['peak_source']})")
    if g := r.get("gpucheck"):
        rank = g["ranks"][0]
        frac = f" ({rank['peak_fraction']:.0%} of peak)" if rank.get("peak_fraction") else ""
        nvml = rank.get("nvml_error") or f"driver {rank.get('driver_version')}"
        findings = "; ".join(f"{f['check']}: {f['detail']}" for f in rank["findings"]) or "none"
        print(f"\ngpucheck: bf16 matmul {rank['matmul_tflops']:.4g} TFLOP/s{frac}, memory copy "
              f"{rank['memory_gbps']:.0f} GB/s; NVML {nvml}; findings: {findings}; exit code {g['exit_code']} "
              f"({g['exit_code_meaning']})")
    if a := r.get("attention"):
        print(f"\nattention alone, forward + backward ({a['shape']}):")
        for name in ATTENTION:
            e = a.get(name) or {}
            print(f"  {name:<18} " + (f"{e['ms']:9.2f} ms {e['tflops']:8.4g} TFLOP/s" if "ms" in e else status(e)))
    if t := r.get("train"):
        ref = r["reference"]
        print(f"\ntraining step, {r['layers']} layers, seq {r['seq']} × batch {r['batch']}, {r['steps']} timed "
              f"steps after {r['warmup']} warm-up:")
        print(f"  {'':<26} {'tok/s/GPU':>10} {'MFU':>7} {'8B-equiv tok/s':>15} {'vs torchtitan':>14} {'peak GiB':>9}")
        rows = [(f"eager, {name}", t.get(name), "eager") for name in ATTENTION]
        c = r.get("compile") or {}
        rows.append((f"compile, {c.get('attention', '-')}", c, "compile"))
        for label, e, kind in rows:
            if e and "tokens_per_s_per_gpu" in e:
                ratio = e["tokens_per_s_8b_equivalent"] / ref["tokens_per_s_per_gpu"][kind]
                memory = f"{e['peak_memory_gib']:.1f}" if "peak_memory_gib" in e else "-"
                print(f"  {label:<26} {e['tokens_per_s_per_gpu']:10,.0f} {e['mfu']:7.1%} "
                      f"{e['tokens_per_s_8b_equivalent']:15,.0f} {ratio:13.2f}× {memory:>9}")
            else:
                print(f"  {label:<26} {status(e)}")
        if "first_step_s" in c:
            print(f"  compile: first step {c['first_step_s']:.1f} s (compile ≈ {c.get('compile_s', 0):.1f} s), "
                  f"dynamo graphs {c.get('dynamo_unique_graphs')}")
        print(f"  torchtitan: {ref['tokens_per_s_per_gpu']['eager']:,} tok/s/GPU eager, "
              f"{ref['tokens_per_s_per_gpu']['compile']:,} compiled (MFU {ref['mfu']['eager']:.1%} / "
              f"{ref['mfu']['compile']:.1%} by this formula, {ref['mfu_peak']}); {ref['parallelism']}")
    if ck := r.get("checkpoint"):
        if "sync_stall_s" in ck:
            print(f"\ncheckpoint of model + AdamW state, {ck['state_gb']:.2f} GB ({ck['written_gb']:.2f} GB "
                  f"written); baseline step {ck['baseline_step_s']:.3f} s\n  sync stall {ck['sync_stall_s']:.2f} s; "
                  f"async stall {ck['async_stall_s']:.2f} s = staging {ck['async_staging_s']:.2f} s + extra step "
                  f"time {ck['async_extra_step_s']:+.2f} s over {ck['steps_while_writing']} step(s) while writing; "
                  f"background write {ck['background_write_s']:.2f} s; async/sync {ck['ratio_async_vs_sync']:.2f}")
        else:
            print(f"\ncheckpoint: {status(ck)}")
    print("\ncaveats:")
    for note in r["caveats"]:
        print(f"  - {note}")


# ---- main -------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="decoder layers (default: as many as fit; 2 with --cpu-smoke)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 8192; 64 with --cpu-smoke)")
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, help="untimed steps before each measurement (default 3; 1 smoke)")
    parser.add_argument("--ac", choices=["none", "selective", "full"], default="none",
                        help="activation checkpointing, as shardline's parallel.activation_checkpointing")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--ckpt-dir", type=Path, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--gpucheck-seconds", type=float, help="each gpucheck measurement (default 5; 0.1 smoke)")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the code, not a GPU")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in args.sections if s not in SECTIONS]:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"bench/gpu.py needs a CUDA GPU; none is visible to torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda or 'none'}). Run it on a GPU machine, or pass --cpu-smoke to run the same code "
              "with tiny shapes on CPU.", file=sys.stderr)
        return EXIT_NO_GPU
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    smoke = args.cpu_smoke
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    run = Run(shape=SMOKE if smoke else LLAMA_8B, seq=args.seq or (64 if smoke else 8192), batch=args.batch,
              ac=args.ac, steps=args.steps, warmup=args.warmup if args.warmup is not None else (1 if smoke else 3),
              device=device)
    r: dict = {
        "kind": "gpu-bench", "mode": "cpu-smoke" if smoke else "gpu",
        "title": "CPU SMOKE RUN: tiny shapes, not GPU numbers" if smoke else "Llama-3.1-8B layer shapes on one GPU",
        "device": "cpu" if smoke else torch.cuda.get_device_name(device),
        "device_memory_gib": None if smoke else torch.cuda.get_device_properties(device).total_memory / GIB,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "transformers": transformers.__version__, "flash_attn": flash_attn_version(),
        "shape": asdict(run.shape), "seq": run.seq, "batch": run.batch, "ac": run.ac, "steps": run.steps,
        "warmup": run.warmup, "sections": args.sections, "layers": None,
    }
    if "gpucheck" in args.sections:
        r["gpucheck"] = gpucheck_section(device, args.gpucheck_seconds or (0.1 if smoke else 5.0))
    if "attention" in args.sections:
        r["attention"] = attention_section(run)
    if {"train", "compile", "checkpoint"} & set(args.sections):
        model_sections(args, run, r)
    r["caveats"] = caveats(r)
    print_report(r)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
