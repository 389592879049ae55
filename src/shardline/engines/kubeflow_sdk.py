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

That command replaces the runtime's, and with it the runtime's way into the shared storage (wait_rendezvous
--chdir), so each process enters `launch.kubernetes.storage.mount_path` itself, as every other Kubernetes target's
pod starts there (its workingDir): a relative run.dir, data cache and checkpoints land on the storage, and a replaced
pod resumes from them. The runtime's container has no workingDir on purpose: the SDK writes its function file into
the working directory, and on shared storage every pod would rewrite the same file while others run it.
"""

from __future__ import annotations

import base64
import os
import sys
import tempfile
from pathlib import Path

from shardline.engines.command import cluster_spec
from shardline.engines.kubernetes import pod as k8s_pod
from shardline.errors import EXIT_BAD_INPUT, ShardlineError, SpecError
from shardline.rundir import with_run_id
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec, spec_to_yaml

SPEC_ARGUMENT = "spec_b64"


def shardline_train(spec_b64=None):
    """Train the shardline job spec given base64-encoded (the Kubeflow SDK runs this function's source under
    torchrun; its Kubernetes backend passes func_args as keywords, its LocalProcessBackend as one dict), then end
    the process with the worker's exit code, as `python -m shardline.worker` does."""
    from shardline.engines.kubeflow_sdk import run_worker
    from shardline.worker import exit_without_teardown

    exit_without_teardown(run_worker(spec_b64))


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


def enter_storage(spec: JobSpec) -> None:
    """Make the spec's shared storage this process's working directory (nothing to do for storage kind none:
    the run stays on the container's own disk, as on every other target)."""
    storage = spec.launch.kubernetes.storage
    if storage.kind == "none":
        return
    try:
        os.chdir(storage.mount_path)
    except OSError as e:
        raise SpecError("launch.kubernetes.storage.mount_path", f"is {storage.mount_path!r}, which this process "
                        f"cannot enter ({e.strerror}), so the run would not reach the {storage.kind} storage",
                        "run the job on shardline's runtime (`shardline cluster bootstrap --trainer-runtime`), "
                        "which mounts the storage there, or set launch.kubernetes.storage.kind=none") from e


def run_worker(spec_b64: str | dict | None) -> int:
    """One torchrun process of the SDK's job: the decoded spec to a private file, the spec's storage entered,
    then shardline's worker. Returns the worker's exit code (0, 2 bad input, 75 preempted), for the caller to
    end the process with it: torchrun and the SDK see that code."""
    if isinstance(spec_b64, dict):
        spec_b64 = spec_b64.get(SPEC_ARGUMENT)
    from shardline.worker import main

    with tempfile.TemporaryDirectory(prefix="shardline-spec-") as tmp:
        path = Path(tmp) / "spec.yaml"
        try:
            if not spec_b64:
                raise SpecError("func_args", f"has no {SPEC_ARGUMENT!r}", "build the CustomTrainer with "
                                "shardline.engines.kubeflow_sdk.trainer_arguments(spec)")
            path.write_bytes(base64.b64decode(spec_b64))
            enter_storage(load_spec(str(path)))
        except ShardlineError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        return main(["--spec", str(path)])
