"""Stand-ins for what a JobSet with `restartStrategy: InPlaceRestart` meets in a cluster, where the real ones
cannot run here (no kube-apiserver, no JobSet controller, no kubelet):

- `JobSetServer`: the API paths the in-place agent uses — a field-selected watch of one JobSet (chunked
  `WatchEvent` lines, an ADDED event first, as kube-apiserver streams them) and PATCH of a pod's annotations
  (optionally: the first watches or patches answered 503, or every patch 403 as without the agent's Role) —
  plus the JobSet controller's in-place rules, restated from its `reconcileInPlaceRestart`
  (kubernetes-sigs/jobset, pkg/controllers/in_place_restart.go): when every pod reports the same
  `jobset.sigs.k8s.io/in-place-restart-attempt`, `status.currentInPlaceRestartAttempt` becomes it; otherwise,
  once any pod reports more than 0, `status.previousInPlaceRestartAttempt` becomes the highest attempt − 1 (never
  lowered). Every status change and patch is logged with its time.
- `Container`: the kubelet's handling of one container with `restartPolicy: Never` and `restartPolicyRules`
  (Kubernetes ContainerRestartRules): on exit, the first rule whose exit codes match restarts it in place;
  no match ends it with that code.

Run as a script, the server runs in another network namespace (`ip netns exec`), logging to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from tests.launch.http_json import send_json
from tests.launch.k8s_apiserver import status

ATTEMPT = "jobset.sigs.k8s.io/in-place-restart-attempt"
UNAVAILABLE = status(503, "ServiceUnavailable", "the server is currently unable to handle the request")


class JobSetServer:
    def __init__(self, jobset: dict, pods: list[str], host: str = "127.0.0.1", port: int = 0,
                 log: Path | None = None, unavailable_watches: int = 0, unavailable_patches: int = 0,
                 forbid_patch: bool = False):
        self.js = copy.deepcopy(jobset)
        self.js["status"] = {}
        self.version = 1
        self.js["metadata"]["resourceVersion"] = "1"
        self.pods = {p: {} for p in pods}
        self.total = sum(r["replicas"] * r["template"]["spec"]["parallelism"]
                         for r in self.js["spec"]["replicatedJobs"])
        self.events: list[dict] = []
        self.log = log
        self.cond = threading.Condition()
        self.closing = False
        self.t0 = time.monotonic()
        self.unavailable_watches, self.unavailable_patches = unavailable_watches, unavailable_patches
        self.forbid_patch = forbid_patch
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, body: dict) -> None:
                send_json(self, code, body)

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                q = parse_qs(query)
                if not path.endswith("/jobsets"):
                    return self._send(*status(404, "NotFound", f"{path} not found"))
                assert q.get("fieldSelector") == [f"metadata.name={server.js['metadata']['name']}"], q
                if q.get("watch", [""])[0].lower() == "true" and server.unavailable_watches > 0:
                    server.unavailable_watches -= 1  # the control plane is away for a moment
                    return self._send(*UNAVAILABLE)
                if q.get("watch", [""])[0].lower() != "true":
                    with server.cond:
                        return self._send(200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSetList",
                                                "metadata": {"resourceVersion": str(server.version)},
                                                "items": [server.js]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + int(q.get("timeoutSeconds", ["300"])[0])
                sent, kind = None, "ADDED"
                while time.monotonic() < deadline:
                    with server.cond:
                        server.cond.wait_for(lambda last=sent: server.version != last or server.closing, timeout=1)
                        if server.closing:
                            break
                        if server.version == sent:
                            continue
                        sent, obj = server.version, copy.deepcopy(server.js)
                    line = (json.dumps({"type": kind, "object": obj}) + "\n").encode()
                    kind = "MODIFIED"
                    try:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    except OSError:
                        return
                with contextlib.suppress(OSError):
                    self.wfile.write(b"0\r\n\r\n")

            def do_PATCH(self) -> None:
                name = self.path.partition("?")[0].rsplit("/", 1)[1]
                if server.unavailable_patches > 0:
                    server.unavailable_patches -= 1
                    self.rfile.read(int(self.headers["Content-Length"]))
                    return self._send(*UNAVAILABLE)
                if server.forbid_patch:  # kube-apiserver's answer without the agent's Role
                    self.rfile.read(int(self.headers["Content-Length"]))
                    return self._send(*status(403, "Forbidden", f'pods "{name}" is forbidden: User "system:'
                                              f'serviceaccount:default:shardline-trainer" cannot patch resource '
                                              f'"pods" in API group "" in the namespace "default"'))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                annotations = body["metadata"]["annotations"]
                server.patch(name, annotations)
                self._send(200, {"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": name, "annotations": server.pods[name]}})

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"

    def _record(self, **event) -> None:
        event["t"] = round(time.monotonic() - self.t0, 3)
        self.events.append(event)
        if self.log:
            with self.log.open("a") as f:
                f.write(json.dumps(event) + "\n")

    def patch(self, pod: str, annotations: dict[str, str]) -> None:
        with self.cond:
            self.pods[pod].update(annotations)
            self._record(kind="annotate", pod=pod, attempt=int(annotations[ATTEMPT]))
            self._reconcile()

    def _reconcile(self) -> None:
        attempts = [int(a[ATTEMPT]) for a in self.pods.values() if ATTEMPT in a]
        status = self.js["status"]
        if len(attempts) == self.total and len(set(attempts)) == 1:
            field, value = "currentInPlaceRestartAttempt", attempts[0]
        elif attempts and max(attempts) > 0:
            field, value = "previousInPlaceRestartAttempt", max(attempts) - 1
            if status.get(field) is not None and value < status[field]:
                return
        else:
            return
        if status.get(field) == value:
            return
        status[field] = value
        self.version += 1
        self.js["metadata"]["resourceVersion"] = str(self.version)
        self._record(kind="status", field=field, value=value)
        self.cond.notify_all()

    def __enter__(self) -> JobSetServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def rule_restarts(rules: list[dict], code: int) -> bool:
    """Whether Kubernetes restarts the container in place for exit `code` (first matching rule wins)."""
    for rule in rules:
        codes = rule["exitCodes"]
        if (code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"] == "Restart"
    return False


class Container:
    """One container run by a kubelet stand-in: started with `start(attempt)` → Popen, restarted per its rules."""

    def __init__(self, container: dict, start) -> None:
        assert container["restartPolicy"] == "Never"
        self.rules = container["restartPolicyRules"]
        self.start = start
        self.exits: list[tuple[float, int]] = []
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.code: int | None = None

    def _run(self) -> None:
        restarts = 0
        while True:
            self.proc = self.start(restarts)
            code = self.proc.wait()
            code = 128 - code if code < 0 else code
            self.exits.append((time.monotonic(), code))
            if not rule_restarts(self.rules, code):
                self.code = code
                return
            restarts += 1

    def __enter__(self) -> Container:
        self.thread.start()
        return self

    def wait(self, timeout: float) -> int | None:
        self.thread.join(timeout)
        return self.code

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobset", type=Path, required=True)
    ap.add_argument("--pods", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", type=Path, required=True)
    a = ap.parse_args()
    with JobSetServer(json.loads(a.jobset.read_text()), a.pods.split(","), a.host, a.port, a.log):
        a.log.with_suffix(".ready").write_text("ready")
        threading.Event().wait()


if __name__ == "__main__":
    main()
