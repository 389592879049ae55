"""`shardline cluster plan gke` for TPU slices (issue 16): one TPU node pool per slice (GKE's "Deploy TPU Multislice
in GKE": a multi-host TPU node pool is one slice, `--machine-type ct6e-standard-4t --tpu-topology 4x4`), spot and
flex-start pools, the Ray operator add-on (`--addons RayOperator`), JobSet and Kueue; idempotent and shellcheck-clean
like the GPU plan. The scripts run against the GPU plan's gcloud/kubectl stubs (tests/ops/test_gke_plan.py)."""

from __future__ import annotations

import shutil
import subprocess

from shardline.ops.cluster.gke_plan import GkePlanOptions, write_plan
from shardline.spec.resolve import load_spec
from tests.ops.test_gke_plan import resources, run_script

OPTS = GkePlanOptions(project="my-project", zone="us-east5-b")


def _plan(tmp_path):
    out = tmp_path / "plan"
    write_plan(load_spec("maxtext-v6e-multislice", ["run.id=mt-1"]), OPTS, out)
    return out


def test_tpu_plan_passes_shellcheck_and_creates_a_pool_per_slice_once(tmp_path):
    out = _plan(tmp_path)
    assert shutil.which("shellcheck")
    for script in ("setup.sh", "teardown.sh"):
        result = subprocess.run(["shellcheck", "--severity=style", out / script], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    text = (out / "setup.sh").read_text()
    assert 'TPU_MACHINE_TYPE="ct6e-standard-4t"' in text and 'TPU_TOPOLOGY="4x4"' in text and "SLICES=2" in text
    assert "--addons GcsFuseCsiDriver,RayOperator" in text and "--enable-queued-provisioning" in text
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    pools = [name for kind, name in resources(calls, "create") if kind == "container node-pools"]
    assert pools == ["shardline-tpu-spot-0", "shardline-tpu-spot-1", "shardline-tpu-flex-0", "shardline-tpu-flex-1"]
    assert all("--tpu-topology 4x4" in c and "--total-max-nodes 4" in c for c in calls if "node-pools create" in c)
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=True)
    assert rc == 0 and resources(calls, "create") == []


def test_tpu_teardown_deletes_the_pools_and_the_cluster_and_keeps_the_bucket(tmp_path):
    out = _plan(tmp_path)
    rc, calls, err = run_script(out / "teardown.sh", tmp_path, exists=True, args=("--yes",))
    assert rc == 0, err
    deleted = resources(calls, "delete")
    assert deleted[-1] == ("container clusters", "shardline")
    assert {n for k, n in deleted if k == "container node-pools"} == {
        "shardline-tpu-spot-0", "shardline-tpu-spot-1", "shardline-tpu-flex-0", "shardline-tpu-flex-1"}
    assert not any(k == "storage buckets" for k, _ in deleted)
