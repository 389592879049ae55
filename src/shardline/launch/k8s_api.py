"""The few Kubernetes API calls the launcher makes, behind one small interface.

`ClusterApi` talks to a real API server through the `kubernetes` client and the user's kubeconfig.
Tests drive the launcher's logic through the same interface with recorded objects (no API server runs
on the project's machines).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from shardline.errors import ShardlineError

KINDS = {  # apiVersion/kind → (group, version, plural) for custom objects
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    ("kueue.x-k8s.io/v1beta2", "Workload"): ("kueue.x-k8s.io", "v1beta2", "workloads"),
    ("ray.io/v1", "RayJob"): ("ray.io", "v1", "rayjobs"),
}


class Api(Protocol):
    def create(self, obj: dict) -> None: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    def list_pods(self, namespace: str, selector: str) -> list[dict]: ...

    def list_workloads(self, namespace: str) -> list[dict]: ...

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]: ...


class ClusterApi:
    def __init__(self, context: str | None = None):
        from kubernetes import client, config

        try:
            config.load_kube_config(context=context)
        except Exception as e:  # noqa: BLE001 — no kubeconfig, unknown context
            try:
                config.load_incluster_config()
            except Exception:  # noqa: BLE001
                raise ShardlineError("kubeconfig", f"cannot load a Kubernetes configuration: {e}",
                                     "set KUBECONFIG or launch.kubernetes.context (gcloud container clusters "
                                     "get-credentials ... on GKE)") from None
        self.client = client.ApiClient()
        self.core = client.CoreV1Api(self.client)
        self.batch = client.BatchV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    def create(self, obj: dict) -> None:
        from kubernetes.client.exceptions import ApiException

        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        try:
            if kind == "ConfigMap":
                self.core.create_namespaced_config_map(ns, obj)
            elif kind == "Service":
                self.core.create_namespaced_service(ns, obj)
            elif kind == "Job":
                self.batch.create_namespaced_job(ns, obj)
            else:
                group, version, plural = KINDS[(obj["apiVersion"], kind)]
                self.custom.create_namespaced_custom_object(group, version, ns, plural, obj)
        except ApiException as e:
            hint = {404: "is the CRD installed (JobSet, Kubeflow Trainer)?", 403: "check your RBAC (the "
                    "shardline-launcher Role from `shardline cluster bootstrap`)", 409: "an object with this "
                    "name exists: launch a new run id"}.get(e.status, "see the API server's message")
            raise ShardlineError(f"{kind}/{obj['metadata']['name']}", f"the API server refused it ({e.status}): "
                                 f"{e.reason} {e.body or ''}".strip(), hint) from None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            if kind == "Job":
                return self.client.sanitize_for_serialization(self.batch.read_namespaced_job(name, namespace))
            group, version, plural = KINDS[(api_version, kind)]
            return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = client.V1DeleteOptions(propagation_policy="Foreground")
        try:
            if kind == "ConfigMap":
                self.core.delete_namespaced_config_map(name, namespace)
            elif kind == "Service":
                self.core.delete_namespaced_service(name, namespace)
            elif kind == "Job":
                self.batch.delete_namespaced_job(name, namespace, body=body)
            else:
                group, version, plural = KINDS[(api_version, kind)]
                self.custom.delete_namespaced_custom_object(group, version, namespace, plural, name, body=body)
        except ApiException as e:
            if e.status != 404:
                raise

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return self.client.sanitize_for_serialization(pods)["items"]

    def list_workloads(self, namespace: str) -> list[dict]:
        from kubernetes.client.exceptions import ApiException

        group, version, plural = KINDS[("kueue.x-k8s.io/v1beta2", "Workload")]
        try:
            return self.custom.list_namespaced_custom_object(group, version, namespace, plural)["items"]
        except ApiException as e:
            if e.status in (403, 404):  # Kueue not installed, or not allowed to read workloads
                return []
            raise

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]:
        resp = self.core.read_namespaced_pod_log(pod, namespace, container=container, follow=follow,
                                                 _preload_content=False)
        buffer = b""
        for chunk in resp.stream():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        if buffer:
            yield buffer.decode(errors="replace")
