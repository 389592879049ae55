"""Plan steps for the cluster itself: NIC networks, the GKE cluster and its upgrade policy, GPU node pools, Kueue and
JobSet, the fabric's node DaemonSets (pinned upstream files, checked before use) and the cluster networks."""

from __future__ import annotations

import yaml

from shardline.network_profiles import NetworkProfile, Pin, gpu_network_names
from shardline.ops.cluster.gke_script import NIC_LOOP, QUIET, P, R, Step, cmd
from shardline.spec import JobSpec

NIC_MTU = {"rdma": 8896, "gpu-nic": 8244}
"""MTU of the GPU NIC VPCs per fabric (GKE's A3 Ultra/A4 RDMA and A3 High/Mega TCPX(O) guides)."""
EXCLUSION = '"${CLUSTER}-training"'
_WHERE = f'"${{CLUSTER}}" {P} {R}'


def network_steps(profile: NetworkProfile) -> list[Step]:
    def vpc(name: str, *flags: str, beta: bool = False, per_nic: bool = False) -> Step:
        gcloud = "gcloud beta compute networks" if beta else "gcloud compute networks"
        return Step(f"VPC {name}", cmd(gcloud, "create", f'"{name}"', P, "--subnet-mode custom", *flags),
                    exists=f'gcloud compute networks describe "{name}" {P}',
                    delete=cmd("gcloud compute networks delete", f'"{name}"', P, QUIET), per_nic=per_nic)

    def subnet(name: str, network: str, cidr: str, per_nic: bool = False) -> Step:
        return Step(f"subnet {name}", cmd("gcloud compute networks subnets create", f'"{name}"', P, R,
                                          f'--network "{network}"', f'--range "{cidr}"'),
                    exists=f'gcloud compute networks subnets describe "{name}" {P} {R}',
                    delete=cmd("gcloud compute networks subnets delete", f'"{name}"', P, R, QUIET),
                    per_nic=per_nic)

    def firewall(name: str, network: str, per_nic: bool = False) -> Step:
        return Step(f"firewall rule {name} (traffic between nodes on this VPC)",
                    cmd("gcloud compute firewall-rules create", f'"{name}"', P, f'--network "{network}"',
                        "--action ALLOW", "--rules tcp:0-65535,udp:0-65535,icmp", "--source-ranges 192.168.0.0/16"),
                    exists=f'gcloud compute firewall-rules describe "{name}" {P}',
                    delete=cmd("gcloud compute firewall-rules delete", f'"{name}"', P, QUIET), per_nic=per_nic)

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


def pins_step(pins: tuple[Pin, ...]) -> Step:
    """Before anything is created: each pinned upstream file's commit must be on its repository's default branch.
    GitHub's compare API answers "behind" (or "identical") when the branch contains the commit; anything else
    (a commit only in a fork or an unmerged pull request, an unreachable API) stops setup."""
    lines = ["pinned_on_branch() {  # owner/repo branch commit",
             "  local status",
             '  status="$(curl -fsSL "https://api.github.com/repos/$1/compare/$2...$3" '
             "| sed -n 's/^  \"status\": \"\\([a-z]*\\)\",$/\\1/p')\"",
             '  [[ "${status}" == behind || "${status}" == identical ]]',
             "}"]
    for pin in pins:
        where = f'"{pin.repo}" "{pin.branch}" "{pin.commit}"'
        lines.append(f'pinned_on_branch {where} || {{ echo "{pin.repo}@{pin.commit} is not on its {pin.branch} '
                     f'branch: refusing {pin.path}" >&2; exit 1; }}')
    return Step("pinned upstream manifests: each commit is on its repository's default branch", "\n".join(lines))


def cluster_steps(spec: JobSpec, profile: NetworkProfile) -> list[Step]:
    cluster = Step(
        "GKE cluster: Dataplane V2 + multi-networking (GPU NICs), GCS FUSE CSI driver, Workload Identity, "
        "Managed Prometheus with DCGM GPU metrics",
        cmd("gcloud container clusters create", _WHERE, '--node-locations "${ZONE}"',
            '--release-channel "${RELEASE_CHANNEL}"', '--machine-type "${SYSTEM_MACHINE_TYPE}"',
            '--num-nodes "${SYSTEM_NODES}"', "--enable-dataplane-v2", "--enable-ip-alias",
            "--enable-multi-networking", "--addons GcsFuseCsiDriver", '--workload-pool "${PROJECT}.svc.id.goog"',
            "--enable-managed-prometheus", "--monitoring=SYSTEM,DCGM"),
        exists=f"gcloud container clusters describe {_WHERE}",
        delete=cmd("gcloud container clusters delete", _WHERE, QUIET))
    # A release channel keeps node auto-upgrade on (the API rejects auto_upgrade=false there); a maintenance
    # exclusion is how GKE's docs keep upgrades from evicting running training pods.
    start = 'START="$(date -u +%Y-%m-%dT%H:%M:%SZ)"'
    end = ('END="$(date -u -d "+${UPGRADE_FREEZE_DAYS} days" +%Y-%m-%dT%H:%M:%SZ 2>/dev/null '
           '|| date -u -v+"${UPGRADE_FREEZE_DAYS}"d +%Y-%m-%dT%H:%M:%SZ)"')
    exclusion = Step(
        "maintenance exclusion: no minor or node upgrades for UPGRADE_FREEZE_DAYS days (node upgrades evict "
        "running training pods)",
        "\n".join([start, end, cmd("gcloud container clusters update", _WHERE, "--add-maintenance-exclusion-name",
                                   EXCLUSION, '--add-maintenance-exclusion-start "${START}"',
                                   '--add-maintenance-exclusion-end "${END}"',
                                   "--add-maintenance-exclusion-scope no_minor_or_node_upgrades")]),
        exists=(f"gcloud container clusters describe {_WHERE} --format "
                f'"value(maintenancePolicy.window.maintenanceExclusions)" | grep -q {EXCLUSION}'))
    credentials = Step("kubectl credentials for the cluster", f"gcloud container clusters get-credentials {_WHERE}")
    networks = Step("cluster networks for the GPU NICs (names match the pods' networking.gke.io/interfaces)",
                    "kubectl apply -f - <<EOF\n" + yaml.safe_dump_all(network_objects(spec, profile), sort_keys=False)
                    + "EOF")
    node_networks = ['"network=${NET_PREFIX}-gvnic-net,subnetwork=${NET_PREFIX}-gvnic-sub"'] * len(
        profile.extra_networks)
    per_nic = ('"network=${NET_PREFIX}-rdma-net,subnetwork=${NET_PREFIX}-rdma-sub-${i}"'
               if profile.gcloud_network_flags == "rdma"
               else '"network=${NET_PREFIX}-gpunic-${i}-net,subnetwork=${NET_PREFIX}-gpunic-${i}-sub"')
    array = Step("node network attachments: each GPU node gets every extra NIC", "\n".join(
        ["NODE_NETWORKS=(" + " ".join(f"--additional-node-network {n}" for n in node_networks) + ")",
         NIC_LOOP, f"  NODE_NETWORKS+=(--additional-node-network {per_nic})", "done"]))
    return [cluster, exclusion, credentials, networks, array]


def node_pool(name_var: str, *flags: str) -> Step:
    pool = f'"${{{name_var}}}"'
    where = f'--cluster "${{CLUSTER}}" {P} {R}'
    return Step(f"GPU node pool {pool}",
                cmd("gcloud container node-pools create", pool, where, '--node-locations "${ZONE}"',
                    '--machine-type "${MACHINE_TYPE}"',
                    '--accelerator "type=${ACCELERATOR},count=${GPUS_PER_NODE},'
                    'gpu-driver-version=${GPU_DRIVER_VERSION}"',
                    *flags, "--num-nodes 0", "--enable-autoscaling", "--total-min-nodes 0",
                    '--total-max-nodes "${MAX_NODES}"', '"${NODE_NETWORKS[@]}"'),
                exists=f"gcloud container node-pools describe {pool} {where}",
                delete=cmd("gcloud container node-pools delete", pool, where, QUIET))


def dws_pool() -> Step:
    """Queued provisioning (DWS flex-start) as GKE's guide creates it: auto-repair off (a repair would recreate a
    node the request owns), auto-upgrade left on — the cluster's release channel requires it."""
    return node_pool("DWS_POOL", "--enable-queued-provisioning", "--flex-start", "--reservation-affinity none",
                     "--location-policy ANY", "--no-enable-autorepair")


JOBSET_IN_PLACE_GATE = "--feature-gates=InPlaceRestart=true"
"""JobSet's InPlaceRestart is alpha and off by default: its webhook refuses the strategy until the gate is on."""


def addons_step(in_place_restart: bool = False) -> Step:
    lines = [
        'kubectl apply --server-side -f "https://github.com/kubernetes-sigs/kueue/releases/download/'
        '${KUEUE_VERSION}/manifests.yaml"',
        'kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/'
        '${JOBSET_VERSION}/manifests.yaml"',
    ]
    if in_place_restart:  # once: the probe finds the flag after the first run
        deployment = "-n jobset-system deployment jobset-controller-manager"
        patch = (f'[{{"op": "add", "path": "/spec/template/spec/containers/0/args/-", '
                 f'"value": "{JOBSET_IN_PLACE_GATE}"}}]')
        lines.append(f"kubectl get {deployment} -o jsonpath='{{.spec.template.spec.containers[0].args}}' | "
                     f"grep -q -- '{JOBSET_IN_PLACE_GATE}' ||\n  kubectl patch {deployment} --type json -p '{patch}'")
    lines += [
        "kubectl wait --for condition=established --timeout 5m crd/clusterqueues.kueue.x-k8s.io "
        "crd/jobsets.jobset.x-k8s.io",
        "kubectl -n kueue-system rollout status deployment/kueue-controller-manager --timeout 10m",
        "kubectl -n jobset-system rollout status deployment/jobset-controller-manager --timeout 10m",
    ]
    title = "Kueue and JobSet (pinned" + (", JobSet's InPlaceRestart gate on" if in_place_restart else "") + \
        "), ready before anything uses their webhooks"
    return Step(title, "\n".join(lines))


def node_manifests_step(profile: NetworkProfile) -> Step:
    return Step(f"{profile.name} node DaemonSets (NCCL/fabric libraries on each GPU node as it joins)",
                "\n".join(f'kubectl apply -f "{pin.url}"' for pin in profile.node_manifests))
