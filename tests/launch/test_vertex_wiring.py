"""The rendered CustomJob really trains: each replica's command and environment, as Vertex AI would start them
(the pool's container spec plus CLUSTER_SPEC naming the replica), runs as a process in its own network namespace
with Vertex-style hostnames; the bucket mount (/gcs/…) is a shared directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline.engines.vertex.job import custom_job
from shardline.spec.resolve import load_spec
from tests.conftest import small_overrides
from tests.launch.k8s_pods import NetnsCluster, Pod, netns_available, netns_missing

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason=netns_missing() or "")]

HOSTS = ["workerpool0-wire-0", "workerpool1-wire-0"]


def _cluster_spec(i: int) -> str:
    """What Vertex AI sets on replica i of a job with one primary and one worker."""
    task = {"type": "workerpool0", "index": 0} if i == 0 else {"type": "workerpool1", "index": i - 1}
    return json.dumps({"cluster": {"workerpool0": [f"{HOSTS[0]}:2222"], "workerpool1": [f"{HOSTS[1]}:2222"]},
                       "environment": "cloud", "task": {**task, "trial": ""}})


def _local(arg: str, root: Path, i: int) -> str:
    """Container paths on this host: the bucket mount is shared, /tmp is each replica's own."""
    if arg.startswith("/gcs/"):
        return str(root / "gcs" / arg.removeprefix("/gcs/"))
    if arg.startswith("/tmp/shardline/"):
        return str(root / f"replica-{i}" / arg.removeprefix("/tmp/"))
    return arg


def test_two_rendered_replicas_train_to_completion_across_two_network_namespaces(tmp_path):
    spec = load_spec("tiny", [*small_overrides(Path("runs")), "launch.nnodes=2", "parallel.nproc_per_node=1",
                              "run.id=wire-vertex", "launch.image=registry.example/shardline:test",
                              "launch.vertex.output_dir=gs://bucket/shardline",
                              "launch.vertex.machine_type=n2-standard-8"])
    job = custom_job(spec)
    pools = job["jobSpec"]["workerPoolSpecs"]
    assert [p["replicaCount"] for p in pools] == ["1", "1"]
    logs = tmp_path / "logs"
    logs.mkdir()
    pods = [Pod(h, "vertex", "default", i, {}, {}, {}, []) for i, h in enumerate(HOSTS)]
    with NetnsCluster("svx", 2) as net:
        net.publish(pods, visible=[0, 1])
        procs = {}
        for i in (1, 0):  # the worker first: it waits for the primary's rendezvous
            container = pools[min(i, 1)]["containerSpec"]
            env = {e["name"]: e["value"] for e in container["env"]} | {"CLUSTER_SPEC": _cluster_spec(i)}
            command = [_local(a, tmp_path, i) for a in container["command"]]
            procs[i] = net.start(i, pods[i], env, command, tmp_path, logs / f"replica-{i}.log")
        codes = {i: p.wait(timeout=400) for i, p in procs.items()}
    assert codes == {0: 0, 1: 0}, {i: (logs / f"replica-{i}.log").read_text()[-3000:] for i in codes}
    assert "node rank 1 of 2, rendezvous workerpool0-wire-0:29500" in (logs / "replica-1.log").read_text()
    run_dir = tmp_path / "gcs" / "bucket" / "shardline" / "runs" / "wire-vertex"  # gs://bucket/shardline/runs/…
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == list(range(1, spec.train.max_steps + 1))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == 2
    assert manifest["image"] == "registry.example/shardline:test"
    assert (run_dir / "logs" / "rank-1.log").exists()
