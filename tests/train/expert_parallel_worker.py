"""torchrun worker for tests/train/test_expert_parallel.py (a script; pytest does not collect it): every expert-parallel
case of one world size in one start (a start, the imports of torch and transformers, is most of a small case's time).

    torchrun --standalone --nproc-per-node=N tests/train/expert_parallel_worker.py JOBS.json

JOBS.json lists jobs, done in order:
- `{"oracle": ep, "out": path, "broken": what, "aux": bool, "z": bool, "lora": bool, "replicate": n, "family": name}`:
  a tiny Qwen3-MoE (or the `family` of FAMILIES: Qwen2-MoE with its gated shared expert, Mixtral; transformers' own
  model code and config class, fp32, init std 0.2) sharded by shardline's `parallelize` with `parallel.ep=ep` and
  `parallel.dp_replicate=n` (FSDP or HSDP over the rest) takes one forward and backward of a global batch split over
  the ranks; rank 0 writes its summed loss and every full gradient's largest difference from transformers' unsharded
  model on the same weights and whole batch (its
  loss with labels: with `aux`, the router aux loss on, coefficient 0.05, which shardline computes from expert counts
  all-reduced over the ranks; with `z`, the router z-loss too, coefficient 0.01, against its hand derivation from
  transformers' router logits; with `lora`, LoRA adapters per expert (drawn nonzero) on shardline's experts
  against transformers' model with them merged into its weights, the adapters' gradients derived from the merged
  weights' gradients). `broken: dispatch` sends every token copy to the next EP rank's experts (a dispatch
  permutation off by one rank), `broken: combine` sums the experts' outputs without their routing weights: the
  oracle must catch both;
- `{"spec": path, "steps": n, "out": path, "save": bool, "save_at": k}`: the Trainer of a created run resumes if its
  spec says so, trains n steps (rank 0 writes their losses, expert loads and dropped copies), saves a checkpoint
  after its k-th step if `save_at` and after the last if `save`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from shardline.data.prepare import prepare
from shardline.model import moe
from shardline.model.expert_lora import add_expert_adapters
from shardline.parallel import expert
from shardline.parallel.fsdp import block_wrapping, device_mesh, parallelize
from shardline.parallel.mesh import distributed
from shardline.rundir import run_path
from shardline.spec import JobSpec, ParallelSpec
from shardline.training.trainer import Trainer
from shardline.worker import exit_without_teardown

EXPERTS, TOP_K, ROWS, SEQ, AUX_COEF, Z_COEF, LORA_R = 8, 2, 4, 24, 0.05, 0.01, 4
CONFIG = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.2, num_experts_per_tok=TOP_K)
FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32, intermediate_size=64)),
    # its shared expert (with a sigmoid gate) runs on every rank's own tokens, beside the dispatched experts
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32, intermediate_size=64,
                                       shared_expert_intermediate_size=48)),
    "mixtral": (MixtralConfig, dict(num_local_experts=EXPERTS, intermediate_size=32)),
}


def tiny_moe(aux: bool, family: str = "qwen3_moe") -> torch.nn.Module:
    torch.manual_seed(0)
    cls, extra = FAMILIES[family]
    config = cls(**CONFIG, **extra, output_router_logits=aux, router_aux_loss_coef=AUX_COEF)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def loss_sum(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """shardline's summed training loss of `ids`: cross-entropy plus, with the aux loss on, this rank's share of it
    (`moe.aux_loss_term`, from expert counts all-reduced over the ranks), and with the z-loss on, its share of that
    (`moe.z_loss_term`)."""
    aux, z = moe.aux_loss_coefficient(model.config), moe.z_loss_coefficient(model.config)
    with moe.router_logits(model, record=aux > 0 or z > 0) as routed:
        logits = model(ids, **moe.forward_kwargs(model.config)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    if aux:
        loss = loss + moe.aux_loss_term(model, routed, None, ids.shape, ids[:, 1:].numel())
    if z:
        loss = loss + moe.z_loss_term(model, routed, None, ids.shape, ids[:, 1:].numel())
    return loss


def expert_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA on the experts of `model` (`shardline.model.expert_lora`, r 4, alpha 8) with adapters drawn at std 0.2,
    the same on every rank (peft's zero lora_B would leave lora_A without a gradient); returns their values by name."""
    add_expert_adapters(model, LORA_R, 2 * LORA_R)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def merge_into(reference: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Fold the adapters into transformers' model: each expert's weight becomes `W + 2 · B·A`."""
    weights = dict(reference.named_parameters())
    with torch.no_grad():
        for name, a in adapters.items():
            if ".lora_A." in name:
                b = adapters[name.replace(".lora_A.", ".lora_B.")]
                weights[name.replace(".lora_A.", ".")].add_(torch.bmm(b, a) * 2.0)


def adapter_gradients(want: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' gradients from transformers' gradient G of the merged weight `W + s·B·A`: `s·Bᵀ·G` for A and
    `s·G·Aᵀ` for B, per expert."""
    found = {}
    for name, a in adapters.items():
        if ".lora_A." in name:
            b_name = name.replace(".lora_A.", ".lora_B.")
            g = want[name.replace(".lora_A.", ".")]
            found[name] = torch.bmm(adapters[b_name].transpose(1, 2), g) * 2.0
            found[b_name] = torch.bmm(g, a.transpose(1, 2)) * 2.0
    return found


def oracle(job: dict) -> None:
    ep, broken, aux, replicate = job["oracle"], job.get("broken"), job.get("aux", False), job.get("replicate", 1)
    family, z, lora, out = job.get("family", "qwen3_moe"), job.get("z", False), job.get("lora", False), job.get("out")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = tiny_moe(aux, family)
    model = tiny_moe(aux, family)
    model.load_state_dict(reference.state_dict())
    adapters = expert_adapters(model) if lora else {}
    merge_into(reference, adapters)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    tokens = ROWS * (SEQ - 1)
    with moe.router_logits(reference, record=z) as routed:  # transformers' router logits, recorded by a hook
        want_loss = reference(ids, labels=ids).loss  # transformers' own: mean cross-entropy (+ coef · its aux loss)
    if z:  # ST-MoE's z-loss by hand: the mean over tokens and layers of logsumexp(router logits)²
        want_loss = want_loss + Z_COEF * torch.cat([torch.logsumexp(t, dim=-1) for t in routed]).pow(2).mean()
    want_loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    want.update(adapter_gradients(want, adapters))

    moe.set_z_loss_coefficient(model.config, Z_COEF if z else 0.0)
    spec = ParallelSpec(ep=ep, dp_replicate=replicate)
    parallelize(model, device_mesh(spec, world, "cpu"), spec, "fp32")
    route, combine = expert.route, expert.ExpertParallelForward.__call__
    if broken == "dispatch":  # every copy to the same local expert of the next EP rank
        expert.route = lambda index, experts, group: route((index + experts // ep) % experts, experts, group)
    if broken == "combine":  # the experts' outputs summed without their routing weights
        expert.ExpertParallelForward.__call__ = lambda self, x, index, weights: combine(self, x, index,
                                                                                         torch.ones_like(weights))
    try:
        rows = ids.chunk(world)[rank]
        local = loss_sum(model, rows)
        (local * (world / tokens)).backward()  # FSDP averages gradients over the ranks (Trainer.train_step)
    finally:
        expert.route, expert.ExpertParallelForward.__call__ = route, combine
    total = local.detach().clone()
    dist.all_reduce(total)
    diffs = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = float((grad - want[name]).abs().max())
    if rank == 0 and out:
        placements = {n: [str(x) for x in p.placements] for n, p in model.named_parameters() if "experts" in n}
        Path(out).write_text(json.dumps({"loss": float(total) / tokens,
                                         "reference_loss": float(want_loss),
                                         "grad_diff": diffs, "grad_scale": max(float(g.abs().max())
                                                                               for g in want.values()),
                                         "expert_placements": placements}))


def main(jobs_file: str) -> None:
    with distributed() as ctx:
        for job in json.loads(Path(jobs_file).read_text()):
            if "oracle" in job:
                oracle(job)
            else:
                spec = JobSpec.model_validate_json(Path(job["spec"]).read_text())
                trainer = Trainer(spec, ctx, prepare(spec), run_path(spec), Console(quiet=True))
                trainer.maybe_resume()
                records = []
                for step in range(1, job["steps"] + 1):
                    records.append(trainer.train_step())
                    if step == job.get("save_at"):
                        trainer.save_checkpoint(blocking=True)
                if ctx.is_main and job.get("out"):
                    blocks = block_wrapping(trainer.model)  # how parallelize wrapped them: the job's AC
                    Path(job["out"]).write_text(json.dumps([{"loss": r.loss, "expert_tokens": r.expert_tokens,
                                                             "expert_imbalance": r.expert_imbalance,
                                                             "expert_dropped": r.expert_dropped, "blocks": blocks}
                                                            for r in records]))
                if job.get("save"):
                    trainer.save_checkpoint(blocking=True)
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
