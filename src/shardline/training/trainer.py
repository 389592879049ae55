"""The training loop: one readable class that owns model, optimizer, data cursor, metrics and checkpoints.

The objective (`training.objectives`, chosen by `train.objective`) turns a step's batches into a loss: each
micro-batch's share of the step's global loss (next-token loss: its token-loss sum over the global count of
loss-bearing tokens, all-reduced before the first backward). FSDP averages gradients over its ranks, so each rank
scales its share by their number to undo that mean; the loop never asks which objective it runs.
Gradients are reduce-scattered after every micro-batch: keeping unsharded gradients across
accumulation would cost a full fp32 model copy per device, which large models cannot afford.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch.profiler import record_function

from shardline.checkpointing.manager import Checkpointer, CheckpointStore, checkpoint_spec, resume_source
from shardline.checkpointing.state import apply_training_state, training_state
from shardline.clock import Laps
from shardline.data.loader import StepSampler
from shardline.data.prepare import PreparedData
from shardline.data.tokenizer import special_ids
from shardline.errors import ShardlineError, SpecError
from shardline.failures import PHASES
from shardline.goodput import Goodput, compute_goodput, goodput_fields
from shardline.jsonl import JsonlTail
from shardline.model.build import build_model, causal_lm
from shardline.model.document_attention import LENGTH_BUCKET, takes_varlen, uses_dense_mask, whole_rows
from shardline.model.families import family_of, layer_windows
from shardline.model.float8 import float8_line
from shardline.model.flops import (
    FORMULA,
    FlopsModel,
    StepWork,
    count_params,
    flops_per_token,
    probe_cpu_peak_tflops,
    probe_matmul_tflops,
    table_peak_tflops,
)
from shardline.model.forced_routing import balanced_routing_forced, force_balanced_routing
from shardline.model.local_cache import staged_model_spec
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.moe import ExpertLoad, limit_expert_capacity, set_z_loss_coefficient
from shardline.model.router_bias import check_router_bias, router_bias
from shardline.model.sharded_load import materialize
from shardline.parallel.context import check_context_parallel
from shardline.parallel.expert import expert_parallel_layers
from shardline.parallel.fsdp import block_wrapping, data_parallel_rank, device_mesh, parallelize
from shardline.parallel.mesh import DistContext
from shardline.parallel.tensor import check_tensor_parallel, split_weights, splits_vocabulary
from shardline.planning.cpu_runtime import resident_bytes
from shardline.planning.memory import MemoryPlan, plan_memory
from shardline.precision import choose_precision, cuda_native_bf16, emulated_bf16_warning
from shardline.procfs import process_age, process_start_epoch
from shardline.resilience.faults import maybe_fail
from shardline.resilience.signals import EvaluationStopped, Preempted, StopRequest
from shardline.resilience.stragglers import own_step_seconds, straggler_fields, with_rank_slot
from shardline.rundir import checkpoint_location, read_manifest
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml
from shardline.spec.resume_policy import check_resume
from shardline.tasks import get_task
from shardline.training import objectives
from shardline.training.evaluate import generation_eval, sample_generations
from shardline.training.heap import HeapTrimmer
from shardline.training.loss import takes_chunked_loss
from shardline.training.metrics import MetricsWriter, TrainRecord, peak_memory_bytes
from shardline.training.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_factor
from shardline.training.profiling import StepProfiler

log = logging.getLogger("shardline")
T = TypeVar("T")
WARMUP_STEPS_EXCLUDED = 3  # first steps (allocator, compile) are left out of the mean throughput


class Trainer:
    def __init__(self, spec: JobSpec, ctx: DistContext, data: PreparedData, run_dir: Path,
                 console: Console, stop: StopRequest | None = None, prepare_s: float = 0.0,
                 startup: Laps | None = None) -> None:
        accelerator = ctx.device.type != "cpu"
        self.precision = choose_precision(spec.train.precision, accelerator,
                                          native_bf16=ctx.device.type != "cuda" or cuda_native_bf16())
        self.precision_warning = emulated_bf16_warning(spec.train.precision, accelerator)
        self.chose_precision = spec.train.precision == "auto"
        if self.chose_precision:  # a cluster worker's spec: chosen here, on the device it trains on
            spec = spec.model_copy(deep=True)
            spec.train.precision = self.precision.precision
        self.spec, self.ctx, self.data, self.run_dir = spec, ctx, data, run_dir
        self.prepare_s = prepare_s
        """Seconds this worker group spent preparing or finding the prepared data (a goodput bucket)."""
        self._goodput_records: JsonlTail | None = None
        self.console = console
        self.phase = "setup"
        """What the run is doing now (`shardline.failures.PHASES`): a failure record names it."""
        self.tokenizer = data.tokenizer()
        self.task = get_task(spec.data.task)
        meta = data.meta
        special = special_ids(self.tokenizer, meta["pad_id"])
        self.dp_rank, self.dp_world = data_parallel_rank(ctx.rank, ctx.world, spec.parallel.ranks_per_row)
        # per data-parallel rank: tensor-parallel peers draw the same dropout masks on their replicated inputs
        torch.manual_seed(spec.train.seed + self.dp_rank)
        # the CPU plan's runtime: what this worker holds before its model (imports, process group, tokenizer, data)
        self.startup_rss = resident_bytes() if ctx.device.type == "cpu" else 0
        # where the start-up goes, from the process's creation: the worker's laps (imports, process group, run
        # directory, data) where it passes them, else one lap to here; then the model's parts
        self.startup = startup or Laps()
        if startup is None:
            self.startup.seconds["process start to trainer"] = round(process_age() or 0.0, 3)
        else:
            self.startup.lap("tokenizer")
        model_spec = staged_model_spec(spec.model, ctx.local_rank)
        model = build_model(model_spec, meta["vocab_size"], special, device="meta")
        if spec.model.lora.enabled:
            model = apply_lora(model, spec.model.lora)
        self.quantized_base = quantize_frozen_base(model, spec.model.lora, spec.train.precision)
        set_z_loss_coefficient(model.config, spec.train.router_z_loss_coef)  # the loss reads it there
        limit_expert_capacity(model, spec.train.expert_capacity_factor)  # before EP takes the forward
        check_router_bias(model.config, spec.train.router_bias_update_rate)
        self.params = count_params(model)
        self.startup.lap("model on meta")
        cfg = model.config
        self.family = family_of(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        width = cfg.num_attention_heads * head_dim
        # sdpa's packed rows: per-document buckets (spans rounded up) unless one varlen flash call takes them; Gemma
        # 2's soft-capped layers always take the buckets
        self.rounds_spans = spec.model.attn_implementation == "sdpa" and (
            getattr(cfg, "attn_logit_softcapping", None) is not None
            or not takes_varlen(ctx.device, torch.bfloat16 if spec.train.precision == "bf16" else torch.float32,
                                head_dim))
        windows = layer_windows(cfg)
        self.flops_per_token = flops_per_token(self.params, cfg.num_hidden_layers, width, spec.train.seq_len, windows)
        self.flops = FlopsModel(self.params, cfg.num_hidden_layers, width, _recompute_fraction(spec), windows)
        check_tensor_parallel(cfg, spec.parallel.tp)
        check_context_parallel(cfg, spec.parallel.cp)
        self.mesh = device_mesh(spec.parallel, ctx.world, ctx.device.type)
        self.cp_mesh = self.mesh["cp"] if spec.parallel.cp > 1 else None
        self.model = parallelize(model, self.mesh, spec.parallel, spec.train.precision, spec.train.float8)
        self.startup.lap("parallelize")
        materialize(self.model, model_spec, torch.device("cpu") if spec.parallel.offload else ctx.device)
        self.startup.lap("weights")
        # auxiliary-loss-free balancing (None: off): before ExpertLoad, whose hooks count the biased choice
        self.router_bias = router_bias(causal_lm(self.model), spec.train.router_bias_update_rate)
        if balanced_routing_forced():  # SHARDLINE_BALANCED_ROUTING=1: a benchmark's balanced mode (bench/moe_a3b.py)
            force_balanced_routing(causal_lm(self.model))
        self.expert_load = ExpertLoad(causal_lm(self.model))  # a mixture of experts: tokens per expert and layer
        self.rows = data.rows("train")
        run = objectives.Run(
            spec=spec, ctx=ctx, data=data, model=self.model, tokenizer=self.tokenizer, task=self.task, run_dir=run_dir,
            dp_rank=self.dp_rank, dp_world=self.dp_world, cp_mesh=self.cp_mesh,
            frozen_copy=lambda: self._frozen_copy(model_spec, meta["vocab_size"], special),
            say=self._say, event=self._event,
            after_validation_batch=lambda: self._after_validation_batch())  # late-bound: a drill may replace it
        self.objective = objectives.build(run)  # before the optimizer: a frozen reference is materialised here
        if self.cp_mesh is not None and not self.objective.supports_context_parallel:
            raise SpecError("parallel.cp", f"is {spec.parallel.cp}, but train.objective={spec.train.objective} "
                            "sums each sequence on the rank that holds its whole row", "use parallel.cp=1")
        self.startup.lap("objective")
        self.optimizer = build_optimizer(self.model, spec.train, ctx.device)
        self.scheduler = build_scheduler(self.optimizer, spec.train)
        self.startup.lap("optimizer")
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl", console) if ctx.is_main else None
        self.checkpointer = Checkpointer(spec.checkpoint, checkpoint_location(spec, run_dir),
                                         on_gpu=ctx.device.type == "cuda")
        self.stop = stop or StopRequest()
        self.step = 0
        self.consumed_tokens = 0
        self.checkpoint_stalls: list[float] = []
        self.last_blocking_save_s = 0.0
        self.sample_trace = run_dir / "logs" / f"samples-rank-{ctx.rank}.jsonl"
        self.sample_trace.parent.mkdir(parents=True, exist_ok=True)
        self.peak_tflops, self.peak_source = self._peak_tflops()
        self.profiler = StepProfiler(spec.observe.profile_steps, run_dir, ctx.rank, ctx.device)

    # ---- setup ---------------------------------------------------------------------------------
    @property
    def sampler(self) -> StepSampler:
        """What each step draws (the objective's: training rows, or prompts)."""
        return self.objective.sampler

    def _frozen_copy(self, model_spec, vocab_size: int, special) -> torch.nn.Module:
        """A frozen copy of the starting weights, sharded and placed like the policy (a reference policy's)."""
        spec = self.spec
        reference = build_model(model_spec, vocab_size, special, device="meta").requires_grad_(False)
        limit_expert_capacity(reference, spec.train.expert_capacity_factor)  # the policy's function
        reference = parallelize(reference, self.mesh, spec.parallel, spec.train.precision)
        materialize(reference, model_spec, torch.device("cpu") if spec.parallel.offload else self.ctx.device)
        return reference.eval()

    def _peak_tflops(self) -> tuple[float, str]:
        t, device = self.spec.train, self.ctx.device
        dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        if t.peak_tflops is not None:
            return t.peak_tflops, "train.peak_tflops"
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak = table_peak_tflops(name, dtype)
            if peak is not None:
                return peak, f"table: {name} dense {t.precision}"
        # No table entry (CPU, unknown GPU): measure, all ranks at once as they will run.
        dist.barrier()
        if device.type == "cpu":
            peak, by = probe_cpu_peak_tflops(dtype)
        else:
            peak, by = probe_matmul_tflops(dtype, device), str(dtype).removeprefix("torch.")
        measured = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(measured)
        threads = torch.get_num_threads()
        slower = f"; {t.precision} is slower than fp32 on this CPU" if by == "float32" and t.precision != "fp32" else ""
        return (float(measured) / self.ctx.world,
                f"probe: best {by} matmul, {threads} thread(s) per rank{slower}")

    def _event(self, **fields) -> None:
        if self.metrics:
            self.metrics.write("event", fields)

    def _say(self, message: str) -> None:
        log.info(message)
        if self.ctx.is_main:
            self.console.print(message, highlight=False)

    def _active_params(self) -> str:
        """A mixture's matmul weights one token runs through (what its FLOPs and MFU count); empty if dense."""
        p = self.params
        if not (p.experts_trainable or p.experts_frozen):
            return ""
        return (f"; {(p.active_trainable + p.active_frozen) / 1e6:.3f}M active per token: "
                f"{p.active_experts:.0%} of each layer's experts")

    def describe(self) -> None:
        p, t = self.params, self.spec.train
        self._say(
            f"model ({self.family.name}): {p.total / 1e6:.2f}M params ({p.trainable / 1e6:.3f}M trainable matmul, "
            f"{p.frozen / 1e6:.3f}M frozen, {p.embedding / 1e6:.3f}M embedding{self._active_params()}) · world "
            f"{self.ctx.world} ({self.ctx.device.type}) · grad accum {self.sampler.accum} · {t.precision}"
        )
        chunked = takes_chunked_loss(causal_lm(self.model).config, t.loss_chunk_tokens)
        if t.loss_chunk_tokens and not chunked:
            self._say(f"train.loss_chunk_tokens={t.loss_chunk_tokens} is not applied: {self.family.name}'s head is "
                      "not one shardline's chunked loss is tested with, so its loss comes from the whole logits")
        if self.spec.parallel.tp > 1:
            head = ("loss parallel over the vocabulary" if splits_vocabulary(self.model)
                    else "the output projection whole: it is the tied embedding")
            self._say(f"tensor parallel: {split_weights(self.model)} weights split over tp={self.spec.parallel.tp}, "
                      f"sequence parallel between them, {head}; FSDP over {self.dp_world} data-parallel ranks")
        if self.cp_mesh is not None:
            self._say(f"context parallel: each row's {self.spec.train.seq_len} tokens split over cp="
                      f"{self.spec.parallel.cp} ranks (load-balanced chunks; keys and values all-gathered per layer); "
                      f"FSDP over {self.dp_world} data-parallel × {self.spec.parallel.cp} context-parallel ranks")
        if self.chose_precision:  # a local launch said its choice when it created the run
            self._say(f"precision {t.precision}: {self.precision.reason}")
        if self.quantized_base is not None:
            self._say(self.quantized_base.describe())
        for line in self.objective.describe():
            self._say(line)
        if self.precision_warning:
            self._say(self.precision_warning)
        self._say(f"MFU (headline) counts model FLOPs = {FORMULA}; with full {t.seq_len}-token documents "
                  f"{self.flops_per_token / 1e6:.2f} MFLOP/token. HFU counts executed FLOPs: padding, the attention "
                  f"the kernel computes ({self.spec.model.attn_implementation}), activation-checkpoint recompute "
                  f"({self.flops.recompute_fraction:.0%} of blocks)")
        self._say(f"MFU peak = {self.peak_tflops:.3f} TFLOP/s per device ({self.peak_source})")
        if t.float8 != "none":
            self._say(float8_line(self.model, t.float8))
        stats = self.data.stats["splits"]["train"]
        self._say(f"data {self.data.version}: {stats['rows']} rows of {t.seq_len} tokens, "
                  f"{stats['kept']} examples, fill {100 * stats['fill']:.1f}%")
        data_sources = [{k: src[k] for k in ("name", "format", "weight", "train_examples", "tokens",
                                              "share_of_train_tokens")} for src in self.data.stats.get("sources", [])]
        if len(data_sources) > 1:
            self._say("sources: " + " · ".join(f"{s['name']} ({s['format']}) {s['tokens'].get('train', 0):,} train "
                                               f"tokens, {100 * s['share_of_train_tokens']:.1f}%"
                                               for s in data_sources))
        self.memory_plan = _memory_plan(self.spec, self.startup_rss)
        self.planned_peak = self.memory_plan.metric_bytes if self.memory_plan else None
        if self.memory_plan:
            self._say(f"memory plan: peak {self.memory_plan.metric_bytes / 2**30:.2f} GiB per device "
                      f"({self.memory_plan.terms()}; shardline plan)")
        self.startup.lap("rest of setup")
        self._say(f"start-up: {self.startup.line()}")
        self._event(event="setup", family=self.family.name, flops_per_token=self.flops_per_token, formula=FORMULA,
                    planned_peak_bytes=self.planned_peak, startup_rss_bytes=self.startup_rss,
                    peak_tflops=self.peak_tflops, peak_source=self.peak_source, params=vars(p),
                    world=self.ctx.world, mesh=dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)),
                    tensor_parallel_weights=split_weights(self.model),
                    expert_parallel_layers=expert_parallel_layers(self.model),
                    blocks=block_wrapping(self.model),
                    chunked_loss=chunked,
                    loss_parallel=splits_vocabulary(self.model), dataset_version=self.data.version,
                    data_sources=data_sources, process_start=process_start_epoch(), prepare_s=round(self.prepare_s, 3),
                    startup_s=self.startup.seconds)

    # ---- checkpoints ---------------------------------------------------------------------------
    def _counters(self) -> dict:
        counters = {"step": self.step, "consumed_rows": self.step * self.spec.train.global_batch_size,
                    "consumed_tokens": self.consumed_tokens, "scheduler": self.scheduler.state_dict()}
        return counters | self.objective.state() | self._router_state()  # the objective's own (a reference table)

    def _router_state(self) -> dict:
        """The routers' balancing biases where `train.router_bias_update_rate` keeps them (part of the model's
        routing: an evaluation restores them too)."""
        return {"router_bias": self.router_bias.bias} if self.router_bias is not None else {}

    def _checkpoint_files(self) -> dict[str, str]:
        meta = {"step": self.step, "world": self.ctx.world, "dataset_version": self.data.version,
                "consumed_rows": self.step * self.spec.train.global_batch_size,
                "base_model": self.spec.model.path or f"model.arch, model.init_seed={self.spec.model.init_seed}"}
        files = {"spec.yaml": spec_to_yaml(self.spec), "meta.json": json.dumps(meta, indent=2)}
        tok_dir = self.data.file("tokenizer")
        files |= {f"tokenizer/{p.name}": p.read_text() for p in tok_dir.iterdir() if p.is_file()}
        return files

    def save_checkpoint(self, blocking: bool = False) -> None:
        phase, self.phase = self.phase, "checkpoint"
        maybe_fail("checkpoint", self.ctx.rank, self.step)
        state = training_state(self.model, self.optimizer, self._counters(), self.ctx.rank)
        stall = self.checkpointer.save(self.step, state, self._checkpoint_files(), blocking=blocking)
        self.checkpoint_stalls.append(stall)
        if blocking:
            self.last_blocking_save_s = stall
        self._event(event="checkpoint", step=self.step, stall_s=round(stall, 4), blocking=blocking,
                    location=self.checkpointer.store.path(self.step))
        self._say(f"checkpoint step {self.step}: training stalled {stall:.2f}s "
                  f"({'written' if blocking or not self.checkpointer.use_async else 'writing in background'})")
        self._flush_checkpoint_events()
        self.record_goodput()
        self.phase = phase

    def record_goodput(self) -> Goodput | None:
        """Rank 0: the run's goodput so far (every attempt, from metrics.jsonl and the manifest) as a `goodput`
        event, which the Prometheus endpoint and trackers see; None on other ranks."""
        if not self.metrics:
            return None
        if self._goodput_records is None:  # read once, then only what was appended (long runs' files are big)
            self._goodput_records = JsonlTail(self.metrics.path, goodput_fields)
        found = compute_goodput(self._goodput_records.read(), read_manifest(self.run_dir), now=time.time())
        if found is not None:
            current = found.attempts[-1]
            self._event(event="goodput", step=self.step, attempt=current.attempt, ratio=found.ratio,
                        wall_s=found.wall_s, buckets=found.buckets,
                        attempt_buckets={b: round(v, 3) for b, v in current.buckets.items()})
        return found

    def _flush_checkpoint_events(self) -> None:
        for event in self.checkpointer.events:
            self._event(**event)
        self.checkpointer.events.clear()

    def load_checkpoint(self, step: int, with_optimizer: bool = True, store: CheckpointStore | None = None) -> None:
        store = store or self.checkpointer.store
        saved = checkpoint_spec(store, step)
        if saved is None:
            raise ShardlineError(f"{store.path(step)}/spec.yaml", "is missing, so the checkpoint's model and data "
                                 "cannot be checked against this run", "resume from a checkpoint shardline "
                                 "committed (it writes spec.yaml before COMMITTED), or start a new run")
        check_resume(saved, self.spec)
        started = time.perf_counter()
        optimizer = self.optimizer if with_optimizer else None
        state = training_state(self.model, optimizer, self._counters(), self.ctx.rank)
        if not with_optimizer and (kept := self.objective.state() | self._router_state()):  # an evaluation scores
            # against its reference, and routes by the trained biases
            state["train"] = kept
        state = self.checkpointer.load(step, state, store, ranks_per_row=self.spec.parallel.ranks_per_row)
        rng = apply_training_state(self.model, optimizer, state, self.ctx.rank)
        if self.router_bias is not None:
            self.router_bias.bias.copy_(state["train"]["router_bias"])
        if with_optimizer:
            counters = state["train"]
            self.scheduler.load_state_dict(counters["scheduler"])
            self.step, self.consumed_tokens = int(counters["step"]), int(counters["consumed_tokens"])
            # the optimizer's saved learning rate is the old schedule's; a run extended or given a new lr
            # (checkpoint.allow_spec_change) takes its next step at this spec's schedule
            rate = self.spec.train.lr * lr_factor(self.step, self.spec.train)
            for group in self.optimizer.param_groups:
                group["lr"] = rate
            self.scheduler.base_lrs = [self.spec.train.lr] * len(self.optimizer.param_groups)
        else:
            self.step = step
        # an evaluation of a finished run loads weights only: not a resume of training (the report, goodput and
        # Prometheus count resumes)
        self._event(event="resume" if with_optimizer else "evaluation_restore", step=step,
                    location=store.path(step), rng_restored=rng, world=self.ctx.world,
                    restore_s=round(time.perf_counter() - started, 3))
        self._say(f"resumed from {store.path(step)} at step {step}"
                  + ("" if rng or not with_optimizer else " (new world size: fresh RNG streams)"))

    def newest_checkpoint(self) -> tuple[CheckpointStore, int] | None:
        """This run's newest intact checkpoint, else the one `checkpoint.resume_from` names, else None.

        Damaged checkpoints are skipped with a warning (their files no longer match the recorded checksums)."""
        ck = self.checkpointer
        store, step = ck.store, ck.newest_intact()
        if step is None and self.spec.checkpoint.resume_from:
            store, wanted = resume_source(self.spec.checkpoint.resume_from)
            committed = store.committed()
            if wanted is not None and wanted not in committed:
                raise SpecError("checkpoint.resume_from", f"{store.path(wanted)} is not a committed checkpoint",
                                f"choose a committed step ({', '.join(map(str, committed)) or 'none there'})")
            step = ck.newest_intact(store, [wanted] if wanted is not None else committed)
            if step is None:
                raise SpecError("checkpoint.resume_from", f"{store.location} has no intact committed checkpoint"
                                + (f" ({'; '.join(ck.warnings)})" if ck.warnings else ""),
                                "point it at a run directory or checkpoint location with a committed step")
        for warning in ck.warnings:
            self._event(event="checkpoint_damaged", message=warning)
            self._say(f"warning: {warning}")
        ck.warnings.clear()
        return None if step is None else (store, step)

    def maybe_resume(self) -> None:
        found = self.newest_checkpoint()
        if found is not None:
            store, step = found
            self.load_checkpoint(step, store=store)

    # ---- the loop ------------------------------------------------------------------------------
    def train_step(self) -> TrainRecord:
        ctx, start = self.ctx, time.perf_counter()
        maybe_fail("train_step", ctx.rank, self.step + 1)
        self.profiler.before_step(self.step + 1)
        objective = self.objective
        sampling_s = objective.sample(self.step)  # a sampling objective draws its step's samples (not data wait)
        with record_function("shardline.data"):
            drawn = objective.step_batches(self.step)
            batches = drawn.batches
            self._trace_samples(drawn.indices)
        data_wait = time.perf_counter() - start - sampling_s
        with record_function("shardline.sync"):
            counts = torch.tensor([sum(b.n_loss_tokens for b in batches), sum(b.n_tokens for b in batches),
                                   sum(b.input_ids.numel() for b in batches), sum(b.spans.pairs for b in batches),
                                   sum(b.spans.causal_pairs for b in batches),
                                   sum(self._executed_pairs(b) for b in batches),
                                   *([sum(b.spans.window_pairs(window, causal) for b in batches)
                                      for causal in (False, True)] if (window := self.flops.window) else [])],
                                  dtype=torch.float64).to(ctx.device, non_blocking=True)  # a blocking copy would sync
            arrived = time.perf_counter()
            dist.all_reduce(counts)
            if ctx.device.type == "cuda":  # NCCL returns before the peers arrive: wait here, so `waited` is it
                torch.cuda.synchronize(ctx.device)
            waited = time.perf_counter() - arrived  # for slower peers: not this rank's own step time
            counts /= self.spec.parallel.ranks_per_row  # tensor- and context-parallel peers counted the same rows
        objective.begin_step(counts[0].clamp(min=1))
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        fsdp_ranks = self.dp_world * self.spec.parallel.cp  # FSDP averages the gradients over these
        for k, batch in enumerate(batches):
            # its forward, in the contexts its backward needs too
            with objective.micro_batch(k, batch) as share, record_function("shardline.backward"):
                (share.loss * fsdp_ranks).backward()
            loss_sum += share.value
        objective_fields = objective.end_step()
        with record_function("shardline.clip"):
            max_norm = self.spec.train.max_grad_norm or float("inf")
            grad_norm = clip_grad_norm([p for p in self.model.parameters() if p.requires_grad], max_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step takes
        with record_function("shardline.optimizer"):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        with record_function("shardline.sync"):
            own = own_step_seconds(start, waited, ctx.device)
            reduced = with_rank_slot(loss_sum, own, ctx.rank, ctx.world)  # every rank's time rides along
            slots, reduced = len(reduced), torch.cat([reduced, self.expert_load.take().to(reduced)])  # MoE load
            dist.all_reduce(reduced)
            if self.router_bias is not None:  # the next step's choice from this step's load, on the device
                self.router_bias.update(reduced[slots:slots + self.router_bias.bias.numel()])
            # the step's one read of device data (on a GPU it waits for the step and the all-reduce): the loss sum,
            # every rank's time, the counts and the gradient norm in one copy to the host
            host = torch.cat([reduced, counts, grad_norm.reshape(1).to(reduced)]).to("cpu", copy=True).tolist()
            step_sum, rank_seconds, load = host[0], host[1:slots], host[slots:len(reduced)]
            counted, norm = host[len(reduced):-1], host[-1]
            # every micro-batch's share of the global loss, summed: tensor-parallel peers computed the same shares,
            # context-parallel peers a part each
            loss = step_sum / self.spec.parallel.tp
            stragglers = straggler_fields(rank_seconds)
        if table := self.profiler.after_step(self.step + 1):
            self._say(f"profile of rank {ctx.rank}: {table} (Chrome trace beside it)")
        step_time = time.perf_counter() - start
        self.step += 1
        tokens_total = int(counted[1])
        self.consumed_tokens += tokens_total
        per_device = tokens_total / step_time / ctx.world
        work = StepWork(*(int(c) for c in counted[1:]))
        per_device_peak = step_time * ctx.world * self.peak_tflops * 1e12
        tflops = self.flops.model(work) / step_time / ctx.world / 1e12
        return TrainRecord(
            step=self.step, loss=loss, lr=lr, grad_norm=norm, tokens=int(counted[0]),
            tokens_total=tokens_total, step_time_s=step_time, data_wait_s=data_wait,
            tokens_per_s_per_device=per_device, loss_tokens_per_s_per_device=int(counted[0]) / step_time / ctx.world,
            tflops_per_device=tflops, mfu=tflops / self.peak_tflops,
            mfu_causal=self.flops.model(work, causal=True) / per_device_peak,
            hfu=self.flops.hardware(work) / per_device_peak, mem_peak_bytes=peak_memory_bytes(ctx.device),
            epoch=self.sampler.epoch_of(self._sampler_steps(self.step)), **self.expert_load.fields(load),
            **stragglers, **objective_fields,
        )

    def _sampler_steps(self, steps: int) -> int:
        """The sampler's steps begun in `steps` training steps: an objective that trains each draw for several steps
        draws once per sampling."""
        return -(-steps // self.objective.steps_per_sampling)

    def _at_sampling_boundary(self) -> bool:
        """Whether a checkpoint of the current step resumes exactly: the next step draws afresh (samples drawn for
        several steps, and their sampling-time log-probabilities, are not checkpointed)."""
        return self.step % self.objective.steps_per_sampling == 0

    def _executed_pairs(self, batch) -> int:
        """Query-key pairs the attention kernel computes: per document and causal (shardline's `sdpa`, its buckets
        rounding each span up to 32 tokens, its varlen flash call on a GPU in bf16 not; `flash_attention_2`), or
        all T² of each row (`eager`, and `sdpa` on short rows on a GPU: the dense block
        mask; context parallel off a GPU: each rank's T/cp queries against all T keys). Context parallel on a GPU
        counts the causal pairs of the documents: flex attention skips fully masked blocks and computes the rest,
        so this is a slight undercount there."""
        rows, seq = batch.input_ids.shape
        if self.cp_mesh is not None:
            return rows * seq * seq if self.ctx.device.type != "cuda" else batch.spans.executed_causal_pairs()
        window = self.flops.window
        if self.spec.model.attn_implementation == "sdpa" and whole_rows(batch.spans, rows) and not (
                window and window < seq):
            return batch.spans.executed_causal_pairs()  # one causal call per row (document_attention.WHOLE_ROWS)
        if self.spec.model.attn_implementation == "eager" or (
                self.spec.model.attn_implementation == "sdpa" and uses_dense_mask(seq, self.ctx.device)):
            return rows * seq * seq
        if self.rounds_spans:
            return batch.spans.executed_causal_pairs(LENGTH_BUCKET)  # the buckets: spans rounded up
        return batch.spans.executed_causal_pairs()  # flash (varlen): each span as it is

    def _trace_samples(self, indices: list) -> None:
        """Which rows each rank trained on at each step: an audit trail for exact resume."""
        rows = [int(i) for index in indices for i in index]
        with self.sample_trace.open("a") as f:
            f.write(json.dumps({"step": self.step + 1, "rows": rows}) + "\n")

    def _agree(self, last_save: float) -> tuple[bool, bool]:
        """All ranks decide together whether to stop (a signal reached any rank) or to save on time."""
        minutes = self.spec.checkpoint.every_minutes
        due = minutes is not None and time.monotonic() - last_save >= 60 * minutes
        flags = torch.tensor([float(self.stop.requested), float(due)], device=self.ctx.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _stop_agreed(self) -> bool:
        """All ranks decide together whether a stop signal reached any of them (a collective: call on every rank)."""
        flag = torch.tensor([float(self.stop.requested)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0])

    def _preempt(self, phase: str = "training") -> NoReturn:
        """Checkpoint the current step synchronously unless it is committed already, record the grace used and the
        phase the stop interrupted, and stop."""
        self.checkpointer.wait()  # a background save in flight commits first (or fails loudly)
        saved, kept = self.step, f"checkpoint of step {self.step} committed"
        if not self._at_sampling_boundary():  # stopped inside a validation between two samplings
            latest = self.checkpointer.store.latest()
            saved = latest or 0
            kept = ("no checkpoint yet" if latest is None else f"checkpoint of step {latest} committed") + (
                f" (the last sampling step: steps {saved + 1}-{self.step} train again when the run resumes)")
        elif not self.checkpointer.store.is_committed(self.step):  # a committed step is not saved again
            self.save_checkpoint(blocking=True)
        self._flush_checkpoint_events()
        grace = time.monotonic() - self.stop.received_at if self.stop.received_at else None
        self._event(event="preempted", step=saved, phase=phase, signal=self.stop.name or "peer rank",
                    grace_used_s=round(grace, 3) if grace is not None else None)
        doing = {**PHASES, "sample_generations": "generating the sample answers"}.get(phase, phase)
        during = "" if phase == "training" else f" while {doing}"
        rest = ("; training is complete: `shardline train RUN_DIR` runs the evaluation that was cut short"
                if self.step >= self.spec.train.max_steps and phase != "training" else "")
        self._say(f"preempted by {self.stop.name or 'a signal on another rank'}{during}: {kept}"
                  + (f", {grace:.1f}s after the signal" if grace is not None else "") + rest)
        raise Preempted(saved)

    def _stoppable(self, evaluation: Callable[[], T]) -> T:
        """Run a validation or generation; a stop the ranks agreed on inside it ends the attempt as a preemption."""
        try:
            return evaluation()
        except EvaluationStopped as e:
            self._preempt(e.phase)

    def _after_validation_batch(self) -> None:
        """Every rank, after each validation batch: a drill's fault point, then stop if a signal reached any rank."""
        maybe_fail("validation_batch", self.ctx.rank, self.step)
        if self._stop_agreed():
            raise EvaluationStopped("validation")

    def _after_generation_batch(self) -> None:
        """Every rank, after each generation batch (the SQL evaluation, sample generations): as validation's."""
        maybe_fail("generation_batch", self.ctx.rank, self.step)
        if self._stop_agreed():
            raise EvaluationStopped(self.phase if self.phase in ("sql_evaluation", "evaluation")
                                    else "sample_generations")

    def validate(self) -> float:
        """The objective's validation over every validation row (`objectives.base.Validation`), logged as an eval
        record."""
        phase, self.phase = self.phase, "validation"
        maybe_fail("validation", self.ctx.rank, self.step)
        started = time.perf_counter()
        found = self.objective.validate()
        if self.metrics:
            self.metrics.write("eval", {"step": self.step, "val_loss": found.loss, **found.fields,
                                        "seconds": round(time.perf_counter() - started, 3)})
        self._say(f"step {self.step}: {found.line}")
        self.phase = phase
        return found.loss

    def begin(self) -> None:
        """What a run does before its first step: what the objective needs to train and an evaluation does not,
        the resume, then the objective's start (at step 0: a reference computed with the starting weights) and,
        where the objective validates first, its step-0 validation."""
        self.objective.prepare()
        self.maybe_resume()
        self.objective.start(self.step)
        if self.objective.validates_first and self.step == 0:  # where the objective starts: the report's first point
            self._stoppable(self.validate)

    def fit(self) -> dict:
        t, ck = self.spec.train, self.spec.checkpoint
        self.describe()
        self.begin()
        self.phase = "training"
        records: list[TrainRecord] = []
        wall = time.perf_counter()
        last_save = time.monotonic()
        heap = HeapTrimmer(self.ctx.device)
        while self.step < t.max_steps:
            record = self.train_step()
            records.append(record)
            heap.after_step(record.step)
            if self.metrics:
                if record.step % t.log_every == 0 or record.step in (1, t.max_steps):
                    self.metrics.train(record, t.max_steps)
                else:
                    self.metrics.write("train", vars(record))
            self.checkpointer.poll()
            self._flush_checkpoint_events()
            stop, time_due = self._agree(last_save)
            resumable = self._at_sampling_boundary()  # else a stop or a time-based save waits for the next step
            if stop and resumable:
                self._preempt()
            if record.step % t.eval_every == 0 and record.step < t.max_steps:
                self._stoppable(self.validate)
            step_due = ck.every_steps and record.step % ck.every_steps == 0
            if (step_due or (time_due and resumable)) and record.step < t.max_steps:
                self.save_checkpoint()
                last_save = time.monotonic()
        wall = time.perf_counter() - wall
        val_loss = self._stoppable(self.validate)
        if self.checkpointer.store.latest() != self.step or self.checkpointer.pending:
            waited = time.perf_counter()
            self.checkpointer.wait()
            self._event(event="checkpoint_wait", step=self.step, stall_s=round(time.perf_counter() - waited, 4))
            if self.checkpointer.store.latest() != self.step:
                self.save_checkpoint(blocking=True)
        self._flush_checkpoint_events()
        if self._stop_agreed():  # the signal came during the final save: it is committed, the evaluation not begun
            self._preempt("checkpoint")
        summary = self.summarize(records, wall, val_loss)
        summary |= self._stoppable(self.evaluate_generation)
        if goodput := self.record_goodput():
            summary["goodput"] = {"ratio": goodput.ratio, "wall_s": goodput.wall_s, **goodput.buckets,
                                  "attempts": len(goodput.attempts)}
            self._say(goodput.line())
        if self.metrics and self.metrics.cost is not None:  # after the generation eval: its device time counts
            summary |= self.metrics.cost.summary()
            if line := self.metrics.cost.summary_line():
                self._say(line)
        if self.ctx.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def summarize(self, records: list[TrainRecord], wall: float, val_loss: float) -> dict:
        steady = records[WARMUP_STEPS_EXCLUDED:] or records
        summary = {
            "steps": self.step, "wall_time_s": round(wall, 2), "val_loss": val_loss,
            "first_loss": records[0].loss if records else None, "final_loss": records[-1].loss if records else None,
            "mean_tokens_per_s_per_device": _mean(r.tokens_per_s_per_device for r in steady),
            "mean_tflops_per_device": _mean(r.tflops_per_device for r in steady),
            "mean_mfu": _mean(r.mfu for r in steady),
            "mean_mfu_causal": _mean(r.mfu_causal for r in steady), "mean_hfu": _mean(r.hfu for r in steady),
            "peak_tflops": self.peak_tflops, "peak_source": self.peak_source,
            "mem_peak_bytes": max((r.mem_peak_bytes for r in records), default=0),
            "mem_planned_bytes": self.planned_peak,
            "mem_planned_terms": _planned_terms(self.memory_plan),
            "dataset_version": self.data.version,
            "checkpoint_stall_s_total": round(sum(self.checkpoint_stalls), 3),
            # A stop signal waits for the current step to end (and the steps up to the next sampling), then for
            # one blocking save.
            "grace_needed_s": round(max((r.step_time_s for r in records), default=0) * self.objective.steps_per_sampling
                                    + self.last_blocking_save_s, 2),
        }
        if records:
            trend = self.objective.trend(records[0], records[-1])
            self._say(
                f"done: {len(records)} steps in {wall:.1f}s · {trend} · val {val_loss:.3f} · "
                f"{summary['mean_tokens_per_s_per_device']:,.0f} tok/s/device · "
                f"MFU {100 * summary['mean_mfu']:.1f}% (causal half only: {100 * summary['mean_mfu_causal']:.1f}%; "
                f"HFU {100 * summary['mean_hfu']:.1f}%; steps > {WARMUP_STEPS_EXCLUDED})"
            )
            if self.memory_plan and (measured := summary["mem_peak_bytes"]):
                self._say(f"peak memory {measured / 2**30:.2f} GiB measured vs {self.planned_peak / 2**30:.2f} GiB "
                          f"planned ({100 * (self.planned_peak / measured - 1):+.0f}%: {self.memory_plan.terms()})")
            self._say(f"checkpoints stalled training {summary['checkpoint_stall_s_total']:.2f}s in total; "
                      f"preemption grace needed ≈ {summary['grace_needed_s']:.1f}s (slowest step"
                      + (f" × {mu} ({self.objective.sampling_field})" if (mu := self.objective.steps_per_sampling) > 1
                         else "")
                      + " + blocking save; "
                      f"launch.grace_seconds={self.spec.launch.grace_seconds})")
        return summary

    def evaluate_generation(self) -> dict:
        """Greedy generations for the first `train.eval_examples` test examples, scored by the task's metric
        (`data.task`); the scores on rank 0, {} elsewhere and for a task without a generation metric."""
        if self.task.score is None:
            return self._sample_generations()
        n = min(self.spec.train.eval_examples, len(self.data.examples("test")))
        if n == 0:
            return {}
        examples = self.data.examples("test")[:n]
        self.phase = "sql_evaluation" if self.phase != "evaluation" else self.phase
        maybe_fail("sql_evaluation", self.ctx.rank, self.step)
        start = time.perf_counter()
        result = generation_eval(self.model, self.tokenizer, examples, self.spec, self.task,
                                 self.data.meta["pad_id"], self.ctx.device,
                                 ranks_per_row=self.spec.parallel.ranks_per_row,
                                 after_batch=self._after_generation_batch, stop_requested=lambda: self.stop.requested)
        if result is None:
            return {}
        seconds = time.perf_counter() - start
        (self.run_dir / "eval.json").write_text(json.dumps(
            {"task": self.task.name, **result.scores, "n": result.n, "metric": result.metric,
             "samples": result.samples}, indent=2))
        self.metrics.write("eval", {"step": self.step, **result.scores, "n": result.n, "seconds": round(seconds, 3)})
        for s in result.samples[:3]:
            mark = {True: "[green]✓[/] ", False: "[red]✗[/] "}.get(s.get("match"), "")
            self.console.print(f"{mark}{s['question']}\n   gold: {s['gold']}\n   pred: {s['pred']}")
        self._say(f"{result.headline} ({seconds:.0f}s)")
        return {**result.scores, "eval_n": result.n}

    def _sample_generations(self) -> dict:
        """A few validation examples answered by the model beside their references (sources taken in turn), for
        data no metric scores: written to eval.json for the report."""
        k = self.spec.train.sample_generations
        if k == 0:
            return {}
        by_source: dict[str, list] = {}
        for ex in self.data.examples("validation"):
            if ex.kind != "text":  # raw text asks nothing
                by_source.setdefault(ex.source, []).append(ex)
        picked = [ex for group in zip_longest(*by_source.values()) for ex in group if ex is not None][:k]
        start = time.perf_counter()
        samples = sample_generations(self.model, self.tokenizer, picked, self.spec, self.task,
                                     self.data.meta["pad_id"], self.ctx.device, self.spec.parallel.ranks_per_row,
                                     after_batch=self._after_generation_batch,
                                     stop_requested=lambda: self.stop.requested)
        if not samples:
            return {}
        (self.run_dir / "eval.json").write_text(json.dumps(
            {"task": self.task.name, "n": len(samples), "metric": "none: the model's answers beside the references",
             "samples": samples}, indent=2))
        for s in samples[:3]:
            self.console.print(f"{s['question'][-200:]}\n   reference: {s['gold']}\n   model: {s['pred']}",
                               markup=False, highlight=False)
        self._say(f"{len(samples)} sample generations beside their references in eval.json "
                  f"({time.perf_counter() - start:.0f}s)")
        return {}


def _recompute_fraction(spec: JobSpec) -> float:
    """Share of blocks whose forward runs twice: full checkpointing of every k-th block. Selective
    checkpointing keeps the matmul and attention outputs, so it recomputes no matmul FLOPs."""
    if spec.parallel.activation_checkpointing != "full":
        return 0.0
    return 1.0 / spec.parallel.activation_checkpointing_every


def _memory_plan(spec: JobSpec, startup_rss: int) -> MemoryPlan | None:
    """The planner's per-device peak for this run on this device (a CPU run's runtime: `startup_rss`, measured), or
    None where the model shape is unknown offline."""
    try:
        return plan_memory(spec, runtime_bytes=startup_rss or None)
    except SpecError:
        return None


def _planned_terms(plan: MemoryPlan | None) -> dict | None:
    """The planned peak's parts for summary.json: tensors, allocator retention, steady-state growth, runtime."""
    if plan is None:
        return None
    return {"tensors": plan.tensor_bytes, "allocator": plan.allocator, "growth": plan.growth,
            "growth_basis": plan.growth_basis, "runtime": plan.runtime, "runtime_source": plan.runtime_source,
            "runtime_in_metric": plan.metric_bytes == plan.total_bytes}


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


