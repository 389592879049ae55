"""The launcher of a training run imports neither torch nor transformers before torchrun starts: those seconds of
imports are paid once per worker, not a second time in series by the command that starts them."""

import json
import subprocess
import sys

from shardline.data.prepare import prepare
from shardline.spec.resolve import load_spec
from tests.conftest import small_overrides

LAUNCHER_PATH = """
import json, sys
import shardline.api, shardline.cli_launch  # what `shardline train` runs through (and every other verb)
from shardline.cli import build_parser
from shardline.data.preflight import preflight
from shardline.data.prepare import prepare
from pathlib import Path
from shardline.engines.local import torchrun_command
from shardline.environment import check_environment
from shardline.rundir import create_run
from shardline.spec.resolve import load_spec

spec = load_spec("tiny", json.loads(sys.argv[1]))  # parallel.nproc_per_node unset: the machine's default
torchrun_command(spec, Path("spec.yaml"))
check_environment(spec)
preflight(spec)
spec, run_dir = create_run(spec)
data = prepare(spec)  # the cache the test filled: a hit
print(json.dumps({"heavy": sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules),
                  "versions": json.loads((run_dir / "manifest.json").read_text())["versions"],
                  "nproc": spec.parallel.nproc_per_node, "root": str(data.root)}))
"""


def test_a_launch_on_prepared_data_imports_no_torch_or_transformers_before_torchrun(tmp_path):
    import torch

    overrides = [o for o in small_overrides(tmp_path / "runs") if not o.startswith("parallel.")]
    filled = prepare(load_spec("tiny", [*overrides, "parallel.nproc_per_node=2"]))
    out = subprocess.run([sys.executable, "-c", LAUNCHER_PATH, json.dumps(overrides)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == [], f"the launcher imported {seen['heavy']} before torchrun"
    assert seen["root"] == str(filled.root)  # the same prepared data, found without a tokenizer
    assert seen["versions"]["torch"] == torch.__version__  # read from the distribution, the build tag included
    assert seen["nproc"] == (torch.cuda.device_count() if torch.cuda.is_available() else 2)
