"""Processes for tests/model/test_nf4.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=N tests/model/nf4_worker.py OUT --spec JSON --precision bf16|fp32

Builds a QLoRA model as the Trainer does (meta → LoRA → NF4 base on meta → parallelize → materialize), then each rank
writes `rank-<r>.pt`: for every NF4 weight, its dequantized values and torchao's inner tensors (codes, block scales,
scaler-block factors, mean), plus the loss of one forward and backward on a fixed input and the names of the LoRA
weights that received a gradient.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from shardline.model.build import build_model
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.nf4 import is_nf4
from shardline.model.sharded_load import hf_name, materialize
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.parallel.mesh import distributed
from shardline.spec import ModelSpec, ParallelSpec
from shardline.worker import exit_without_teardown

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
"""torchao NF4Tensor's stored tensors (besides the code book)."""


def fixed_batch(vocab: int) -> torch.Tensor:
    return (torch.arange(64).view(2, 32) * 7919 + 11) % vocab


def run(out: Path, spec: ModelSpec, precision: str) -> None:
    with distributed() as ctx:
        model = apply_lora(build_model(spec, 0, {}, device="meta"), spec.lora)
        quantize_frozen_base(model, spec.lora, precision)
        parallel = ParallelSpec()
        parallelize(model, device_mesh(parallel, ctx.world, ctx.device.type), parallel, precision)
        materialize(model, spec, ctx.device)
        weights = {}
        for name, param in model.named_parameters():
            if is_nf4(param):
                weights[hf_name(name)] = {"dequantized": param.get_original_weight().cpu(),
                                          **{k: getattr(param, k).cpu() for k in INNER}}
        ids = fixed_batch(model.config.vocab_size).to(ctx.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        graded = sorted(n for n, p in model.named_parameters() if p.grad is not None)
        torch.save({"weights": weights, "loss": float(loss), "graded": graded, "world": ctx.world},
                   out / f"rank-{ctx.rank}.pt")
        torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--spec", required=True, help="ModelSpec as JSON")
    parser.add_argument("--precision", choices=["bf16", "fp32"], required=True)
    args = parser.parse_args()
    run(args.out, ModelSpec.model_validate_json(args.spec), args.precision)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
