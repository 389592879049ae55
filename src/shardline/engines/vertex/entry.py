"""`python -m shardline.engines.vertex.entry`: what a Vertex AI replica runs in front of the one torchrun line.

Vertex AI starts the same container on every replica and tells each where it stands in `CLUSTER_SPEC`, JSON like
`{"cluster": {"workerpool0": ["<host>:2222"], "workerpool1": ["<host>:2222", ...]}, "task": {"type":
"workerpool1", "index": 0}, "environment": "cloud"}`. Pool 0 holds the primary replica alone and pool 1 the
others (engines/vertex/job.py renders them so), hence node rank 0 for pool 0 and 1 + index for pool 1, and the
rendezvous host is pool 0's replica; its port there is Vertex's (TensorFlow's), torchrun's is RENDEZVOUS_PORT.
Without CLUSTER_SPEC, the variables Vertex sets for PyTorch (MASTER_ADDR, RANK) are read instead.

Before it replaces itself with the torchrun command (once the rendezvous host resolves), the entry
- reads the secrets named in SHARDLINE_SECRETS (env name → Secret Manager version) with the job's service
  account, through the metadata server's token and the Secret Manager REST API (no client library in the image);
  values exist only in this process's environment;
- writes the resolved spec carried in SHARDLINE_SPEC to `--spec`;
- enters `--workdir`: the base output directory as Vertex mounts it (Cloud Storage FUSE under /gcs/).
Bad input (a CLUSTER_SPEC that does not match the job, an unreadable secret) exits 2, which is never retried.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from shardline.engines.wait_rendezvous import wait_for_host
from shardline.errors import EXIT_BAD_INPUT, EXIT_FAILURE, ShardlineError
from shardline.network_profiles import RENDEZVOUS_PORT

SPEC_ENV = "SHARDLINE_SPEC"
SECRETS_ENV = "SHARDLINE_SECRETS"
SPEC_PATH = "/tmp/shardline/spec.yaml"
PRIMARY_POOL, WORKER_POOL = "workerpool0", "workerpool1"
METADATA_HOST = "metadata.google.internal"
"""The metadata server; GCE_METADATA_HOST overrides it, as it does for google-auth."""
SECRET_MANAGER = "https://secretmanager.googleapis.com/v1"


def node_position(environ: Mapping[str, str], nnodes: int) -> tuple[int, str, str]:
    """(node rank, rendezvous host, where this replica stands in words) from Vertex's environment."""
    raw = environ.get("CLUSTER_SPEC")
    if raw:
        try:
            spec = json.loads(raw)
            cluster, task = spec["cluster"], spec["task"]
            primary, workers = list(cluster[PRIMARY_POOL]), list(cluster.get(WORKER_POOL) or [])
            pool, index = str(task["type"]), int(task["index"])
        except (ValueError, KeyError, TypeError) as e:
            raise ShardlineError("CLUSTER_SPEC", f"is not Vertex AI's cluster description ({e!r}): {raw[:300]}",
                                 "run this entry only as the command of a CustomJob rendered by shardline") from None
        others = sorted(set(cluster) - {PRIMARY_POOL, WORKER_POOL})
        if len(primary) != 1 or others or pool not in (PRIMARY_POOL, WORKER_POOL):
            raise ShardlineError("CLUSTER_SPEC", f"has pools {sorted(cluster)} with {len(primary)} primary "
                                 f"replica(s), this one in {pool}", "launch the job as `shardline render --target "
                                 "vertex` writes it: one primary replica in workerpool0, the others in workerpool1")
        if 1 + len(workers) != nnodes:
            raise ShardlineError("CLUSTER_SPEC", f"lists {1 + len(workers)} replicas, but the job was rendered for "
                                 f"launch.nnodes={nnodes}", "render and launch the job again from its spec")
        rank = 0 if pool == PRIMARY_POOL else 1 + index
        return rank, primary[0].rsplit(":", 1)[0], f"{pool} replica {index}"
    if environ.get("MASTER_ADDR") and environ.get("RANK"):
        return int(environ["RANK"]), environ["MASTER_ADDR"], f"replica {environ['RANK']} (MASTER_ADDR)"
    if nnodes == 1:
        return 0, "127.0.0.1", "the only replica"
    raise ShardlineError("CLUSTER_SPEC", f"is not set, and neither are MASTER_ADDR and RANK, in a {nnodes}-node job",
                         "run this entry only as the command of a Vertex AI CustomJob rendered by shardline")


def _get_json(request: urllib.request.Request, timeout: float) -> dict:
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def access_token(metadata_host: str | None = None) -> str:
    """An OAuth token of the job's service account, from the metadata server."""
    host = metadata_host or os.environ.get("GCE_METADATA_HOST") or METADATA_HOST
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/service-accounts/default/token",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        return _get_json(request, 10)["access_token"]
    except (OSError, ValueError, KeyError) as e:
        raise ShardlineError("launch.vertex.secret_env", f"no token from the metadata server at {host} ({e})",
                             "secrets are read inside a Vertex AI job, which has a metadata server") from None


def read_secrets(refs: Mapping[str, str], token: str, endpoint: str = SECRET_MANAGER) -> dict[str, str]:
    """Environment name → secret value, each read from its Secret Manager version (`projects/…/versions/…`)."""
    values = {}
    for name, version in sorted(refs.items()):
        request = urllib.request.Request(f"{endpoint}/{version}:access",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            data = _get_json(request, 30)["payload"]["data"]
        except urllib.error.HTTPError as e:
            raise ShardlineError(f"launch.vertex.secret_env.{name}", f"Secret Manager refused {version}: HTTP "
                                 f"{e.code} {e.reason}", "check the secret's name and grant the job's service "
                                 "account (launch.vertex.service_account) roles/secretmanager.secretAccessor on it"
                                 ) from None
        except (OSError, ValueError, KeyError) as e:
            raise ShardlineError(f"launch.vertex.secret_env.{name}", f"could not read {version} ({e})",
                                 "check that the job can reach secretmanager.googleapis.com") from None
        try:
            values[name] = base64.b64decode(data).decode()
        except (ValueError, UnicodeDecodeError):  # a binary secret cannot be an environment variable's text
            raise ShardlineError(f"launch.vertex.secret_env.{name}", f"{version} is not UTF-8 text",
                                 "store the secret as text (base64-encode binary data yourself)") from None
    return values


def prepare(environ: MutableMapping[str, str], workdir: str, spec_path: str, nnodes: int, log=print,
            secret_manager: str = SECRET_MANAGER) -> tuple[int, str]:
    """Everything before torchrun, applied to `environ`; returns (node rank, rendezvous host)."""
    rank, host, where = node_position(environ, nnodes)
    environ.update({"PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": host, "PET_MASTER_PORT": str(RENDEZVOUS_PORT)})
    refs = json.loads(environ.pop(SECRETS_ENV, "") or "{}")
    if refs:
        environ.update(read_secrets(refs, access_token(environ.get("GCE_METADATA_HOST")), secret_manager))
    text = environ.pop(SPEC_ENV, None)
    if not text:
        raise ShardlineError(SPEC_ENV, "is not set", "run this entry only as the command of a CustomJob rendered "
                             "by shardline (it carries the resolved spec)")
    Path(spec_path).parent.mkdir(parents=True, exist_ok=True)
    Path(spec_path).write_text(text)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    log(f"[shardline] Vertex AI {where}: node rank {rank} of {nnodes}, rendezvous {host}:{RENDEZVOUS_PORT}, "
        f"working directory {workdir}" + (f", secrets {', '.join(sorted(refs))}" if refs else ""))
    return rank, host


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m shardline.engines.vertex.entry --workdir DIR --spec PATH --nnodes N -- COMMAND...",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="shardline.engines.vertex.entry")
    parser.add_argument("--workdir", required=True, help="working directory (the base output directory's mount)")
    parser.add_argument("--spec", default=SPEC_PATH, help="where the resolved spec is written")
    parser.add_argument("--nnodes", type=int, required=True, help="replicas the job was rendered for")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the rendezvous host")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    try:
        _, host = prepare(os.environ, args.workdir, args.spec, args.nnodes, log=lambda m: print(m, flush=True))
    except ShardlineError as e:
        print(f"[shardline] {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if args.nnodes > 1 and not wait_for_host(host, args.timeout, log=lambda m: print(f"[shardline] {m}", flush=True)):
        return EXIT_FAILURE
    os.execvp(command[0], command)
    return EXIT_FAILURE  # not reached


if __name__ == "__main__":
    sys.exit(main())
