"""The rendered Indexed Job, JobSet and TrainJob really train: each pod's command and environment, extracted as
Kubernetes would set them, runs as a process in its own network namespace with cluster-style DNS names."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shardline.engines.kubernetes.objects import render_objects
from shardline.engines.kubernetes.pod import SPEC_MOUNT
from shardline.spec.resolve import load_spec
from tests.conftest import small_overrides
from tests.k8s_schemas import validate_all
from tests.launch.k8s_pods import NetnsCluster, mount_map, netns_available, netns_missing, pod_env, pods_from

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason=netns_missing() or "")]


def _spec(tmp: Path, target: str):
    storage, read = tmp / "storage", tmp / "read-only"
    storage.mkdir()
    read.mkdir()
    return load_spec("tiny", [
        *small_overrides(Path("runs")),  # relative: resolved against the pod's working directory (the storage)
        "launch.nnodes=2", "parallel.nproc_per_node=1", f"run.id=wire-{target}",
        "launch.image=registry.example/shardline:test", "launch.kubernetes.gpu_resource=null",
        "launch.kubernetes.storage.kind=pvc", "launch.kubernetes.storage.claim=shared",
        f"launch.kubernetes.storage.mount_path={storage}", f"launch.kubernetes.storage.read_path={read}",
    ]), storage


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text() if path.exists() else '(missing)'}")


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob"])
def test_rendered_pods_train_to_completion_across_two_network_namespaces(target, tmp_path):
    spec, storage = _spec(tmp_path, target)
    objects = render_objects(spec, target)
    validate_all(objects)
    pods = pods_from(objects)
    assert [p.index for p in pods] == [0, 1]
    logs = tmp_path / "logs"
    logs.mkdir()
    with NetnsCluster("slw", 2) as net:
        net.publish(pods, visible=[1])  # rank 0's DNS record does not exist yet: the known startup race
        procs = {}
        for i in (1, 0):
            pod = pods[i]
            mounts = mount_map(pod, objects, tmp_path / "volumes")
            command = [str(mounts[SPEC_MOUNT] / a[len(SPEC_MOUNT) + 1:]) if a.startswith(SPEC_MOUNT + "/") else a
                       for a in pod.container["command"]]
            # TrainJob: no workingDir, the image's own; the command's --chdir enters the storage
            cwd = pod.container.get("workingDir") or str(tmp_path)
            procs[i] = net.start(i, pod, pod_env(pod, {}), command, Path(cwd), logs / f"pod-{i}.log")
            if i == 1:
                _wait_for_text(logs / "pod-1.log", "waiting for rendezvous host", 60)
                net.publish(pods, visible=[0, 1])  # rank 0's pod got its IP: its record appears
        codes = {i: p.wait(timeout=400) for i, p in procs.items()}
    assert codes == {0: 0, 1: 0}, {i: (logs / f"pod-{i}.log").read_text()[-3000:] for i in codes}
    assert "resolves after" in (logs / "pod-1.log").read_text()
    run_dir = storage / "runs" / f"wire-{target}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, spec.train.max_steps + 1))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == 2
    assert manifest["image"] == "registry.example/shardline:test"
    assert (run_dir / "logs" / "rank-1.log").exists()
