"""The worker entry point: bad input is a named error and exit code 2 before any process group exists."""

import importlib.util
import os
import subprocess
import sys

import yaml

from shardline.errors import EXIT_BAD_INPUT
from shardline.spec.resolve import spec_to_yaml
from tests.conftest import REPO, small_spec


def _worker(spec_file) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "shardline.worker", "--spec", str(spec_file)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_worker_names_a_bad_spec_field_and_exits_2_without_traceback(tmp_path):
    spec = yaml.safe_load(spec_to_yaml(small_spec(tmp_path, "run.id=bad")))
    spec["train"]["lr"] = "fast"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    proc = _worker(spec_file)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_BAD_INPUT, out
    assert "train.lr" in out and "'fast'" in out
    assert "Traceback" not in out


def test_worker_without_gcsfs_names_checkpoint_dir_before_starting(tmp_path, capsys):
    """The worker's main in this process (the exit code it returns is the process's, as the test above shows)."""
    from shardline.worker import main

    assert importlib.util.find_spec("gcsfs") is None  # the test needs the package absent
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec_to_yaml(small_spec(tmp_path, "run.id=gcs", "checkpoint.dir=gs://bucket/ckpt")))
    code = main(["--spec", str(spec_file)])
    out = "".join(capsys.readouterr())
    assert code == EXIT_BAD_INPUT, out
    assert "checkpoint.dir" in out and "gs://" in out and "pip install gcsfs" in out
    assert "Traceback" not in out and not (tmp_path / "runs" / "gcs").exists()  # failed before any setup
