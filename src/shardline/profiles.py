"""Cluster network profiles: the one table of machine types, GPU NICs and the NCCL environment each needs.

Every launcher (Kubernetes, Slurm, Ray), `shardline netcheck` and `shardline cluster plan` read this table;
nothing else hard-codes a machine type, an NCCL variable or an expected bandwidth.

Sources: A3 Ultra / A4 (RDMA over gIB) settings are the ones in the reference tutorial this project
replaces (its `nccl_params` and the 8 GB all_gather busbw of ~376 GB/s on A4). A3 High
(GPUDirect-TCPX) and A3 Mega (GPUDirect-TCPXO) follow Google's GKE "maximize GPU network bandwidth"
pages; they have not been run on hardware by this project — check them against the plugin version your
cluster's NCCL installer DaemonSet ships.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.hardware import Accelerator, match_device

RENDEZVOUS_PORT = 29500
"""torchrun's rendezvous port on every engine (Kubeflow Trainer's constant, so one command fits all)."""


@dataclass(frozen=True)
class HostLibrary:
    """A host directory the NCCL installer DaemonSet fills, mounted into the training container."""

    name: str
    host_path: str
    mount_path: str


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
    host_libraries: tuple[HostLibrary, ...] = ()
    ld_library_path: str | None = None
    expected_busbw_gbps: float | None = None
    """nccl-tests all_gather bus bandwidth at 8 GB across 2 nodes; `shardline netcheck` passes above 90 % of it."""
    gcloud_network_flags: str = ""
    """How `cluster plan gke` creates the NIC VPCs: "rdma" (one RDMA VPC, N subnets) or "gpu-nic" (N VPCs)."""
    node_cpus: int | None = None
    """vCPUs of one node of machine_type (`cluster bootstrap` sizes the Kueue cpu quota from it)."""
    node_memory_gib: int | None = None
    """Memory of one node of machine_type in GiB (`cluster bootstrap` sizes the Kueue memory quota from it)."""
    node_manifests: tuple[str, ...] = ()
    """Google's node DaemonSets this fabric needs (NCCL/gIB or TCPX(O) installer, NRI device injector), pinned
    to a commit of GoogleCloudPlatform/container-engine-accelerators; `cluster plan gke` applies them."""
    capabilities: tuple[str, ...] = ()
    """Linux capabilities the trainer container adds (all others dropped). RDMA (gIB) registers GPU and host
    memory with the NIC, which pins pages: IPC_LOCK lifts the locked-memory limit for that."""

    @property
    def gpu(self) -> Accelerator | None:
        """The catalogue entry of this machine type's GPU (from its GKE accelerator label); None for any cluster."""
        return match_device(self.accelerator) if self.accelerator else None


_RDMA_CAPABILITIES = ("IPC_LOCK",)
_GIB_COMMON = {
    "NCCL_NET": "gIB",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_NET_CHUNKSIZE": "131072",
    "NCCL_P2P_PCI_CHUNKSIZE": "131072",
    "NCCL_P2P_NVL_CHUNKSIZE": "524288",
    "NCCL_NVLS_CHUNKSIZE": "524288",
    "NCCL_IB_GID_INDEX": "3",
    "NCCL_IB_ADAPTIVE_ROUTING": "1",
    "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_IB_TC": "52",
    "NCCL_IB_FIFO_TC": "84",
}
_GIB_LIBS = (
    HostLibrary("nvidia-libs", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),
    HostLibrary("gib", "/home/kubernetes/bin/gib", "/usr/local/gib"),
)
_GIB_LD = "/usr/local/nvidia/lib64:/usr/local/gib/lib64"
_CEA = "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators"
_GIB_INSTALLER = f"{_CEA}/2c776f7e9656a2b6476f19938b738b4186000ce3/gpudirect-rdma/nccl-rdma-installer.yaml"

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
            "NCCL_CROSS_NIC": "0",
            "NCCL_ALGO": "Ring",
            "NCCL_PROTO": "Simple",
            "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "1",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_P2P_PXN_LEVEL": "0",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_BUFFSIZE": "4194304",
            "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
            "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
            "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx",
            "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "50000",
        },
        host_libraries=(HostLibrary("nvidia-libs", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),
                        HostLibrary("tcpx-libs", "/home/kubernetes/bin/tcpx", "/usr/local/tcpx")),
        ld_library_path="/usr/local/nvidia/lib64:/usr/local/tcpx/lib64",
        expected_busbw_gbps=80.0, gcloud_network_flags="gpu-nic", node_cpus=208, node_memory_gib=1872,
        node_manifests=(f"{_CEA}/db325df93989b62ffb6959393c827e54a00f5d2d/gpudirect-tcpx/nccl-tcpx-installer.yaml",
                        f"{_CEA}/a5c392e4a533fc2727e8fa0a9fdd14c80852a7e0/gpudirect-tcpx/nri-device-injector.yaml")),
    "a3-mega": NetworkProfile(
        name="a3-mega", description="A3 Mega, 8× H100 80GB, GPUDirect-TCPXO over 8 GPU NICs",
        machine_type="a3-megagpu-8g", accelerator="nvidia-h100-mega-80gb", gpus_per_node=8, gpu_nics=8,
        nic_prefix="gpu-nic", nic_interface_offset=1, extra_networks=(),
        nccl_env={
            "NCCL_FASTRAK_CTRL_DEV": "eth0",
            "NCCL_FASTRAK_IFNAME": "eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8",
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_CROSS_NIC": "0",
            "NCCL_ALGO": "Ring,Tree",
            "NCCL_PROTO": "Simple,LL128",
            "NCCL_MIN_NCHANNELS": "4",
            "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
            "NCCL_TUNER_CONFIG_PATH": "/usr/local/nvidia/lib64/a3plus_tuner_config.textproto",
            "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": "/usr/local/nvidia/lib64/a3plus_guest_config.textproto",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_FASTRAK_NUM_FLOWS": "2",
            "NCCL_FASTRAK_USE_SNAP": "1",
            "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
            "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
            "NCCL_BUFFSIZE": "8388608",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
            "NCCL_FASTRAK_USE_LLCM": "1",
            "NCCL_NVLS_ENABLE": "0",
        },
        host_libraries=(HostLibrary("nvidia-libs", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),),
        ld_library_path="/usr/local/nvidia/lib64",
        expected_busbw_gbps=185.0, gcloud_network_flags="gpu-nic", node_cpus=208, node_memory_gib=1872,
        node_manifests=(
            f"{_CEA}/e14ee8a4998b4952775281047f019bb7a6bacff8/gpudirect-tcpxo/nccl-tcpxo-installer.yaml",
            f"{_CEA}/d4919d335f6cddb2d1b1f7242090ff9e93316579/nri_device_injector/nri-device-injector.yaml")),
    "a3-ultra": NetworkProfile(
        name="a3-ultra", description="A3 Ultra, 8× H200 141GB, RDMA (RoCE, gIB) over 8 NICs",
        machine_type="a3-ultragpu-8g", accelerator="nvidia-h200-141gb", gpus_per_node=8, gpu_nics=8,
        nic_prefix="rdma-", nic_interface_offset=2, extra_networks=("gvnic-1",),
        nccl_env={**_GIB_COMMON, "NCCL_TUNER_CONFIG_PATH": "/usr/local/gib/configs/tuner_config_a3u.txtpb"},
        host_libraries=_GIB_LIBS, ld_library_path=_GIB_LD, expected_busbw_gbps=370.0,
        gcloud_network_flags="rdma", capabilities=_RDMA_CAPABILITIES, node_cpus=224,
        node_memory_gib=2952, node_manifests=(_GIB_INSTALLER,)),
    "a4": NetworkProfile(
        name="a4", description="A4, 8× B200, RDMA (RoCE, gIB) over 8 NICs",
        machine_type="a4-highgpu-8g", accelerator="nvidia-b200", gpus_per_node=8, gpu_nics=8,
        nic_prefix="rdma-", nic_interface_offset=2, extra_networks=("gvnic-1",),
        nccl_env={**_GIB_COMMON, "NCCL_TUNER_CONFIG_PATH": "/usr/local/gib/configs/tuner_config_a4.txtpb"},
        host_libraries=_GIB_LIBS, ld_library_path=_GIB_LD, expected_busbw_gbps=370.0,
        gcloud_network_flags="rdma", capabilities=_RDMA_CAPABILITIES, node_cpus=224,
        node_memory_gib=3968, node_manifests=(_GIB_INSTALLER,)),
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
