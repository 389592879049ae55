"""A Vertex AI replica's entry: node rank and rendezvous host from CLUSTER_SPEC, secrets from Secret Manager by
name, the spec file and the working directory, then the torchrun command in its place."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardline.engines.vertex.entry import SECRETS_ENV, SPEC_ENV, access_token, node_position, prepare, read_secrets
from shardline.errors import ShardlineError


def cluster_spec(pool: str, index: int, workers: int = 2) -> str:
    """CLUSTER_SPEC as Vertex AI sets it on a replica of a job with one primary and `workers` workers."""
    return json.dumps({"cluster": {"workerpool0": ["workerpool0-a1b2-0:2222"],
                                   "workerpool1": [f"workerpool1-a1b2-{i}:2222" for i in range(workers)]},
                       "environment": "cloud", "task": {"type": pool, "index": index, "trial": ""},
                       "job": "{}"})


@pytest.mark.parametrize("pool,index,rank", [("workerpool0", 0, 0), ("workerpool1", 0, 1), ("workerpool1", 1, 2)])
def test_node_rank_and_rendezvous_host_come_from_cluster_spec(pool, index, rank):
    got = node_position({"CLUSTER_SPEC": cluster_spec(pool, index), "RANK": "7", "MASTER_ADDR": "ignored"}, 3)
    assert got[:2] == (rank, "workerpool0-a1b2-0")


def test_without_cluster_spec_vertex_pytorch_variables_or_a_single_node_suffice():
    assert node_position({"MASTER_ADDR": "10.0.0.2", "RANK": "1"}, 2)[:2] == (1, "10.0.0.2")
    assert node_position({}, 1)[:2] == (0, "127.0.0.1")
    with pytest.raises(ShardlineError, match="CLUSTER_SPEC"):
        node_position({}, 2)


@pytest.mark.parametrize("raw,problem", [
    (cluster_spec("workerpool1", 0, workers=3), "lists 4 replicas"),
    (json.dumps({"cluster": {"workerpool0": ["a:1"], "workerpool2": ["b:1"]},
                 "task": {"type": "workerpool0", "index": 0}}), "pools"),
    ("not json", "is not Vertex AI's cluster description"),
])
def test_a_cluster_that_does_not_match_the_job_is_refused(raw, problem):
    with pytest.raises(ShardlineError, match=problem):
        node_position({"CLUSTER_SPEC": raw}, 3)


class SecretServer:
    """The metadata server's token endpoint and Secret Manager's `versions:access`, on one local port."""

    def __init__(self, secrets: dict[str, str]):
        self.seen: list[tuple[str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server.seen.append((self.path, dict(self.headers)))
                if self.path == "/computeMetadata/v1/instance/service-accounts/default/token":
                    ok = self.headers.get("Metadata-Flavor") == "Google"
                    return self._send(200 if ok else 403, {"access_token": "tok-1", "expires_in": 3599})
                name = self.path.removeprefix("/v1/").removesuffix(":access")
                if self.headers.get("Authorization") != "Bearer tok-1" or name not in secrets:
                    return self._send(403, {"error": {"code": 403, "status": "PERMISSION_DENIED"}})
                value = secrets[name]
                data = base64.b64encode(value if isinstance(value, bytes) else value.encode()).decode()
                self._send(200, {"name": name, "payload": {"data": data}})

            def _send(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()
        self.host = f"127.0.0.1:{self.http.server_port}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def secrets():
    server = SecretServer({"projects/p/secrets/hf-token/versions/latest": "hf_abc",
                           "projects/p/secrets/binary/versions/1": b"\xff\xfe\x00key"})
    yield server
    server.close()


def test_secrets_are_read_with_the_service_accounts_token(secrets):
    token = access_token(secrets.host)
    values = read_secrets({"HF_TOKEN": "projects/p/secrets/hf-token/versions/latest"}, token,
                          endpoint=f"http://{secrets.host}/v1")
    assert values == {"HF_TOKEN": "hf_abc"}
    assert secrets.seen[0][1]["Metadata-Flavor"] == "Google"
    with pytest.raises(ShardlineError, match="secretAccessor") as e:
        read_secrets({"WANDB_API_KEY": "projects/p/secrets/wandb/versions/1"}, token, f"http://{secrets.host}/v1")
    assert e.value.where == "launch.vertex.secret_env.WANDB_API_KEY"
    # a binary secret cannot become an environment variable: a named error (exit 2, never retried by Vertex),
    # not a UnicodeDecodeError traceback (exit 1, retried forever)
    with pytest.raises(ShardlineError, match="is not UTF-8 text") as e:
        read_secrets({"KEY": "projects/p/secrets/binary/versions/1"}, token, f"http://{secrets.host}/v1")
    assert e.value.where == "launch.vertex.secret_env.KEY"


def test_prepare_sets_rank_writes_the_spec_and_enters_the_bucket(tmp_path, monkeypatch, secrets):
    monkeypatch.chdir(tmp_path)
    environ = {"CLUSTER_SPEC": cluster_spec("workerpool1", 1), SPEC_ENV: "run:\n  name: tiny\n",
               SECRETS_ENV: json.dumps({"HF_TOKEN": "projects/p/secrets/hf-token/versions/latest"}),
               "GCE_METADATA_HOST": secrets.host}
    workdir, spec = tmp_path / "gcs" / "bucket" / "prefix", tmp_path / "local" / "spec.yaml"
    got = prepare(environ, str(workdir), str(spec), 3, log=lambda m: None, secret_manager=f"http://{secrets.host}/v1")
    assert got == (2, "workerpool0-a1b2-0")
    assert environ["PET_NODE_RANK"] == "2" and environ["PET_MASTER_ADDR"] == "workerpool0-a1b2-0"
    assert environ["PET_MASTER_PORT"] == "29500" and environ["HF_TOKEN"] == "hf_abc"
    assert SPEC_ENV not in environ and SECRETS_ENV not in environ
    assert spec.read_text() == "run:\n  name: tiny\n" and os.getcwd() == str(workdir)


def test_the_entry_execs_the_command_in_place_and_refuses_bad_input_with_exit_2(tmp_path):
    env = {**os.environ, SPEC_ENV: "run: {}\n", "CLUSTER_SPEC": cluster_spec("workerpool0", 0, workers=0)}
    probe = "import os; print(os.getcwd(), os.environ['PET_NODE_RANK'], os.environ['PET_MASTER_ADDR'], os.getpid())"
    args = [sys.executable, "-m", "shardline.engines.vertex.entry", "--workdir", str(tmp_path / "w"),
            "--spec", str(tmp_path / "s.yaml"), "--nnodes", "1", "--", sys.executable, "-c", probe]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    lines = stdout.strip().splitlines()
    assert "node rank 0 of 1, rendezvous workerpool0-a1b2-0:29500" in lines[0]
    assert lines[-1].split() == [str(tmp_path / "w"), "0", "workerpool0-a1b2-0", str(proc.pid)]  # exec'd in place
    bad = subprocess.run([*args[:8], "3", *args[9:]], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "lists 1 replicas" in bad.stderr
