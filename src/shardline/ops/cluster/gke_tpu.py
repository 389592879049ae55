"""`shardline cluster plan gke` for TPU slices (train.engine maxtext): the cluster, one TPU node pool per slice,
JobSet and Kueue, the Ray operator add-on, the buckets and Secrets — the same idempotent Steps as the GPU plan.

GKE's TPU guides ("Plan TPUs in GKE", "Deploy TPU Multislice", "Run flex-start TPUs"): a multi-host TPU node pool is
exactly one slice (`--machine-type ct6e-standard-4t --tpu-topology 4x4`, its hosts created and removed together);
multislice needs one pool per slice, joined over the data-center network of the default VPC (DCN: no extra NICs,
unlike the GPU fabrics). Capacity: spot pools (`--spot`) or flex-start pools (`--flex-start
--enable-queued-provisioning`, DWS through Kueue's ProvisioningRequest), both autoscaled from 0 to the slice's hosts.
The Ray operator add-on (`--addons RayOperator`) installs KubeRay for --target rayjob.
"""

from __future__ import annotations

from shardline.hardware import tpu_slice
from shardline.ops.cluster.gke_report import plan_header
from shardline.ops.cluster.gke_resources import bucket_binding_step, bucket_step, buckets, secrets_step
from shardline.ops.cluster.gke_script import QUIET, P, R, Step, cmd
from shardline.ops.cluster.gke_steps import addons_step
from shardline.spec import JobSpec

_WHERE = f'"${{CLUSTER}}" {P} {R}'
SLICE_LOOP_VAR = "SLICES"


def tpu_cluster_step() -> Step:
    return Step("GKE cluster: GCS FUSE CSI driver, Ray operator (KubeRay), Workload Identity, Managed Prometheus",
                cmd("gcloud container clusters create", _WHERE, '--node-locations "${ZONE}"',
                    '--release-channel "${RELEASE_CHANNEL}"', '--machine-type "${SYSTEM_MACHINE_TYPE}"',
                    '--num-nodes "${SYSTEM_NODES}"', "--enable-ip-alias", "--addons GcsFuseCsiDriver,RayOperator",
                    '--workload-pool "${PROJECT}.svc.id.goog"', "--enable-managed-prometheus"),
                exists=f"gcloud container clusters describe {_WHERE}",
                delete=cmd("gcloud container clusters delete", _WHERE, QUIET))


def tpu_pool_step(capacity: str) -> Step:
    """One node pool per slice (`${i}` the slice), each a whole slice, scaled from 0 to its hosts."""
    pool = f'"${{CLUSTER}}-tpu-{capacity}-${{i}}"'
    where = f'--cluster "${{CLUSTER}}" {P} {R}'
    flags = ("--spot",) if capacity == "spot" else ("--flex-start", "--enable-queued-provisioning",
                                                    "--reservation-affinity none", "--no-enable-autorepair")
    create = cmd("gcloud container node-pools create", pool, where, '--node-locations "${ZONE}"',
                 '--machine-type "${TPU_MACHINE_TYPE}"', '--tpu-topology "${TPU_TOPOLOGY}"', *flags,
                 "--num-nodes 0", "--enable-autoscaling", "--total-min-nodes 0", '--total-max-nodes "${TPU_HOSTS}"')
    loop = 'for i in $(seq 0 $((SLICES - 1))); do'

    def each(body: str) -> str:
        return f"{loop}\n" + "\n".join("  " + line for line in body.split("\n")) + "\ndone"

    exists = f"gcloud container node-pools describe {pool} {where} >/dev/null 2>&1"
    return Step(f"TPU node pools, {capacity}: one per slice, each a whole slice of launch.tpu's type and topology",
                each(f"if ! {exists}; then\n" + "\n".join("  " + line for line in create.split("\n")) + "\nfi"),
                delete=each(f"if {exists}; then\n  " + cmd("gcloud container node-pools delete", pool, where, QUIET)
                            + "\nfi"))


def tpu_plan_steps(spec: JobSpec, dws: bool, spot: bool) -> list[Step]:
    steps = [Step("APIs this plan uses", cmd("gcloud services enable", "container.googleapis.com",
                                             "compute.googleapis.com", "tpu.googleapis.com", P))]
    steps += [bucket_step(var) for var in buckets(spec)]
    steps.append(tpu_cluster_step())
    steps.append(Step("kubectl credentials for the cluster", f"gcloud container clusters get-credentials {_WHERE}"))
    if spot:
        steps.append(tpu_pool_step("spot"))
    if dws:
        steps.append(tpu_pool_step("flex"))
    steps.append(addons_step())
    if spec.launch.kubernetes.secret_env:
        steps.append(secrets_step(spec))
    steps += [bucket_binding_step(var) for var in buckets(spec)]
    return steps


def tpu_setup_lines(spec: JobSpec, risks: list[str]) -> list[str]:
    tp = spec.launch.tpu
    return plan_header(f"TPU {tp.type} {tp.topology} x {tp.slices} slice(s) for MaxText (train.engine maxtext).",
                       "Needs gcloud and kubectl. Kueue's queue for the slices: `shardline cluster bootstrap` on this "
                       "spec (google.com/tpu quota).", risks)


def tpu_variables(spec: JobSpec) -> dict[str, str]:
    tp = spec.launch.tpu
    sl = tpu_slice(tp.type, tp.topology)
    return {"TPU_MACHINE_TYPE": f'"{sl.machine_type}"', "TPU_TOPOLOGY": f'"{sl.topology}"',
            "TPU_HOSTS": str(sl.hosts), SLICE_LOOP_VAR: str(tp.slices)}
