"""Processes for tests/model/test_sharded_load.py and bench/memory.py (a script; pytest does not collect it).

    python tests/model/sharded_load_worker.py write DIR [--layers N] [--dtype bf16|fp32]
    torchrun --standalone --nproc-per-node=2 tests/model/sharded_load_worker.py load OUT --spec JSON
        [--parallel JSON ...] [--from-pretrained] [--dump-state] [--block-elements N]

`load` builds the model as the Trainer does (meta → LoRA → parallelize → materialize), or with
`--from-pretrained` as shardline did before (a full `from_pretrained` in every rank, then parallelize), once
per `--parallel` spec. Per rank it writes `rank-<r>-<i>.json` (RSS before loading, peak RSS after loading and
after one forward, load time); rank 0 also writes `logits-<i>.pt` (a fixed input) and, with `--dump-state`,
`state-<i>.pt` (the full parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from shardline.model import sharded_load
from shardline.model.build import build_model
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.parallel.mesh import distributed
from shardline.spec import ModelSpec, ParallelSpec
from shardline.worker import exit_without_teardown


def write_checkpoint(path: Path, *, hidden: int = 2048, intermediate: int = 5632, layers: int = 18, heads: int = 16,
                     vocab: int = 32000, dtype: str = "bf16", layers_per_file: int = 4) -> int:
    """A random Llama checkpoint as `save_pretrained` lays it out (config.json, sharded safetensors + index),
    written one file at a time without building the model; returns the number of parameters."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False)
    config.save_pretrained(path)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    groups: list[list[str]] = [[k for k in shapes if ".layers." not in k]]
    for first in range(0, layers, layers_per_file):
        group = range(first, min(first + layers_per_file, layers))
        groups.append([k for k in shapes if any(k.startswith(f"model.layers.{i}.") for i in group)])
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for n, keys in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k in keys:
            t = torch.randn(shapes[k], generator=generator) * 0.02 + (1.0 if k.endswith("norm.weight") else 0.0)
            tensors[k] = t.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
            total += t.numel() * tensors[k].element_size()
            weight_map[k] = name
        save_file(tensors, path / name, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(s.numel() for s in shapes.values())


def fixed_input(vocab: int) -> torch.Tensor:
    return (torch.arange(32).view(1, 32) * 7919 + 11) % vocab


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(out: Path, spec: ModelSpec, parallels: list[ParallelSpec], from_pretrained: bool, dump_state: bool) -> None:
    with distributed() as ctx:
        for i, parallel in enumerate(parallels):
            start, before = time.perf_counter(), rss_bytes()
            if from_pretrained:
                model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
            else:
                model = build_model(spec, 0, {}, device="meta")
                if spec.lora.enabled:
                    from shardline.model.lora import apply_lora

                    model = apply_lora(model, spec.lora)
            parallelize(model, device_mesh(parallel, ctx.world, ctx.device.type), parallel, "fp32")
            if not from_pretrained:
                sharded_load.materialize(model, spec, ctx.device)
            torch.distributed.barrier()
            report = {"rank": ctx.rank, "world": ctx.world, "load_s": time.perf_counter() - start,
                      "rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes()}
            state = {n: p.full_tensor().cpu() for n, p in model.named_parameters()} if dump_state else None
            with torch.no_grad():
                logits = model(input_ids=fixed_input(model.config.vocab_size).to(ctx.device)).logits.cpu()
            report["peak_rss_after_forward_bytes"] = peak_rss_bytes()
            if ctx.is_main:
                torch.save(logits, out / f"logits-{i}.pt")
                if state is not None:
                    torch.save(state, out / f"state-{i}.pt")
            (out / f"rank-{ctx.rank}-{i}.json").write_text(json.dumps(report))
            del model, state


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--layers", type=int, default=18)
    w.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ld = sub.add_parser("load")
    ld.add_argument("out", type=Path)
    ld.add_argument("--spec", required=True, help="ModelSpec as JSON")
    ld.add_argument("--parallel", action="append", default=[], help="ParallelSpec as JSON (repeatable)")
    ld.add_argument("--from-pretrained", action="store_true")
    ld.add_argument("--dump-state", action="store_true")
    ld.add_argument("--block-elements", type=int, default=None)
    args = parser.parse_args()
    if args.command == "write":
        args.dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"params": write_checkpoint(args.dir, layers=args.layers, dtype=args.dtype)}))
        return
    if args.block_elements:
        sharded_load.INIT_BLOCK_ELEMENTS = args.block_elements
    parallels = [ParallelSpec.model_validate_json(p) for p in args.parallel] or [ParallelSpec()]
    load(args.out, ModelSpec.model_validate_json(args.spec), parallels, args.from_pretrained, args.dump_state)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
