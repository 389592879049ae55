"""`shardline cluster plan gke`: a reviewable `setup.sh` / `teardown.sh` pair for a GKE training cluster.

The plan is a list of `Step`s (typed data, ops/cluster/gke_script.py); the two scripts are renderings of it, so teardown
is the reverse of setup by construction. Steps inside the cluster (Kueue, JobSet, network objects, NCCL
installer, bootstrap) have no delete: they go with the cluster. Machine type, accelerator, NIC count and the
fabric's node DaemonSets come from the profile table (network_profiles.py); tunables sit in a variables block at the top
of each script.

What it builds (the reference tutorial's stack, made idempotent and profile-driven): a check that every pinned
upstream manifest's commit is on its repository's default branch; RDMA profiles (A3 Ultra, A4): a gVNIC VPC +
subnet + firewall and one RDMA VPC (`--network-profile ZONE-vpc-roce`) with one subnet per GPU NIC; TCPX/TCPXO
profiles (A3 High/Mega): one VPC + subnet + firewall per GPU NIC (ops/cluster/gke_steps.py). Then a cluster with
Dataplane V2, multi-networking, the GCS FUSE CSI driver and Workload Identity on a release channel, with a
maintenance exclusion instead of disabled auto-upgrade; GKENetworkParamSet/Network objects named as the
launcher's `networking.gke.io/interfaces` annotation expects; a DWS flex-start node pool and/or a spot node pool
(both scale from 0); Kueue and JobSet at pinned versions; the fabric's node DaemonSets; the `shardline cluster
bootstrap` objects (written next to the scripts); the Secrets, buckets and the Cloud Build image the spec uses
(ops/cluster/gke_resources.py). Teardown keeps the buckets: they hold the runs and checkpoints. The capacity's risks
(spot grace, DWS run limits) head setup.sh and are printed when it ends (ops/cluster/gke_report.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from shardline.errors import SpecError
from shardline.network_profiles import get_profile
from shardline.ops.cluster.bootstrap import BOOTSTRAP_FILE, BootstrapOptions, write_bootstrap
from shardline.ops.cluster.gke_report import TEARDOWN_LINES, plan_risks, risk_echo, setup_lines
from shardline.ops.cluster.gke_resources import (
    IMAGE_FILE,
    bucket_binding_step,
    bucket_step,
    buckets,
    build_step,
    repository_step,
    secrets_step,
)
from shardline.ops.cluster.gke_script import P, Step, cmd, header, setup_body, teardown_body, used
from shardline.ops.cluster.gke_steps import (
    addons_step,
    cluster_steps,
    dws_pool,
    network_steps,
    node_manifests_step,
    node_pool,
    pins_step,
)
from shardline.ops.cluster.gke_tpu import tpu_plan_steps, tpu_setup_lines, tpu_variables
from shardline.spec import JobSpec

__all__ = ["IMAGE_FILE", "GkePlanOptions", "plan_steps", "render_setup", "render_teardown", "write_plan"]

KUEUE_VERSION = "v0.19.2"
JOBSET_VERSION = "v0.12.0"
RELEASE_CHANNEL = "regular"
UPGRADE_FREEZE_DAYS = 30
"""Length of the maintenance exclusion setup.sh adds (no minor or node upgrades); re-run setup.sh to renew it."""
GPU_DRIVER_VERSION = "default"
"""The GKE version's default driver: what the NCCL installers and DCGM metrics are tested against."""
SYSTEM_MACHINE_TYPE = "e2-standard-8"

_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_CLUSTER = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_REPOSITORY = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def plan_steps(spec: JobSpec, opts: GkePlanOptions) -> list[Step]:
    if spec.train.engine == "maxtext":  # TPU slices: ops/cluster/gke_tpu.py
        return tpu_plan_steps(spec, dws=opts.dws, spot=opts.spot)
    profile = get_profile(spec.launch.profile)
    apis = ["container.googleapis.com", "compute.googleapis.com", "monitoring.googleapis.com"]
    if opts.build:
        apis += ["artifactregistry.googleapis.com", "cloudbuild.googleapis.com"]
    steps = [pins_step(profile.node_manifests), Step("APIs this plan uses", cmd("gcloud services enable", *apis, P))]
    if opts.build:
        steps.append(repository_step())
    steps += [bucket_step(var) for var in buckets(spec)]
    steps += network_steps(profile)
    steps += cluster_steps(spec, profile)
    if opts.dws:
        steps.append(dws_pool())
    if opts.spot:
        steps.append(node_pool("SPOT_POOL", "--spot"))
    steps += [addons_step(spec.launch.kubernetes.restarts_in_place), node_manifests_step(profile)]
    steps.append(Step("Kueue queues, DWS admission check, trainer service account, launcher Role, namespace Pod "
                      "Security level" + (", PodMonitoring for rank 0's /metrics" if spec.observe.metrics_port else ""),
                      f'kubectl apply --server-side -f "${{HERE}}/{BOOTSTRAP_FILE}"'))
    if spec.launch.kubernetes.secret_env:
        steps.append(secrets_step(spec))
    steps += [bucket_binding_step(var) for var in buckets(spec)]
    if opts.build:
        steps.append(build_step())
    return steps


def _variables(spec: JobSpec, opts: GkePlanOptions) -> dict[str, str]:
    """Every tunable, in the order the scripts declare them (values are already shell-safe)."""
    profile = get_profile(spec.launch.profile)
    region = opts.region or _ZONE.match(opts.zone).group(1)  # type: ignore[union-attr]
    max_nodes = opts.max_nodes if opts.max_nodes is not None else spec.launch.nnodes
    out = {
        "PROJECT": f'"{opts.project}"', "REGION": f'"{region}"', "ZONE": f'"{opts.zone}"',
        "CLUSTER": f'"{opts.cluster}"', "NET_PREFIX": '"${CLUSTER}"',
        "RELEASE_CHANNEL": f'"{RELEASE_CHANNEL}"', "UPGRADE_FREEZE_DAYS": str(UPGRADE_FREEZE_DAYS),
        "SYSTEM_MACHINE_TYPE": f'"{SYSTEM_MACHINE_TYPE}"', "SYSTEM_NODES": "1",
        "MACHINE_TYPE": f'"{profile.machine_type}"', "ACCELERATOR": f'"{profile.accelerator}"',
        "GPUS_PER_NODE": str(profile.gpus_per_node), "GPU_NICS": str(profile.gpu_nics),
        "GPU_DRIVER_VERSION": f'"{GPU_DRIVER_VERSION}"', "MAX_NODES": str(max_nodes),
        "DWS_POOL": '"${CLUSTER}-dws"', "SPOT_POOL": '"${CLUSTER}-spot"',
        "KUEUE_VERSION": f'"{KUEUE_VERSION}"', "JOBSET_VERSION": f'"{JOBSET_VERSION}"',
    }
    out |= {var: f'"{bucket}"' for var, (bucket, _) in buckets(spec).items()}
    out |= {"NAMESPACE": f'"{spec.launch.kubernetes.namespace}"', "KSA": f'"{spec.launch.kubernetes.service_account}"'}
    # A file to read a Secret's value from; empty: the variable itself, from setup.sh's environment.
    out |= {f"{env}_FILE": f'"${{{env}_FILE:-}}"' for env in sorted(spec.launch.kubernetes.secret_env)}
    if opts.build:
        out |= {"REPOSITORY": f'"{opts.repository}"', "SOURCE_DIR": shlex.quote(opts.source)}
    if spec.train.engine == "maxtext":
        out |= tpu_variables(spec)
    return out


def render_setup(spec: JobSpec, opts: GkePlanOptions) -> str:
    body = setup_body(plan_steps(spec, opts))
    risks = plan_risks(spec, spot=opts.spot, dws=opts.dws)
    lines = (tpu_setup_lines(spec, risks) if spec.train.engine == "maxtext"
             else setup_lines(get_profile(spec.launch.profile), risks))
    head = header("Create a GKE cluster for shardline training jobs.", lines, used(body, _variables(spec, opts)))
    if spec.train.engine == "maxtext":
        return f"{head}\n{body}\necho \"cluster ${{CLUSTER}} is ready for TPU slices\"\n" + risk_echo(risks)
    here = 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
    return (f"{head}\n{here}\n{body}\necho \"cluster ${{CLUSTER}} is ready; queue: see {BOOTSTRAP_FILE}\"\n"
            + risk_echo(risks))


def render_teardown(spec: JobSpec, opts: GkePlanOptions) -> str:
    body = teardown_body(plan_steps(spec, opts))
    head = header("Delete the GKE cluster and networks setup.sh created.", TEARDOWN_LINES,
                  used(body, _variables(spec, opts)))
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
    if spec.train.engine == "maxtext":  # TPU node pools come from launch.tpu, not a GPU profile
        for bucket, field in buckets(spec).values():
            if not _BUCKET.match(bucket):
                raise SpecError(field, f"{bucket!r} is not a GCS bucket name", "write gs://BUCKET/path")
        return
    profile = get_profile(spec.launch.profile)
    if profile.machine_type is None or not profile.gcloud_network_flags:
        raise SpecError("--profile", f"profile {profile.name!r} has no GKE machine type",
                        "pass --profile a3-high, a3-mega, a3-ultra or a4")
    if spec.launch.kubernetes.gpu_resource is None:
        raise SpecError("launch.kubernetes.gpu_resource", "is null, but the plan builds GPU node pools",
                        "set it to nvidia.com/gpu")
    for bucket, field in buckets(spec).values():
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
    if spec.train.engine == "maxtext":  # no image build, no GPU bootstrap: setup.sh and teardown.sh
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in (("setup.sh", render_setup(spec, opts)), ("teardown.sh", render_teardown(spec, opts))):
            path = out / name
            path.write_text(text)
            path.chmod(0o755)
            paths.append(path)
        return paths
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
