"""The RayJob driver of a MaxText run on TPU slices: runs MaxText once on every host of every slice it finds.

KubeRay starts one Ray worker per TPU VM host; Ray marks host 0 of each slice with the resource
`TPU-<type>-<chips>-head` and every host of a slice with the slice's name (Ray's TPU accelerator manager,
python/ray/_private/accelerators/tpu.py; ray.util.accelerators.tpu.get_current_pod_name). The driver waits until
between `--min-slices` and `--max-slices` slices are up (elastic on spot: the KubeRay worker group's minReplicas and
maxReplicas), then runs the MaxText command rendered for that many slices on each host with libtpu's multislice
environment (MEGASCALE_*: slice 0's first host coordinates), as Ray's own TPU helpers set it. MaxText resumes from
its last checkpoint, so a shrunk or regrown run continues where it stopped.

Runs in the cluster only (`ray` is imported when it runs); rendered by engines/tpu/rayjob.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MEGASCALE_PORT = "8081"
"""The port Ray's TPU helpers give libtpu's multislice coordinator."""


def _run_on_host(command: list[str], env: dict[str, str]) -> int:
    return subprocess.run(command, env={**os.environ, **env}, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-resource", required=True, help="e.g. TPU-v6e-16-head")
    parser.add_argument("--hosts", type=int, required=True, help="TPU VM hosts per slice")
    parser.add_argument("--chips-per-host", type=int, required=True)
    parser.add_argument("--min-slices", type=int, required=True)
    parser.add_argument("--max-slices", type=int, required=True)
    parser.add_argument("--commands", required=True, help="JSON: slice count → MaxText argv")
    parser.add_argument("--wait-seconds", type=float, default=3600.0)
    args = parser.parse_args(argv)
    commands = {int(k): v for k, v in json.loads(args.commands).items()}

    import ray
    from ray.util.accelerators import tpu

    ray.init()
    deadline = time.monotonic() + args.wait_seconds
    while (up := int(ray.cluster_resources().get(args.head_resource, 0))) < args.min_slices:
        if time.monotonic() > deadline:
            print(f"only {up} of at least {args.min_slices} TPU slices came up", file=sys.stderr)
            return 1
        time.sleep(10)
    slices = min(up, args.max_slices)
    print(f"running MaxText on {slices} slice(s) of {args.hosts} host(s)", flush=True)

    @ray.remote(num_cpus=0, resources={args.head_resource: 1})
    def slice_name() -> tuple[str, str]:
        return tpu.get_current_pod_name(), ray.util.get_node_ip_address()

    heads = ray.get([slice_name.remote() for _ in range(slices)])
    coordinator = heads[0][1]
    runs = []
    for slice_id, (name, _) in enumerate(heads):
        env = {} if slices == 1 else {"MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:{MEGASCALE_PORT}",
                                      "MEGASCALE_PORT": MEGASCALE_PORT, "MEGASCALE_NUM_SLICES": str(slices),
                                      "MEGASCALE_SLICE_ID": str(slice_id)}
        host_run = ray.remote(num_cpus=0, resources={name: 1, "TPU": args.chips_per_host})(_run_on_host)
        runs += [host_run.remote(commands[slices], env) for _ in range(args.hosts)]
    codes = ray.get(runs)
    return max(codes, key=lambda c: c != 0)


if __name__ == "__main__":
    sys.exit(main())
