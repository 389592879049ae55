"""The few Kubernetes API calls the launcher makes, behind one small interface.

`ClusterApi` talks to a real API server through the `kubernetes` client and the user's kubeconfig, and turns
every failed request into a ClusterError (engines/kubernetes/api_errors.py). Every create asks the API server for
strict field validation (`fieldValidation=Strict`): a field the server does not know is an error, never silently
dropped (https://kubernetes.io/docs/reference/using-api/api-concepts/#field-validation). Tests drive the launcher's
logic through the same interface with recorded objects, and `ClusterApi` itself against a local server that answers
like one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Protocol

from shardline.engines.kubernetes.api_errors import Request, api_error
from shardline.errors import ClusterError, ShardlineError

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

    def get_crd(self, name: str) -> dict | None: ...

    def list_workloads(self, namespace: str) -> list[dict]: ...

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]: ...


def create_all(api: Api, objects: list[dict]) -> None:
    """Create `objects` in order; when one fails, delete the ones this call created (no orphan ConfigMap or
    Service outlives a refused Job) and say in the error what was removed and what is left to remove."""
    created: list[dict] = []
    for obj in objects:
        try:
            api.create(obj)
        except ClusterError as e:
            raise _after_cleanup(api, created, e) from e
        created.append(obj)


def _after_cleanup(api: Api, created: list[dict], error: ClusterError) -> ClusterError:
    if not created:
        return error
    removed, left = [], []
    for obj in reversed(created):
        meta, ref = obj["metadata"], f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            api.delete(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            removed.append(ref)
        except ClusterError as e:
            left.append((obj, e))
    problem, fix = error.problem, error.fix
    if removed:
        problem += f"; removed what this launch had created before: {', '.join(removed)}"
    if left:
        refs = " ".join(f"{resource(o['apiVersion'], o['kind'])}/{o['metadata']['name']}" for o, _ in left)
        problem += "; could not remove " + "; ".join(f"{o['kind']}/{o['metadata']['name']} ({e.problem})"
                                                    for o, e in left)
        fix += f"; then delete the leftovers: `kubectl delete {refs} -n {left[0][0]['metadata']['namespace']}`"
    return ClusterError(error.where, problem, fix)


RESOURCES = {"ConfigMap": "configmaps", "Service": "services", "Job": "jobs.batch", "Pod": "pods",
             "NetworkPolicy": "networkpolicies.networking.k8s.io"}
STRICT = "Strict"


def resource(api_version: str, kind: str) -> str:
    """The RBAC resource name of a kind (`jobs.batch`, `jobsets.jobset.x-k8s.io`), as `kubectl auth can-i` takes it."""
    if kind in RESOURCES:
        return RESOURCES[kind]
    group, _, plural = KINDS[(api_version, kind)]
    return f"{plural}.{group}"


class ClusterApi:
    """Every failed request raises a ClusterError naming the request, the API server's answer and the fix."""

    def __init__(self, context: str | None = None, config_file: str | None = None):
        from kubernetes import client, config

        self.context = context
        try:
            self.client = config.new_client_from_config(config_file=config_file, context=context)
        except Exception as e:  # noqa: BLE001 — no kubeconfig, unknown context
            try:
                config.load_incluster_config()
            except Exception:  # noqa: BLE001
                raise ShardlineError("kubeconfig", f"cannot load a Kubernetes configuration: {e}",
                                     "set KUBECONFIG or launch.kubernetes.context (gcloud container clusters "
                                     "get-credentials ... on GKE)") from None
            self.client = client.ApiClient()
        self.server = self.client.configuration.host
        self.core = client.CoreV1Api(self.client)
        self.batch = client.BatchV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self.extensions = client.ApiextensionsV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    def _call(self, request: Request, fn, *args, absent: tuple[int, ...] = (), **kwargs):
        """`fn(*args, **kwargs)`; None where the API server answers one of the `absent` statuses."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status in absent:
                return None
            raise api_error(request, e, self.server, self.context) from e
        except (HTTPError, OSError) as e:
            raise api_error(request, e, self.server, self.context) from e

    def create(self, obj: dict) -> None:
        ns, kind, name = obj["metadata"]["namespace"], obj["kind"], obj["metadata"]["name"]
        request = Request("create", resource(obj["apiVersion"], kind), ns, name)
        strict = {"field_validation": STRICT}
        if kind == "ConfigMap":
            self._call(request, self.core.create_namespaced_config_map, ns, obj, **strict)
        elif kind == "Service":
            self._call(request, self.core.create_namespaced_service, ns, obj, **strict)
        elif kind == "Job":
            self._call(request, self.batch.create_namespaced_job, ns, obj, **strict)
        elif kind == "NetworkPolicy":
            self._call(request, self.networking.create_namespaced_network_policy, ns, obj, **strict)
        else:
            group, version, plural = KINDS[(obj["apiVersion"], kind)]
            self._call(request, self.custom.create_namespaced_custom_object, group, version, ns, plural, obj,
                       **strict)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        request = Request("get", resource(api_version, kind), namespace, name)
        if kind == "Job":
            job = self._call(request, self.batch.read_namespaced_job, name, namespace, absent=(404,))
            return None if job is None else self.client.sanitize_for_serialization(job)
        group, version, plural = KINDS[(api_version, kind)]
        return self._call(request, self.custom.get_namespaced_custom_object, group, version, namespace, plural, name,
                          absent=(404,))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        from kubernetes import client

        request = Request("delete", resource(api_version, kind), namespace, name)
        body = client.V1DeleteOptions(propagation_policy="Foreground")
        if kind == "ConfigMap":
            self._call(request, self.core.delete_namespaced_config_map, name, namespace, absent=(404,))
        elif kind == "Service":
            self._call(request, self.core.delete_namespaced_service, name, namespace, absent=(404,))
        elif kind == "Job":
            self._call(request, self.batch.delete_namespaced_job, name, namespace, body=body, absent=(404,))
        elif kind == "NetworkPolicy":
            self._call(request, self.networking.delete_namespaced_network_policy, name, namespace, absent=(404,))
        else:
            group, version, plural = KINDS[(api_version, kind)]
            self._call(request, self.custom.delete_namespaced_custom_object, group, version, namespace, plural, name,
                       body=body, absent=(404,))

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        pods = self._call(Request("list", "pods", namespace), self.core.list_namespaced_pod, namespace,
                          label_selector=selector)
        return self.client.sanitize_for_serialization(pods)["items"]

    def get_crd(self, name: str) -> dict | None:
        """A CustomResourceDefinition as the cluster serves it; None where it is not installed, {} where this
        identity may not read it (then the strict create still refuses what the cluster's schema lacks)."""
        from kubernetes.client.exceptions import ApiException

        request = Request("get", "customresourcedefinitions.apiextensions.k8s.io", "(cluster)", name)
        try:
            crd = self._call(request, self.extensions.read_custom_resource_definition, name, absent=(404,),
                             _preload_content=False)
        except ClusterError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 403:
                return {}
            raise
        return None if crd is None else json.loads(crd.data)

    def list_workloads(self, namespace: str) -> list[dict]:
        group, version, plural = KINDS[("kueue.x-k8s.io/v1beta2", "Workload")]
        request = Request("list", f"{plural}.{group}", namespace)
        # Kueue not installed, or not allowed to read workloads: status explains without them
        found = self._call(request, self.custom.list_namespaced_custom_object, group, version, namespace, plural,
                           absent=(403, 404))
        return [] if found is None else found["items"]

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]:
        request = Request("get", "pods/log", namespace, pod)
        resp = self._call(request, self.core.read_namespaced_pod_log, pod, namespace, container=container,
                          follow=follow, _preload_content=False)
        buffer = b""
        chunks = resp.stream()
        while True:
            chunk = self._call(request, next, chunks, None)
            if chunk is None:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        if buffer:
            yield buffer.decode(errors="replace")
