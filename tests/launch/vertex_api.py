"""A local HTTP server that plays Vertex AI's JobService REST API for the real `JobServiceClient`.

The client runs unchanged on its REST transport (`url_scheme="http"`, anonymous credentials) against this server,
which records every request and answers as the API does: create assigns a name and queues the job, get returns it
in the next state of a scripted sequence (QUEUED → PENDING → RUNNING → …, or an error message as Vertex writes it),
cancel moves it to CANCELLING and then CANCELLED. Enums are encoded as numbers when the client asks for
`enum-encoding=int`, as the API does. An error can be queued for the next request.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from google.auth.credentials import AnonymousCredentials
from google.cloud import aiplatform_v1
from google.cloud.aiplatform_v1.services.job_service.transports.rest import JobServiceRestTransport

from tests.launch.http_json import send_json

_CREATE = re.compile(r"^/v1/(projects/[^/]+/locations/[^/]+)/customJobs$")
_JOB = re.compile(r"^/v1/(projects/[^/]+/locations/[^/]+/customJobs/[^/:]+)(:cancel)?$")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: dict | None


@dataclass
class VertexApi:
    requests: list[Request] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)
    scripts: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)
    next_script: list[tuple[str, str | None]] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                api._handle(self, "GET")

            def do_POST(self) -> None:
                api._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_port}"

    def client(self, region: str) -> aiplatform_v1.JobServiceClient:
        """What VertexBackend's client factory returns: the real client, its REST transport pointed here."""
        self.regions.append(region)
        transport = JobServiceRestTransport(host=self.host, credentials=AnonymousCredentials(), url_scheme="http")
        return aiplatform_v1.JobServiceClient(transport=transport)

    def script(self, states: list[tuple[str, str | None]], name: str | None = None) -> None:
        """The states successive GETs return (the last one repeats): JobState names with an error message or None;
        for the job `name`, or for the next job created."""
        if name is None:
            self.next_script = list(states)
        else:
            self.scripts[name] = list(states)

    def fail_next(self, code: int, status: str, message: str) -> None:
        self.errors.append((code, status, message))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # the API
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        self.requests.append(Request(method, url.path, parse_qs(url.query), json.loads(raw) if raw else None))
        ints = "enum-encoding=int" in (parse_qs(url.query).get("$alt") or [""])[0]
        if self.errors:
            code, status, message = self.errors.pop(0)
            return send_json(h, code, {"error": {"code": code, "message": message, "status": status}})
        if method == "POST" and (m := _CREATE.match(url.path)):
            name = f"{m.group(1)}/customJobs/{1000 + len(self.jobs)}"
            job = dict(json.loads(raw), name=name, state="JOB_STATE_QUEUED", createTime="2026-11-25T10:00:00Z")
            self.jobs[name] = job
            self.scripts.setdefault(name, self.next_script)
            self.next_script = []
            return send_json(h, 200, self._encode(job, ints))
        m = _JOB.match(url.path)
        if not m or m.group(1) not in self.jobs:
            return send_json(h, 404, {"error": {"code": 404, "message": f"CustomJob {url.path} not found",
                                                 "status": "NOT_FOUND"}})
        name, job = m.group(1), self.jobs[m.group(1)]
        if method == "POST" and m.group(2):
            self.scripts[name] = [("JOB_STATE_CANCELLING", None), ("JOB_STATE_CANCELLED", None)]
            return send_json(h, 200, {})
        script = self.scripts.get(name) or []
        if script:
            state, error = script.pop(0) if len(script) > 1 else script[0]
            job["state"] = state
            if state in ("JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"):
                job.setdefault("startTime", "2026-11-25T10:05:00Z")
            if error:
                job["error"] = {"code": 3, "message": error}
        return send_json(h, 200, self._encode(job, ints))

    @staticmethod
    def _encode(job: dict, ints: bool) -> dict[str, Any]:
        message = aiplatform_v1.CustomJob.from_json(json.dumps(job), ignore_unknown_fields=False)
        return json.loads(aiplatform_v1.CustomJob.to_json(message, use_integers_for_enums=ints,
                                                          always_print_fields_with_no_presence=False))

