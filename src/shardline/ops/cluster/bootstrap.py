"""`shardline cluster bootstrap`: the admin objects a cluster needs before `shardline launch` can queue a job.

Built from the job spec as plain dicts (typed data, never text templates):

- Kueue: one ResourceFlavor per capacity source (DWS flex-start, spot, or plain on-demand/reserved nodes) →
  a ClusterQueue with GPU/CPU/memory quota that preempts lower-priority workloads → the LocalQueue that
  `launch.kubernetes.queue` names, in the spec's namespace. With DWS, an AdmissionCheck and its
  ProvisioningRequestConfig (GKE queued provisioning) gate the DWS flavor only. Optional
  WorkloadPriorityClasses (`shardline-low|medium|high`).
- Namespace: on a GKE GPU profile the training pods mount host paths (the fabric's libraries, /sys for the
  RxDM sidecar), which only the Pod Security level "privileged" admits
  (https://kubernetes.io/docs/concepts/security/pod-security-standards/): the namespace is labelled so, with an
  annotation saying why.
- Identity: the trainer ServiceAccount `launch.kubernetes.service_account` with no API token at all (training
  pods never call the Kubernetes API; GCS FUSE and the GKE metadata server authenticate the pod without a
  mounted token) — except with `launch.kubernetes.restart_strategy: InPlaceRestart`, whose agent may watch its
  JobSet and annotate its own pod (the `shardline-inplace-agent` Role, bound to that ServiceAccount) —
  and a `shardline-launcher` Role holding exactly what a *user* of `shardline
  launch|status|logs|wait|cancel` needs in that namespace (every target: Job, JobSet, TrainJob, RayJob with its
  NetworkPolicy), plus a ClusterRole that reads the one CRD `--target trainjob` checks the Trainer version in.
  Bind them with `--bind-launcher`, or `kubectl create rolebinding shardline-launcher --role shardline-launcher
  --user alice@example.com -n NS` and the matching `kubectl create clusterrolebinding`.
- Metrics (`--managed-prometheus`, on GKE with Google Cloud Managed Service for Prometheus): one PodMonitoring
  in the namespace that scrapes rank 0 of every shardline job through its container port `metrics`. It lives
  here, not with each job, because it serves every job of the namespace, needs no monitoring permission in the
  launcher Role, and leaves `shardline launch` working on clusters without the PodMonitoring CRD.

Output: ONE multi-document `bootstrap.yaml`, in apply order (Namespace, cluster-scoped Kueue objects with each
reference's target first, then namespaced objects). `kubectl apply --server-side -f bootstrap.yaml` applies
documents in file order, so nothing is applied before what it names, and one file is one reviewable diff.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardline.errors import SpecError
from shardline.hardware import tpu_slice
from shardline.network_profiles import NetworkProfile, get_profile
from shardline.observe.prometheus import pod_monitoring
from shardline.spec import JobSpec

KUEUE_API = "kueue.x-k8s.io/v1beta2"
"""Storage version of the Kueue CRDs the project pins (v1beta1 is still served, but deprecated)."""

DWS_PROVISIONING_CLASS = "queued-provisioning.gke.io"
DWS_QUEUED_TAINT = "cloud.google.com/gke-queued"
"""Taint GKE puts on nodes created by queued provisioning (DWS flex-start)."""
ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
TPU_RESOURCE = "google.com/tpu"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
HOSTNAME = "kubernetes.io/hostname"
GKE_TOPOLOGY_LEVELS = ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock",
                       "cloud.google.com/gce-topology-host", HOSTNAME)
"""The labels GKE puts on GPU nodes with compact placement / reservations (block, sub-block, host), and the node."""
DEFAULT_LOCAL_QUEUE = "shardline"
LAUNCHER_ROLE = "shardline-launcher"
CRD_READER_ROLE = "shardline-launcher-crd-reader"
IN_PLACE_ROLE = "shardline-inplace-agent"
TRAINJOB_CRD = "trainjobs.trainer.kubeflow.org"
"""The CRD `launch --target trainjob` reads (engines/kubernetes/trainer_api.py; ops/ may not import launch/)."""
POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"
ADMISSION_CHECK = "shardline-dws"
PRIORITY_CLASSES = {"shardline-low": 100, "shardline-medium": 1000, "shardline-high": 10000}
LABELS = {"app.kubernetes.io/managed-by": "shardline", "app.kubernetes.io/component": "cluster-bootstrap"}
BOOTSTRAP_FILE = "bootstrap.yaml"

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_WRITE = ["create", "get", "list", "watch", "delete"]
_READ = ["get", "list", "watch"]


@dataclass(frozen=True)
class BootstrapOptions:
    """What the cluster admin chooses; everything else comes from the job spec."""

    gpus: int | None = None
    """GPU quota per flavor (None: the spec's job — nnodes full nodes on a GKE profile, else its world size)."""
    cpu: str | None = None
    """CPU quota per flavor (None: nodes × the profile's vCPUs per node)."""
    memory: str | None = None
    """Memory quota per flavor (None: nodes × the profile's memory per node)."""
    dws: bool = False
    spot: bool = False
    priority_classes: bool = False
    cluster_queue: str = "shardline"
    bind_launcher: tuple[str, ...] = ()
    """RoleBinding subjects for the launcher Role: user:NAME, group:NAME or serviceaccount:[NS/]NAME."""
    managed_prometheus: bool = False
    """A PodMonitoring (GKE Managed Prometheus) for rank 0's `/metrics`; needs observe.metrics_port set."""


def _meta(name: str, namespace: str | None = None) -> dict:
    meta: dict = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = dict(LABELS)
    return meta


def _gpu_default(spec: JobSpec, profile: NetworkProfile) -> int:
    if profile.accelerator:  # whole nodes: a GKE GPU VM is never shared between jobs
        return spec.launch.nnodes * profile.gpus_per_node
    return spec.world_size


def _check_quantity(where: str, value: str) -> str:
    if not _QUANTITY.match(value):
        raise SpecError(where, f"{value!r} is not a Kubernetes quantity", "write e.g. 224, 500m, 3968Gi")
    return value


def _is_tpu(spec: JobSpec) -> bool:
    return spec.train.engine == "maxtext"


def _topology_aware(spec: JobSpec) -> bool:
    """GPU/CPU flavors under Kueue TAS (launch.kubernetes.topology); TPU slices are placed by their node pools."""
    return bool(spec.launch.kubernetes.topology) and not _is_tpu(spec)


def _tpu_quota(spec: JobSpec, opts: BootstrapOptions) -> dict[str, int | str]:
    """MaxText on TPU slices: every chip of every slice (GKE's device plugin resource), plus cpu/memory where the
    pods request them and a quantity is given (a TPU VM's size is not in the catalogue)."""
    if opts.gpus is not None:
        raise SpecError("--gpus", "the spec runs MaxText on TPU slices (train.engine maxtext)",
                        "drop --gpus: the quota is the chips of launch.tpu's slices")
    tp = spec.launch.tpu
    quota: dict[str, int | str] = {}
    for resource, option, request in (("cpu", opts.cpu, spec.launch.kubernetes.cpu),
                                      ("memory", opts.memory, spec.launch.kubernetes.memory)):
        if option is not None:
            quota[resource] = _check_quantity(f"--{resource}", option)
        elif request is not None:
            raise SpecError(f"launch.kubernetes.{resource}", f"TPU pods request {resource} {request!r}, so Kueue "
                            "needs a quota for it", f"pass --{resource} QUANTITY")
    quota[TPU_RESOURCE] = tpu_slice(tp.type, tp.topology).chips * tp.slices
    return quota


def resource_quota(spec: JobSpec, opts: BootstrapOptions) -> dict[str, int | str]:
    """Nominal quota per flavor: {resource name: quantity}, in coveredResources order."""
    if _is_tpu(spec):
        return _tpu_quota(spec, opts)
    profile = get_profile(spec.launch.profile)
    gpu_resource = spec.launch.kubernetes.gpu_resource
    quota: dict[str, int | str] = {}
    nodes = spec.launch.nnodes
    if opts.gpus is not None and opts.gpus < 1:
        raise SpecError("--gpus", f"{opts.gpus} GPUs is no quota", "give at least 1")
    if gpu_resource is not None:
        gpus = opts.gpus if opts.gpus is not None else _gpu_default(spec, profile)
        nodes = math.ceil(gpus / profile.gpus_per_node)
    elif opts.gpus is not None:
        raise SpecError("--gpus", "launch.kubernetes.gpu_resource is null (a CPU-only cluster)",
                        "drop --gpus, or set launch.kubernetes.gpu_resource")
    for resource, option, per_node, unit, request in (
        ("cpu", opts.cpu, profile.node_cpus, "", spec.launch.kubernetes.cpu),
        ("memory", opts.memory, profile.node_memory_gib, "Gi", spec.launch.kubernetes.memory),
    ):
        if option is not None:
            quota[resource] = _check_quantity(f"--{resource}", option)
        elif per_node is not None:
            quota[resource] = f"{nodes * per_node}{unit}" if unit else nodes * per_node
        elif request is not None:  # pods request it, so Kueue needs a quota for it; we cannot size it
            raise SpecError(f"launch.kubernetes.{resource}", f"pods request {resource} {request!r} but profile "
                            f"{profile.name!r} does not know the node size", f"pass --{resource} QUANTITY")
    if gpu_resource is not None:
        quota[gpu_resource] = gpus
    if not quota:
        raise SpecError("--cpu", "nothing to put a quota on: no GPU resource, no CPU or memory quota",
                        "pass --cpu and --memory, or set launch.kubernetes.gpu_resource")
    return quota


def dws_flavor_name(spec: JobSpec) -> str:
    if _is_tpu(spec):
        return f"shardline-tpu-{spec.launch.tpu.type}-{spec.launch.tpu.topology}-dws"
    return f"shardline-{spec.launch.profile}-dws"


def _tolerations(spec: JobSpec) -> list[dict]:
    if _is_tpu(spec):  # GKE taints every TPU node with google.com/tpu
        return [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if spec.launch.kubernetes.gpu_resource == "nvidia.com/gpu":  # GKE taints every GPU node with it
        return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return []


def topology_levels(spec: JobSpec) -> list[str]:
    """The Kueue Topology's node labels, highest first, always ending at the node itself: Kueue replaces a failed
    node of an admitted workload only in a topology whose lowest level is kubernetes.io/hostname."""
    requested = spec.launch.kubernetes.topology
    levels = list(GKE_TOPOLOGY_LEVELS) if get_profile(spec.launch.profile).accelerator else [requested, HOSTNAME]
    levels = list(dict.fromkeys(levels))
    if requested not in levels:
        raise SpecError("launch.kubernetes.topology", f"{requested!r} is not a level of GKE's node topology",
                        f"use one of {', '.join(levels)}")
    return levels


def topology_object(spec: JobSpec) -> dict:
    return {"apiVersion": KUEUE_API, "kind": "Topology", "metadata": _meta(topology_name(spec)),
            "spec": {"levels": [{"nodeLabel": level} for level in topology_levels(spec)]}}


def topology_name(spec: JobSpec) -> str:
    return f"shardline-{spec.launch.profile}"


def resource_flavors(spec: JobSpec, opts: BootstrapOptions) -> list[dict]:
    """One flavor per capacity source, in the order Kueue should try them: DWS, then spot (or one plain flavor).
    With launch.kubernetes.topology, each is a TAS flavor of the Topology `topology_object` renders."""
    profile = get_profile(spec.launch.profile)
    labels = {ACCELERATOR_LABEL: profile.accelerator} if profile.accelerator else {}
    if _topology_aware(spec) and not labels:
        labels = dict(spec.launch.kubernetes.node_selector)
        if not labels:  # Kueue: "at least one nodeLabel is required when topology is set"
            raise SpecError("launch.kubernetes.node_selector", "is empty, but a topology-aware flavor "
                            "(launch.kubernetes.topology) must select its nodes by label",
                            "set launch.kubernetes.node_selector to the training nodes' label")
    base = f"shardline-{profile.name}"
    if _is_tpu(spec):  # the slice's accelerator and topology: one flavor per slice shape
        tp = spec.launch.tpu
        labels = {TPU_ACCELERATOR_LABEL: tpu_slice(tp.type, tp.topology).generation.gke_accelerator,
                  TPU_TOPOLOGY_LABEL: tp.topology}
        base = f"shardline-tpu-{tp.type}-{tp.topology}"
    flavors = []
    if opts.dws:
        tolerations = [*_tolerations(spec), {"key": DWS_QUEUED_TAINT, "operator": "Exists", "effect": "NoSchedule"}]
        flavors.append((dws_flavor_name(spec), labels, tolerations))
    if opts.spot:
        flavors.append((f"{base}-spot", {**labels, SPOT_LABEL: "true"}, _tolerations(spec)))
    if not flavors:
        flavors.append((base, labels, _tolerations(spec)))
    out = []
    for name, node_labels, tolerations in flavors:
        spec_: dict = {}
        if node_labels:
            spec_["nodeLabels"] = node_labels
        if tolerations:
            spec_["tolerations"] = tolerations
        if _topology_aware(spec):
            spec_["topologyName"] = topology_name(spec)
        out.append({"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": _meta(name), "spec": spec_})
    return out


def _dws_objects(spec: JobSpec) -> list[dict]:
    gpu_resource = TPU_RESOURCE if _is_tpu(spec) else spec.launch.kubernetes.gpu_resource
    if gpu_resource is None:
        raise SpecError("--dws", "DWS provisions GPU nodes but launch.kubernetes.gpu_resource is null",
                        "set launch.kubernetes.gpu_resource: nvidia.com/gpu, or drop --dws")
    config = {
        "apiVersion": KUEUE_API, "kind": "ProvisioningRequestConfig", "metadata": _meta(ADMISSION_CHECK),
        "spec": {
            "provisioningClassName": DWS_PROVISIONING_CLASS,
            "managedResources": [gpu_resource],
            # A failed or expired request releases the quota; the workload re-queues after 1, 2, 4... min.
            "retryStrategy": {"backoffLimitCount": 3, "backoffBaseSeconds": 60, "backoffMaxSeconds": 1800},
            # Pin the admitted pods to exactly the nodes DWS created for this request.
            "podSetUpdates": {"nodeSelector": [{"key": "autoscaling.gke.io/provisioning-request",
                                                "valueFromProvisioningClassDetail": "ResizeRequestName"}]},
        },
    }
    check = {
        "apiVersion": KUEUE_API, "kind": "AdmissionCheck", "metadata": _meta(ADMISSION_CHECK),
        "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request",
                 "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig",
                                "name": ADMISSION_CHECK}},
    }
    return [config, check]


def cluster_queue(spec: JobSpec, opts: BootstrapOptions, flavors: list[dict]) -> dict:
    quota = resource_quota(spec, opts)
    namespace = spec.launch.kubernetes.namespace
    cq_spec: dict = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "queueingStrategy": "BestEffortFIFO",
        "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [{
            "coveredResources": list(quota),
            "flavors": [{"name": f["metadata"]["name"],
                         "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()]} for f in flavors],
        }],
    }
    if opts.dws:
        # Only DWS capacity waits for a ProvisioningRequest; spot or reserved flavors admit on quota alone.
        cq_spec["admissionChecksStrategy"] = {
            "admissionChecks": [{"name": ADMISSION_CHECK, "onFlavors": [dws_flavor_name(spec)]}]}
    return {"apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": _meta(opts.cluster_queue), "spec": cq_spec}


def _subject(text: str, namespace: str) -> dict:
    kind, _, name = text.partition(":")
    fix = "write user:alice@example.com, group:ml-team@example.com or serviceaccount:[NAMESPACE/]NAME"
    if not name:
        raise SpecError("--bind-launcher", f"{text!r} has no subject kind", fix)
    if kind == "user":
        return {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": name}
    if kind == "group":
        return {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": name}
    if kind == "serviceaccount":
        ns, _, sa = name.rpartition("/")
        if not _NAME.match(sa) or (ns and not _NAME.match(ns)):
            raise SpecError("--bind-launcher", f"{text!r} is not a valid service account", fix)
        return {"kind": "ServiceAccount", "name": sa, "namespace": ns or namespace}
    raise SpecError("--bind-launcher", f"unknown subject kind {kind!r} in {text!r}", fix)


def launcher_role(namespace: str) -> dict:
    """What `shardline launch|status|logs|wait|cancel` does in the namespace, and nothing else.

    No Secrets (manifests reference them by name only), no pods/exec, no update/patch, nothing cluster-wide.
    """
    rules = [
        {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": _WRITE},  # resolved spec, rendezvous
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": _WRITE},
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": _WRITE},
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"], "verbs": _WRITE},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": _WRITE},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": _WRITE},  # RayJob head
        {"apiGroups": [""], "resources": ["pods"], "verbs": _READ},  # status per rank; logs find pods
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": _READ},  # why a pod is unschedulable / not pulling
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": _READ},  # why a job is queued
    ]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(LAUNCHER_ROLE, namespace), "rules": rules}


def crd_reader_role() -> dict:
    """Read the TrainJob CRD only: `--target trainjob` reads its schema for the Trainer version first."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": _meta(CRD_READER_ROLE),
            "rules": [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                       "resourceNames": [TRAINJOB_CRD], "verbs": ["get"]}]}


def in_place_agent_role(namespace: str) -> dict:
    """What the in-place restart agent in each JobSet pod does (engines/kubernetes/inplace_agent.py): watch its
    JobSet's status, and write the restart-attempt annotation on its own pod. Nothing else."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(IN_PLACE_ROLE, namespace),
            "rules": [{"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": _READ},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]}


def _binding(role_kind: str, role: str, meta: dict, subjects: list[dict]) -> dict:
    """A RoleBinding (ClusterRoleBinding for a ClusterRole) of `role` to `subjects`."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{role_kind}Binding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
            "subjects": subjects}


def identity_objects(spec: JobSpec, opts: BootstrapOptions) -> list[dict]:
    k8s = spec.launch.kubernetes
    objs: list[dict] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(k8s.service_account, k8s.namespace),
         # The trainer never calls the Kubernetes API: no token in its pods, unless the in-place restart agent
         # runs there (the pod then asks for one itself).
         "automountServiceAccountToken": False},
        launcher_role(k8s.namespace),
        crd_reader_role(),
    ]
    if k8s.restarts_in_place:
        objs += [in_place_agent_role(k8s.namespace),
                 _binding("Role", IN_PLACE_ROLE, _meta(IN_PLACE_ROLE, k8s.namespace),
                          [{"kind": "ServiceAccount", "name": k8s.service_account, "namespace": k8s.namespace}])]
    if opts.bind_launcher:
        subjects = [_subject(s, k8s.namespace) for s in opts.bind_launcher]
        objs += [_binding("Role", LAUNCHER_ROLE, _meta(LAUNCHER_ROLE, k8s.namespace), subjects),
                 _binding("ClusterRole", CRD_READER_ROLE, _meta(f"{CRD_READER_ROLE}-{k8s.namespace}"), subjects)]
    return objs


def namespace_object(spec: JobSpec) -> dict | None:
    """The job namespace, labelled Pod Security "privileged" where the profile's pods mount host paths (the
    fabric's libraries, devices and /sys): the baseline level forbids hostPath volumes."""
    namespace = spec.launch.kubernetes.namespace
    profile = get_profile(spec.launch.profile)
    privileged = bool(profile.host_mounts or profile.rx_daemon)
    if namespace == "default" and not privileged:
        return None  # exists on every cluster, and nothing to label
    meta: dict = {"name": namespace, "labels": dict(LABELS)}
    if privileged:
        meta["labels"][POD_SECURITY_ENFORCE] = "privileged"
        meta["annotations"] = {"shardline.dev/why-privileged": (
            f"profile {profile.name} mounts host paths into training pods (installed NCCL/fabric libraries"
            + (f", devices and /sys for the {profile.rx_daemon.name} sidecar" if profile.rx_daemon else "")
            + "); Pod Security baseline and restricted reject hostPath volumes")}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def _priority_classes(spec: JobSpec) -> list[dict]:
    wanted = spec.launch.kubernetes.workload_priority_class
    if wanted is not None and wanted not in PRIORITY_CLASSES:
        raise SpecError("launch.kubernetes.workload_priority_class",
                        f"{wanted!r} is not one of the classes --priority-classes creates",
                        f"use one of {', '.join(PRIORITY_CLASSES)}, or create {wanted!r} yourself")
    return [{"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass", "metadata": _meta(name), "value": value,
             "description": f"shardline {name.removeprefix('shardline-')} priority; higher preempts lower "
                            "within the ClusterQueue"}
            for name, value in PRIORITY_CLASSES.items()]


def local_queue_name(spec: JobSpec) -> str:
    return spec.launch.kubernetes.queue or DEFAULT_LOCAL_QUEUE


def bootstrap_objects(spec: JobSpec, opts: BootstrapOptions) -> list[dict]:
    """Every object, in apply order."""
    if not _NAME.match(opts.cluster_queue):
        raise SpecError("--cluster-queue", f"{opts.cluster_queue!r} is not a Kubernetes name",
                        "use lowercase letters, digits and '-'")
    namespace = spec.launch.kubernetes.namespace
    objs: list[dict] = []
    if ns := namespace_object(spec):
        objs.append(ns)
    flavors = resource_flavors(spec, opts)
    if _topology_aware(spec):
        objs.append(topology_object(spec))
    objs += flavors
    if opts.dws:
        objs += _dws_objects(spec)
    if opts.priority_classes:
        objs += _priority_classes(spec)
    objs.append(cluster_queue(spec, opts, flavors))
    objs.append({"apiVersion": KUEUE_API, "kind": "LocalQueue",
                 "metadata": _meta(local_queue_name(spec), namespace), "spec": {"clusterQueue": opts.cluster_queue}})
    objs += identity_objects(spec, opts)
    if opts.managed_prometheus:
        if not spec.observe.metrics_port:
            raise SpecError("observe.metrics_port", f"is {spec.observe.metrics_port}, so pods declare no fixed "
                            "metrics port for the PodMonitoring to scrape", "set it to a port, e.g. 9405, or drop "
                            "--managed-prometheus")
        objs.append(pod_monitoring(namespace))
    return objs


def to_yaml(objs: list[dict], header: str) -> str:
    body = yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body


def write_bootstrap(spec: JobSpec, opts: BootstrapOptions, out: Path, extra: list[dict] | None = None) -> Path:
    """Write `out/bootstrap.yaml` (the objects, then `extra`: shardline's Kubeflow Trainer runtime, built in
    engines/kubernetes/runtime.py); returns its path."""
    objs = [*bootstrap_objects(spec, opts), *(extra or [])]
    header = (f"Generated by `shardline cluster bootstrap` for namespace {spec.launch.kubernetes.namespace!r}, "
              f"profile {spec.launch.profile!r}.\nApply (needs Kueue installed): kubectl apply --server-side -f "
              f"{BOOTSTRAP_FILE}\nJobs reach the queue with launch.kubernetes.queue: {local_queue_name(spec)}")
    if _topology_aware(spec):
        header += ("\nTopology-aware (launch.kubernetes.topology): when a node of an admitted job fails, Kueue moves "
                   "its pods to a replacement node in the same domain (feature gate TASFailedNodeReplacement, beta "
                   "and on from Kueue 0.14; enable it on older Kueue)")
    if spec.launch.kubernetes.restarts_in_place:
        header += ("\nInPlaceRestart: the JobSet controller needs --feature-gates=InPlaceRestart=true (alpha); "
                   "`cluster plan gke` sets it")
    out.mkdir(parents=True, exist_ok=True)
    path = out / BOOTSTRAP_FILE
    path.write_text(to_yaml(objs, header))
    return path
