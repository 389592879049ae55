"""Balanced routing for the dry run of a mixture of experts under expert parallel (`parallel.ep`).

A fake tensor has no values, so the router's top-k choices are unknown and expert parallel's dispatch plan
(`shardline.parallel.expert.route`: a count all-to-all and one host read of the splits) cannot be computed from them.
The simulation assumes balanced routing instead: token t's j-th choice is expert (t·k + j) mod E, so every expert
receives N·k/E of a rank's N·k routed copies (exactly, when E divides N·k), and the real `route` runs on that real
index outside the fake mode: its count all-to-all goes through the fake process group, which returns a rank's own
counts (what each rank sends, it receives, as under balanced routing on every rank). Everything else of the layer
(the token exchange, the local experts, the combine, and their backward) runs as in training, on fake tensors that
the memory tracker sees. Real routing is rarely balanced: `shardline plan` states the headroom a rank has for the
extra copies its busiest experts receive (`planning.advice.imbalance_headroom`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from shardline.model.forced_routing import balanced_top_k
from shardline.parallel import expert
from shardline.planning.simulation.fake_world import outside_fake_mode


def route_balanced(copies: torch.Tensor, experts: int, group: dist.ProcessGroup) -> expert.Routing:
    """Expert parallel's own dispatch plan for balanced routing of the routed copies (`route`'s input: each copy's
    expert, flattened token-major, so copy t·k + j goes to expert (t·k + j) mod E), on real tensors."""
    with outside_fake_mode():
        return _route(balanced_top_k(copies.numel(), 1, experts).reshape(-1), experts, group)


_route = expert.route


@contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside: every expert-parallel MoE layer dispatches by `route_balanced` (the module's `route`, which
    `ExpertParallelForward` calls, swapped in this process only: the dry run's own)."""
    expert.route = route_balanced
    try:
        yield
    finally:
        expert.route = _route
