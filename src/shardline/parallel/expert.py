"""Expert parallel (`parallel.ep`): each MoE layer's routed experts split over `ep` data-parallel ranks, tokens sent
to the ranks that hold their experts and their outputs sent back, as torchtitan does it.

Layout: the data-parallel ranks are viewed as a mesh `[dp_replicate?, efsdp, ep]`, efsdp × ep = dp_shard (ep
innermost: an EP group is consecutive ranks). Each routed-experts module's fused weights (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) become DTensors sharded on dim 0, the expert dimension, over `ep` (E/ep experts a rank);
FSDP2 then shards them over `efsdp` on dim 1 (HSDP: and replicates them over `dp_replicate`), so the placements
are plain `(Shard(1), Shard(0))`, no strided shard, and DCP reshards them to any other EP size. Everything else of
the model is sharded by FSDP over all data-parallel ranks as without EP. The experts' gradients end as the mean
over all data-parallel ranks, as every other gradient does (every rank's loss is scaled for that mean,
`Trainer.train_step`): a rank's expert gradients hold its whole EP group's tokens (the all-to-all's backward
brings them), are divided by ep (`run_experts`), and FSDP averages them over the rest (efsdp, and dp_replicate).

One MoE layer's forward on a rank (`ExpertParallelForward`): its N tokens × top-k routed copies sorted by expert;
the per-expert counts exchanged with `all_to_all_single` (one small collective), then read on the host once (the
splits of the token all-to-all are host integers: one host read per MoE layer and forward — the step's host-read
budget, tests/train/test_host_reads.py, covers dense steps only); the copies sent with `all_to_all_single` with
exact uneven splits (gloo takes uneven splits on CPU, NCCL on GPU; no copy dropped unless a capacity factor is set,
`shardline.model.moe.within_capacity`: then the copies over an expert's capacity, of this rank's tokens as at ep 1,
are left out before the counts, so the all-to-all sends fewer rows, and counted); the received
rows grouped by local expert and run through each expert (`act(x·gate) * (x·up) · down`, transformers' own
expert math, exact on CPU); the outputs sent back by the reverse all-to-all, weighted by their routing weights and
summed per token. Both all-to-alls are autograd functions: backward sends the gradients the opposite way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardline.errors import SpecError
from shardline.model.moe import (
    EXPERT_WEIGHTS,
    count_dropped,
    expert_modules,
    num_experts,
    run_experts,
    within_capacity,
)


def check_expert_parallel(config: object, ep: int) -> None:
    """`parallel.ep` needs a mixture of experts whose expert count it divides."""
    if ep == 1:
        return
    experts = num_experts(config)
    if not experts:
        raise SpecError("parallel.ep", f"{ep} on {getattr(config, 'model_type', 'this model')}, which has no "
                        "routed experts", "set parallel.ep=1 (expert parallel splits a mixture of experts' experts)")
    if experts % ep:
        raise SpecError("parallel.ep", f"{ep} does not divide the model's {experts} routed experts per layer",
                        f"choose an ep that divides {experts}")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The data-parallel ranks of `mesh` as `[dp_replicate?, efsdp, ep]`: ep consecutive ranks of a replica share a
    layer's experts, FSDP shards each EP rank's experts over the efsdp ranks that hold the same ones (and HSDP
    replicates them over `dp_replicate`)."""
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    dims = [("dp_replicate", sizes["dp_replicate"])] if "dp_replicate" in sizes else []
    dims += [("efsdp", sizes["dp_shard"] // ep), ("ep", ep)]
    return init_device_mesh(mesh.device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(n for n, _ in dims))


def expert_data_parallel_mesh(experts: DeviceMesh) -> DeviceMesh:
    """What FSDP (or HSDP) shards the experts over: all of the expert mesh but `ep`."""
    return experts[tuple(n for n in experts.mesh_dim_names if n != "ep")]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every routed-experts module's weights on the expert dimension over `ep_mesh` and run the module by
    dispatch (this module's forward); returns the modules, for FSDP over the rest of the ranks."""
    check_expert_parallel(model.config, ep_mesh.size())
    modules = expert_modules(model)
    for module in modules:
        # the weights, and LoRA's per-expert adapters where the experts carry them (`shardline.model.expert_lora`)
        holders = [module, *(getattr(module, n) for n in ("lora_A", "lora_B") if getattr(module, n, None) is not None)]
        for holder, name in ((h, n) for h in holders for n in EXPERT_WEIGHTS):
            param = getattr(holder, name)
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            holder.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = ExpertParallelForward(module, ep_mesh.get_group())
    return modules


def expert_parallel_layers(model: nn.Module) -> int:
    """How many MoE layers of `model` run their experts by dispatch (`apply_expert_parallel`): the setup record's
    proof that `parallel.ep` took effect."""
    return sum(isinstance(m.forward, ExpertParallelForward) for m in expert_modules(model))


@dataclass(frozen=True)
class Routing:
    """Where one layer's routed token copies go. `order` sorts the copies (token-major, top-k inner) by expert, the
    dropped ones left out (`dropped` of them, a host integer); `send`/`receive` are the rows exchanged with each EP
    rank (host integers); `grouped` sorts the received rows by local expert and `per_expert` counts them (on the
    host; `expert_counts` on the device)."""

    order: torch.Tensor
    send: list[int]
    receive: list[int]
    grouped: torch.Tensor
    per_expert: list[int]
    expert_counts: torch.Tensor
    dropped: int


def route(copies: torch.Tensor, experts: int, group: dist.ProcessGroup) -> Routing:
    """The dispatch plan of one MoE layer (`copies`: each routed copy's expert, flattened token-major, `experts` for
    a copy dropped over capacity, as `within_capacity` gives them): one count all-to-all and one host read."""
    ranks = dist.get_world_size(group)
    local = experts // ranks
    flat = copies.reshape(-1)
    counts = torch.bincount(flat, minlength=experts + 1)  # [ranks × local]: what this rank sends each expert; dropped
    received = torch.empty_like(counts[:experts])
    dist.all_to_all_single(received, counts[:experts], group=group)  # [source rank × local]: what each rank sends mine
    host = torch.cat([counts, received]).tolist()  # the layer's one host read: the splits are host integers
    sent, dropped, got = host[:experts], host[experts], host[experts + 1:]
    order = torch.argsort(flat, stable=True)[:len(flat) - dropped]  # the dropped sort last
    source_expert = torch.arange(local, device=flat.device).repeat(ranks)
    grouped = torch.argsort(torch.repeat_interleave(source_expert, received), stable=True)
    return Routing(order=order, send=[sum(sent[r * local:(r + 1) * local]) for r in range(ranks)],
                   receive=[sum(got[r * local:(r + 1) * local]) for r in range(ranks)], grouped=grouped,
                   per_expert=[sum(got[r * local + e] for r in range(ranks)) for e in range(local)],
                   expert_counts=received.view(ranks, local).sum(dim=0), dropped=dropped)


def exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`all_to_all_single` of rows with exact uneven splits, differentiable (backward sends the gradients back)."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), receive, send, group))


class ExpertParallelForward:
    """A routed-experts module's forward under expert parallel (same signature and result as transformers':
    `(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        self.module, self.group = module, group
        self.experts = module.gate_up_proj.shape[0]

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        factor = getattr(self.module, "capacity_factor", None)
        # the copies over capacity dropped here, before the dispatch, of this rank's own tokens (as at ep 1)
        plan = route(within_capacity(top_k_index, top_k_weights, self.experts, factor), self.experts, self.group)
        if factor is not None:
            count_dropped(self.module, plan.dropped)
        token = plan.order // k  # the token each sorted copy is of
        sent = hidden_states[token]
        arrived = exchange(sent, plan.receive, plan.send, self.group)
        # the weights' gradients hold the whole EP group's tokens: divided by its size, FSDP then averages them over
        # efsdp only, which together is the mean over all data-parallel ranks FSDP takes of every other gradient
        # (`set_gradient_divide_factor` would say it too, but gloo has no pre-multiplied reduce-scatter)
        computed = run_experts(self.module, arrived[plan.grouped], plan.per_expert, plan.expert_counts,
                               1.0 / dist.get_world_size(self.group))
        back = torch.empty_like(computed).index_copy(0, plan.grouped, computed)  # in arrival order again
        returned = exchange(back, plan.send, plan.receive, self.group)
        weighted = returned * top_k_weights.reshape(-1)[plan.order, None]
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, weighted.to(out.dtype))
