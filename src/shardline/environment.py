"""What a spec needs from the machine that trains it: optional packages, checked where training starts.

Spec validation is pure, so a GPU spec renders on a laptop and `export`/`report` run anywhere. These
probes run only where the packages are used: in the worker (`shardline.worker.run`, every launcher)
and before a local `shardline train` starts torchrun, so a missing package is a named error before
any step runs.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from shardline.spec import JobSpec


def check_environment(spec: JobSpec, task: str = "train") -> None:
    """Raise SpecError naming the field when a package the spec asks for is not installed here.
    Trackers are only needed to train; `eval` checks the attention implementation alone."""
    needs = []  # (field, package, problem, fix)
    if spec.model.attn_implementation == "flash_attention_2":
        needs.append(("model.attn_implementation", "flash_attn",
                      "'flash_attention_2' is selected but the flash-attn package is not installed",
                      "pip install flash-attn on a CUDA machine, or use 'sdpa'"))
    if task == "train" and spec.observe.tensorboard:
        needs.append(("observe.tensorboard", "tensorboard", "true, but the tensorboard package is not installed",
                      "pip install 'shardline[observe]', or set observe.tensorboard=false"))
    if task == "train" and spec.observe.wandb_project is not None:
        needs.append(("observe.wandb_project", "wandb",
                      f"{spec.observe.wandb_project!r} is set, but the wandb package is not installed",
                      "pip install wandb, or remove observe.wandb_project"))
    for field, package, problem, fix in needs:
        if importlib.util.find_spec(package) is None:
            raise SpecError(field, problem, fix)
