"""What spot and DWS capacity grant a preempted pod, in the rendered objects and the warnings (issue 19, item 10)."""

from __future__ import annotations

import pytest
import yaml

from shardline.engines.kubernetes.backend import KubernetesBackend
from shardline.engines.kubernetes.preemption import SPOT_SHUTDOWN_S
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec

BASE = ["run.id=pre-20261122-000000", "launch.image=registry.example/shardline:1", "launch.nnodes=2",
        "parallel.nproc_per_node=8", "train.global_batch_size=16", "train.micro_batch_size=1",
        "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=my-bucket"]


def _render(*extra: str) -> tuple[str, dict]:
    (text,) = KubernetesBackend("jobset").render(load_spec("tiny", [*BASE, *extra])).values()
    jobset = list(yaml.safe_load_all(text))[-1]
    return text, jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("spot", ["cost.provisioning=spot",
                                  "launch.kubernetes.node_selector={'cloud.google.com/gke-spot': 'true'}"])
def test_spot_pods_get_the_grace_gke_grants_and_the_render_says_what_a_preemption_costs(spot):
    """https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms: a Spot VM stops 30 s after its
    preemption notice and graceful node shutdown gives non-system pods 15 s of it (best effort), not the 60 s
    launch.grace_seconds assumes."""
    text, pod = _render(spot, "checkpoint.every_steps=50", "launch.grace_seconds=60")
    assert pod["terminationGracePeriodSeconds"] == SPOT_SHUTDOWN_S == 15
    warnings = [line for line in text.splitlines() if line.startswith("# warning: ")]
    assert any("15 s" in w and "checkpoint.every_steps=50" in w for w in warnings)
    assert any("launch.grace_seconds=60" in w for w in warnings)


def test_spot_without_periodic_checkpoints_is_refused():
    """Same source: 15 s rarely fits a checkpoint of a large model, so without checkpoint.every_steps a preemption
    would lose the run."""
    with pytest.raises(SpecError) as e:
        _render("cost.provisioning=spot")
    assert e.value.where == "checkpoint.every_steps" and "15 s" in e.value.problem


def test_dws_runs_are_warned_of_their_run_limit_and_on_demand_keeps_its_grace():
    """https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest: flex-start nodes are removed
    when maxRunDurationSeconds ends."""
    text, pod = _render("launch.kubernetes.queue=q", "launch.kubernetes.max_run_seconds=7200")
    assert "# warning: DWS flex-start capacity" in text and "max_run_seconds=7200" in text
    assert pod["terminationGracePeriodSeconds"] == 60 + 30
    text, pod = _render("launch.grace_seconds=90")
    assert "# warning" not in text and pod["terminationGracePeriodSeconds"] == 120
