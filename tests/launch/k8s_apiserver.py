"""A stand-in Kubernetes API server on 127.0.0.1 for the real `kubernetes` client.

It answers as the API server does (kube-apiserver's REST paths; errors as `Status` objects, e.g. the 403 body
`{"kind": "Status", "reason": "Forbidden", "code": 403, ...}`): each request is looked up in a table of
(method, path) → (HTTP status, body); otherwise a POST echoes the object with 201 (created), a DELETE answers
a Success Status, and anything else 404 NotFound. Every request is recorded as (method, path); `queries` holds
each request's query parameters.

Given CRDs (`crds`), it serves them at /apis/apiextensions.k8s.io/v1/customresourcedefinitions/<name> and treats
a POST of their kind as kube-apiserver does with server-side field validation
(https://kubernetes.io/docs/reference/using-api/api-concepts/#field-validation): a field the CRD's structural schema
does not declare is pruned from what is stored (the default, `Warn`/`Ignore`), or refused with 400 BadRequest
"strict decoding error: unknown field" when the request says `fieldValidation=Strict`.
"""

from __future__ import annotations

import copy
import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import yaml

from tests.launch.http_json import Served

Answer = tuple[int, dict | str]
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"


def status(code: int, reason: str, message: str, details: dict | None = None) -> Answer:
    """An error answer as kube-apiserver writes it (metav1.Status)."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    if details is not None:
        body["details"] = details
    return code, body


def forbidden(verb: str, resource: str, group: str, namespace: str) -> Answer:
    user, full = "system:serviceaccount:ci:launcher", f"{resource}.{group}" if group else resource
    return status(403, "Forbidden", f'{full} is forbidden: User "{user}" cannot {verb} resource '
                  f'"{resource}" in API group "{group}" in the namespace "{namespace}"',
                  {"group": group, "kind": resource})


def namespace_not_found(namespace: str) -> Answer:
    return status(404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})


def no_such_resource() -> Answer:
    """What a path under an API group the cluster does not serve gets (no CRD installed)."""
    return 404, "404 page not found\n"


def unknown_fields(obj: object, schema: dict, path: str = "") -> list[str]:
    """Dotted paths in `obj` that a structural schema does not declare (kube-apiserver's pruning rule): below
    `x-kubernetes-preserve-unknown-fields` anything goes; `metadata` is ObjectMeta, checked elsewhere."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(obj, dict | list):
        return []
    if isinstance(obj, list):
        items = schema.get("items") or {}
        return [u for i, item in enumerate(obj) for u in unknown_fields(item, items, f"{path}[{i}]")]
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    out = []
    for key, value in obj.items():
        where = f"{path}.{key}" if path else key
        if path == "" and key in ("apiVersion", "kind", "metadata"):
            continue
        if props is not None and key in props:
            out += unknown_fields(value, props[key], where)
        elif isinstance(extra, dict):
            out += unknown_fields(value, extra, where)
        elif props is not None:
            out.append(where)
    return out


def prune(obj: dict, fields: list[str]) -> dict:
    """`obj` without the dotted `fields` (what the API server stores when it does not validate strictly)."""
    out = copy.deepcopy(obj)
    for field in fields:
        *parents, last = field.replace("[", ".[").split(".")
        node = out
        for part in parents:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        node.pop(last, None)
    return out


class ApiServerStub(Served):
    def __init__(self, answers: dict[tuple[str, str], Answer] | None = None, crds: list[dict] | None = None):
        self.answers = dict(answers or {})
        self.requests: list[tuple[str, str]] = []
        self.queries: list[dict[str, list[str]]] = []
        self.stored: list[dict] = []
        self.crds = {c["metadata"]["name"]: c for c in crds or []}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path, _, query = self.path.partition("?")
                stub.requests.append((self.command, path))
                stub.queries.append(parse_qs(query))
                length = int(self.headers.get("Content-Length") or 0)
                sent = self.rfile.read(length) if length else b""
                if (self.command, path) in stub.answers:
                    code, body = stub.answers[(self.command, path)]
                elif self.command == "GET" and path.startswith(CRD_PATH):
                    name = path.removeprefix(CRD_PATH)
                    code, body = (200, stub.crds[name]) if name in stub.crds else status(
                        404, "NotFound", f'customresourcedefinitions.apiextensions.k8s.io "{name}" not found')
                elif self.command == "POST":
                    code, body = stub.create(json.loads(sent or b"{}"), parse_qs(query))
                elif self.command == "DELETE":
                    code, body = 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
                else:
                    code, body = status(404, "NotFound", f"{path} not found")
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _schema(self, obj: dict) -> dict | None:
        group, _, version = obj.get("apiVersion", "").rpartition("/")
        for crd in self.crds.values():
            if crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == obj.get("kind"):
                served = next((v for v in crd["spec"]["versions"] if v["name"] == version), None)
                return served and served["schema"]["openAPIV3Schema"]
        return None

    def create(self, obj: dict, query: dict[str, list[str]]) -> Answer:
        schema = self._schema(obj)
        unknown = unknown_fields(obj, schema) if schema else []
        if unknown and query.get("fieldValidation") == ["Strict"]:
            return status(400, "BadRequest", f'{obj["kind"]} in version "{obj["apiVersion"].rpartition("/")[2]}" '
                          f'cannot be handled as a {obj["kind"]}: strict decoding error: unknown field "{unknown[0]}"')
        stored = prune(obj, unknown)
        self.stored.append(stored)
        return 201, stored



def closed_port_url() -> str:
    """An address where nothing listens: connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def kubeconfig(path: Path, server: str, context: str = "stub") -> Path:
    """A kubeconfig whose context `context` points at `server` with a bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "stub", "cluster": {"server": server}}],
        "users": [{"name": "stub", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": context, "context": {"cluster": "stub", "user": "stub", "namespace": "default"}}]}))
    return path
