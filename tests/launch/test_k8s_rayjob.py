"""The KubeRay RayJob on GKE GPU profiles: the head on the CPU pool without GPU NICs, and a head that only its own run
can reach, with Ray's token authentication (issue 19, items 3 and 14)."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

from shardline.engines.ray.backend import rayjob_manifests
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import load_crd, validate

BASE = ["run.id=ray-20261122-000000", "launch.image=registry.example/shardline:1", "launch.nnodes=2",
        "parallel.nproc_per_node=8", "train.global_batch_size=16", "train.micro_batch_size=1",
        "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=my-bucket",
        "launch.kubernetes.secret_env.HF_TOKEN.secret=hf", "launch.kubernetes.secret_env.HF_TOKEN.key=token"]
GPU_ONLY_ANNOTATIONS = ("networking.gke.io/interfaces", "networking.gke.io/default-interface", "devices.gke.io/")


def _render(*extra: str) -> tuple[dict, dict, dict]:
    _, policy, rayjob = rayjob_manifests(load_spec("tiny", [*BASE, *extra]))
    return policy, rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"], \
        rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]


@pytest.mark.parametrize("profile", ["a4", "a3-mega", "a3-high"])
def test_only_gpu_workers_carry_gpu_nics_host_paths_and_the_rxdm_sidecar(profile):
    """GKE multi-networking (https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods):
    a pod naming device networks fits only nodes attached to them, the GPU nodes, which GKE taints
    nvidia.com/gpu:NoSchedule (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus). A head with the NICs
    and no GPU toleration would stay Pending and take a worker's NICs; it belongs on the CPU pool."""
    _, head, worker = _render(f"launch.profile={profile}")
    head_ann = head["metadata"].get("annotations", {})
    assert not any(k.startswith(GPU_ONLY_ANNOTATIONS) for k in head_ann), head_ann
    assert "initContainers" not in head["spec"] and "nodeSelector" not in head["spec"]
    assert not any(t.get("key") == "nvidia.com/gpu" for t in head["spec"].get("tolerations", []))
    assert not any("hostPath" in v for v in head["spec"]["volumes"])
    assert head_ann["gke-gcsfuse/volumes"] == "true"  # the driver still reads the spec and storage
    worker_ann = worker["metadata"]["annotations"]
    assert "networking.gke.io/interfaces" in worker_ann
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["spec"]["tolerations"]
    assert any("hostPath" in v for v in worker["spec"]["volumes"])
    if profile != "a4":
        (sidecar,) = worker["spec"]["initContainers"]
        assert f"devices.gke.io/container.{sidecar['name']}" in worker_ann


def test_the_head_has_token_auth_and_a_network_policy_that_admits_only_its_run():
    """Ray token authentication (Ray >= 2.52; KubeRay `rayClusterSpec.authOptions.mode: token`, ray-project/kuberay
    ray-operator/config/crd/bases/ray.io_rayjobs.yaml; https://docs.ray.io/en/latest/cluster/kubernetes/user-guides/
    kuberay-auth.html), and a NetworkPolicy (https://kubernetes.io/docs/concepts/services-networking/network-policies/)
    that selects the head (KubeRay's `ray.io/node-type: head` label) and admits this run's Ray pods and its
    submitter Job's pods only: the head's env holds HF_TOKEN and its Jobs API runs code."""
    policy, head, worker = _render("launch.profile=a4")
    objs = rayjob_manifests(load_spec("tiny", [*BASE, "launch.profile=a4"]))
    assert [o["kind"] for o in objs] == ["ConfigMap", "NetworkPolicy", "RayJob"]  # closed before the head starts
    rayjob = objs[-1]
    assert rayjob["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    crd = load_crd("ray.io_rayjobs")
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    jsonschema.validate(rayjob, schema)
    validate(rayjob)
    kubernetes_validate.validate(policy, "1.31.0", strict=True)
    name = rayjob["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"shardline.dev/run-id": name, "ray.io/node-type": "head"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule and [p["podSelector"]["matchLabels"] for p in rule["from"]] == [
        {"shardline.dev/run-id": name}, {"batch.kubernetes.io/job-name": name}]
    for pod in (head, worker):  # both Ray pods carry the run label the policy admits
        assert pod["metadata"]["labels"]["shardline.dev/run-id"] == name


def test_a_ray_without_token_auth_is_refused_by_name():
    """Token authentication exists from Ray 2.52 (https://docs.ray.io/en/latest/cluster/kubernetes/user-guides/
    kuberay-auth.html prerequisites)."""
    with pytest.raises(SpecError) as e:
        rayjob_manifests(load_spec("tiny", [*BASE, "launch.ray.ray_version=2.51.0"]))
    assert e.value.where == "launch.ray.ray_version" and "2.52" in e.value.fix
