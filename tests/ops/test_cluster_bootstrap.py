"""`shardline cluster bootstrap`: Kueue queues, DWS admission check, trainer identity and launcher RBAC."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml

from shardline.cli import main
from shardline.errors import SpecError
from shardline.ops.cluster.bootstrap import KUEUE_API, BootstrapOptions, bootstrap_objects
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import load_crd, validate

A4 = ["launch.profile=a4", "launch.nnodes=2"]


def spec_with(*overrides: str):
    return load_spec("tiny", ["parallel.nproc_per_node=1", *overrides])


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    (obj,) = by_kind(objs, kind)
    return obj


@pytest.mark.parametrize("overrides, opts", [
    (A4 + ["launch.kubernetes.namespace=ml"],
     BootstrapOptions(dws=True, spot=True, priority_classes=True, bind_launcher=("user:a@example.com",))),
    ([], BootstrapOptions()),
    (["launch.kubernetes.gpu_resource=null"], BootstrapOptions(cpu="8", memory="32Gi")),
    (A4 + ["launch.kubernetes.topology=cloud.google.com/gce-topology-block"], BootstrapOptions(dws=True)),
    (["launch.kubernetes.gpu_resource=null", "launch.kubernetes.topology=example.com/rack",
      "launch.kubernetes.node_selector={pool: train}"], BootstrapOptions(cpu="8", memory="32Gi")),
], ids=["a4-everything", "generic-defaults", "cpu-only", "a4-topology-aware", "cpu-topology-aware"])
def test_every_bootstrap_object_validates_against_its_api_schema(overrides, opts):
    for obj in bootstrap_objects(spec_with(*overrides), opts):
        validate(obj)


def test_tpu_slices_get_a_chip_quota_and_flavors_for_their_accelerator_and_topology():
    """MaxText on TPU: Kueue admits whole slices by `google.com/tpu` (GKE's TPU device plugin) on flavors that select
    the slice's node pools by `cloud.google.com/gke-tpu-accelerator` and `gke-tpu-topology` (GKE "Plan TPUs in
    GKE"); DWS provisions TPU nodes the same way, so the provisioning request manages google.com/tpu."""
    from tests.k8s_schemas import validate

    spec = load_spec("maxtext-v6e-multislice", ["run.id=mt-1"])
    objs = bootstrap_objects(spec, BootstrapOptions(dws=True, spot=True))
    for obj in objs:
        validate(obj)
    dws, spot = by_kind(objs, "ResourceFlavor")
    labels = {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "4x4"}
    assert dws["spec"]["nodeLabels"] == labels and spot["spec"]["nodeLabels"] == labels | {
        "cloud.google.com/gke-spot": "true"}
    assert {t["key"] for t in spot["spec"]["tolerations"]} == {"google.com/tpu"}
    (group,) = one(objs, "ClusterQueue")["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["google.com/tpu"]
    assert all(f["resources"] == [{"name": "google.com/tpu", "nominalQuota": 2 * 16}] for f in group["flavors"])
    assert one(objs, "ProvisioningRequestConfig")["spec"]["managedResources"] == ["google.com/tpu"]
    with pytest.raises(SpecError) as e:
        bootstrap_objects(spec, BootstrapOptions(gpus=8))
    assert e.value.field == "--gpus"


def test_kueue_objects_use_a_version_the_pinned_crds_serve():
    served = {v["name"] for v in load_crd("kueue.x-k8s.io_clusterqueues")["spec"]
              ["versions"] if v["served"]}
    assert KUEUE_API.split("/")[1] in served
    objs = bootstrap_objects(spec_with(*A4), BootstrapOptions(dws=True, priority_classes=True))
    assert {o["apiVersion"] for o in objs if "kueue" in o["apiVersion"]} == {KUEUE_API}


def test_dws_gates_only_the_dws_flavor_with_a_gke_queued_provisioning_check():
    objs = bootstrap_objects(spec_with(*A4), BootstrapOptions(dws=True, spot=True))
    dws, spot = by_kind(objs, "ResourceFlavor")
    assert dws["metadata"]["name"] == "shardline-a4-dws" and spot["metadata"]["name"] == "shardline-a4-spot"
    assert dws["spec"]["nodeLabels"] == {"cloud.google.com/gke-accelerator": "nvidia-b200"}
    assert {t["key"] for t in dws["spec"]["tolerations"]} == {"nvidia.com/gpu", "cloud.google.com/gke-queued"}
    assert spot["spec"]["nodeLabels"]["cloud.google.com/gke-spot"] == "true"
    assert {t["key"] for t in spot["spec"]["tolerations"]} == {"nvidia.com/gpu"}
    config = one(objs, "ProvisioningRequestConfig")["spec"]
    assert config["provisioningClassName"] == "queued-provisioning.gke.io"
    assert config["managedResources"] == ["nvidia.com/gpu"]
    assert config["retryStrategy"]["backoffLimitCount"] >= 1
    assert config["podSetUpdates"]["nodeSelector"] == [
        {"key": "autoscaling.gke.io/provisioning-request", "valueFromProvisioningClassDetail": "ResizeRequestName"}]
    check = one(objs, "AdmissionCheck")
    assert check["spec"]["controllerName"] == "kueue.x-k8s.io/provisioning-request"
    assert check["spec"]["parameters"]["name"] == one(objs, "ProvisioningRequestConfig")["metadata"]["name"]
    cq = one(objs, "ClusterQueue")["spec"]
    assert cq["admissionChecksStrategy"]["admissionChecks"] == [
        {"name": check["metadata"]["name"], "onFlavors": ["shardline-a4-dws"]}]
    assert [f["name"] for f in cq["resourceGroups"][0]["flavors"]] == ["shardline-a4-dws", "shardline-a4-spot"]
    assert cq["preemption"] == {"withinClusterQueue": "LowerPriority"}


def test_without_dws_or_spot_one_plain_flavor_and_no_admission_check():
    objs = bootstrap_objects(spec_with(*A4), BootstrapOptions())
    assert [f["metadata"]["name"] for f in by_kind(objs, "ResourceFlavor")] == ["shardline-a4"]
    assert not by_kind(objs, "AdmissionCheck") and not by_kind(objs, "ProvisioningRequestConfig")
    assert "admissionChecksStrategy" not in one(objs, "ClusterQueue")["spec"]


def quota(objs: list[dict]) -> dict:
    flavor = one(objs, "ClusterQueue")["spec"]["resourceGroups"][0]["flavors"][0]
    return {r["name"]: r["nominalQuota"] for r in flavor["resources"]}


def test_quota_defaults_to_the_specs_whole_nodes_sized_by_the_profile():
    # 2 A4 nodes: 16 GPUs, 2 × 224 vCPUs, 2 × 3968 GiB (network_profiles.py)
    assert quota(bootstrap_objects(spec_with(*A4), BootstrapOptions())) == {
        "cpu": 448, "memory": "7936Gi", "nvidia.com/gpu": 16}


def test_gpus_cpu_memory_options_set_the_quota_and_gpus_sizes_the_derived_cpu():
    assert quota(bootstrap_objects(spec_with(*A4), BootstrapOptions(gpus=32))) == {
        "cpu": 896, "memory": "15872Gi", "nvidia.com/gpu": 32}
    assert quota(bootstrap_objects(spec_with(*A4), BootstrapOptions(gpus=8, cpu="100", memory="1Ti"))) == {
        "cpu": "100", "memory": "1Ti", "nvidia.com/gpu": 8}


@pytest.mark.parametrize("opts, where", [
    (BootstrapOptions(cpu="lots"), "--cpu"), (BootstrapOptions(memory="1 GiB"), "--memory"),
    (BootstrapOptions(gpus=0), "--gpus"), (BootstrapOptions(cluster_queue="Bad_Name"), "--cluster-queue"),
    (BootstrapOptions(bind_launcher=("alice",)), "--bind-launcher"),
    (BootstrapOptions(bind_launcher=("robot:x",)), "--bind-launcher"),
])
def test_bad_options_are_errors_that_name_the_option(opts, where):
    with pytest.raises(SpecError) as e:
        bootstrap_objects(spec_with(*A4), opts)
    assert e.value.where == where


def test_cpu_only_cluster_quotas_cpu_and_memory_and_refuses_gpu_options():
    spec = spec_with("launch.kubernetes.gpu_resource=null")
    assert quota(bootstrap_objects(spec, BootstrapOptions(cpu="8", memory="32Gi"))) == {"cpu": "8", "memory": "32Gi"}
    for opts, where in ((BootstrapOptions(cpu="8", dws=True), "--dws"), (BootstrapOptions(gpus=8), "--gpus"),
                        (BootstrapOptions(), "--cpu")):
        with pytest.raises(SpecError) as e:
            bootstrap_objects(spec, opts)
        assert e.value.where == where


def test_generic_profile_with_pod_cpu_requests_needs_an_explicit_cpu_quota():
    with pytest.raises(SpecError, match="--cpu"):
        bootstrap_objects(spec_with("launch.kubernetes.cpu='4'"), BootstrapOptions())


def test_local_queue_is_the_specs_queue_in_its_namespace_and_points_at_the_cluster_queue():
    objs = bootstrap_objects(spec_with("launch.kubernetes.queue=team-a", "launch.kubernetes.namespace=ml"),
                             BootstrapOptions(cluster_queue="gpu-pool"))
    lq = one(objs, "LocalQueue")
    assert lq["metadata"]["name"] == "team-a" and lq["metadata"]["namespace"] == "ml"
    assert lq["spec"]["clusterQueue"] == one(objs, "ClusterQueue")["metadata"]["name"] == "gpu-pool"
    assert one(objs, "ClusterQueue")["spec"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "ml"}}
    assert one(objs, "Namespace")["metadata"]["name"] == "ml"
    assert objs[0]["kind"] == "Namespace"  # applied before anything namespaced
    default = bootstrap_objects(spec_with(), BootstrapOptions())
    assert one(default, "LocalQueue")["metadata"]["name"] == "shardline"
    assert not by_kind(default, "Namespace")  # "default" exists on every cluster


def test_trainer_service_account_mounts_no_token_and_launcher_role_is_least_privilege():
    objs = bootstrap_objects(spec_with("launch.kubernetes.service_account=trainer-x"), BootstrapOptions())
    sa = one(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == "trainer-x" and sa["automountServiceAccountToken"] is False
    assert not by_kind(objs, "RoleBinding")  # nothing binds the trainer, and users bind the Role themselves
    rules = one(objs, "Role")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    resources = {r for _, r, _ in granted}
    assert resources == {"configmaps", "services", "jobs", "jobsets", "trainjobs", "rayjobs", "networkpolicies",
                         "pods", "pods/log", "events", "workloads"}
    assert not any("*" in (g, r, v) for g, r, v in granted)
    assert {v for _, _, v in granted} <= {"create", "get", "list", "watch", "delete"}
    assert {v for _, r, v in granted if r in ("pods", "pods/log", "events", "workloads")} <= {"get", "list", "watch"}
    assert "secrets" not in resources and "pods/exec" not in resources


def test_bind_launcher_binds_users_groups_and_service_accounts_to_the_launcher_role():
    objs = bootstrap_objects(spec_with("launch.kubernetes.namespace=ml"), BootstrapOptions(
        bind_launcher=("user:alice@example.com", "group:ml@example.com", "serviceaccount:ci/deployer",
                       "serviceaccount:bot")))
    binding = one(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == one(objs, "Role")["metadata"]["name"] == "shardline-launcher"
    assert [(s["kind"], s["name"], s.get("namespace")) for s in binding["subjects"]] == [
        ("User", "alice@example.com", None), ("Group", "ml@example.com", None),
        ("ServiceAccount", "deployer", "ci"), ("ServiceAccount", "bot", "ml")]


def test_priority_classes_are_ordered_and_must_include_the_specs_class():
    objs = bootstrap_objects(spec_with("launch.kubernetes.workload_priority_class=shardline-high"),
                             BootstrapOptions(priority_classes=True))
    values = {o["metadata"]["name"]: o["value"] for o in by_kind(objs, "WorkloadPriorityClass")}
    assert values["shardline-low"] < values["shardline-medium"] < values["shardline-high"]
    assert not by_kind(bootstrap_objects(spec_with(), BootstrapOptions()), "WorkloadPriorityClass")
    with pytest.raises(SpecError) as e:
        bootstrap_objects(spec_with("launch.kubernetes.workload_priority_class=urgent"),
                          BootstrapOptions(priority_classes=True))
    assert e.value.where == "launch.kubernetes.workload_priority_class"


def test_cli_writes_one_multi_document_file_in_apply_order(tmp_path):
    rc = main(["cluster", "bootstrap", "tiny", "--set", "parallel.nproc_per_node=1", "--set", "launch.profile=a4",
               "--set", "launch.kubernetes.namespace=ml", "--out", str(tmp_path), "--gpus", "24", "--cpu", "600",
               "--memory", "9000Gi", "--dws", "--spot", "--priority-classes", "--cluster-queue", "big",
               "--bind-launcher", "group:ml@example.com"])
    assert rc == 0
    objs = list(yaml.safe_load_all((tmp_path / "bootstrap.yaml").read_text()))
    kinds = [o["kind"] for o in objs]
    assert kinds == ["Namespace", "ResourceFlavor", "ResourceFlavor", "ProvisioningRequestConfig", "AdmissionCheck",
                     "WorkloadPriorityClass", "WorkloadPriorityClass", "WorkloadPriorityClass", "ClusterQueue",
                     "LocalQueue", "ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"]
    assert quota(objs) == {"cpu": "600", "memory": "9000Gi", "nvidia.com/gpu": 24}
    assert one(objs, "ClusterQueue")["metadata"]["name"] == "big"
    assert one(objs, "RoleBinding")["subjects"][0]["name"] == "ml@example.com"


def test_cli_reports_bad_input_with_exit_code_2(tmp_path, capsys):
    assert main(["cluster", "bootstrap", "tiny", "--set", "parallel.nproc_per_node=1", "--out", str(tmp_path),
                 "--cpu", "many"]) == 2
    assert "--cpu" in capsys.readouterr().err


def test_managed_prometheus_adds_one_pod_monitoring_for_rank_0_of_every_job_in_the_namespace(tmp_path):
    rc = main(["cluster", "bootstrap", "tiny", "--set", "parallel.nproc_per_node=1", "--set",
               "launch.kubernetes.namespace=ml", "--out", str(tmp_path), "--managed-prometheus"])
    assert rc == 0
    pm = one(list(yaml.safe_load_all((tmp_path / "bootstrap.yaml").read_text())), "PodMonitoring")
    assert pm["apiVersion"] == "monitoring.googleapis.com/v1" and pm["metadata"]["namespace"] == "ml"
    assert pm["spec"]["selector"]["matchLabels"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert pm["spec"]["endpoints"][0]["port"] == "metrics"  # the trainer container's named port
    assert by_kind(bootstrap_objects(spec_with(), BootstrapOptions()), "PodMonitoring") == []
    with pytest.raises(SpecError) as e:
        bootstrap_objects(spec_with("observe.metrics_port=null"), BootstrapOptions(managed_prometheus=True))
    assert e.value.where == "observe.metrics_port"


def _rbac_requests(tmp_path: Path) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every request `launch`, `status`, `logs` and `cancel` make, for every target,
    against the stand-in API server (which serves the pinned CRDs)."""
    from shardline.engines.kubernetes.api import ClusterApi
    from shardline.engines.registry import get_backend
    from tests.launch.k8s_apiserver import ApiServerStub, kubeconfig

    crds = [load_crd("trainer.kubeflow.org_trainjobs")]
    spec = spec_with("run.id=rbac-20261122-000000", "launch.image=img:1", "launch.kubernetes.namespace=ml")
    seen = set()
    for target in ("k8s-job", "jobset", "trainjob", "rayjob"):
        with ApiServerStub(crds=crds) as stub:
            config = kubeconfig(tmp_path / "config", stub.url)
            backend = get_backend(target)
            backend._api_factory = lambda ctx, c=config: ClusterApi(ctx, config_file=str(c))
            record = backend.submit(spec)
            for verb, args in (("status", ()), ("logs", (None, False)), ("cancel", ())):
                # the stub answers 404 to reads; the requests are what counts
                with contextlib.suppress(Exception):
                    result = getattr(backend, verb)(record, *args)
                    if verb == "logs":
                        list(result)
        for method, path in stub.requests:
            parts = path.strip("/").split("/")
            group = "" if parts[0] == "api" else parts[1]
            rest = parts[2:] if parts[0] == "api" else parts[3:]
            if rest[0] == "namespaces" and len(rest) > 2:
                rest = rest[2:]
            resource = rest[0] + ("/" + rest[2] if len(rest) > 2 else "")
            verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if len(rest) > 1 else "list")
            seen.add((group, resource, verb))
    return seen


def test_the_launcher_roles_grant_every_request_of_every_target(tmp_path):
    """Kubernetes RBAC (https://kubernetes.io/docs/reference/access-authn-authz/rbac/): a request is allowed when a
    rule names its API group, resource and verb. Observed requests of all four targets: RayJobs (ray.io, KubeRay's
    ray-operator/config/crd/bases/ray.io_rayjobs.yaml) and their NetworkPolicy included; the cluster-scoped TrainJob
    CRD read through the ClusterRole."""
    objs = bootstrap_objects(spec_with("launch.kubernetes.namespace=ml"), BootstrapOptions())
    granted = {(g, r, v) for obj in objs if obj["kind"] in ("Role", "ClusterRole") for rule in obj["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    missing = _rbac_requests(tmp_path) - granted
    assert not missing, missing


def test_namespaces_of_host_path_profiles_are_labelled_privileged_and_say_why():
    """Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/): baseline and
    restricted forbid hostPath volumes, which GKE GPU profiles' pods mount; Pod Security Admission reads the
    namespace label pod-security.kubernetes.io/enforce (https://kubernetes.io/docs/concepts/security/
    pod-security-admission/)."""
    from shardline.engines.kubernetes.objects import render_objects

    for profile in ("a3-high", "a3-mega", "a3-ultra", "a4"):
        spec = spec_with(f"launch.profile={profile}", "parallel.nproc_per_node=8", "train.global_batch_size=64",
                         "launch.image=img:1", "run.id=psa-20261122-000000")
        pod = render_objects(spec, "jobset")[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        assert any("hostPath" in v for v in pod["spec"]["volumes"])  # what the baseline level would reject
        ns = one(bootstrap_objects(spec, BootstrapOptions()), "Namespace")
        assert ns["metadata"]["name"] == "default"
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        assert "hostPath" in ns["metadata"]["annotations"]["shardline.dev/why-privileged"]
    assert not by_kind(bootstrap_objects(spec_with(), BootstrapOptions()), "Namespace")


def test_the_crd_the_launcher_checks_is_the_one_the_cluster_role_lets_it_read():
    from shardline.engines.kubernetes.trainer_api import TRAINJOB_CRD
    from shardline.ops.cluster.bootstrap import TRAINJOB_CRD as READABLE

    assert READABLE == TRAINJOB_CRD


def test_a_topology_aware_job_gets_a_kueue_topology_down_to_the_node_so_kueue_can_replace_a_failed_node():
    """Kueue TAS (KEP-2724, "Node failures"): a failed node of an admitted workload is replaced only in a Topology
    whose lowest level is kubernetes.io/hostname; a TAS flavor names its Topology and selects nodes by label."""
    objs = bootstrap_objects(spec_with(*A4, "launch.kubernetes.topology=cloud.google.com/gce-topology-subblock"),
                             BootstrapOptions(dws=True, spot=True))
    topology = one(objs, "Topology")
    assert [lv["nodeLabel"] for lv in topology["spec"]["levels"]] == [
        "cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock",
        "cloud.google.com/gce-topology-host", "kubernetes.io/hostname"]
    flavors = by_kind(objs, "ResourceFlavor")
    assert len(flavors) == 2 and all(f["spec"]["topologyName"] == topology["metadata"]["name"] for f in flavors)
    assert all(f["spec"]["nodeLabels"] for f in flavors)
    assert objs.index(topology) < objs.index(flavors[0])  # applied before the flavors that name it
    cpu = bootstrap_objects(spec_with("launch.kubernetes.gpu_resource=null", "launch.kubernetes.topology=rack",
                                      "launch.kubernetes.node_selector={pool: train}"),
                            BootstrapOptions(cpu="8", memory="32Gi"))
    assert [lv["nodeLabel"] for lv in one(cpu, "Topology")["spec"]["levels"]] == ["rack", "kubernetes.io/hostname"]
    assert one(cpu, "ResourceFlavor")["spec"]["nodeLabels"] == {"pool": "train"}
    assert not by_kind(bootstrap_objects(spec_with(*A4), BootstrapOptions()), "Topology")


@pytest.mark.parametrize("overrides, where", [
    (A4 + ["launch.kubernetes.topology=example.com/rack"], "launch.kubernetes.topology"),
    (["launch.kubernetes.gpu_resource=null", "launch.kubernetes.topology=rack"], "launch.kubernetes.node_selector"),
])
def test_a_topology_kueue_could_not_use_is_refused_by_name(overrides, where):
    with pytest.raises(SpecError) as e:
        bootstrap_objects(spec_with(*overrides), BootstrapOptions(cpu="8", memory="32Gi"))
    assert e.value.field == where
