"""Targets a run can be rendered for and launched on; each maps to a backend factory (imported lazily)."""

from __future__ import annotations

from collections.abc import Callable

from shardline.engines.backend import Backend
from shardline.errors import SpecError


def _kubernetes(target: str) -> Callable:
    def make():
        from shardline.engines.kubernetes.backend import KubernetesBackend

        return KubernetesBackend(target)

    return make


def _slurm():
    from shardline.engines.slurm import SlurmBackend

    return SlurmBackend()


def _ray(target: str) -> Callable:
    def make():
        from shardline.engines.ray.backend import RayBackend, RayJobBackend

        return RayBackend() if target == "ray" else RayJobBackend()

    return make


def _vertex():
    from shardline.engines.vertex.backend import VertexBackend

    return VertexBackend()


def _local():
    from shardline.engines.local import LocalBackend

    return LocalBackend()


BACKENDS: dict[str, Callable[[], Backend]] = {
    "local": _local,
    "k8s-job": _kubernetes("k8s-job"),
    "jobset": _kubernetes("jobset"),
    "trainjob": _kubernetes("trainjob"),
    "slurm": _slurm,
    "ray": _ray("ray"),
    "rayjob": _ray("rayjob"),
    "vertex": _vertex,
}


def get_backend(target: str) -> Backend:
    if target not in BACKENDS:
        raise SpecError("--target", f"unknown target {target!r}", f"use one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[target]()
