"""What a Kubeflow TrainJob can carry of the pod every other target runs, and a named error for what it cannot.

A TrainJob (trainer.kubeflow.org/v1alpha1) names a (Cluster)TrainingRuntime, which owns the JobSet, its pod
template and failure policy. The TrainJob sets the trainer container's image, command, env and resources
(`spec.trainer`) and may patch the runtime's `node` pod only in the fields `runtimePatches` lists (Trainer ≥ 2.2).
Every field of the pod the other targets run (engines/kubernetes/pod.py) is carried one of those ways, carried another
way, or refused with the spec field that asks for it — never dropped:
- `automountServiceAccountToken: false` has no patch field: an empty read-only volume is mounted over the token
  path instead, and the API server adds no token to a container that already mounts that path;
- `workingDir` has none either: the node command enters the directory itself (wait_rendezvous --chdir);
- `priorityClassName` cannot be carried: launch.kubernetes.priority_class is refused;
- an elastic job (launch.min_nnodes) cannot run: Trainer's torch plugin has no elastic policy, injects a
  fixed PET_NNODES, and its rendezvous host belongs to the runtime's JobSet, not to an object rendered here;
- a GPUDirect-TCPX(O) profile cannot run: its RxDM sidecar is a container with its own image and command, and a
  runtime patch may only set env, volume mounts and security context of containers the runtime already has.
`restartPolicy` is the runtime's own (its Job template), like its JobSet's failure and success policies.
"""

from __future__ import annotations

from shardline.engines.kubernetes import pod as k8s_pod
from shardline.errors import SpecError
from shardline.network_profiles import get_profile
from shardline.spec import JobSpec

TARGET = "trainjob"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
NO_TOKEN_VOLUME = "no-api-token"  # not `kube-api-access-*`: the API server would take that for its token volume
POD_PATCH_KEYS = ("serviceAccountName", "securityContext", "terminationGracePeriodSeconds", "volumes",
                  "nodeSelector", "tolerations")
CONTAINER_PATCH_KEYS = ("name", "volumeMounts", "securityContext")
TRAINER_KEYS = {"image": "image", "command": "command", "env": "env", "resources": "resourcesPerNode"}
RUNTIME_OWNED = ("restartPolicy",)
CARRIED_OTHERWISE = ("automountServiceAccountToken", "containers")
CONTAINER_CARRIED_OTHERWISE = ("workingDir", "ports")
"""workingDir goes into the command; ports cannot be patched (Trainer's container patch has env, securityContext
and volumeMounts only): the runtime's pod template must name the metrics port for a PodMonitoring to find it."""


def check_trainjob(spec: JobSpec) -> None:
    """Refuse the spec fields a TrainJob cannot honour, each with what to do instead."""
    if spec.is_elastic:
        raise SpecError("launch.min_nnodes", f"is {spec.launch.min_nnodes} of launch.nnodes={spec.launch.nnodes} "
                        "(an elastic job), which target trainjob cannot run: Kubeflow Trainer has no elastic policy, "
                        "gives every node a fixed PET_NNODES, and owns the rendezvous host",
                        "use --target jobset or k8s-job for an elastic job, or unset launch.min_nnodes")
    daemon = get_profile(spec.launch.profile).rx_daemon
    if daemon is not None:
        raise SpecError("launch.profile", f"is {spec.launch.profile}, whose pods need the {daemon.name} sidecar, "
                        "which target trainjob cannot add (runtime patches set only env, volume mounts and security "
                        "context of the runtime's own containers)", "use --target jobset or k8s-job, or a "
                        f"TrainingRuntime whose pod template already runs {daemon.name}, and launch with "
                        "launch.profile=generic plus its NCCL settings")
    if spec.launch.kubernetes.priority_class:
        raise SpecError("launch.kubernetes.priority_class", f"is {spec.launch.kubernetes.priority_class!r}, but "
                        "target trainjob cannot set a pod's priorityClassName (Trainer's runtime patches have no "
                        "such field)", "use --target jobset or k8s-job; or set priorityClassName in the pod "
                        f"template of the runtime {spec.launch.kubernetes.trainjob_runtime!r} and unset this "
                        "field; or rank queued jobs with launch.kubernetes.workload_priority_class (Kueue)")


def split_pod(spec: JobSpec, task: str, pod: dict) -> tuple[dict, dict]:
    """The pod spec of k8s_pod.pod_spec as `spec.trainer` and the runtime patch's pod spec."""
    unplaced = set(pod) - {*POD_PATCH_KEYS, *RUNTIME_OWNED, *CARRIED_OTHERWISE}
    node = pod["containers"][0]
    unplaced |= set(node) - {*TRAINER_KEYS, *CONTAINER_PATCH_KEYS, *CONTAINER_CARRIED_OTHERWISE}
    if unplaced:  # a pod field added in k8s_pod without deciding how a TrainJob carries it
        raise AssertionError(f"target {TARGET} has no place for pod fields {sorted(unplaced)}")
    trainer = {dst: node[src] for src, dst in TRAINER_KEYS.items() if src in node}
    if "workingDir" in node:
        trainer["command"] = k8s_pod.node_command(spec, task, workdir=node["workingDir"])
    trainer |= {"numNodes": spec.launch.nnodes, "numProcPerNode": spec.parallel.nproc_per_node}
    patched = {k: pod[k] for k in POD_PATCH_KEYS if k in pod}
    container = {k: node[k] for k in CONTAINER_PATCH_KEYS if k in node}
    if pod.get("automountServiceAccountToken") is False:
        patched["volumes"] = [*patched.get("volumes", []), {"name": NO_TOKEN_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}}]
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     {"name": NO_TOKEN_VOLUME, "mountPath": TOKEN_PATH, "readOnly": True}]
    patched["containers"] = [container]
    return trainer, patched
