"""How many devices `shardline plan` plans for, and why: the first line of its answer.

A spec's world (launch.nnodes × parallel.nproc_per_node) is planned when it is asked for (`--nproc`, a `--set` of
either field), when no device is named (the spec's own), on the CPU (its processes share the host), or when the
named GPU is the one the spec's world was written for (its launch profile's GPU). A GPU named otherwise is one
device: a user asking about "my L4" has one L4, not the 8 H100s of a preset's launch profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.hardware import Accelerator, match_device
from shardline.spec import JobSpec

WORLD_FIELDS = ("parallel.nproc_per_node", "launch.nnodes")
ONE_DEVICE = ["launch.nnodes=1", "parallel.nproc_per_node=1", "parallel.dp_replicate=1", "parallel.dp_shard=null",
              "parallel.tp=1", "parallel.cp=1"]


@dataclass(frozen=True)
class World:
    devices: int
    reason: str
    overrides: list[str]
    """`--set` assignments that turn the spec into the world planned (empty: the spec's own)."""

    def line(self, device_name: str) -> str:
        return f"planning for {self.devices} × {device_name}: {self.reason}"


def spec_gpu(spec: JobSpec) -> Accelerator | None:
    """The GPU a spec's world is written for: `launch.vertex.accelerator`, else its launch profile's GPU, else an
    H100 (the generic profile's) for a hub model; None for a spec without one (`model.arch` on the generic profile)."""
    if spec.launch.vertex.accelerator:
        return match_device(spec.launch.vertex.accelerator.replace("_", " "))
    from shardline.network_profiles import get_profile

    gpu = get_profile(spec.launch.profile).gpu
    if gpu is None and spec.model.path is not None:
        gpu = match_device("h100")
    return gpu


def sets_world(source: dict[str, Any]) -> bool:
    """Whether spec data (a preset's or a file's, before defaults) gives a world of its own."""
    parallel, launch = source.get("parallel") or {}, source.get("launch") or {}
    return parallel.get("nproc_per_node") is not None or (launch.get("nnodes") or 1) > 1


def planned_world(spec: JobSpec, source: dict[str, Any], assignments: list[str], nproc: int | None,
                  device: str | None) -> World:
    """The world `plan` plans for `spec` (resolved from `source` with `assignments`; `nproc`: `--nproc`) on the
    `--device` named (None: the spec's own device)."""
    p, world = spec.parallel, spec.world_size
    shape = f"launch.nnodes {spec.launch.nnodes} × parallel.nproc_per_node {p.nproc_per_node}"
    if nproc:
        return World(world, f"--nproc {nproc} ({shape})", [])
    asked = [a for a in assignments if a.partition("=")[0] in WORLD_FIELDS]
    if asked:
        return World(world, f"--set {' --set '.join(asked)} ({shape})", [])
    if device is None:
        return World(world, f"the spec's world ({shape}) on its own device", [])
    if device.lower() == "cpu":
        return World(world, f"the spec's world: {p.nproc_per_node} processes share the host ({shape})", [])
    gpu, own = match_device(device), spec_gpu(spec)
    if sets_world(source) and gpu is not None and own is not None and own.key == gpu.key:
        return World(world, f"the spec's world for its {own.name} ({shape})", [])
    if world == 1:
        return World(1, "the spec's world is one device", [])
    why = (f"--device names one GPU; the spec's world of {world} is for "
           f"{'its ' + own.name if own is not None else 'the host it was written for'}"
           if sets_world(source) else "--device names one GPU and the spec gives no world")
    return World(1, f"{why} (--nproc N plans N of them)", ONE_DEVICE)
