"""The training pod, built as typed data from the spec: one container named `node` running the node's torchrun.

Shared by the Indexed Job, the JobSet and the TrainJob renders (engines/kubernetes/objects.py) and the RayJob's GPU
workers (engines/ray/backend.py); only how rank and rendezvous host reach the pod differs, and that is passed in as
`rank_env`.
"""

from __future__ import annotations

import hashlib
import json
import re

import yaml

from shardline.engines.command import node_torchrun_command
from shardline.engines.kubernetes.preemption import termination_grace_seconds
from shardline.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED, SpecError
from shardline.network_profiles import HostMount, NetworkProfile, get_profile, gpu_network_names, nccl_environment
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_hash

BAD_INPUT_FAILURE = "exit code 2 matching FailJob rule"
"""The message of a Job failed by the podFailurePolicy rule for exit code 2 (bad input): JobSet rules match it."""

SPEC_MOUNT = "/etc/shardline"
SPEC_PATH = f"{SPEC_MOUNT}/spec.yaml"
CONTAINER = "node"
USER_ID = 1000
NAME_LIMIT = 40
"""Object names stay short enough that JobSet pod hostnames (`<name>-node-0-<i>`) fit a 63-char DNS label."""
GCSFUSE_WRITE_OPTIONS = ("implicit-dirs", "metadata-cache:ttl-secs:60", "metadata-cache:negative-ttl-secs:0",
                         "write:enable-streaming-writes:true")
GCSFUSE_READ_OPTIONS = ("implicit-dirs", "metadata-cache:ttl-secs:60", "metadata-cache:stat-cache-max-size-mb:-1",
                        "metadata-cache:type-cache-max-size-mb:-1", "file-system:kernel-list-cache-ttl-secs:60",
                        "file-cache:cache-file-for-range-read:true", "file-cache:enable-parallel-downloads:true")
"""The write mount changes what the read mount shows (checkpoints, run directories): metadata expires after 60 s
there too. The file cache is bounded by launch.kubernetes.storage.file_cache (`file-cache:max-size-mb`)."""
GCSFUSE_CACHE_VOLUME = "gke-gcsfuse-cache"
"""The GCS FUSE CSI driver keeps its file cache in a pod volume of this name when the pod defines one."""
NODE_SHARE = 0.9
"""Share of a GKE node's vCPUs and memory a training pod requests when launch.kubernetes.cpu/memory are unset:
the rest is the kubelet's reservation (about 1 vCPU and 2-3 % of memory on these machine types) and DaemonSets."""
_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_UNITS = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def object_name(spec: JobSpec) -> str:
    """Objects are named after the run id (unique per launch), shortened with a hash when too long."""
    run_id = spec.run.id or spec.run.name
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", run_id):
        raise SpecError("run.id", f"{run_id!r} cannot name Kubernetes objects (lowercase letters, digits and '-', "
                        "starting and ending with a letter or digit)",
                        "use a run.id in that form (ids shardline assigns always are)")
    if len(run_id) <= NAME_LIMIT:
        return run_id
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{run_id[:NAME_LIMIT - 9].rstrip('-')}-{digest}"


def labels(spec: JobSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "shardline", "app.kubernetes.io/managed-by": "shardline",
            "shardline.dev/run-name": spec.run.name, "shardline.dev/run-id": object_name(spec),
            "shardline.dev/spec-hash": spec_hash(spec)[:16]}


def image_ref(spec: JobSpec) -> str:
    image = spec.launch.image
    if not image:
        raise SpecError("launch.image", "is not set", "build the image from the project's Dockerfile, push it, and "
                        "set launch.image (and launch.image_digest to pin it)")
    if spec.launch.image_digest:
        repo = image.split("@")[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        return f"{repo}@{spec.launch.image_digest}"
    return image


def node_command(spec: JobSpec, task: str, rdzv_endpoint: str | None = None,
                 workdir: str | None = None) -> list[str]:
    """Wait for the rendezvous host's DNS record (and enter `workdir` where the engine cannot set the
    container's working directory), then the one torchrun line (docs/architecture.md §6). Where the fabric ships
    an environment script (gIB), bash sources it first; the script path and the command reach bash as arguments
    ("$0", "$@"), never inside the shell text."""
    chdir = ["--chdir", workdir] if workdir else []
    command = ["python", "-m", "shardline.engines.wait_rendezvous", *chdir, "--",
               *node_torchrun_command(spec, SPEC_PATH, task, rdzv_endpoint=rdzv_endpoint)]
    script = get_profile(spec.launch.profile).nccl_env_script
    return ["bash", "-c", 'source "$0" && exec "$@"', script, *command] if script else command


def check_restart_strategy(spec: JobSpec, target: str) -> None:
    """Only a JobSet running shardline's own image restarts anything but by recreating it."""
    strategy = spec.launch.kubernetes.restart_strategy
    if strategy == "Recreate":
        return
    if target == "trainjob":
        raise SpecError("launch.kubernetes.restart_strategy", f"is {strategy}, but a TrainJob's JobSet failure "
                        "policy is its TrainingRuntime's", "set failurePolicy.restartStrategy in the runtime "
                        f"({spec.launch.kubernetes.trainjob_runtime}), or use --target jobset")
    if target != "jobset":
        raise SpecError("launch.kubernetes.restart_strategy", f"is {strategy}, a JobSet failure policy, but "
                        f"--target {target} is not a JobSet", "use --target jobset, or leave it at Recreate")
    if spec.launch.kubernetes.restarts_in_place and spec.train.engine != "torch":
        raise SpecError("launch.kubernetes.restart_strategy", "is InPlaceRestart, whose agent runs in shardline's "
                        f"image, but train.engine={spec.train.engine} runs its own image",
                        "use Recreate or BlockingRecreate for MaxText")


IN_PLACE_ENV = (("JOBSET_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
                ("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"))


def in_place_container(container: dict) -> None:
    """The node command behind the in-place restart agent (engines/kubernetes/inplace_agent.py), restarted in
    place (Kubernetes ContainerRestartRules) on every exit but success, bad input and preemption: those end the
    pod, and the Job's podFailurePolicy decides (fail the JobSet / replace the pod)."""
    container["command"] = ["python", "-m", "shardline.engines.kubernetes.inplace_agent", "--",
                            *container["command"]]
    container["env"] = [*container["env"], *({"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}}
                                             for n, p in IN_PLACE_ENV)]
    container["restartPolicy"] = "Never"
    container["restartPolicyRules"] = [{"action": "Restart", "exitCodes": {
        "operator": "NotIn", "values": [EXIT_OK, EXIT_BAD_INPUT, EXIT_PREEMPTED]}}]


def container_env(spec: JobSpec, rank_env: list[dict]) -> list[dict]:
    k = spec.launch.kubernetes
    env = list(rank_env)
    env += [{"name": n, "value": v} for n, v in nccl_environment(get_profile(spec.launch.profile)).items()]
    env += [{"name": "SHARDLINE_IMAGE", "value": image_ref(spec)},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    if spec.launch.image_digest:
        env.append({"name": "SHARDLINE_IMAGE_DIGEST", "value": spec.launch.image_digest})
    for name, ref in sorted(k.secret_env.items()):
        env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}})
    return env


def node_requests(profile: NetworkProfile) -> dict[str, str]:
    """cpu and memory a whole-node training pod requests on this profile's machine type ({} when unknown)."""
    if not (profile.node_cpus and profile.node_memory_gib):
        return {}
    return {"cpu": str(int(profile.node_cpus * NODE_SHARE)), "memory": f"{int(profile.node_memory_gib * NODE_SHARE)}Gi"}


def resources(spec: JobSpec) -> dict:
    """GPUs per pod, and cpu/memory: launch.kubernetes.cpu/memory, else sized to the profile's node. A pod that
    requests only GPUs is the first the kubelet evicts under memory pressure (its memory-backed /dev/shm counts
    as memory) and counts nothing against Kueue's cpu/memory quota."""
    k = spec.launch.kubernetes
    amounts: dict[str, str] = {}
    if k.gpu_resource:
        amounts[k.gpu_resource] = str(spec.parallel.nproc_per_node)
        amounts |= node_requests(get_profile(spec.launch.profile))
    if k.cpu:
        amounts["cpu"] = k.cpu
    if k.memory:
        amounts["memory"] = k.memory
    limits = {r: v for r, v in amounts.items() if r == k.gpu_resource}  # extended resources need limit = request
    return {"requests": amounts, "limits": limits} if amounts else {}


def _storage_volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    st = spec.launch.kubernetes.storage
    if st.kind == "none":
        return [], []
    if st.kind == "pvc":
        if not st.claim:
            raise SpecError("launch.kubernetes.storage.claim", "is required for storage kind pvc",
                            "name a ReadWriteMany PersistentVolumeClaim in the job's namespace")
        source = {"persistentVolumeClaim": {"claimName": st.claim}}
        return ([{"name": "storage", **source}, {"name": "storage-read", **source}],
                [{"name": "storage", "mountPath": st.mount_path},
                 {"name": "storage-read", "mountPath": st.read_path, "readOnly": True}])
    if not st.bucket:
        raise SpecError("launch.kubernetes.storage.bucket", "is required for storage kind gcsfuse",
                        "name the GCS bucket that holds runs, data and weights")
    owner = f"uid={USER_ID},gid={USER_ID}"

    def fuse(name: str, options: tuple[str, ...], read_only: bool, extra: dict) -> dict:
        attrs = {"bucketName": st.bucket, "mountOptions": ",".join((*options, owner)), **extra}
        return {"name": name, "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": read_only,
                                      "volumeAttributes": attrs}}

    read_options = (*GCSFUSE_READ_OPTIONS, f"file-cache:max-size-mb:{quantity_bytes(st.file_cache) // 2**20}")
    return ([fuse("storage", GCSFUSE_WRITE_OPTIONS, False, {}),
             fuse("storage-read", read_options, True, {"gcsfuseMetadataPrefetchOnMount": "true",
                                                       "fileCacheForRangeRead": "true"}),
             {"name": GCSFUSE_CACHE_VOLUME, "emptyDir": {"sizeLimit": st.file_cache}}],
            [{"name": "storage", "mountPath": st.mount_path},
             {"name": "storage-read", "mountPath": st.read_path, "readOnly": True}])


def quantity_bytes(value: str) -> int:
    """A Kubernetes quantity without fractions (`100Gi`, `500M`, `1024`) in bytes."""
    m = _QUANTITY.match(value)
    if not m:
        raise SpecError("launch.kubernetes.storage.file_cache", f"{value!r} is not a whole quantity",
                        "write e.g. 100Gi or 500000Mi")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _host_volume(mount: HostMount) -> dict:
    return {"name": mount.name, "hostPath": {"path": mount.host_path}}


def _mount(mount: HostMount) -> dict:
    return {"name": mount.name, "mountPath": mount.mount_path, **({"readOnly": True} if mount.read_only else {})}


def gpu_volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """Host paths of the profile's fabric: every volume the trainer or the RxDM sidecar mounts, and the trainer's
    mounts. Only GPU pods get them (a CPU node has no /home/kubernetes/bin/gib)."""
    profile = get_profile(spec.launch.profile)
    daemon = profile.rx_daemon.mounts if profile.rx_daemon else ()
    by_name = {m.name: m for m in (*profile.host_mounts, *daemon)}
    return [_host_volume(m) for m in by_name.values()], [_mount(m) for m in profile.host_mounts]


def volumes_and_mounts(spec: JobSpec, config_map: str, gpu: bool = True) -> tuple[list[dict], list[dict]]:
    """The pod's volumes and the trainer's mounts: spec, /dev/shm, the fabric's host paths (`gpu`), storage."""
    k = spec.launch.kubernetes
    volumes = [{"name": "spec", "configMap": {"name": config_map}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    mounts = [{"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if gpu:
        host_volumes, host_mounts = gpu_volumes(spec)
        volumes, mounts = volumes + host_volumes, mounts + host_mounts
    storage_volumes, storage_mounts = _storage_volumes(spec)
    return volumes + storage_volumes, mounts + storage_mounts


def rx_daemon_container(spec: JobSpec) -> dict | None:
    """The fabric's receive-datapath daemon as a native sidecar (init container, restartPolicy Always: started
    before the trainer, stopped after it, so a Job's pod completes). It runs as root with the capabilities the
    upstream pod gives it; the trainer's own security context is unchanged."""
    daemon = get_profile(spec.launch.profile).rx_daemon
    if daemon is None:
        return None
    return {"name": daemon.name, "image": daemon.image, "command": list(daemon.command), "restartPolicy": "Always",
            "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                                "capabilities": {"add": list(daemon.capabilities)}},
            "volumeMounts": [_mount(m) for m in daemon.mounts]}


def check_whole_node(spec: JobSpec, profile: NetworkProfile) -> None:
    """A pod that takes every GPU NIC of its node must take every GPU too: with fewer processes the node's other
    GPUs idle (no second pod can get a NIC) while Kueue counts only the GPUs requested."""
    nproc = spec.parallel.nproc_per_node
    if profile.gpu_nics and spec.launch.kubernetes.gpu_resource and nproc != profile.gpus_per_node:
        raise SpecError("parallel.nproc_per_node", f"is {nproc}, but profile {profile.name} gives each pod all "
                        f"{profile.gpu_nics} GPU NICs of a {profile.gpus_per_node}-GPU node",
                        f"set parallel.nproc_per_node={profile.gpus_per_node} (fewer nodes for the same world "
                        "size), or use launch.profile=generic for pods that share a node")


def gpu_annotations(spec: JobSpec) -> dict[str, str]:
    """What only a GPU pod carries: its GPU NICs (GKE multi-networking) and the RxDM sidecar's devices (GKE's
    NRI device injector)."""
    k = spec.launch.kubernetes
    profile = get_profile(spec.launch.profile)
    out: dict[str, str] = {}
    if profile.gpu_nics:
        check_whole_node(spec, profile)
        names = gpu_network_names(profile, k.gpu_networks)
        if len(names) != profile.gpu_nics:
            raise SpecError("launch.kubernetes.gpu_networks", f"has {len(names)} names but profile "
                            f"{profile.name} has {profile.gpu_nics} GPU NICs", "list one network per GPU NIC")
        interfaces = [{"interfaceName": "eth0", "network": "default"}]
        for i, net in enumerate([*profile.extra_networks, *names]):
            interfaces.append({"interfaceName": f"eth{i + 1}", "network": net})
        out["networking.gke.io/default-interface"] = "eth0"
        out["networking.gke.io/interfaces"] = json.dumps(interfaces)
    if profile.rx_daemon:
        out[f"devices.gke.io/container.{profile.rx_daemon.name}"] = yaml.safe_dump(
            [{"path": d} for d in profile.rx_daemon.devices], default_flow_style=False)
    return out


def storage_annotations(spec: JobSpec) -> dict[str, str]:
    """GCS FUSE: the sidecar may use what the node has ("0" limits) and requests the file cache's disk."""
    st = spec.launch.kubernetes.storage
    if st.kind != "gcsfuse":
        return {}
    out = {"gke-gcsfuse/volumes": "true"}
    for r in ("cpu", "memory", "ephemeral-storage"):
        out[f"gke-gcsfuse/{r}-limit"] = "0"
    out["gke-gcsfuse/ephemeral-storage-request"] = st.file_cache
    return out


def pod_annotations(spec: JobSpec) -> dict[str, str]:
    k = spec.launch.kubernetes
    out = gpu_annotations(spec) | storage_annotations(spec)
    if k.topology:
        out[f"kueue.x-k8s.io/podset-{k.topology_mode}-topology"] = k.topology
    if spec.observe.metrics_port:  # rank 0 serves /metrics; other ranks' pods answer nothing there
        from shardline.observe.prometheus import scrape_annotations

        out |= scrape_annotations(spec.observe.metrics_port)
    return out


def node_selector(spec: JobSpec) -> dict[str, str]:
    profile = get_profile(spec.launch.profile)
    out = {"cloud.google.com/gke-accelerator": profile.accelerator} if profile.accelerator else {}
    return out | spec.launch.kubernetes.node_selector


def tolerations(spec: JobSpec) -> list[dict]:
    k = spec.launch.kubernetes
    out = [t.model_dump(exclude_none=True) for t in k.tolerations]
    if k.gpu_resource and not any(t.key == k.gpu_resource for t in k.tolerations):
        out.append({"key": k.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    return out


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def container_security(spec: JobSpec) -> dict:
    """Drop every capability, then add back only what the profile's fabric needs (IPC_LOCK for RDMA)."""
    added = get_profile(spec.launch.profile).capabilities
    if not added:
        return CONTAINER_SECURITY
    return {**CONTAINER_SECURITY, "capabilities": {"drop": ["ALL"], "add": list(added)}}


def container_ports(spec: JobSpec) -> list[dict]:
    """The metrics port, named, so that a PodMonitoring finds it (port 0 picks a free port: nothing to declare).
    Every pod declares it; only rank 0 listens, and the PodMonitoring selects rank 0's pod."""
    from shardline.observe.prometheus import METRICS_PORT_NAME

    port = spec.observe.metrics_port
    return [{"name": METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}] if port else []


def pod_spec(spec: JobSpec, task: str, config_map: str, rank_env: list[dict], subdomain: str | None,
             rdzv_endpoint: str | None = None) -> dict:
    """A complete pod spec for one node of the job; `rdzv_endpoint` (host:port) is an elastic job's c10d store."""
    k = spec.launch.kubernetes
    volumes, mounts = volumes_and_mounts(spec, config_map)
    container = {"name": CONTAINER, "image": image_ref(spec), "command": node_command(spec, task, rdzv_endpoint),
                 "env": container_env(spec, rank_env), "volumeMounts": mounts,
                 "securityContext": container_security(spec)}
    if spec.launch.kubernetes.restarts_in_place:
        in_place_container(container)
    if ports := container_ports(spec):
        container["ports"] = ports
    if res := resources(spec):
        container["resources"] = res
    if k.storage.kind != "none":
        container["workingDir"] = k.storage.mount_path
    out = {"restartPolicy": "Never", "serviceAccountName": k.service_account,
           # only the in-place agent calls the Kubernetes API (its own JobSet and pod); the trainer never does
           "automountServiceAccountToken": spec.launch.kubernetes.restarts_in_place, "securityContext": POD_SECURITY,
           "terminationGracePeriodSeconds": termination_grace_seconds(spec),
           "containers": [container], "volumes": volumes}
    if sidecar := rx_daemon_container(spec):
        out["initContainers"] = [sidecar]
    if subdomain:
        out["subdomain"] = subdomain
    if k.priority_class:
        out["priorityClassName"] = k.priority_class
    if selector := node_selector(spec):
        out["nodeSelector"] = selector
    if tol := tolerations(spec):
        out["tolerations"] = tol
    return out


def pod_template(spec: JobSpec, task: str, config_map: str, rank_env: list[dict], subdomain: str | None,
                 rdzv_endpoint: str | None = None) -> dict:
    meta: dict = {"labels": labels(spec)}
    if ann := pod_annotations(spec):
        meta["annotations"] = ann
    return {"metadata": meta, "spec": pod_spec(spec, task, config_map, rank_env, subdomain, rdzv_endpoint)}
