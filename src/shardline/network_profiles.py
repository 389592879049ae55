"""Cluster network profiles: the one table of machine types, GPU NICs and the NCCL environment each needs.

Every launcher (Kubernetes, Slurm, Ray), `shardline netcheck` and `shardline cluster plan` read this table;
nothing else hard-codes a machine type, an NCCL variable, a node DaemonSet URL or an expected bandwidth.

Sources, all GoogleCloudPlatform/container-engine-accelerators unless named (commits in PINS below):
- A3 High (GPUDirect-TCPX): gpudirect-tcpx/README.md release of Jun 22, 2026 (installer v3.1.12, tcpx-daemon
  v2.0.15, its NCCL variables) and the pod layout of gpudirect-tcpx/nccl-test-latest.yaml (daemon sidecar with
  NET_ADMIN, /run/tcpx socket shared with the workload, /sys and /proc/sys mounts, NRI device annotation).
- A3 Mega (GPUDirect-TCPXO): gpudirect-tcpxo/README.md release of Apr 30, 2026 (installer v1.0.16, tcpxo-daemon
  v1.0.22, its NCCL variables: no NCCL_ALGO, NCCL_NVLS_ENABLE=1, NCCL_NVLSTREE_MAX_CHUNKSIZE) and the pod layout of
  gpudirect-tcpxo/nccl-test-latest.yaml (daemon sidecar, /dev/aperture_devices for LLCM).
- A3 Ultra / A4 (RDMA over gIB): https://docs.cloud.google.com/ai-hypercomputer/docs/nccl/test-vms — source
  /usr/local/gib/scripts/set_nccl_env.sh (Google updates it) and keep /usr/local/gib/lib64 on LD_LIBRARY_PATH.
None of these has been run on hardware by this project.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.hardware import Accelerator, match_device

RENDEZVOUS_PORT = 29500
"""torchrun's rendezvous port on every engine (Kubeflow Trainer's constant, so one command fits all)."""


@dataclass(frozen=True)
class HostMount:
    """A host path (installed libraries, device directories, sysfs) mounted into a pod's container."""

    name: str
    host_path: str
    mount_path: str
    read_only: bool = True


@dataclass(frozen=True)
class Pin:
    """One upstream file at one commit, as `cluster plan gke` applies it.

    `source` says why this commit (the release note that names it); `default_branch` says whether the commit was
    verified to be on the repository's default branch. Where it could not be verified offline, setup.sh asks
    GitHub before applying the file (ops/cluster/gke_steps.py) and stops when the answer is no."""

    repo: str
    commit: str
    path: str
    source: str
    default_branch: str
    branch: str = "master"

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"


@dataclass(frozen=True)
class RxDaemon:
    """The receive-datapath manager (RxDM) sidecar GPUDirect-TCPX(O) needs in every training pod, run as a
    native sidecar (an init container with restartPolicy Always) so the pod ends when the trainer does."""

    name: str
    image: str
    command: tuple[str, ...]
    capabilities: tuple[str, ...]
    mounts: tuple[HostMount, ...]
    devices: tuple[str, ...]
    """Device nodes the GKE NRI device injector adds to this container (`devices.gke.io/container.<name>`)."""


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    description: str
    machine_type: str | None
    """GCE machine type of the GPU node pool (None: any cluster)."""
    accelerator: str | None
    """GKE accelerator type (`cloud.google.com/gke-accelerator` label and `--accelerator type=`)."""
    gpus_per_node: int
    gpu_nics: int
    """Secondary NICs that carry GPU traffic; 0 = the pod network only."""
    nic_prefix: str
    """Default network name prefix: NIC i attaches to `<prefix><i>` (override with launch.kubernetes.gpu_networks)."""
    nic_interface_offset: int
    """eth index of the first GPU NIC inside the pod (eth0 is the pod network; RDMA adds gVNIC eth1 first)."""
    extra_networks: tuple[str, ...]
    """Networks attached before the GPU NICs (A3 Ultra / A4 need a second gVNIC)."""
    nccl_env: dict[str, str] = field(default_factory=dict)
    """Variables shardline sets itself (those `nccl_env_script` does not set)."""
    nccl_env_script: str | None = None
    """A script the fabric's installer ships and the trainer sources before torchrun (gIB's set_nccl_env.sh)."""
    host_mounts: tuple[HostMount, ...] = ()
    ld_library_path: str | None = None
    expected_busbw_gbps: float | None = None
    """nccl-tests all_gather bus bandwidth at 8 GB across 2 nodes; `shardline netcheck` passes above 90 % of it."""
    gcloud_network_flags: str = ""
    """How `cluster plan gke` creates the NIC VPCs: "rdma" (one RDMA VPC, N subnets) or "gpu-nic" (N VPCs)."""
    node_cpus: int | None = None
    """vCPUs of one node of machine_type (Kueue quota in `cluster bootstrap`, pod requests in launch)."""
    node_memory_gib: int | None = None
    """Memory of one node of machine_type in GiB (Kueue quota in `cluster bootstrap`, pod requests in launch)."""
    node_manifests: tuple[Pin, ...] = ()
    """Google's node DaemonSets this fabric needs (NCCL/gIB or TCPX(O) installer, NRI device injector)."""
    capabilities: tuple[str, ...] = ()
    """Linux capabilities the trainer container adds (all others dropped). RDMA (gIB) registers GPU and host
    memory with the NIC, which pins pages: IPC_LOCK lifts the locked-memory limit for that; the TCPX workload of
    nccl-test-latest.yaml adds it too."""
    rx_daemon: RxDaemon | None = None

    @property
    def gpu(self) -> Accelerator | None:
        """The catalogue entry of this machine type's GPU (from its GKE accelerator label); None for any cluster."""
        return match_device(self.accelerator) if self.accelerator else None


CEA = "GoogleCloudPlatform/container-engine-accelerators"
_UNVERIFIED = ("unverified: no git access from where this table was written; setup.sh checks it with GitHub's "
               "compare API before applying")
PINS = {
    "tcpx-installer": Pin(
        CEA, "98c85a6e581d7ec53329f9ab1de5f8626b637dbb", "gpudirect-tcpx/nccl-tcpx-installer.yaml",
        "gpudirect-tcpx/README.md at the same commit: release Jun 22, 2026, installer image v3.1.12 pinned by tag, "
        "tcpx-daemon v2.0.15; installs into /home/kubernetes/bin/nvidia/lib64", _UNVERIFIED),
    "tcpxo-installer": Pin(
        CEA, "10c8d2375fae8bd04d291148e2754334cdecc521", "gpudirect-tcpxo/nccl-tcpxo-installer.yaml",
        "gpudirect-tcpxo/README.md at the same commit: release Apr 30, 2026, installer image v1.0.16, tcpxo-daemon "
        "v1.0.22; installs into /home/kubernetes/bin/nvidia/lib64 (its pre-installation step uses the untagged "
        "`ubuntu` image, as every upstream version does)", _UNVERIFIED),
    "nri-device-injector": Pin(
        CEA, "09c9c53c6ec0ce7d27c21d7cf14462c55acb0a02", "nri_device_injector/nri-device-injector.yaml",
        "the generic injector GKE's GPUDirect guide applies: image pinned by digest, runs on every GPU node "
        "(cloud.google.com/gke-gpu), no init container that edits containerd's config or restarts it", _UNVERIFIED),
    "gib-installer": Pin(
        CEA, "2c776f7e9656a2b6476f19938b738b4186000ce3", "gpudirect-rdma/nccl-rdma-installer.yaml",
        "the gIB installer of the A3 Ultra / A4 guide: plugin image v1.0.6 pinned by tag; installs into "
        "/home/kubernetes/bin/gib (its log_martians step uses alpine:latest upstream)", _UNVERIFIED),
}

_RDMA_CAPABILITIES = ("IPC_LOCK",)
_NVIDIA_LIB64 = HostMount("nvidia-lib64", "/home/kubernetes/bin/nvidia/lib64", "/usr/local/nvidia/lib64")
_GIB_MOUNTS = (
    HostMount("nvidia-libs", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),
    HostMount("gib", "/home/kubernetes/bin/gib", "/usr/local/gib"),
)
_GIB_LD = "/usr/local/nvidia/lib64:/usr/local/gib/lib64"
_GIB_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo (CPU collectives, c10d) on the pod network, not a GPU NIC
_GIB_SCRIPT = "/usr/local/gib/scripts/set_nccl_env.sh"
_SYSFS = (HostMount("sys", "/sys", "/hostsysfs", read_only=False),
          HostMount("proc-sys", "/proc/sys", "/hostprocsysfs", read_only=False))
_GPU_DEVICES = (*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidiactl", "/dev/nvidia-uvm")
TCPX_SOCKET = HostMount("tcpx-socket", "/run/tcpx", "/run/tcpx", read_only=False)
APERTURE = HostMount("aperture-devices", "/dev/aperture_devices", "/dev/aperture_devices", read_only=False)

PROFILES: dict[str, NetworkProfile] = {
    "generic": NetworkProfile(
        name="generic", description="any Kubernetes cluster: pod network only, NCCL defaults",
        machine_type=None, accelerator=None, gpus_per_node=8, gpu_nics=0, nic_prefix="",
        nic_interface_offset=1, extra_networks=()),
    "a3-high": NetworkProfile(
        name="a3-high", description="A3 High, 8× H100 80GB, GPUDirect-TCPX over 4 GPU NICs",
        machine_type="a3-highgpu-8g", accelerator="nvidia-h100-80gb", gpus_per_node=8, gpu_nics=4,
        nic_prefix="gpu-nic", nic_interface_offset=1, extra_networks=(),
        nccl_env={
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_ALGO": "Ring,Tree",
            "NCCL_PROTO": "Simple",
            "NCCL_CROSS_NIC": "0",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_P2P_PXN_LEVEL": "0",
            "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
            "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_BUFFSIZE": "4194304",
            "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "1",
            "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;"
                                              "eth4:60-73,164-177",
            "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;"
                                              "eth4:74-87,178-191",
            "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
            "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET.mount_path,
        },
        host_mounts=(_NVIDIA_LIB64, TCPX_SOCKET), ld_library_path="/usr/local/nvidia/lib64",
        expected_busbw_gbps=80.0, gcloud_network_flags="gpu-nic", node_cpus=208, node_memory_gib=1872,
        node_manifests=(PINS["tcpx-installer"], PINS["nri-device-injector"]), capabilities=("IPC_LOCK",),
        rx_daemon=RxDaemon(
            name="tcpx-daemon", image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.15",
            command=("/tcpgpudmarxd/build/app/tcpgpudmarxd", "--gpu_nic_preset", "a3vm", "--gpu_shmem_type", "fd",
                     "--uds_path", TCPX_SOCKET.mount_path, "--setup_param", "--verbose 128 2 0 "),
            capabilities=("NET_ADMIN",), mounts=(_NVIDIA_LIB64, TCPX_SOCKET, *_SYSFS), devices=_GPU_DEVICES)),
    "a3-mega": NetworkProfile(
        name="a3-mega", description="A3 Mega, 8× H100 80GB, GPUDirect-TCPXO over 8 GPU NICs",
        machine_type="a3-megagpu-8g", accelerator="nvidia-h100-mega-80gb", gpus_per_node=8, gpu_nics=8,
        nic_prefix="gpu-nic", nic_interface_offset=1, extra_networks=(),
        nccl_env={
            "NCCL_FASTRAK_IFNAME": "eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8",
            "NCCL_FASTRAK_CTRL_DEV": "eth0",
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_CROSS_NIC": "0",
            "NCCL_PROTO": "Simple,LL128",
            "NCCL_MIN_NCHANNELS": "4",
            "NCCL_NVLSTREE_MAX_CHUNKSIZE": "131072",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_FASTRAK_NUM_FLOWS": "2",
            "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
            "NCCL_BUFFSIZE": "8388608",
            "NCCL_FASTRAK_USE_SNAP": "1",
            "NCCL_FASTRAK_USE_LLCM": "1",
            "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": APERTURE.mount_path,
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
            "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
            # the README's /usr/local/tcpxo/lib64 is "the NCCL lib directory inside the workload container": ours
            "NCCL_TUNER_CONFIG_PATH": "/usr/local/nvidia/lib64/a3plus_tuner_config.textproto",
            "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": "/usr/local/nvidia/lib64/a3plus_guest_config.textproto",
            "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
            "NCCL_NVLS_ENABLE": "1",
            "NCCL_NET_PLUGIN_TELEMETRY_MODE": "0",
        },
        host_mounts=(_NVIDIA_LIB64, APERTURE), ld_library_path="/usr/local/nvidia/lib64",
        expected_busbw_gbps=185.0, gcloud_network_flags="gpu-nic", node_cpus=208, node_memory_gib=1872,
        node_manifests=(PINS["tcpxo-installer"], PINS["nri-device-injector"]),
        rx_daemon=RxDaemon(
            name="tcpxo-daemon", image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.22",
            command=("/bin/sh", "-c", "chmod 755 /fts/entrypoint_rxdm_container.sh && "
                     "exec /fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8"),
            capabilities=("NET_ADMIN", "NET_BIND_SERVICE"), mounts=(_NVIDIA_LIB64, *_SYSFS),
            devices=(*_GPU_DEVICES, "/dev/dmabuf_import_helper"))),
    "a3-ultra": NetworkProfile(
        name="a3-ultra", description="A3 Ultra, 8× H200 141GB, RDMA (RoCE, gIB) over 8 NICs",
        machine_type="a3-ultragpu-8g", accelerator="nvidia-h200-141gb", gpus_per_node=8, gpu_nics=8,
        nic_prefix="rdma-", nic_interface_offset=2, extra_networks=("gvnic-1",),
        nccl_env=_GIB_ENV, nccl_env_script=_GIB_SCRIPT,
        host_mounts=_GIB_MOUNTS, ld_library_path=_GIB_LD, expected_busbw_gbps=370.0,
        gcloud_network_flags="rdma", capabilities=_RDMA_CAPABILITIES, node_cpus=224,
        node_memory_gib=2952, node_manifests=(PINS["gib-installer"],)),
    "a4": NetworkProfile(
        name="a4", description="A4, 8× B200, RDMA (RoCE, gIB) over 8 NICs",
        machine_type="a4-highgpu-8g", accelerator="nvidia-b200", gpus_per_node=8, gpu_nics=8,
        nic_prefix="rdma-", nic_interface_offset=2, extra_networks=("gvnic-1",),
        nccl_env=_GIB_ENV, nccl_env_script=_GIB_SCRIPT,
        host_mounts=_GIB_MOUNTS, ld_library_path=_GIB_LD, expected_busbw_gbps=370.0,
        gcloud_network_flags="rdma", capabilities=_RDMA_CAPABILITIES, node_cpus=224,
        node_memory_gib=3968, node_manifests=(PINS["gib-installer"],)),
}

ProfileName = str


def get_profile(name: str) -> NetworkProfile:
    from shardline.errors import SpecError

    if name not in PROFILES:
        raise SpecError("launch.profile", f"unknown profile {name!r}", f"use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def gpu_network_names(profile: NetworkProfile, override: list[str] | None) -> list[str]:
    """The cluster's network names for the GPU NICs, in interface order."""
    if override is not None:
        return list(override)
    return [f"{profile.nic_prefix}{i}" for i in range(profile.gpu_nics)]


def nccl_environment(profile: NetworkProfile) -> dict[str, str]:
    """Environment the training container needs for this profile's fabric (LD_LIBRARY_PATH included)."""
    env = dict(profile.nccl_env)
    if profile.ld_library_path:
        env["LD_LIBRARY_PATH"] = profile.ld_library_path
    return env
