"""The Kubeflow SDK path: a shardline job spec run by `TrainerClient().train(...)` on shardline's runtime.

    from kubeflow.trainer import CustomTrainer, TrainerClient
    from shardline.engines.kubeflow_sdk import trainer_arguments
    client = TrainerClient()                                   # Kubernetes backend: the cluster's runtimes
    job = client.train(runtime=client.get_runtime("shardline"), trainer=CustomTrainer(**trainer_arguments(spec)))

The spec travels in the command the SDK writes: the SDK puts the source of `shardline_train` and a call with
`func_args` into the trainer's command, and torchrun runs it in every process (Trainer injects the PET_*
rendezvous variables; the LocalProcessBackend runs it on this machine). The resolved spec is passed
base64-encoded: the SDK embeds the call in an unquoted shell here-document, where `$`, backquotes and
backslashes of a YAML text would be expanded; base64 has none.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from shardline.engines.command import cluster_spec
from shardline.engines.kubernetes import pod as k8s_pod
from shardline.errors import SpecError
from shardline.rundir import with_run_id
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml

SPEC_ARGUMENT = "spec_b64"


def shardline_train(spec_b64=None):
    """Train the shardline job spec given base64-encoded (the Kubeflow SDK runs this function's source under
    torchrun; its Kubernetes backend passes func_args as keywords, its LocalProcessBackend as one dict)."""
    from shardline.engines.kubeflow_sdk import run_worker

    run_worker(spec_b64)


def encode_spec(spec: JobSpec) -> str:
    return base64.b64encode(spec_to_yaml(spec).encode()).decode("ascii")


def trainer_arguments(spec: JobSpec) -> dict:
    """Keyword arguments of the SDK's `CustomTrainer` for this spec: the function, the spec (run id assigned,
    served /metrics on the pod's interfaces as on every cluster target), nodes, the image pinned by digest where
    one is set, and GPUs per node."""
    spec = cluster_spec(with_run_id(spec))
    out: dict = {"func": shardline_train, "func_args": {SPEC_ARGUMENT: encode_spec(spec)},
                 "num_nodes": spec.launch.nnodes}
    if spec.launch.image:
        out["image"] = k8s_pod.image_ref(spec)
    gpu = spec.launch.kubernetes.gpu_resource
    if gpu:
        out["resources_per_node"] = {gpu: spec.parallel.nproc_per_node}
    return out


def run_worker(spec_b64: str | dict | None) -> None:
    """One torchrun process of the SDK's job: the decoded spec to a private file, then shardline's worker;
    a failure leaves with the worker's exit code (2 bad input, 75 preempted), which torchrun and the SDK see."""
    if isinstance(spec_b64, dict):
        spec_b64 = spec_b64.get(SPEC_ARGUMENT)
    if not spec_b64:
        raise SpecError("func_args", f"has no {SPEC_ARGUMENT!r}",
                        "build the CustomTrainer with shardline.engines.kubeflow_sdk.trainer_arguments(spec)")
    from shardline.worker import main

    with tempfile.TemporaryDirectory(prefix="shardline-spec-") as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_bytes(base64.b64decode(spec_b64))
        code = main(["--spec", str(path)])
    if code:
        raise SystemExit(code)
