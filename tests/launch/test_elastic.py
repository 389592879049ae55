"""Elastic node counts: torchrun --nnodes=min:max with c10d rendezvous; losing a node costs a restart, not the job."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardline.engines.command import node_torchrun_command
from shardline.engines.registry import get_backend
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec, spec_to_yaml
from tests.conftest import REPO, free_port, read_metrics, small_overrides


def test_min_nnodes_makes_torchrun_elastic_and_slurm_ask_for_a_node_range():
    spec = load_spec("tiny", ["run.id=el", "launch.nnodes=4", "launch.min_nnodes=2", "parallel.nproc_per_node=8",
                              "train.global_batch_size=384", "train.micro_batch_size=2"])
    cmd = node_torchrun_command(spec, "/s.yaml")
    assert "--nnodes=2:4" in cmd and "--rdzv-backend=c10d" in cmd and "--rdzv-id=el" in cmd
    script = get_backend("slurm").render(spec)["job.sbatch"]
    assert "#SBATCH --nodes=2-4\n" in script and "#SBATCH --no-kill\n" in script
    assert 'export PET_RDZV_ENDPOINT="$PET_MASTER_ADDR:$PET_MASTER_PORT"' in script and "--kill-on-bad-exit=0" in script
    fixed = load_spec("tiny", ["launch.nnodes=2", "parallel.nproc_per_node=1"])
    assert "--nnodes=2" in node_torchrun_command(fixed, "/s.yaml") and "--rdzv-backend=c10d" not in \
        node_torchrun_command(fixed, "/s.yaml")


def test_every_world_size_an_elastic_job_may_reach_must_fit_the_batch():
    with pytest.raises(SpecError, match="for 3 nodes") as e:  # 2, 3 and 4 nodes of 8: 16·2, 24·2, 32·2
        load_spec("tiny", ["launch.nnodes=4", "launch.min_nnodes=2", "parallel.nproc_per_node=8",
                           "train.global_batch_size=128", "train.micro_batch_size=2"])
    assert e.value.where == "train.global_batch_size"
    with pytest.raises(SpecError, match="launch.min_nnodes"):
        load_spec("tiny", ["launch.nnodes=2", "launch.min_nnodes=3", "parallel.nproc_per_node=1"])
    with pytest.raises(SpecError, match="HSDP"):
        load_spec("tiny", ["launch.nnodes=2", "launch.min_nnodes=1", "parallel.nproc_per_node=2",
                           "parallel.dp_replicate=2", "train.global_batch_size=32"])


def _lose_node(agent: subprocess.Popen) -> None:
    """SIGKILL a node's torchrun agent and its workers (torchrun starts each worker in its own session)."""
    children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    for pid in [*map(int, children), agent.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_elastic_job_loses_a_node_and_finishes_on_the_other_from_the_checkpoint(session_dir, prepared, tmp_path):
    spec = load_spec("tiny", [*small_overrides(session_dir / "runs"), f"run.dir={tmp_path / 'runs'}", "run.id=el-1",
                              "launch.nnodes=2", "launch.min_nnodes=1", "parallel.nproc_per_node=1",
                              "launch.max_restarts=2", "train.max_steps=30", "checkpoint.every_steps=2",
                              "observe.metrics_port=null"])
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(spec_to_yaml(spec))
    cmd = node_torchrun_command(spec, spec_path, python=sys.executable)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = {}
    # node 0 hosts the rendezvous store and survives; node 1 is lost. Node 1 starts first and waits for the
    # store, so both are in the first round (a node joining late makes torchrun restart the group to admit it).
    # A node without a heartbeat for 3 keep-alive intervals is dead: 6 s here instead of torch's 15 s.
    for node in (1, 0):
        env = dict(os.environ, PET_RDZV_ENDPOINT=endpoint, TOKENIZERS_PARALLELISM="false",
                   PET_RDZV_CONF=f"is_host={int(node == 0)},last_call_timeout=5,keep_alive_interval=2")
        log = (tmp_path / f"node{node}.log").open("w")
        nodes[node] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        time.sleep(1.0 if node == 1 else 0)
    survivor, lost = nodes[0], nodes[1]
    run = tmp_path / "runs" / "el-1"
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "step-00000002" / "COMMITTED").exists():
            assert time.monotonic() < deadline and survivor.poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.2)
        _lose_node(lost)
        assert survivor.wait(timeout=400) == 0, (tmp_path / "node0.log").read_text()[-5000:]
    finally:
        for p in nodes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resumes and resumes[-1]["world"] == 1 and resumes[-1]["step"] >= 2
    assert {r["step"] for r in read_metrics(run, "train")} == set(range(1, 31))
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
    assert Path(run / "spec.yaml").is_file()


@pytest.mark.parametrize("target", ["ray", "rayjob"])
def test_the_ray_targets_refuse_an_elastic_range_whose_sizes_the_batch_does_not_divide(target):
    """torchrun changes the world size by whole nodes (16, 24, 32 here, all dividing 384 / 2); Ray Train's elastic
    worker group may run any count from 16 to 32, and 17 does not divide."""
    from shardline.engines.ray.train import num_workers

    overrides = ["run.id=el", "launch.nnodes=4", "launch.min_nnodes=2", "parallel.nproc_per_node=8",
                 "train.micro_batch_size=2", "launch.image=img:1"]
    spec = load_spec("tiny", [*overrides, "train.global_batch_size=384"])
    with pytest.raises(SpecError) as refused:
        get_backend(target).render(spec)
    assert refused.value.field == "train.global_batch_size" and "17 × 2" in refused.value.problem
    ok = load_spec("tiny", [*overrides, "launch.nnodes=2", "launch.min_nnodes=1", "parallel.nproc_per_node=2",
                            "train.global_batch_size=24"])  # sizes 2, 3, 4 all divide 24 / 2
    assert num_workers(ok) == (2, 4) and num_workers(load_spec("tiny", ["parallel.nproc_per_node=2"])) == 2
    rendered = get_backend(target).render(ok)
    if target == "rayjob":
        rayjob = next(d for d in yaml.safe_load_all("\n---\n".join(rendered.values())) if d and d["kind"] == "RayJob")
        group = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
        assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 2, 2)

