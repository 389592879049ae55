"""Kubernetes API failures as errors for people: the request that failed, the API server's HTTP status and reason
(or why it could not be reached), and what to do about it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shardline.errors import ClusterError

CRD_HINT = {"jobset.x-k8s.io": "JobSet", "trainer.kubeflow.org": "Kubeflow Trainer", "kueue.x-k8s.io": "Kueue",
            "ray.io": "KubeRay"}


@dataclass(frozen=True)
class Request:
    """One API request as RBAC names it: verb, resource (`jobs.batch`, `jobsets.jobset.x-k8s.io`), namespace."""

    verb: str
    resource: str
    namespace: str
    name: str | None = None

    def __str__(self) -> str:
        target = f"{self.resource} {self.name}" if self.name else self.resource  # as kubectl takes them
        return f"{self.verb} {target} in namespace {self.namespace}"

    @property
    def group(self) -> str:
        return self.resource.split("/")[0].partition(".")[2]


def _status(body: object) -> dict:
    """The API server's `Status` object from an error body ({} when the body is not one)."""
    try:
        out = json.loads(body) if isinstance(body, str | bytes) and body else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _root_cause(exc: BaseException) -> str:
    """The innermost OS error (`Connection refused`, `Name or service not known`), else the exception's text."""
    e: BaseException | None = exc
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        reason = getattr(e, "reason", None)  # urllib3's MaxRetryError wraps the last attempt's error here
        e = reason if isinstance(reason, BaseException) else (e.__cause__ or e.__context__)
    return str(exc)


def _fix(request: Request, code: int, status: dict) -> str:
    ns, details = request.namespace, status.get("details") or {}
    if code == 401:
        return ("the cluster rejected your credentials (missing or expired): refresh them (on GKE `gcloud container "
                "clusters get-credentials ...`) and check with `kubectl auth whoami`")
    if code == 403:
        return (f"your identity may not {request.verb} {request.resource} in namespace {ns}: bind it to the "
                "shardline-launcher Role (`shardline cluster bootstrap`) and check with "
                f"`kubectl auth can-i {request.verb} {request.resource} -n {ns}`")
    if code == 404:
        if details.get("kind") == "namespaces":
            return f"create namespace {details.get('name', ns)} (`kubectl create namespace {ns}`) or set " \
                   "launch.kubernetes.namespace to an existing one"
        if request.verb == "create" or not details.get("kind"):
            product = CRD_HINT.get(request.group, "its API")
            return (f"the cluster does not serve {request.resource}: install {product} (its CRD and controller) "
                    "or choose another --target; `kubectl api-resources` lists what it serves")
        return (f"{request.resource} {request.name} is gone (deleted, or launched with another namespace or "
                "context): check launch.kubernetes.namespace and launch.kubernetes.context")
    if code == 409:
        return (f"{request.resource} {request.name} already exists (an earlier launch of this run id?): launch again "
                f"for a new run id, or delete it with `kubectl delete {request.resource} {request.name} -n {ns}`")
    if code in (400, 422):
        return ("the API server or an admission webhook rejected the object: fix what the message names; "
                "`shardline render` prints the manifests and `kubectl apply --dry-run=server -f` checks them")
    if code == 429 or code >= 500:
        return "the API server (or a webhook it calls) is overloaded or failing: retry in a minute"
    return "see the API server's message"


def api_error(request: Request, exc: BaseException, server: str, context: str | None) -> ClusterError:
    """The ClusterError for a failed request: an HTTP answer from the API server, or no answer at all."""
    code = getattr(exc, "status", 0) or 0
    if code:
        status = _status(getattr(exc, "body", None))
        message = status.get("message") or str(getattr(exc, "body", "") or "").strip()[:300]
        reason = status.get("reason") or getattr(exc, "reason", "")
        problem = f"the API server at {server} answered HTTP {code} {reason}" + (f": {message}" if message else "")
        return ClusterError(str(request), problem, _fix(request, code, status))
    which = f"context {context!r}" if context else "the current context"
    return ClusterError(str(request), f"cannot reach the API server at {server}: {_root_cause(exc)}",
                        f"check the kubeconfig ({which}: `kubectl config current-context`, launch.kubernetes.context, "
                        "KUBECONFIG) and that its cluster endpoint is reachable from here (VPN, authorized networks; "
                        "`kubectl cluster-info`)")
