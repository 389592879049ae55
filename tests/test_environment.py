"""Spec validation is pure; the packages a spec asks for are checked only where training starts."""

import importlib.util
import os
import subprocess
import sys

import pytest

from shardline import cli
from shardline.engines.registry import get_backend
from shardline.environment import check_environment
from shardline.errors import SpecError
from shardline.failures import read_failures
from shardline.rundir import create_run
from shardline.spec.resolve import load_spec
from tests.conftest import free_port, small_overrides
from tests.tiers import without_gpu

NEEDS_PACKAGES = ["model.attn_implementation=flash_attention_2", "observe.tensorboard=true",
                  "observe.wandb_project=sql-ft"]
ABSENT = {"flash_attn", "tensorboard", "wandb"}


@pytest.fixture
def packages_absent(monkeypatch):
    """flash-attn and wandb are absent here; tensorboard may be installed, so hide all three alike."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ABSENT else real(name, *a))


def test_a_spec_needing_absent_packages_validates_shows_and_renders(packages_absent, capsys):
    spec = load_spec("tiny", ["run.id=r1", "launch.image=img:1", *NEEDS_PACKAGES])
    assert spec.model.attn_implementation == "flash_attention_2" and spec.observe.wandb_project == "sql-ft"
    assert "job.sbatch" in get_backend("slurm").render(spec)
    assert get_backend("k8s-job").render(spec)
    assert cli.main(["config", "show", "tiny", *(a for s in NEEDS_PACKAGES for a in ("--set", s))]) == 0
    assert "flash_attention_2" in capsys.readouterr().out


@pytest.mark.parametrize(("override", "field", "fix"), [
    ("model.attn_implementation=flash_attention_2", "model.attn_implementation", "pip install flash-attn"),
    ("observe.tensorboard=true", "observe.tensorboard", "shardline[observe]"),
    ("observe.wandb_project=sql-ft", "observe.wandb_project", "pip install wandb"),
])
def test_the_environment_check_names_the_field_of_each_missing_package(packages_absent, override, field, fix):
    with pytest.raises(SpecError) as e:
        check_environment(load_spec("tiny", [override]))
    assert e.value.where == field and fix in e.value.fix


def test_eval_needs_flash_attn_but_not_the_trackers(packages_absent):
    check_environment(load_spec("tiny", ["observe.tensorboard=true", "observe.wandb_project=x"]), "eval")
    with pytest.raises(SpecError, match="model.attn_implementation"):
        check_environment(load_spec("tiny", ["model.attn_implementation=flash_attention_2"]), "eval")


def test_local_train_stops_before_creating_a_run_when_a_package_is_missing(packages_absent, tmp_path, capsys):
    code = cli.main(["train", "tiny", "--set", f"run.dir={tmp_path}", "--set", "observe.wandb_project=sql-ft"])
    assert code == 2 and "observe.wandb_project" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@without_gpu("flash-attn (CUDA only) is installed here", gpu_side=importlib.util.find_spec("flash_attn") is not None)
def test_the_worker_refuses_to_start_without_flash_attn_and_records_why(tmp_path):
    spec, run_dir = create_run(load_spec("tiny", [*small_overrides(tmp_path / "runs", shared_cache=False),
                                                  "parallel.nproc_per_node=1",
                                                  "model.attn_implementation=flash_attention_2"]))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "shardline.worker", "--spec", str(run_dir / "spec.yaml")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    [failure] = read_failures(run_dir)
    assert failure.phase == "setup" and failure.message.startswith("model.attn_implementation:")
    assert not (tmp_path / "prepared-cache").exists()  # stopped before preparing data


def test_importing_the_models_with_torchao_installed_prints_nothing_but_other_warnings_pass():
    """transformers imports torchao (the QLoRA base's package) with every model; on a CPU build of torch torchao
    warned on every command that its CUDA kernels do not load. Those lines are dropped, nothing else is."""
    import logging
    import subprocess
    import sys

    code = ("import shardline, logging, transformers.models.llama.modeling_llama, torchao\n"
            "logging.getLogger('torchao').warning('Failed to load x.so')\n"
            "logging.getLogger('torchao').warning('a real torchao warning')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.strip() == "a real torchao warning", out.stderr[-2000:]
    assert logging.getLogger("torchao").filters  # installed in this process too, by importing shardline
