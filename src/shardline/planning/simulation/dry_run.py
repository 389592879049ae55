"""`shardline plan --dry-run`: the spec's real model, sharded by shardline's own code at the spec's world size, as
one rank of a fake process group on this CPU; then, unless `step=False`, one training step on fake tensors (and
GRPO's sampling at its peak); a mixture of experts under expert parallel with balanced routing
(`simulation.balanced_routing`).

Its own process (`python -m shardline.planning.simulation.dry_run SPEC.yaml …`, started by
`shardline.api.dry_run`): the fake process group is process-global. Prints progress on stderr and the result as
JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from shardline.errors import EXIT_BAD_INPUT, ShardlineError, SpecError
from shardline.model.build import causal_lm, hf_attention, llama_config, model_config
from shardline.model.flops import FlopsModel, StepWork, count_params
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.nf4 import nf4_parameters, nf4_stored_bytes
from shardline.parallel.fsdp import device_mesh, fsdp_param_groups, parallelize
from shardline.planning.devices import Device, planned_precision
from shardline.planning.memory import (
    COMPONENTS,
    model_shape,
    nf4_block_weights,
    param_budget,
    plan_memory,
    shape_config,
    tensor_parallel_shape,
)
from shardline.planning.moe import gathered_block
from shardline.planning.simulation.balanced_routing import balanced_routing
from shardline.planning.simulation.fake_world import fake_process_group
from shardline.planning.simulation.step_memory import Sampling, simulate_step
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec

KERNELS = ("CPU kernels: per-document SDPA (CPU flash) for sdpa and flash_attention_2, CPU dropout, "
           "unfused (foreach) AdamW")


@dataclass(frozen=True)
class Sharding:
    """Exact per-rank bytes of the sharded state, FSDP's padding included, and what the shards say."""

    params: int
    grads: int
    optimizer: int
    padding: int  # bytes of `params` that are padding
    gather_buffers: int  # compute-dtype all-gather outputs: the root + the two largest blocks
    groups: int  # FSDP parameter groups (blocks + root)
    notes: list[str]  # parameters with fewer rows than shards (ranks holding only padding)


def simulation_config(spec: JobSpec) -> PretrainedConfig:
    """The model's HF config: `model.arch`, a local config.json, else the shape of a hub model the planner knows."""
    if spec.model.path is None or (Path(spec.model.path).expanduser() / "config.json").is_file():
        return model_config(spec.model, spec.model.arch.vocab_size, {}) if spec.model.path else \
            llama_config(spec.model, spec.model.arch.vocab_size, {})
    return shape_config(model_shape(spec.model))


def simulated_attention(name: str) -> str:
    """Eager stays eager; `flash_attention_2` (CUDA only) runs as shardline's per-document SDPA: both take the
    document spans, use native GQA and build no mask, so they save the same tensors."""
    return hf_attention("eager" if name == "eager" else "sdpa")


def build_sharded(spec: JobSpec, precision: str) -> nn.Module:
    """Meta build → LoRA → shardline's `parallelize` (float8 block linears with `train.float8`; compile off: nothing
    is compiled for a simulation)."""
    config = simulation_config(spec)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=simulated_attention(
            spec.model.attn_implementation), dtype=torch.float32)
    if spec.model.lora.enabled:
        model = apply_lora(model, spec.model.lora)
    quantize_frozen_base(model, spec.model.lora, precision)
    mesh = device_mesh(spec.parallel, spec.world_size, "cpu")
    return parallelize(model, mesh, spec.parallel.model_copy(update={"compile": False}), precision, spec.train.float8)


def sharding(model: nn.Module, compute_bytes: int) -> Sharding:
    params = grads = padding = groups = 0
    gathers: list[int] = []
    notes: list[str] = []
    names = {id(m): n for n, m in causal_lm(model).named_modules()}
    for _, group in fsdp_param_groups(model):
        groups += 1
        gathered = 0
        for fp in group.fsdp_params:
            padded, shards = fp.padded_sharded_param_size.numel(), group.mesh_info.shard_mesh_size
            real = fp.sharded_size.numel()
            held = fp.sharded_param.element_size()  # fp32 masters; a LoRA base frozen in the compute dtype
            params += held * padded
            padding += held * (padded - real)
            grads += 4 * padded if fp.sharded_param.requires_grad else 0
            gathered += compute_bytes * padded * shards
            rows = fp._orig_size[0]
            if rows < shards:
                where = f"{names[id(fp._module_info.module)]}.{fp._module_info.param_name}"
                notes.append(f"{where}: {rows} rows over {shards} shards "
                             f"({shards - rows} ranks hold only padding)")
        gathers.append(gathered)
    root, blocks = gathers[-1], sorted(gathers[:-1], reverse=True)
    nf4 = nf4_parameters(model)
    if nf4:
        notes.append(f"QLoRA: {len(nf4)} NF4 weights ({nf4_stored_bytes(model) / 2**30:.2f} GiB) held whole outside "
                     "FSDP on every rank, not in the rows above (in the step peak)")
    return Sharding(params, grads, 2 * grads, padding, root + sum(blocks[:2]), groups, notes)


def at_world(spec: JobSpec, world: int | None) -> JobSpec:
    """`spec` at `world` ranks (same nodes' size, micro-batch and accumulation): what `--world N` simulates."""
    if world is None or world == spec.world_size:
        return spec
    per_node = spec.parallel.nproc_per_node or 1
    if world % per_node:
        raise SpecError("--world", f"{world} is not a multiple of parallel.nproc_per_node ({per_node})",
                        f"use a multiple of {per_node}")
    data = spec.model_dump(mode="json")
    data["launch"]["nnodes"], data["launch"]["min_nnodes"] = world // per_node, None
    p = spec.parallel
    data["parallel"]["dp_shard"] = None if p.dp_shard is None else world // (p.dp_replicate * p.tp)
    data["train"]["global_batch_size"] = world // p.tp * spec.train.micro_batch_size * spec.grad_accum_steps
    return JobSpec.model_validate(data)


def _planned(spec: JobSpec, device: Device, compute_bytes: int) -> dict:
    """The planner's numbers beside the simulation's: its sharded state, and its peak without what a simulation
    cannot see (runtime, allocator retention)."""
    plan = plan_memory(spec, device)
    shape = tensor_parallel_shape(model_shape(spec.model), spec.parallel.tp)
    pb = param_budget(shape, spec.model.lora)
    nf4 = nf4_block_weights(shape, spec.model.lora)  # a QLoRA base's NF4 weights: outside FSDP, not in these rows
    shard = plan.dp_shard
    seen = sum(getattr(plan, f) for f in COMPONENTS if f not in ("allocator", "growth", "runtime"))
    training = {name: b for name, b in plan.moment_bytes.items() if name != "GRPO sampling"}
    return {"device": plan.device.name, "step_peak": max(training.values()),
            "sampling_peak": plan.moment_bytes.get("GRPO sampling"),
            "params": (4 * pb.trainable + compute_bytes * (pb.total - pb.trainable - pb.layers * sum(nf4))) / shard,
            "grads": 4 * pb.trainable / shard, "optimizer": 8 * pb.trainable / shard,
            "gather_buffers": compute_bytes * (pb.root + 2 * (gathered_block(shape, pb.block, spec.parallel.ep)
                                                              - sum(nf4))),
            "peak": seen, "phase": plan.phase, "unseen": plan.allocator + plan.growth + plan.runtime,
            "offloaded": plan.host_offload_bytes}


def _flops(model: nn.Module, spec: JobSpec, micro_batches: int) -> float:
    """The non-attention FLOPs `model/flops.py` gives for this rank's step (attention too where it is eager)."""
    t, p = spec.train, spec.parallel
    n = t.micro_batch_size * t.seq_len * micro_batches
    pairs = t.micro_batch_size * t.seq_len ** 2 * micro_batches if spec.model.attn_implementation == "eager" else 0
    recompute = 1.0 / p.activation_checkpointing_every if p.activation_checkpointing == "full" else 0.0
    config = model.config
    return FlopsModel(count_params(model), config.num_hidden_layers, config.hidden_size, recompute).hardware(
        StepWork(tokens=n, slots=n, pairs=pairs, causal_pairs=pairs, executed_pairs=pairs))


def dry_run(spec: JobSpec, device: Device, rank: int = 0, step: bool = True, progress=lambda _: None) -> dict:
    """The JSON-able result: exact shards, the simulated step (with `step`), and beside them the plan for `device`
    and the plan for the kernels the simulation runs (CPU: dropout noise, unfused AdamW)."""
    if spec.train.engine != "torch":
        raise SpecError("train.engine", f"{spec.train.engine} trains outside shardline's torch code, so there is "
                        "no model to simulate", "plan it without --dry-run (shardline plan SPEC)")
    if spec.parallel.cp > 1:
        raise SpecError("parallel.cp", f"is {spec.parallel.cp}: the dry run does not split rows over a "
                        "context-parallel group (its step would count whole rows per rank)",
                        "plan it without --dry-run (shardline plan SPEC models cp)")
    precision = planned_precision(spec.train.precision, device)
    c = 2 if precision == "bf16" else 4
    # The plans beside the simulation are of what it runs: eager blocks (`shardline plan` counts a compiled
    # block's smaller saved activations)
    eager = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"compile": False})})
    result: dict = {"world": spec.world_size, "rank": rank, "dp_replicate": spec.parallel.dp_replicate,
                    "dp_shard": spec.parallel.dp_shard or spec.world_size // (spec.parallel.dp_replicate
                                                                              * spec.parallel.tp),
                    "tp": spec.parallel.tp, "ep": spec.parallel.ep,
                    "precision": precision, "torch": torch.__version__, "kernels": KERNELS,
                    "planned": _planned(eager, device, c),
                    "planned_cpu_kernels": _planned(eager, Device("CPU kernels", device.memory_bytes, "cpu"), c)}
    start = time.perf_counter()
    with fake_process_group(spec.world_size, rank):
        progress(f"building and sharding on the meta device (world {spec.world_size}, rank {rank})")
        model = build_sharded(spec, precision)
        result["sharding"] = asdict(sharding(model, c))
        if spec.train.float8 != "none":  # torchao's Float8Linear, as `parallelize` converted the block linears
            result["float8_linears"] = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
        result["sharding_seconds"] = round(time.perf_counter() - start, 2)
        if step:
            micro_batches = 2 if spec.grad_accum_steps > 1 else 1
            t = spec.train
            sampling = Sampling(t.global_batch_size // spec.world_size, t.seq_len,
                                torch.bfloat16 if precision == "bf16" else torch.float32)
            with balanced_routing():  # expert parallel: the real dispatch, of balanced routing
                mem, sampled = simulate_step(model, t, model.config.vocab_size, micro_batches, progress,
                                             sampling if t.objective == "grpo" else None)
            if spec.parallel.ep > 1:
                result["routing"] = "balanced (every expert receives k·N/E of a rank's N tokens' routed copies)"
            result["step"] = asdict(mem) | {"micro_batches": micro_batches,
                                            "flops_expected": _flops(model, spec, micro_batches)}
            if sampled is not None:  # the planner's sampling moment: this rank's completions at seq_len
                result["sampling"] = asdict(sampled) | {"sequences": sampling.sequences, "tokens": sampling.tokens}
            result["step_seconds"] = round(time.perf_counter() - start - result["sharding_seconds"], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardline.planning.simulation.dry_run")
    p.add_argument("spec", help="resolved spec YAML")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int)
    p.add_argument("--device", nargs=3, metavar=("NAME", "BYTES", "KIND"), required=True,
                   help="the device the plan beside the simulation is for")
    p.add_argument("--no-step", action="store_true")
    args = p.parse_args(argv)
    try:
        spec = at_world(load_spec(args.spec), args.world)
        device = Device(args.device[0], int(args.device[1]), args.device[2])
        result = dry_run(spec, device, args.rank, not args.no_step, lambda line: print(line, file=sys.stderr,
                                                                                          flush=True))
    except ShardlineError as e:
        print(json.dumps({"error": {"type": type(e).__name__, "where": e.where, "problem": e.problem, "fix": e.fix}}))
        return EXIT_BAD_INPUT
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
