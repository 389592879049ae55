"""Kubernetes API failures reach people as named errors (the request, the HTTP status and reason, the fix), and a
launch that fails half-way removes what it created: the real `kubernetes` client against a local stand-in server."""

from __future__ import annotations

import pytest

from shardline.engines.kubernetes.api import ClusterApi
from shardline.engines.kubernetes.backend import KubernetesBackend
from shardline.errors import ClusterError
from shardline.spec.resolve import load_spec
from tests.launch.k8s_apiserver import (
    ApiServerStub,
    closed_port_url,
    forbidden,
    kubeconfig,
    namespace_not_found,
    no_such_resource,
    status,
)

NAME = "api-20261122-000000"
NS = "ml"
CONFIG_MAP, SERVICE = f"/api/v1/namespaces/{NS}/configmaps", f"/api/v1/namespaces/{NS}/services"
JOBS, JOBSETS = f"/apis/batch/v1/namespaces/{NS}/jobs", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
SPEC = load_spec("tiny", [f"run.id={NAME}", "launch.image=registry.example/shardline:1", "launch.nnodes=1",
                          f"launch.kubernetes.namespace={NS}"])


def _backend(target: str, config) -> KubernetesBackend:
    return KubernetesBackend(target, api_factory=lambda ctx: ClusterApi(ctx, config_file=str(config)), poll_s=0)


def _deletes(stub: ApiServerStub) -> list[str]:
    return [path for method, path in stub.requests if method == "DELETE"]


def test_a_forbidden_job_names_rbac_and_removes_the_configmap_and_service_created_before_it(tmp_path):
    refused = {("POST", JOBS): forbidden("create", "jobs", "batch", NS)}
    with ApiServerStub(refused) as stub, pytest.raises(ClusterError) as e:
        _backend("k8s-job", kubeconfig(tmp_path / "config", stub.url)).submit(SPEC)
    err = e.value
    assert err.where == f"create jobs.batch {NAME} in namespace {NS}"
    assert "HTTP 403 Forbidden" in err.problem and 'cannot create resource "jobs"' in err.problem
    assert f"kubectl auth can-i create jobs.batch -n {NS}" in err.fix and "shardline-launcher Role" in err.fix
    assert f"removed what this launch had created before: Service/{NAME}, ConfigMap/{NAME}-spec" in err.problem
    assert _deletes(stub) == [f"{SERVICE}/{NAME}", f"{CONFIG_MAP}/{NAME}-spec"]


def test_a_cluster_without_the_jobset_crd_is_told_to_install_it_and_keeps_no_configmap(tmp_path):
    with ApiServerStub({("POST", JOBSETS): no_such_resource()}) as stub, pytest.raises(ClusterError) as e:
        _backend("jobset", kubeconfig(tmp_path / "config", stub.url)).submit(SPEC)
    assert e.value.where == f"create jobsets.jobset.x-k8s.io {NAME} in namespace {NS}"
    assert "HTTP 404" in e.value.problem and "404 page not found" in e.value.problem
    assert "install JobSet" in e.value.fix and "--target" in e.value.fix
    assert _deletes(stub) == [f"{CONFIG_MAP}/{NAME}-spec"]


def test_a_missing_namespace_is_named_and_nothing_is_left_to_remove(tmp_path):
    with ApiServerStub({("POST", CONFIG_MAP): namespace_not_found(NS)}) as stub, pytest.raises(ClusterError) as e:
        _backend("k8s-job", kubeconfig(tmp_path / "config", stub.url)).submit(SPEC)
    assert f'namespaces "{NS}" not found' in e.value.problem and "removed" not in e.value.problem
    assert f"kubectl create namespace {NS}" in e.value.fix and "launch.kubernetes.namespace" in e.value.fix
    assert [m for m, _ in stub.requests] == ["POST"]


def test_objects_that_cannot_be_removed_are_named_with_the_command_that_removes_them(tmp_path):
    answers = {("POST", JOBS): status(500, "InternalError", 'Internal error occurred: failed calling webhook '
                                      '"mjob.kb.io": connection refused'),
               ("DELETE", f"{CONFIG_MAP}/{NAME}-spec"): forbidden("delete", "configmaps", "", NS)}
    with ApiServerStub(answers) as stub, pytest.raises(ClusterError) as e:
        _backend("k8s-job", kubeconfig(tmp_path / "config", stub.url)).submit(SPEC)
    err = e.value
    assert "HTTP 500 InternalError" in err.problem and "retry" in err.fix
    assert f"removed what this launch had created before: Service/{NAME}" in err.problem
    assert f"could not remove ConfigMap/{NAME}-spec (the API server at {stub.url} answered HTTP 403" in err.problem
    assert f"kubectl delete configmaps/{NAME}-spec -n {NS}" in err.fix


def test_status_logs_and_cancel_name_the_failed_request_and_the_fix(tmp_path):
    pod = {"metadata": {"name": f"{NAME}-0-abcde", "creationTimestamp": "2026-11-22T00:00:00Z",
                        "annotations": {"batch.kubernetes.io/job-completion-index": "0"}}}
    answers = {("GET", f"{JOBS}/{NAME}"): status(401, "Unauthorized", "Unauthorized"),
               ("GET", f"/api/v1/namespaces/{NS}/pods"): (200, {"kind": "PodList", "apiVersion": "v1",
                                                                "metadata": {}, "items": [pod]}),
               ("GET", f"/api/v1/namespaces/{NS}/pods/{NAME}-0-abcde/log"): forbidden("get", "pods/log", "", NS),
               ("DELETE", f"{JOBS}/{NAME}"): forbidden("delete", "jobs", "batch", NS)}
    with ApiServerStub(answers) as stub:
        backend = _backend("k8s-job", kubeconfig(tmp_path / "config", stub.url))
        record = backend.submit(SPEC)
        with pytest.raises(ClusterError) as st:
            backend.status(record)
        with pytest.raises(ClusterError) as logs:
            list(backend.logs(record, rank=None, follow=False))
        with pytest.raises(ClusterError) as cancel:
            backend.cancel(record)
    assert st.value.where == f"get jobs.batch {NAME} in namespace {NS}"
    assert "HTTP 401 Unauthorized" in st.value.problem and "credentials" in st.value.fix
    assert logs.value.where == f"get pods/log {NAME}-0-abcde in namespace {NS}"
    assert "HTTP 403 Forbidden" in logs.value.problem and f"kubectl auth can-i get pods/log -n {NS}" in logs.value.fix
    assert cancel.value.where == f"delete jobs.batch {NAME} in namespace {NS}"
    assert f"kubectl auth can-i delete jobs.batch -n {NS}" in cancel.value.fix


def test_an_unreachable_api_server_points_at_the_kubeconfig_context(tmp_path):
    url = closed_port_url()
    config = kubeconfig(tmp_path / "config", url, context="gke_prod")
    spec = SPEC.model_copy(deep=True)
    spec.launch.kubernetes.context = "gke_prod"
    backend = _backend("jobset", config)
    with pytest.raises(ClusterError) as e:
        backend.submit(spec)
    assert e.value.where == f"create configmaps {NAME}-spec in namespace {NS}"
    assert e.value.problem == f"cannot reach the API server at {url}: Connection refused"
    assert "context 'gke_prod'" in e.value.fix and "kubectl config current-context" in e.value.fix


def test_a_refused_rayjob_removes_its_configmap_and_names_the_kuberay_crd(tmp_path):
    from shardline.engines.ray.backend import RayJobBackend

    rayjobs = f"/apis/ray.io/v1/namespaces/{NS}/rayjobs"
    with ApiServerStub({("POST", rayjobs): no_such_resource()}) as stub, pytest.raises(ClusterError) as e:
        RayJobBackend(api_factory=lambda ctx: ClusterApi(ctx, config_file=str(kubeconfig(tmp_path / "config",
                                                                                          stub.url)))).submit(SPEC)
    assert e.value.where == f"create rayjobs.ray.io {NAME} in namespace {NS}" and "HTTP 404" in e.value.problem
    policy = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{NAME}-head"
    assert _deletes(stub) == [policy, f"{CONFIG_MAP}/{NAME}-spec"]  # before: the ConfigMap stayed behind
