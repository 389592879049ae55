"""Targets a run can be rendered for and launched on; each maps to a backend factory (imported lazily)."""

from __future__ import annotations

from collections.abc import Callable

from shardline.errors import SpecError
from shardline.launch.backend import Backend


def _kubernetes(target: str) -> Callable:
    def make():
        from shardline.launch.kubernetes.backend import KubernetesBackend

        return KubernetesBackend(target)

    return make


def _slurm():
    from shardline.launch.slurm import SlurmBackend

    return SlurmBackend()


def _ray(target: str) -> Callable:
    def make():
        from shardline.launch.ray import RayBackend, RayJobBackend

        return RayBackend() if target == "ray" else RayJobBackend()

    return make


def _vertex():
    from shardline.launch.vertex import VertexBackend

    return VertexBackend()


def _local():
    from shardline.launch.local import LocalBackend

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
