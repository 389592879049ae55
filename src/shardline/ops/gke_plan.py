"""`shardline cluster plan gke`: a reviewable `setup.sh` / `teardown.sh` pair for a GKE training cluster.

The plan is a list of `Step`s (typed data); the two scripts are renderings of it, so teardown is the reverse of
setup by construction. Each step that creates a cloud resource carries the probe that tells whether it exists:
setup runs `probe || create`, teardown runs `probe && delete`, so both scripts can be re-run after a failure.
Steps inside the cluster (Kueue, JobSet, network objects, NCCL installer, bootstrap) have no delete: they go with
the cluster. Machine type, accelerator, NIC count and the NCCL installer come from the profile table
(launch/profiles.py); tunables sit in a variables block at the top of each script.

What it builds (the reference tutorial's stack, made idempotent and profile-driven):
RDMA profiles (A3 Ultra, A4): a gVNIC VPC + subnet + firewall, and one RDMA VPC (`--network-profile
ZONE-vpc-roce`) with one subnet per GPU NIC. TCPX/TCPXO profiles (A3 High/Mega): one VPC + subnet + firewall
per GPU NIC. Then a cluster with Dataplane V2, multi-networking, the GCS FUSE CSI driver and Workload Identity;
GKENetworkParamSet/Network objects named as the launcher's `networking.gke.io/interfaces` annotation expects; a
DWS flex-start node pool and/or a spot node pool (both scale from 0); Kueue and JobSet at pinned versions; the
fabric's node DaemonSets; the `shardline cluster bootstrap` objects (written next to the scripts), with a Managed
Prometheus PodMonitoring for rank 0's `/metrics` (the cluster runs Managed Prometheus and DCGM GPU metrics); the
Kubernetes Secrets the spec's `launch.kubernetes.secret_env` reads, from a file or the environment of setup.sh,
never written anywhere; each GCS bucket the spec uses (the GCS FUSE mount, a gs:// checkpoint.dir) with the IAM
binding for the trainer's Kubernetes service account; and an Artifact Registry Docker repository with the image
built from the checkout's Dockerfile by Cloud Build (cloudbuild.yaml), whose `--set launch.image=…
--set launch.image_digest=…` setup.sh prints and writes to image.txt. Teardown keeps the buckets: they hold the
runs and checkpoints.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardline.errors import SpecError
from shardline.ops.cluster_bootstrap import BOOTSTRAP_FILE, BootstrapOptions, write_bootstrap
from shardline.profiles import NetworkProfile, get_profile, gpu_network_names
from shardline.spec import JobSpec

KUEUE_VERSION = "v0.19.2"
JOBSET_VERSION = "v0.12.0"
RELEASE_CHANNEL = "regular"
GPU_DRIVER_VERSION = "default"
"""The GKE version's default driver: what the NCCL installers and DCGM metrics are tested against."""
SYSTEM_MACHINE_TYPE = "e2-standard-8"
NIC_MTU = {"rdma": 8896, "gpu-nic": 8244}
"""MTU of the GPU NIC VPCs per fabric (GKE's A3 Ultra/A4 RDMA and A3 High/Mega TCPX(O) guides)."""

_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_CLUSTER = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_REPOSITORY = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IMAGE_FILE = "image.txt"
"""Written by setup.sh: the `--set launch.image=… --set launch.image_digest=…` flags of the built image."""
_NIC_LOOP = 'for i in $(seq 0 $((GPU_NICS - 1))); do'
_NIC_LOOP_REVERSED = 'for i in $(seq $((GPU_NICS - 1)) -1 0); do'


@dataclass(frozen=True)
class GkePlanOptions:
    project: str
    zone: str
    region: str | None = None
    """None: the zone's region."""
    cluster: str = "shardline"
    max_nodes: int | None = None
    """Most GPU nodes per node pool (None: the spec's launch.nnodes)."""
    dws: bool = True
    spot: bool = True
    build: bool = True
    """Create the Artifact Registry repository and build the image with Cloud Build."""
    repository: str = "shardline"
    """Artifact Registry Docker repository (in the cluster's region)."""
    source: str = "."
    """The shardline checkout Cloud Build uploads (Dockerfile, cloudbuild.yaml), as setup.sh sees it."""


@dataclass(frozen=True)
class Step:
    """One thing setup does; teardown undoes the steps that have a `delete`, in reverse order."""

    title: str
    create: str
    exists: str | None = None
    """Probe that succeeds when the resource is there: setup skips `create`, teardown runs `delete`."""
    delete: str | None = None
    """None: nothing to undo, or removed with the cluster."""
    delete_if: str | None = None
    """Teardown's probe where `create` needs none (it is idempotent itself); default: `exists`."""
    keep: str | None = None
    """Teardown leaves the resource and says why (a bucket holds the runs and checkpoints)."""
    per_nic: bool = False
    """Repeat for each GPU NIC; `${i}` is the NIC index."""


def _cmd(*parts: str) -> str:
    """One command, continued over lines when long, for review."""
    line = " ".join(parts)
    if len(line) <= 100:
        return line
    lines, current = [], parts[0]
    for part in parts[1:]:
        if len(current) + 1 + len(part) > 100:
            lines.append(current)
            current = "    " + part
        else:
            current += " " + part
    return " \\\n".join([*lines, current])


_P = '--project "${PROJECT}"'
_R = '--region "${REGION}"'
_QUIET = "--quiet"


def _network_steps(profile: NetworkProfile) -> list[Step]:
    def vpc(name: str, *flags: str, beta: bool = False, per_nic: bool = False) -> Step:
        gcloud = "gcloud beta compute networks" if beta else "gcloud compute networks"
        return Step(f"VPC {name}", _cmd(gcloud, "create", f'"{name}"', _P, "--subnet-mode custom", *flags),
                    exists=f'gcloud compute networks describe "{name}" {_P}',
                    delete=_cmd("gcloud compute networks delete", f'"{name}"', _P, _QUIET), per_nic=per_nic)

    def subnet(name: str, network: str, cidr: str, per_nic: bool = False) -> Step:
        return Step(f"subnet {name}", _cmd("gcloud compute networks subnets create", f'"{name}"', _P, _R,
                                           f'--network "{network}"', f'--range "{cidr}"'),
                    exists=f'gcloud compute networks subnets describe "{name}" {_P} {_R}',
                    delete=_cmd("gcloud compute networks subnets delete", f'"{name}"', _P, _R, _QUIET),
                    per_nic=per_nic)

    def firewall(name: str, network: str, per_nic: bool = False) -> Step:
        return Step(f"firewall rule {name} (traffic between nodes on this VPC)",
                    _cmd("gcloud compute firewall-rules create", f'"{name}"', _P, f'--network "{network}"',
                         "--action ALLOW", "--rules tcp:0-65535,udp:0-65535,icmp", "--source-ranges 192.168.0.0/16"),
                    exists=f'gcloud compute firewall-rules describe "{name}" {_P}',
                    delete=_cmd("gcloud compute firewall-rules delete", f'"{name}"', _P, _QUIET), per_nic=per_nic)

    mtu = f"--mtu {NIC_MTU[profile.gcloud_network_flags]}"
    if profile.gcloud_network_flags == "rdma":
        gvnic, rdma = "${NET_PREFIX}-gvnic-net", "${NET_PREFIX}-rdma-net"
        return [
            vpc(gvnic, mtu), subnet("${NET_PREFIX}-gvnic-sub", gvnic, "192.168.0.0/24"), firewall(
                "${NET_PREFIX}-gvnic-internal", gvnic),
            # RoCE needs the zone's RDMA network profile; it is a beta gcloud flag.
            vpc(rdma, '--network-profile "${ZONE}-vpc-roce"', mtu, beta=True),
            subnet("${NET_PREFIX}-rdma-sub-${i}", rdma, "192.168.$((i + 1)).0/24", per_nic=True),
        ]
    net = "${NET_PREFIX}-gpunic-${i}-net"
    return [vpc(net, mtu, per_nic=True),
            subnet("${NET_PREFIX}-gpunic-${i}-sub", net, "192.168.$((i + 1)).0/24", per_nic=True),
            firewall("${NET_PREFIX}-gpunic-${i}-internal", net, per_nic=True)]


def network_objects(spec: JobSpec, profile: NetworkProfile) -> list[dict]:
    """GKENetworkParamSet + Network per extra NIC, named as the launcher's multi-NIC annotation expects."""
    pairs: list[tuple[str, str, str, str]] = []  # (cluster network, VPC, subnet, deviceMode)
    if profile.gcloud_network_flags == "rdma":
        for name in profile.extra_networks:
            pairs.append((name, "${NET_PREFIX}-gvnic-net", "${NET_PREFIX}-gvnic-sub", "NetDevice"))
        for i, name in enumerate(gpu_network_names(profile, spec.launch.kubernetes.gpu_networks)):
            pairs.append((name, "${NET_PREFIX}-rdma-net", f"${{NET_PREFIX}}-rdma-sub-{i}", "RDMA"))
    else:
        for i, name in enumerate(gpu_network_names(profile, spec.launch.kubernetes.gpu_networks)):
            pairs.append((name, f"${{NET_PREFIX}}-gpunic-{i}-net", f"${{NET_PREFIX}}-gpunic-{i}-sub", "NetDevice"))
    objs: list[dict] = []
    for name, vpc, subnet, mode in pairs:
        objs.append({"apiVersion": "networking.gke.io/v1", "kind": "GKENetworkParamSet", "metadata": {"name": name},
                     "spec": {"vpc": vpc, "vpcSubnet": subnet, "deviceMode": mode}})
        objs.append({"apiVersion": "networking.gke.io/v1", "kind": "Network", "metadata": {"name": name},
                     "spec": {"type": "Device", "parametersRef": {"group": "networking.gke.io",
                                                                  "kind": "GKENetworkParamSet", "name": name}}})
    return objs


def _node_pool(name_var: str, *flags: str) -> Step:
    pool = f'"${{{name_var}}}"'
    where = f'--cluster "${{CLUSTER}}" {_P} {_R}'
    return Step(f"GPU node pool {pool}",
                _cmd("gcloud container node-pools create", pool, where, '--node-locations "${ZONE}"',
                     '--machine-type "${MACHINE_TYPE}"',
                     '--accelerator "type=${ACCELERATOR},count=${GPUS_PER_NODE},'
                     'gpu-driver-version=${GPU_DRIVER_VERSION}"',
                     *flags, "--num-nodes 0", "--enable-autoscaling", "--total-min-nodes 0",
                     '--total-max-nodes "${MAX_NODES}"', '"${NODE_NETWORKS[@]}"'),
                exists=f"gcloud container node-pools describe {pool} {where}",
                delete=_cmd("gcloud container node-pools delete", pool, where, _QUIET))


def plan_steps(spec: JobSpec, opts: GkePlanOptions) -> list[Step]:
    profile = get_profile(spec.launch.profile)
    where = f'"${{CLUSTER}}" {_P} {_R}'
    apis = ["container.googleapis.com", "compute.googleapis.com", "monitoring.googleapis.com"]
    if opts.build:
        apis += ["artifactregistry.googleapis.com", "cloudbuild.googleapis.com"]
    steps = [Step("APIs this plan uses", _cmd("gcloud services enable", *apis, _P))]
    if opts.build:
        steps.append(_repository_step())
    steps += [_bucket_step(var) for var in _bucket_variables(spec)]
    steps += _network_steps(profile)
    steps.append(Step(
        "GKE cluster: Dataplane V2 + multi-networking (GPU NICs), GCS FUSE CSI driver, Workload Identity, "
        "Managed Prometheus with DCGM GPU metrics",
        _cmd("gcloud container clusters create", where, '--node-locations "${ZONE}"',
             '--release-channel "${RELEASE_CHANNEL}"', '--machine-type "${SYSTEM_MACHINE_TYPE}"',
             '--num-nodes "${SYSTEM_NODES}"', "--enable-dataplane-v2", "--enable-ip-alias",
             "--enable-multi-networking", "--addons GcsFuseCsiDriver", '--workload-pool "${PROJECT}.svc.id.goog"',
             "--enable-managed-prometheus", "--monitoring=SYSTEM,DCGM"),
        exists=f"gcloud container clusters describe {where}",
        delete=_cmd("gcloud container clusters delete", where, _QUIET)))
    steps.append(Step("kubectl credentials for the cluster",
                      f"gcloud container clusters get-credentials {where}"))
    objs = network_objects(spec, profile)
    steps.append(Step("cluster networks for the GPU NICs (names match the pods' networking.gke.io/interfaces)",
                      "kubectl apply -f - <<EOF\n" + yaml.safe_dump_all(objs, sort_keys=False) + "EOF"))
    node_networks = ['"network=${NET_PREFIX}-gvnic-net,subnetwork=${NET_PREFIX}-gvnic-sub"'] * len(
        profile.extra_networks)
    per_nic = ('"network=${NET_PREFIX}-rdma-net,subnetwork=${NET_PREFIX}-rdma-sub-${i}"'
               if profile.gcloud_network_flags == "rdma"
               else '"network=${NET_PREFIX}-gpunic-${i}-net,subnetwork=${NET_PREFIX}-gpunic-${i}-sub"')
    networks_array = "\n".join(
        ["NODE_NETWORKS=(" + " ".join(f"--additional-node-network {n}" for n in node_networks) + ")",
         _NIC_LOOP, f"  NODE_NETWORKS+=(--additional-node-network {per_nic})", "done"])
    steps.append(Step("node network attachments: each GPU node gets every extra NIC", networks_array))
    if opts.dws:
        steps.append(_node_pool("DWS_POOL", "--enable-queued-provisioning", "--flex-start",
                                "--reservation-affinity none", "--location-policy ANY",
                                "--no-enable-autoupgrade", "--no-enable-autorepair"))
    if opts.spot:
        steps.append(_node_pool("SPOT_POOL", "--spot"))
    steps.append(Step(
        "Kueue and JobSet (pinned), ready before anything uses their webhooks",
        "\n".join([
            'kubectl apply --server-side -f "https://github.com/kubernetes-sigs/kueue/releases/download/'
            '${KUEUE_VERSION}/manifests.yaml"',
            'kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/'
            '${JOBSET_VERSION}/manifests.yaml"',
            "kubectl wait --for condition=established --timeout 5m crd/clusterqueues.kueue.x-k8s.io "
            "crd/jobsets.jobset.x-k8s.io",
            "kubectl -n kueue-system rollout status deployment/kueue-controller-manager --timeout 10m",
            "kubectl -n jobset-system rollout status deployment/jobset-controller-manager --timeout 10m",
        ])))
    steps.append(Step(
        f"{profile.name} node DaemonSets (NCCL/fabric libraries on each GPU node as it joins)",
        'for manifest in "${NODE_MANIFESTS[@]}"; do\n  kubectl apply -f "${manifest}"\ndone'))
    steps.append(Step("Kueue queues, DWS admission check, trainer service account, launcher Role"
                      + (", PodMonitoring for rank 0's /metrics" if spec.observe.metrics_port else ""),
                      f'kubectl apply --server-side -f "${{HERE}}/{BOOTSTRAP_FILE}"'))
    if spec.launch.kubernetes.secret_env:
        steps.append(_secrets_step(spec))
    steps += [_bucket_binding_step(var) for var in _bucket_variables(spec)]
    if opts.build:
        steps.append(_build_step())
    return steps


def _repository_step() -> Step:
    where = f'"${{REPOSITORY}}" {_P} --location "${{REGION}}"'
    return Step("Artifact Registry Docker repository for the training image",
                _cmd("gcloud artifacts repositories create", where, "--repository-format docker"),
                exists=f"gcloud artifacts repositories describe {where}",
                delete=_cmd("gcloud artifacts repositories delete", where, _QUIET))


def _build_step() -> Step:
    """Cloud Build with the checkout's cloudbuild.yaml; the image is tagged with the commit, so a commit that was
    built already is not built again, and its digest pins the launch (`launch.image_digest`)."""
    image = '"${REGION}-docker.pkg.dev/${PROJECT}/${REPOSITORY}/shardline:${GIT_COMMIT:0:12}"'
    substitutions = '"_REGION=${REGION},_REPOSITORY=${REPOSITORY},_TAG=${GIT_COMMIT:0:12},_GIT_COMMIT=${GIT_COMMIT}"'
    build = _cmd('gcloud builds submit "${SOURCE_DIR}"', _P, '--config "${SOURCE_DIR}/cloudbuild.yaml"',
                 "--substitutions", substitutions)
    digest = 'DIGEST="$(gcloud artifacts docker images describe "${IMAGE}" --format "value(image_summary.digest)")"'
    return Step(
        "the training image: Cloud Build builds the Dockerfile (cloudbuild.yaml) once per commit; its digest pins "
        "launches",
        "\n".join([
            'GIT_COMMIT="$(git -C "${SOURCE_DIR}" rev-parse HEAD)"', f"IMAGE={image}",
            'if ! gcloud artifacts docker images describe "${IMAGE}" >/dev/null 2>&1; then',
            _indent(build, "  "), "fi", digest,
            'echo "--set launch.image=${IMAGE} --set launch.image_digest=${DIGEST}"'
            f' | tee "${{HERE}}/{IMAGE_FILE}"',
        ]))


def _secrets_step(spec: JobSpec) -> Step:
    """Each Secret the pods read, created from `<ENV>_FILE` when it names a file, else from the variable <ENV> in
    setup.sh's environment. The value only passes through a pipe (process substitution): it is in no argument,
    no file and no trace (the script never sets -x)."""
    namespace = '--namespace "${NAMESPACE}"'
    by_secret: dict[str, list[tuple[str, str]]] = {}
    for env, ref in sorted(spec.launch.kubernetes.secret_env.items()):
        by_secret.setdefault(ref.secret, []).append((ref.key, env))
    # $1: the environment variable, $2: a file to read instead (may be empty). A process substitution's failure
    # goes unnoticed, so the source is checked first: a missing token stops setup, never makes an empty Secret.
    lines = ["check_secret_source() {",
             '  if [[ -n "$2" && ! -r "$2" ]]; then echo "cannot read ${1}_FILE=$2" >&2; return 1; fi',
             '  if [[ -z "$2" && -z "${!1:-}" ]]; then echo "export $1 or set ${1}_FILE" >&2; return 1; fi',
             "}",
             "secret_value() {",
             '  if [[ -n "$2" ]]; then cat -- "$2"; else printf "%s" "${!1}"; fi',
             "}"]
    for secret, keys in by_secret.items():
        sources = [f'--from-file={key}=<(secret_value {env} "${{{env}_FILE}}")' for key, env in keys]
        lines += [f'if ! kubectl get secret "{secret}" {namespace} >/dev/null 2>&1; then',
                  *(f'  check_secret_source {env} "${{{env}_FILE}}"' for _, env in keys),
                  _indent(_cmd(f'kubectl create secret generic "{secret}"', namespace, *sources), "  "), "fi"]
    return Step("Kubernetes Secrets the pods read (launch.kubernetes.secret_env), from a file or the environment",
                "\n".join(lines))


def _bucket_step(var: str) -> Step:
    bucket = f'"gs://${{{var}}}"'
    return Step(f"GCS bucket gs://${{{var}}}: hierarchical namespace (fast renames for checkpoints), uniform access",
                _cmd("gcloud storage buckets create", bucket, _P, '--location="${REGION}"',
                     "--uniform-bucket-level-access", "--enable-hierarchical-namespace"),
                exists=f"gcloud storage buckets describe {bucket} {_P}",
                keep=f"gs://${{{var}}} holds the runs and checkpoints; delete it yourself: "
                     f"gcloud storage rm --recursive gs://${{{var}}}")


def _bucket_binding_step(var: str) -> Step:
    member = ('"principal://iam.googleapis.com/projects/${PROJECT_NUMBER}/locations/global/workloadIdentityPools/'
              '${PROJECT}.svc.id.goog/subject/ns/${NAMESPACE}/sa/${KSA}"')

    def binding(verb: str) -> str:
        return _cmd(f"gcloud storage buckets {verb}-iam-policy-binding", f'"gs://${{{var}}}"', "--member", member,
                    "--role roles/storage.objectUser")

    number = 'PROJECT_NUMBER="$(gcloud projects describe "${PROJECT}" --format "value(projectNumber)")"'
    return Step(
        f"GCS bucket gs://${{{var}}} access for the trainer's Kubernetes service account (Workload Identity, no GSA)",
        number + "\n" + binding("add"),  # adding a binding that is there already is a no-op
        delete_if=f'gcloud storage buckets describe "gs://${{{var}}}"',
        # Removing a binding that is not there fails; an absent binding is what teardown wants.
        delete=number + "\n" + binding("remove") + " || true")


def _buckets(spec: JobSpec) -> dict[str, tuple[str, str]]:
    """Script variable → (bucket, the spec field naming it): the GCS FUSE mount, then a gs:// checkpoint.dir."""
    out: dict[str, tuple[str, str]] = {}
    storage = spec.launch.kubernetes.storage
    if storage.kind == "gcsfuse" and storage.bucket:
        out["BUCKET"] = (storage.bucket, "launch.kubernetes.storage.bucket")
    ckpt = spec.checkpoint.dir or ""
    if ckpt.startswith("gs://"):
        bucket = ckpt.removeprefix("gs://").split("/", 1)[0]
        if bucket not in {b for b, _ in out.values()}:
            out["CHECKPOINT_BUCKET"] = (bucket, "checkpoint.dir")
    return out


def _bucket_variables(spec: JobSpec) -> list[str]:
    return list(_buckets(spec))


def _variables(spec: JobSpec, opts: GkePlanOptions) -> dict[str, str]:
    """Every tunable, in the order the scripts declare them (values are already shell-safe)."""
    profile = get_profile(spec.launch.profile)
    region = opts.region or _ZONE.match(opts.zone).group(1)  # type: ignore[union-attr]
    max_nodes = opts.max_nodes if opts.max_nodes is not None else spec.launch.nnodes
    out = {
        "PROJECT": f'"{opts.project}"', "REGION": f'"{region}"', "ZONE": f'"{opts.zone}"',
        "CLUSTER": f'"{opts.cluster}"', "NET_PREFIX": '"${CLUSTER}"',
        "RELEASE_CHANNEL": f'"{RELEASE_CHANNEL}"', "SYSTEM_MACHINE_TYPE": f'"{SYSTEM_MACHINE_TYPE}"',
        "SYSTEM_NODES": "1",
        "MACHINE_TYPE": f'"{profile.machine_type}"', "ACCELERATOR": f'"{profile.accelerator}"',
        "GPUS_PER_NODE": str(profile.gpus_per_node), "GPU_NICS": str(profile.gpu_nics),
        "GPU_DRIVER_VERSION": f'"{GPU_DRIVER_VERSION}"', "MAX_NODES": str(max_nodes),
        "DWS_POOL": '"${CLUSTER}-dws"', "SPOT_POOL": '"${CLUSTER}-spot"',
        "KUEUE_VERSION": f'"{KUEUE_VERSION}"', "JOBSET_VERSION": f'"{JOBSET_VERSION}"',
        "NODE_MANIFESTS": "(\n" + "".join(f"  {shlex.quote(u)}\n" for u in profile.node_manifests) + ")",
    }
    out |= {var: f'"{bucket}"' for var, (bucket, _) in _buckets(spec).items()}
    out |= {"NAMESPACE": f'"{spec.launch.kubernetes.namespace}"', "KSA": f'"{spec.launch.kubernetes.service_account}"'}
    # A file to read a Secret's value from; empty: the variable itself, from setup.sh's environment.
    out |= {f"{env}_FILE": f'"${{{env}_FILE:-}}"' for env in sorted(spec.launch.kubernetes.secret_env)}
    if opts.build:
        out |= {"REPOSITORY": f'"{opts.repository}"', "SOURCE_DIR": shlex.quote(opts.source)}
    return out


def _used(body: str, variables: dict[str, str]) -> dict[str, str]:
    """The variables a script body uses (and those they refer to), so neither script declares a dead one."""
    def refers(text: str) -> set[str]:
        return {name for name in variables if re.search(rf"\b{name}\b", text)}

    names = refers(body)
    for name in reversed(variables):  # a value only refers to variables declared before it (NET_PREFIX → CLUSTER)
        if name in names:
            names |= refers(variables[name])
    return {k: v for k, v in variables.items() if k in names}


def _header(title: str, lines: list[str], variables: dict[str, str]) -> str:
    comment = "".join(f"# {line}\n" if line else "#\n" for line in lines)
    block = "".join(f"{k}={v}\n" for k, v in variables.items())
    return f"#!/usr/bin/env bash\n# {title}\n{comment}set -euo pipefail\n\n# --- tunables\n{block}"


def _indent(text: str, prefix: str) -> str:
    # Heredoc bodies must stay at column 0 (an unquoted <<EOF does not strip indentation).
    out, in_heredoc = [], False
    for line in text.split("\n"):
        out.append(line if in_heredoc or not line else prefix + line)
        if line.endswith("<<EOF"):
            in_heredoc = True
        elif line == "EOF":
            in_heredoc = False
    return "\n".join(out)


def render_setup(spec: JobSpec, opts: GkePlanOptions) -> str:
    parts = []
    for step in plan_steps(spec, opts):
        body = step.create
        if step.exists:
            body = f"if ! {step.exists} >/dev/null 2>&1; then\n{_indent(body, '  ')}\nfi"
        if step.per_nic:
            body = f"{_NIC_LOOP}\n{_indent(body, '  ')}\ndone"
        parts.append(f"# --- {step.title}\n{body}\n")
    body = "\n".join(parts)
    profile = get_profile(spec.launch.profile)
    lines = [f"Profile {profile.name}: {profile.description}.",
             "Generated by `shardline cluster plan gke`; review, then run. Safe to re-run: each create is guarded",
             "by an existence check (it does not change a resource that exists with other settings).",
             "Needs gcloud (with the beta component for RDMA network profiles) and kubectl."]
    variables = _variables(spec, opts)
    head = _header("Create a GKE cluster for shardline training jobs.", lines, _used(body, variables))
    here = 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
    return f"{head}\n{here}\n{body}\necho \"cluster ${{CLUSTER}} is ready; queue: see {BOOTSTRAP_FILE}\"\n"


def render_teardown(spec: JobSpec, opts: GkePlanOptions) -> str:
    parts = []
    for step in reversed(plan_steps(spec, opts)):
        if step.keep is not None:
            parts.append(f"# --- {step.title}: kept\necho \"kept {step.keep}\"\n")
        if step.delete is None:
            continue
        probe = step.delete_if or step.exists
        body = f"if {probe} >/dev/null 2>&1; then\n{_indent(step.delete, '  ')}\nfi" if probe else step.delete
        if step.per_nic:
            body = f"{_NIC_LOOP_REVERSED}\n{_indent(body, '  ')}\ndone"
        parts.append(f"# --- {step.title}\n{body}\n")
    body = "\n".join(parts)
    lines = ["Generated by `shardline cluster plan gke`: deletes what setup.sh created, in reverse order.",
             "Safe to re-run: every delete is guarded by an existence check. Objects inside the cluster",
             "(Kueue, JobSet, queues, service accounts) go with the cluster. Run with --yes."]
    variables = _variables(spec, opts)
    head = _header("Delete the GKE cluster and networks setup.sh created.", lines, _used(body, variables))
    confirm = ('if [[ "${1:-}" != "--yes" ]]; then\n'
               '  echo "this deletes cluster ${CLUSTER}, its node pools and networks in ${PROJECT}; '
               'run: $0 --yes" >&2\n  exit 2\nfi\n')
    return f"{head}\n{confirm}\n{body}"


def _check(opts: GkePlanOptions, spec: JobSpec) -> None:
    if not _PROJECT.match(opts.project):
        raise SpecError("--project", f"{opts.project!r} is not a GCP project id", "pass e.g. --project my-project")
    if not _ZONE.match(opts.zone):
        raise SpecError("--zone", f"{opts.zone!r} is not a GCP zone", "pass e.g. --zone us-central1-b")
    if opts.region is not None and not (_REGION.match(opts.region) and opts.zone.startswith(opts.region + "-")):
        raise SpecError("--region", f"{opts.region!r} is not the region of zone {opts.zone!r}",
                        "drop --region (it defaults to the zone's region)")
    if not _CLUSTER.match(opts.cluster):
        raise SpecError("--cluster", f"{opts.cluster!r} is not a GKE cluster name",
                        "use at most 40 lowercase letters, digits and '-', starting with a letter")
    if opts.max_nodes is not None and opts.max_nodes < 1:
        raise SpecError("--max-nodes", f"{opts.max_nodes}", "give at least 1")
    if not (opts.dws or opts.spot):
        raise SpecError("--no-dws/--no-spot", "no GPU node pool left", "keep --dws, --spot or both")
    profile = get_profile(spec.launch.profile)
    if profile.machine_type is None or not profile.gcloud_network_flags:
        raise SpecError("--profile", f"profile {profile.name!r} has no GKE machine type",
                        "pass --profile a3-high, a3-mega, a3-ultra or a4")
    if spec.launch.kubernetes.gpu_resource is None:
        raise SpecError("launch.kubernetes.gpu_resource", "is null, but the plan builds GPU node pools",
                        "set it to nvidia.com/gpu")
    for bucket, field in _buckets(spec).values():
        if not _BUCKET.match(bucket):
            raise SpecError(field, f"{bucket!r} is not a GCS bucket name",
                            "use the bucket name without gs://" if field.endswith("bucket") else "write gs://BUCKET/path")
    if opts.build and not _REPOSITORY.match(opts.repository):
        raise SpecError("--repository", f"{opts.repository!r} is not an Artifact Registry repository id",
                        "use lowercase letters, digits and '-', starting with a letter")
    for env, ref in spec.launch.kubernetes.secret_env.items():
        if not _ENV_NAME.match(env):
            raise SpecError(f"launch.kubernetes.secret_env.{env}", "is not an environment variable name",
                            "use letters, digits and '_', e.g. HF_TOKEN")
        if not _SECRET_KEY.match(ref.key):
            raise SpecError(f"launch.kubernetes.secret_env.{env}.key", f"{ref.key!r} is not a Secret key",
                            "use letters, digits, '-', '_' and '.', e.g. token")


def write_plan(spec: JobSpec, opts: GkePlanOptions, out: Path) -> list[Path]:
    """Write setup.sh, teardown.sh and the bootstrap objects setup.sh applies; returns the paths."""
    _check(opts, spec)
    profile = get_profile(spec.launch.profile)
    max_nodes = opts.max_nodes if opts.max_nodes is not None else spec.launch.nnodes
    setup, teardown = render_setup(spec, opts), render_teardown(spec, opts)
    # The cluster runs Managed Prometheus: rank 0's /metrics is scraped when the spec serves it on a fixed port.
    bootstrap = write_bootstrap(spec, BootstrapOptions(gpus=max_nodes * profile.gpus_per_node, dws=opts.dws,
                                                       spot=opts.spot,
                                                       managed_prometheus=bool(spec.observe.metrics_port)), out)
    paths = [bootstrap]
    for name, text in (("setup.sh", setup), ("teardown.sh", teardown)):
        path = out / name
        path.write_text(text)
        path.chmod(0o755)
        paths.append(path)
    return paths
