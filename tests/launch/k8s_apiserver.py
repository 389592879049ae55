"""A stand-in Kubernetes API server on 127.0.0.1 for the real `kubernetes` client.

It answers as the API server does (kube-apiserver's REST paths; errors as `Status` objects, e.g. the 403 body
`{"kind": "Status", "reason": "Forbidden", "code": 403, ...}`): each request is looked up in a table of
(method, path) → (HTTP status, body); otherwise a POST echoes the object with 201 (created), a DELETE answers
a Success Status, and anything else 404 NotFound. Every request is recorded as (method, path).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

Answer = tuple[int, dict | str]


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


class ApiServerStub:
    def __init__(self, answers: dict[tuple[str, str], Answer] | None = None):
        self.answers = dict(answers or {})
        self.requests: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path = self.path.split("?")[0]
                stub.requests.append((self.command, path))
                length = int(self.headers.get("Content-Length") or 0)
                sent = self.rfile.read(length) if length else b""
                if (self.command, path) in stub.answers:
                    code, body = stub.answers[(self.command, path)]
                elif self.command == "POST":
                    code, body = 201, json.loads(sent or b"{}")
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

    def __enter__(self) -> ApiServerStub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


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
