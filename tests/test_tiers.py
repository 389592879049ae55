"""The suite's tiers (tests/tiers.py): what counts as a launch, and how a test's tiers are found."""

import sys

from tests import tiers


def test_a_launch_is_torchrun_or_python_m_of_a_launcher_the_worker_or_a_training_verb():
    py = sys.executable
    for argv in (["torchrun", "--standalone", "x.py"], [py, "-m", "torch.distributed.run", "--nproc-per-node=2"],
                 [py, "-m", "shardline.worker", "--spec", "s.yaml"], [py, "-m", "shardline.cli", "train", "tiny"],
                 [py, "-m", "shardline.cli", "eval", "runs/x"], "/usr/bin/torchrun"):
        assert tiers._is_launch(argv), argv
    for argv in ([py, "-c", "import shardline.worker"], [py, "-m", "shardline.cli", "plan", "tiny"],
                 ["sh", "-c", "echo torchrun"], [py, "-m", "pytest"]):
        assert not tiers._is_launch(argv), argv


def test_tiers_come_from_path_prefixes_and_fixtures():
    assert tiers.tiers_of("tests/real/test_real_gemma3.py::test_x", []) == {"real_checkpoint", "launch"}
    assert tiers.tiers_of("tests/launch/test_slurm.py::test_unit", []) == set()
    assert tiers.tiers_of("tests/launch/test_slurm.py::test_unit", ["tmp_path", "slurm"]) == {"system", "launch"}
    assert tiers.tiers_of("tests/test_spec.py::test_local_train_refuses_multi_node_spec_before_starting", []) == {
        "launch"}
    assert tiers.FAST == "not launch and not real_checkpoint and not system"
