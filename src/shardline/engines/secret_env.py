"""Secrets by reference for engines without a secret store (Slurm, a Ray cluster).

A spec names environment variables (`launch.slurm.secret_env`, `launch.ray.secret_env`); their values
come from the environment of `shardline launch` at submit time and reach the job through the engine
(sbatch's exported environment, a Ray job's runtime_env). No value is ever written into a spec, script,
manifest or report. Kubernetes reads Secrets instead (`launch.kubernetes.secret_env`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from shardline.errors import ShardlineError, SpecError

# A name that ends in a credential word (HF_TOKEN, WANDB_API_KEY); TOKENIZERS_PARALLELISM or HF_TOKEN_PATH do not.
_SECRET_NAME = re.compile(r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)$",
                          re.IGNORECASE)
_ASSIGNMENT = re.compile(r"(?:^|[\s;&|(])([A-Za-z_][A-Za-z0-9_]*)=(\S*)")


def from_environment(names: list[str], field: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of `names` in the submitting environment; a name that is unset or empty is a named error."""
    environ = os.environ if environ is None else environ
    for name in names:
        if not environ.get(name):
            raise ShardlineError(field, f"{name} is not set in the environment of `shardline launch`",
                                 f"export {name}=… in the shell that launches (its value goes to the job, "
                                 f"never into a file), or remove {name} from {field}")
    return {name: environ[name] for name in names}


def check_no_literal_secrets(lines: list[str], field: str, secret_field: str) -> None:
    """Refuse shell lines that assign a literal to a credential-named variable (`export HF_TOKEN=hf_…`):
    they would be written into the rendered job. A value read at run time (`$(cat …)`, `$VAR`) passes."""
    for i, line in enumerate(lines):
        for name, value in _ASSIGNMENT.findall(line):
            if _SECRET_NAME.search(name) and value.lstrip("\"'")[:1] not in ("", "$"):
                raise SpecError(f"{field}[{i}]", f"sets {name} to a literal value, which would be written into "
                                "the rendered job", f"export {name} where you run `shardline launch` and list it "
                                f"in {secret_field}: [{name}]")
