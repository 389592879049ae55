"""Run rendered Kubernetes training pods as real processes, each "pod" in its own network namespace.

What Kubernetes and its controllers would do is reproduced from their documented behaviour, not from our
renderer: the Job controller's completion index (annotation + JOB_COMPLETION_INDEX), pod hostnames
`<job>-<i>` under a Service subdomain or JobSet's `<js>-<rj>-<j>-<i>.<js>`, Kubeflow Trainer's injected
PET_* variables, the downward API (fieldRef), `$(VAR)`-free commands, DNS records (an /etc/hosts per
namespace, see `ip netns exec`), the container's working directory and ConfigMap volumes (written to a
directory; the mount path in the command is mapped to it).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.7"
TRAINER_PORT = 29500


@dataclass
class Pod:
    hostname: str
    subdomain: str
    namespace: str
    index: int
    annotations: dict[str, str]
    labels: dict[str, str]
    container: dict
    volumes: list[dict]
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def fqdn(self) -> str:
        return f"{self.hostname}.{self.subdomain}"


def _pod_spec_of(obj: dict) -> tuple[dict, dict]:
    if obj["kind"] == "Job":
        t = obj["spec"]["template"]
    else:  # JobSet
        t = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return t["metadata"], t["spec"]


def pods_from(objects: list[dict]) -> list[Pod]:
    """The pods the cluster would create for the rendered workload, in index order."""
    work = next(o for o in objects if o["kind"] in ("Job", "JobSet", "TrainJob"))
    name, ns = work["metadata"]["name"], work["metadata"]["namespace"]
    pods = []
    if work["kind"] == "TrainJob":
        trainer = work["spec"]["trainer"]
        patch = work["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod_t = patch["template"]["spec"]["template"]
        patched = pod_t["spec"]["containers"][0]
        container = {"name": "node", "command": trainer["command"], "env": trainer.get("env", []),
                     "volumeMounts": patched.get("volumeMounts", []), "workingDir": None}
        n = trainer["numNodes"]
        for i in range(n):
            # Trainer's torch plugin: numNodes, numProcPerNode, completion index, node-0-0 pod under the JobSet
            pet = {"PET_NNODES": str(n), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                   "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                   "PET_MASTER_PORT": str(TRAINER_PORT)}
            pods.append(Pod(f"{name}-node-0-{i}", name, ns, i, {}, {}, container,
                            pod_t["spec"].get("volumes", []), pet))
        return pods
    meta, spec = _pod_spec_of(work)
    job_spec = work["spec"] if work["kind"] == "Job" else work["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job_spec["completionMode"] == "Indexed"
    for i in range(job_spec["completions"]):
        if work["kind"] == "Job":
            hostname, subdomain = f"{name}-{i}", spec["subdomain"]
        else:
            rj = work["spec"]["replicatedJobs"][0]["name"]
            hostname, subdomain = f"{name}-{rj}-0-{i}", work["spec"]["network"]["subdomain"]
        ann = dict(meta.get("annotations", {}), **{"batch.kubernetes.io/job-completion-index": str(i)})
        labels = dict(meta.get("labels", {}))
        if work["kind"] == "JobSet":  # the JobSet controller labels every pod of its Jobs with its name
            labels["jobset.sigs.k8s.io/jobset-name"] = name
        pods.append(Pod(hostname, subdomain, ns, i, ann, labels, spec["containers"][0], spec.get("volumes", [])))
    return pods


def _field_ref(pod: Pod, path: str) -> str:
    m = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", path)
    if m:
        return (pod.annotations if m.group(1) == "annotations" else pod.labels)[m.group(2)]
    if path == "metadata.namespace":
        return pod.namespace
    if path == "metadata.name":
        return pod.hostname
    raise AssertionError(f"unsupported fieldRef {path}")


def pod_env(pod: Pod, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    env = {"JOB_COMPLETION_INDEX": str(pod.index), "HOSTNAME": pod.hostname, **pod.extra_env}
    for var in pod.container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = _field_ref(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            raise AssertionError(f"unsupported env source {var}")
    return env


def mount_map(pod: Pod, objects: list[dict], root: Path) -> dict[str, Path]:
    """mountPath → host directory: ConfigMaps are written out; persistent volumes are the shared host paths."""
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in pod.volumes}
    out = {}
    for m in pod.container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "configMap" in v:
            d = root / pod.hostname / m["name"]
            d.mkdir(parents=True, exist_ok=True)
            for key, text in config_maps[v["configMap"]["name"]]["data"].items():
                (d / key).write_text(text)
            out[m["mountPath"]] = d
    return out


class NetnsCluster:
    """One network namespace per pod, joined by a bridge, each with its own /etc/hosts (cluster DNS)."""

    def __init__(self, tag: str, n: int):
        self.tag, self.n = tag, n
        self.names = [f"{tag}{i}" for i in range(n)]
        self.ips = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.bridge = f"{tag}br"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def __enter__(self) -> NetnsCluster:
        self.close()
        ns0 = self.names[0]
        self._ip("netns", "add", ns0)
        self._ip("-n", ns0, "link", "add", self.bridge, "type", "bridge")
        self._ip("-n", ns0, "link", "set", self.bridge, "up")
        self._ip("-n", ns0, "link", "set", "lo", "up")
        for i, (ns, ip) in enumerate(zip(self.names, self.ips, strict=True)):
            if i:
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            a, b = f"{self.tag}v{i}", f"{self.tag}p{i}"
            self._ip("-n", ns0, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns)
            self._ip("-n", ns0, "link", "set", a, "master", self.bridge)
            self._ip("-n", ns0, "link", "set", a, "up")
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", b)
            self._ip("-n", ns, "link", "set", b, "up")
        return self

    def hosts_file(self, ns: str) -> Path:
        return Path("/etc/netns") / ns / "hosts"

    def publish(self, pods: list[Pod], visible: list[int]) -> None:
        """Write each namespace's /etc/hosts: 127.0.0.1, its own hostname, and the DNS records of `visible` pods.

        Written in place (same inode), so a running `ip netns exec` process sees records that appear later,
        as pods do when a peer's DNS record is published after they started.
        """
        for i, ns in enumerate(self.names):
            lines = ["127.0.0.1 localhost"]
            for j in sorted(set(visible) | {i}):
                p = pods[j]
                lines.append(f"{self.ips[j]} {p.fqdn} {p.fqdn}.{p.namespace}.svc.cluster.local {p.hostname}")
            f = self.hosts_file(ns)
            f.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "w") as fh:
                fh.write("\n".join(lines) + "\n")

    def start(self, i: int, pod: Pod, env: dict[str, str], command: list[str], cwd: Path | None,
              log: Path) -> subprocess.Popen:
        """The pod's container process: its namespace, its hostname, a clean environment."""
        base = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/bin", "HOME": str(log.parent),
                "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        full_env = base | env
        argv = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', pod.hostname, "env", "-i",
                *[f"{k}={v}" for k, v in full_env.items()], *command]
        return subprocess.Popen(argv, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def netns_missing() -> str | None:
    """What the network-namespace tests lack here, as their skip reason (a failure under CI=true), or None."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    absent = [f"{tool} (Debian package {pkg}, scripts/apt-packages.txt)"
              for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux")) if shutil.which(tool) is None]
    if absent:
        return f"network namespaces need {' and '.join(absent)}"
    probe = subprocess.run(["ip", "netns", "add", "slprobe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "slprobe"], capture_output=True)
    if probe.returncode != 0:
        return f"`ip netns add` refused (an unprivileged container lacks CAP_SYS_ADMIN): {probe.stderr.strip()}"
    return None


def netns_available() -> bool:
    return netns_missing() is None
