"""The Vertex AI CustomJob of a spec, as the REST JSON the API takes; engines/vertex/backend.py checks it against the
`google-cloud-aiplatform` types and submits it. Nothing here needs that package.

What is mapped:
- worker pools: the primary replica alone in pool 0 (Vertex requires one replica there) and the other
  `launch.nnodes - 1` in pool 1, every replica the same machine, image and command;
- the machine: launch.profile's machine type and its GPUs (Vertex's accelerator type is the profile's GKE accelerator
  label in upper snake case: nvidia-h100-mega-80gb → NVIDIA_H100_MEGA_80GB), one process per GPU; with the generic
  profile, launch.vertex.machine_type and launch.vertex.accelerator;
- the command: `shardline.engines.vertex.entry` (node rank and rendezvous host from CLUSTER_SPEC, secrets, the
  spec file, the working directory) in front of the one torchrun line (docs/architecture.md §6);
- the image: launch.image, pinned by launch.image_digest; the resolved spec travels in the environment;
- scheduling from cost.provisioning (the price the cost meter charges is the capacity the job asks for):
  on-demand → STANDARD, spot → SPOT, dws-flex-start → FLEX_START (launch.vertex.max_wait_seconds), reservation →
  the named reservation; launch.vertex.max_run_seconds → timeout; restart_job_on_worker_restart;
- launch.vertex.output_dir → base_output_directory, mounted at /gcs/… as the working directory, so the run
  directory (run.dir relative) and its checkpoints are in the bucket; service account, network, labels (run id,
  name, spec hash); secrets as Secret Manager names, read by each replica when it starts.

What is refused, each with the field and the fix: elastic node counts (Vertex keeps a fixed replica count), a
run.dir or checkpoint.dir on the replica's own disk (gone when the job ends), a secret another engine's section
passes that has no Secret Manager name here, settings of one provisioning model under another.
The network profile's NCCL environment is not applied: it points at libraries GKE's installer puts on the host.
"""

from __future__ import annotations

import json
import posixpath

from shardline.engines.command import cluster_spec, node_torchrun_command
from shardline.engines.kubernetes.pod import image_ref
from shardline.engines.vertex.entry import SECRETS_ENV, SPEC_ENV, SPEC_PATH
from shardline.errors import SpecError
from shardline.network_profiles import get_profile
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_hash, spec_to_yaml
from shardline.spec.rules import require_torch_engine

FUSE_ROOT = "/gcs"
"""Where Vertex AI mounts Cloud Storage in a training container (gs://b/p is /gcs/b/p)."""
RESERVATION_KEY = "compute.googleapis.com/reservation-name"
STRATEGIES = {"on-demand": "STANDARD", "spot": "SPOT", "dws-flex-start": "FLEX_START", "reservation": None}
FLEX_START_MAX_RUN_S = 7 * 24 * 3600
LABEL_LIMIT = 63


def vertex_accelerator(gke_accelerator: str) -> str:
    """Vertex AI's AcceleratorType name of a GKE accelerator label (checked against the API's enum on render)."""
    return gke_accelerator.upper().replace("-", "_")


def fuse_path(url: str) -> str:
    """The container path of a gs:// location."""
    return posixpath.join(FUSE_ROOT, url.removeprefix("gs://"))


def output_dir(spec: JobSpec) -> str:
    out = spec.launch.vertex.output_dir
    if not out:
        raise SpecError("launch.vertex.output_dir", "is not set; a replica's own disk is deleted when the job ends",
                        "name a bucket the job's service account may write, e.g. "
                        "--set launch.vertex.output_dir=gs://my-bucket/shardline")
    return out.rstrip("/")


def run_dir_url(spec: JobSpec) -> str:
    """Where the run directory is: the relative run.dir under the output directory, or a /gcs/ path's bucket."""
    run_dir = posixpath.normpath(spec.run.dir)
    if run_dir.startswith(FUSE_ROOT + "/"):
        return f"gs://{run_dir.removeprefix(FUSE_ROOT + '/')}/{spec.run.id}"
    return f"{output_dir(spec)}/{run_dir}/{spec.run.id}".replace("/./", "/")


def _check_locations(spec: JobSpec) -> None:
    for field, value in (("run.dir", spec.run.dir), ("checkpoint.dir", spec.checkpoint.dir)):
        if value and value.startswith("/") and not posixpath.normpath(value).startswith(FUSE_ROOT + "/"):
            raise SpecError(field, f"{value!r} is on the replica's own disk, which Vertex AI deletes when the job "
                            "ends", f"use a relative path (under launch.vertex.output_dir), a {FUSE_ROOT}/<bucket>/… "
                            "path" + (", or a gs:// URL" if field == "checkpoint.dir" else ""))
        relative = value and not value.startswith("/") and "://" not in value
        if relative and posixpath.normpath(value).split("/")[0] == "..":
            raise SpecError(field, f"{value!r} climbs out of launch.vertex.output_dir, onto the replica's own disk, "
                            "which Vertex AI deletes when the job ends", "use a path inside the output directory "
                            f"(no leading ..) or a {FUSE_ROOT}/<bucket>/… path")


def _check_spec(spec: JobSpec) -> None:
    launch, v = spec.launch, spec.launch.vertex
    if spec.is_elastic:
        raise SpecError("launch.min_nnodes", f"{launch.min_nnodes} makes the job elastic, but Vertex AI runs a fixed "
                        "number of replicas and restarts a lost one", "remove launch.min_nnodes; a restarted replica "
                        "rejoins through launch.vertex.restart_job_on_worker_restart and resumes from the checkpoint")
    _check_locations(spec)
    passed = {"launch.kubernetes.secret_env": set(launch.kubernetes.secret_env),
              "launch.slurm.secret_env": set(launch.slurm.secret_env),
              "launch.ray.secret_env": set(launch.ray.secret_env)}
    for field, names in passed.items():
        if missing := sorted(names - set(v.secret_env)):
            raise SpecError(field, f"passes {', '.join(missing)} on another engine, but launch.vertex.secret_env "
                            "names no Secret Manager secret for it, so the job would run without it",
                            f"add launch.vertex.secret_env.{missing[0]}: <secret id>, or remove it from {field}")
    provisioning = spec.cost.provisioning
    if v.reservation and provisioning != "reservation":
        raise SpecError("launch.vertex.reservation", f"is set, but cost.provisioning is {provisioning}",
                        "set cost.provisioning=reservation to run on it (and be priced for it), or remove it")
    if provisioning == "reservation" and not v.reservation:
        raise SpecError("launch.vertex.reservation", "is required with cost.provisioning reservation",
                        "give the reservation's full name: projects/P/zones/Z/reservations/R")
    if v.max_wait_seconds is not None and provisioning != "dws-flex-start":
        raise SpecError("launch.vertex.max_wait_seconds", f"only applies to flex-start, but cost.provisioning is "
                        f"{provisioning}", "set cost.provisioning=dws-flex-start, or remove it")
    if provisioning == "dws-flex-start" and (v.max_run_seconds or 0) > FLEX_START_MAX_RUN_S:
        raise SpecError("launch.vertex.max_run_seconds", f"{v.max_run_seconds} is more than the 7 days a flex-start "
                        "job may run", f"use at most {FLEX_START_MAX_RUN_S}")


def machine_spec(spec: JobSpec) -> dict:
    """machineType, the accelerators of one replica, and the reservation it draws from."""
    v, nproc = spec.launch.vertex, spec.parallel.nproc_per_node
    profile = get_profile(spec.launch.profile)
    if profile.machine_type:
        for field in ("machine_type", "accelerator"):
            if getattr(v, field) is not None:
                raise SpecError(f"launch.vertex.{field}", f"is set, but launch.profile {profile.name} already names "
                                f"the machine ({profile.machine_type})", "remove it, or use launch.profile=generic "
                                "to choose the machine yourself")
        machine, count = profile.machine_type, profile.gpus_per_node
        accelerator = vertex_accelerator(profile.accelerator) if profile.accelerator else None
    elif v.machine_type:
        machine, accelerator, count = v.machine_type, v.accelerator, nproc
    else:
        raise SpecError("launch.vertex.machine_type", "is not set, and launch.profile generic names no machine",
                        "choose a GPU profile (--set launch.profile=a3-mega), or set launch.vertex.machine_type "
                        "(and launch.vertex.accelerator)")
    if accelerator and nproc != count:
        raise SpecError("parallel.nproc_per_node", f"is {nproc}, but each {machine} has {count} GPUs",
                        f"--set parallel.nproc_per_node={count} (one process per GPU)")
    out: dict = {"machineType": machine}
    if accelerator:
        out |= {"acceleratorType": accelerator, "acceleratorCount": count}
    if v.reservation:
        out["reservationAffinity"] = {"reservationAffinityType": "SPECIFIC_RESERVATION", "key": RESERVATION_KEY,
                                      "values": [v.reservation]}
    return out


def scheduling(spec: JobSpec) -> dict:
    v = spec.launch.vertex
    out: dict = {}
    if v.max_run_seconds:
        out["timeout"] = f"{v.max_run_seconds}s"
    if v.restart_job_on_worker_restart:
        out["restartJobOnWorkerRestart"] = True
    if strategy := STRATEGIES[spec.cost.provisioning]:
        out["strategy"] = strategy
    if v.max_wait_seconds is not None:
        out["maxWaitDuration"] = f"{v.max_wait_seconds}s"
    return out


def secret_versions(spec: JobSpec) -> dict[str, str]:
    """Environment name → full Secret Manager version name (short ids are in launch.vertex.project, latest)."""
    v, out = spec.launch.vertex, {}
    for name, ref in sorted(v.secret_env.items()):
        if not ref.startswith("projects/"):
            if not v.project:
                raise SpecError(f"launch.vertex.secret_env.{name}", f"{ref!r} is a secret id, and "
                                "launch.vertex.project is not set to say whose", "set launch.vertex.project, or give "
                                "the full name projects/P/secrets/S")
            ref = f"projects/{v.project}/secrets/{ref}"
        out[name] = ref if "/versions/" in ref else f"{ref}/versions/latest"
    return out


def _label(value: str) -> str:
    """A label value: lower-case letters, digits, '-' and '_', at most 63 characters."""
    return value.lower()[:LABEL_LIMIT]


def labels(spec: JobSpec) -> dict[str, str]:
    return {"app": "shardline", "shardline-run-id": _label(str(spec.run.id)), "shardline-run-name": spec.run.name,
            "shardline-spec-hash": spec_hash(spec)[:16]}


def container_env(spec: JobSpec) -> list[dict[str, str]]:
    env = {SPEC_ENV: spec_to_yaml(cluster_spec(spec)), "SHARDLINE_IMAGE": image_ref(spec),
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if spec.launch.image_digest:
        env["SHARDLINE_IMAGE_DIGEST"] = spec.launch.image_digest
    if versions := secret_versions(spec):
        env[SECRETS_ENV] = json.dumps(versions, sort_keys=True)  # names of secrets, never their values
    return [{"name": k, "value": v} for k, v in env.items()]


def replica_command(spec: JobSpec, task: str) -> list[str]:
    workdir = fuse_path(output_dir(spec))
    return ["python", "-m", "shardline.engines.vertex.entry", "--workdir", workdir, "--spec", SPEC_PATH,
            "--nnodes", str(spec.launch.nnodes), "--", *node_torchrun_command(spec, SPEC_PATH, task)]


def custom_job(spec: JobSpec, task: str = "train") -> dict:
    """The CustomJob (REST JSON, int64 as strings as the API writes them) for a spec whose run id is assigned."""
    require_torch_engine(spec, "--target vertex")
    _check_spec(spec)
    v = spec.launch.vertex
    pool = {"machineSpec": machine_spec(spec), "replicaCount": "1",
            "containerSpec": {"imageUri": image_ref(spec), "command": replica_command(spec, task),
                              "env": container_env(spec)}}
    pools = [pool] + ([{**pool, "replicaCount": str(spec.launch.nnodes - 1)}] if spec.launch.nnodes > 1 else [])
    job_spec: dict = {"workerPoolSpecs": pools}
    if sched := scheduling(spec):
        job_spec["scheduling"] = sched
    if v.service_account:
        job_spec["serviceAccount"] = v.service_account
    if v.network:
        job_spec["network"] = v.network
    job_spec["baseOutputDirectory"] = {"outputUriPrefix": output_dir(spec)}
    return {"displayName": str(spec.run.id), "jobSpec": job_spec, "labels": labels(spec)}
