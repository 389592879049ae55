"""Training pods on GKE GPU profiles against Google's published rules: GPUDirect-TCPX(O) sidecars and mounts, the gIB
environment script, whole-node NIC profiles, GCS FUSE caching and cpu/memory requests (issue 19, items 1, 2, 8, 9,
11, 12)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from shardline.engines.kubernetes.objects import render_objects
from shardline.errors import SpecError
from shardline.network_profiles import PINS
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import validate_all

BASE = ["run.id=fab-20261122-000000", "launch.image=registry.example/shardline:1", "launch.nnodes=2",
        "parallel.nproc_per_node=8", "train.global_batch_size=16", "train.micro_batch_size=1",
        "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=my-bucket"]
GPU_DEVICES = [*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidiactl", "/dev/nvidia-uvm"]
INSTALLER_WRITES = {PINS["tcpx-installer"].path: "/home/kubernetes/bin/nvidia/lib64",
                    PINS["tcpxo-installer"].path: "/home/kubernetes/bin/nvidia/lib64"}
"""Where each pinned installer copies its libraries (`cp -r /var/lib/tcpx(o)/lib64/. /usr/local/nvidia/lib64` with
/home/kubernetes/bin mounted at /usr/local), read at the pinned commits."""


def _pod(profile: str, *extra: str, target: str = "jobset") -> dict:
    objs = render_objects(load_spec("tiny", [*BASE, f"launch.profile={profile}", *extra]), target)
    validate_all(objs)
    work = objs[-1]
    return work["spec"]["template"] if work["kind"] == "Job" else \
        work["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def _host_paths(pod: dict) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}


def _mounts(container: dict, pod: dict) -> dict[str, str]:
    """mountPath → host path, for the container's hostPath mounts."""
    paths = _host_paths(pod)
    return {m["mountPath"]: paths[m["name"]] for m in container["volumeMounts"] if m["name"] in paths}


def test_a3_mega_pods_run_the_tcpxo_daemon_sidecar_with_llcm_devices_and_current_nccl_settings():
    """GoogleCloudPlatform/container-engine-accelerators gpudirect-tcpxo/nccl-test-latest.yaml: a `tcpxo-daemon`
    container with NET_ADMIN and NET_BIND_SERVICE, /sys at /hostsysfs and /proc/sys at /hostprocsysfs, the
    `devices.gke.io/container.tcpxo-daemon` annotation, and /dev/aperture_devices mounted where
    NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY points; gpudirect-tcpxo/README.md (release Apr 30, 2026): no NCCL_ALGO,
    NCCL_NVLS_ENABLE=1, NCCL_NVLSTREE_MAX_CHUNKSIZE=131072 (the guest config checker aborts without it).
    Kubernetes sidecar containers (an init container with restartPolicy Always) end with the pod's main container:
    https://kubernetes.io/docs/concepts/workloads/pods/sidecar-containers/."""
    for target in ("k8s-job", "jobset"):
        pod = _pod("a3-mega", target=target)
        (daemon,) = pod["spec"]["initContainers"]
        assert daemon["name"] == "tcpxo-daemon" and daemon["restartPolicy"] == "Always"
        assert daemon["image"].endswith("tcpgpudmarxd-dev:v1.0.22")
        assert set(daemon["securityContext"]["capabilities"]["add"]) == {"NET_ADMIN", "NET_BIND_SERVICE"}
        assert _mounts(daemon, pod) == {"/usr/local/nvidia/lib64": "/home/kubernetes/bin/nvidia/lib64",
                                        "/hostsysfs": "/sys", "/hostprocsysfs": "/proc/sys"}
        devices = yaml.safe_load(pod["metadata"]["annotations"]["devices.gke.io/container.tcpxo-daemon"])
        assert [d["path"] for d in devices] == [*GPU_DEVICES, "/dev/dmabuf_import_helper"]
        trainer = pod["spec"]["containers"][0]
        env = _env(trainer)
        assert env["NCCL_FASTRAK_USE_LLCM"] == "1"
        assert _mounts(trainer, pod)[env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"]] == "/dev/aperture_devices"
        assert "NCCL_ALGO" not in env and env["NCCL_NVLS_ENABLE"] == "1"
        assert env["NCCL_NVLSTREE_MAX_CHUNKSIZE"] == "131072" and "NCCL_DYNAMIC_CHUNK_SIZE" not in env
        libs = _mounts(trainer, pod)
        assert libs["/usr/local/nvidia/lib64"] == INSTALLER_WRITES[PINS["tcpxo-installer"].path]
        assert env["NCCL_TUNER_CONFIG_PATH"].startswith("/usr/local/nvidia/lib64/")


def test_a3_high_pods_run_the_tcpx_daemon_and_share_its_socket_and_the_installed_libraries():
    """container-engine-accelerators gpudirect-tcpx/nccl-test-latest.yaml: a `tcpx-daemon` container
    (`--uds_path /run/tcpx`, NET_ADMIN, /sys and /proc/sys), the host's /run/tcpx shared with the workload,
    libraries from /home/kubernetes/bin/nvidia/lib64, the `devices.gke.io/container.tcpx-daemon` annotation;
    gpudirect-tcpx/nccl-tcpx-installer.yaml at the pinned commit copies the plugin there (nothing writes
    /home/kubernetes/bin/tcpx). Without the socket NCCL falls back to plain sockets."""
    pod = _pod("a3-high")
    (daemon,) = pod["spec"]["initContainers"]
    assert daemon["name"] == "tcpx-daemon" and daemon["restartPolicy"] == "Always"
    assert daemon["command"][daemon["command"].index("--uds_path") + 1] == "/run/tcpx"
    assert daemon["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"]
    assert _mounts(daemon, pod)["/run/tcpx"] == "/run/tcpx"
    assert {"/hostsysfs": "/sys", "/hostprocsysfs": "/proc/sys"}.items() <= _mounts(daemon, pod).items()
    devices = yaml.safe_load(pod["metadata"]["annotations"]["devices.gke.io/container.tcpx-daemon"])
    assert [d["path"] for d in devices] == GPU_DEVICES
    trainer = pod["spec"]["containers"][0]
    env, mounts = _env(trainer), _mounts(trainer, pod)
    assert mounts[env["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"]] == "/run/tcpx"  # the daemon's socket directory
    assert mounts["/usr/local/nvidia/lib64"] == INSTALLER_WRITES[PINS["tcpx-installer"].path]
    assert "/home/kubernetes/bin/tcpx" not in _host_paths(pod).values()
    assert "/usr/local/nvidia/lib64" in env["LD_LIBRARY_PATH"].split(":")


@pytest.mark.parametrize("profile", ["a3-high", "a3-mega"])
def test_a_trainjob_cannot_add_the_rxdm_sidecar_and_says_which_targets_can(profile):
    """kubeflow/trainer manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml (tests/crds): a runtime patch's
    containers and initContainers carry only name, env, securityContext and volumeMounts: no image, no command."""
    with pytest.raises(SpecError) as e:
        render_objects(load_spec("tiny", [*BASE, f"launch.profile={profile}"]), "trainjob")
    assert e.value.where == "launch.profile" and "jobset" in e.value.fix


def test_gib_pods_source_googles_environment_script_and_set_only_what_it_does_not(tmp_path):
    """https://docs.cloud.google.com/ai-hypercomputer/docs/nccl/test-vms ("Enable NCCL/gIB"): source
    /usr/local/gib/scripts/set_nccl_env.sh (Google updates it) and keep /usr/local/gib/lib64 on LD_LIBRARY_PATH;
    GLOO_SOCKET_IFNAME=eth0 keeps gloo on the pod network. The wrapper is run here with a stand-in script: the
    script's variables reach the command, and the command's arguments reach it unchanged (no shell parsing)."""
    for profile in ("a4", "a3-ultra"):
        trainer = _pod(profile)["spec"]["containers"][0]
        env = _env(trainer)
        assert trainer["command"][:4] == ["bash", "-c", 'source "$0" && exec "$@"',
                                          "/usr/local/gib/scripts/set_nccl_env.sh"]
        assert env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert "/usr/local/gib/lib64" in env["LD_LIBRARY_PATH"].split(":")
        assert not any(n.startswith("NCCL_") for n in env), sorted(n for n in env if n.startswith("NCCL_"))
    script = tmp_path / "set_nccl_env.sh"
    script.write_text("export NCCL_NET=gIB\n")
    wrapper = trainer["command"][:3]
    out = subprocess.run([*wrapper, str(script), "sh", "-c", 'echo "$NCCL_NET|$1"', "x", "$(id); `id`"],
                         capture_output=True, text=True, check=True).stdout
    assert out == "gIB|$(id); `id`\n"


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob", "rayjob"])
def test_a_nic_profile_takes_whole_nodes_or_is_refused(target):
    """https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx: the workload must use
    all GPUs and all secondary NICs of a node. A pod with every NIC but 4 of 8 GPUs leaves 4 GPUs idle (no other
    pod can get a NIC) while Kueue counts 4."""
    from shardline.engines.registry import get_backend

    spec = load_spec("tiny", [*BASE, "launch.profile=a4", "parallel.nproc_per_node=4", "train.global_batch_size=8"])
    with pytest.raises(SpecError) as e:
        get_backend(target).render(spec)
    assert e.value.where == "parallel.nproc_per_node" and "parallel.nproc_per_node=8" in e.value.fix
    get_backend(target).render(load_spec("tiny", [*BASE, "parallel.nproc_per_node=4", "train.global_batch_size=8"]))


def test_gcs_fuse_read_cache_is_bounded_requested_and_its_metadata_expires():
    """GoogleCloudPlatform/gcs-fuse-csi-driver docs/usage.md: the sidecar's ephemeral storage is set by pod
    annotations (`gke-gcsfuse/ephemeral-storage-request`); the driver keeps its file cache in a pod volume named
    `gke-gcsfuse-cache` when one is defined. GoogleCloudPlatform/gcsfuse docs/semantics.md: a TTL of -1 never
    expires, so files the write mount changes would stay stale on the read mount."""
    pod = _pod("a4", "launch.kubernetes.storage.file_cache=200Gi")
    read = next(v for v in pod["spec"]["volumes"] if v["name"] == "storage-read")
    options = dict(o.rsplit(":", 1) for o in read["csi"]["volumeAttributes"]["mountOptions"].split(",") if ":" in o)
    assert options["file-cache:max-size-mb"] == str(200 * 1024)
    assert options["metadata-cache:ttl-secs"] != "-1" and options["file-system:kernel-list-cache-ttl-secs"] != "-1"
    cache = next(v for v in pod["spec"]["volumes"] if v["name"] == "gke-gcsfuse-cache")
    assert cache == {"name": "gke-gcsfuse-cache", "emptyDir": {"sizeLimit": "200Gi"}}
    assert pod["metadata"]["annotations"]["gke-gcsfuse/ephemeral-storage-request"] == "200Gi"


@pytest.mark.parametrize("profile", ["a3-high", "a3-mega", "a3-ultra", "a4"])
def test_training_pods_request_cpu_and_memory_sized_to_their_node(profile):
    """https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/: pods whose usage exceeds
    their requests are evicted first (a memory-backed /dev/shm counts as the pod's memory);
    https://kueue.sigs.k8s.io/docs/concepts/cluster_queue/: quota is charged by requests. The pod asks for most of
    the node (the kubelet reserves the rest), more than its /dev/shm, and fits the quota `cluster bootstrap` sizes."""
    from shardline.network_profiles import get_profile
    from shardline.ops.cluster.bootstrap import BootstrapOptions, resource_quota

    spec = load_spec("tiny", [*BASE, f"launch.profile={profile}"])
    requests = _pod(profile)["spec"]["containers"][0]["resources"]["requests"]
    node = get_profile(profile)
    cpu, memory = int(requests["cpu"]), int(requests["memory"].removesuffix("Gi"))
    assert 0.8 * node.node_cpus <= cpu < node.node_cpus and 0.8 * node.node_memory_gib <= memory < node.node_memory_gib
    assert memory > int(spec.launch.kubernetes.shm_size.removesuffix("Gi"))
    quota = resource_quota(spec, BootstrapOptions())
    assert cpu * spec.launch.nnodes <= quota["cpu"]
    assert memory * spec.launch.nnodes <= int(str(quota["memory"]).removesuffix("Gi"))
    explicit = _pod(profile, "launch.kubernetes.cpu=100", "launch.kubernetes.memory=900Gi")
    assert explicit["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "100"
