"""A stand-in for Kubeflow Trainer's TrainJob status endpoint (feature gate TrainJobStatus, KEP-2779), checking what
the controller's server checks: HTTPS with a certificate of the CA it hands the pods, the path of one TrainJob, a
bearer token (the real server reviews the projected token; here it must equal the one written to the pod's token
file), and a body that the pinned TrainJob CRD's `status.trainerStatus` schema and the kubeflow-trainer-api
request model both accept. Binds loopback; records every accepted post."""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.k8s_schemas import _strict, load_crd
from tests.launch.http_json import Served, send_json


def _trainer_status_schema() -> dict:
    crd = load_crd("trainer.kubeflow.org_trainjobs")
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["trainerStatus"]
    return {"type": "object", "properties": {"trainerStatus": _strict(status)}, "required": ["trainerStatus"],
            "additionalProperties": False}


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it: (ca.crt, server.crt, server.key)."""
    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("trainer-ca")).issuer_name(name("trainer-ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name("trainer-status")).issuer_name(name("trainer-ca"))
            .public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False).sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class TrainerStatusServer(Served):
    """`with TrainerStatusServer(tmp, "ns", "job") as s: s.env` — the variables the controller injects."""

    def __init__(self, directory: Path, namespace: str, name: str) -> None:
        self.path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"
        self.ca, cert, key = _certificates(directory)
        self.token_file = directory / "token"
        self.token = secrets.token_urlsafe(24)
        self.token_file.write_text(self.token)
        self.posts: list[dict] = []
        self.refused: list[str] = []
        self.schema = _trainer_status_schema()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                problem = server.check(self.path, self.headers.get("Authorization"), self.headers.get("Content-Type"),
                                       body)
                if problem:
                    server.refused.append(problem)
                    send_json(self, 401 if "token" in problem else 400, {"message": problem})
                    return
                server.posts.append(json.loads(body))
                send_json(self, 200, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)

    def check(self, path: str, authorization: str | None, content_type: str | None, body: bytes) -> str | None:
        from kubeflow_trainer_api import models

        if path != self.path:
            return f"path {path} is not this TrainJob's status"
        if authorization != f"Bearer {self.token}":
            return "bearer token missing or not the pod's"
        if content_type != "application/json":
            return f"content type {content_type}"
        try:
            payload = json.loads(body)
            jsonschema.validate(payload, self.schema, cls=jsonschema.Draft7Validator)
            models.TrainerV1alpha1UpdateTrainJobStatusRequest.from_dict(payload)
        except Exception as e:  # noqa: BLE001 - every refusal is recorded for the test to show
            return f"body: {e}"
        return None

    @property
    def env(self) -> dict[str, str]:
        port = self.server.server_address[1]
        return {"KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{port}{self.path}",
                "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca), "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file)}

