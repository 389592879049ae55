"""Ray Train entry point: the one worker under `TorchTrainer` (docs/architecture.md §6).

Ray starts one worker actor per rank and creates the torch process group itself (gloo on CPU workers,
`cpu:gloo,cuda:nccl` on GPU workers); each actor then calls `train_loop_per_worker`, which runs the same
`shardline.worker.run` as under torchrun — `train.distributed` sees the existing group and uses it. When
a worker dies, Ray restarts the whole worker group (`launch.ray.max_failures` times) and the trainer
resumes from the run's last committed checkpoint, exactly as after a torchrun restart — with
launch.min_nnodes, at whatever size between min and max the cluster then fits (`num_workers`); the checkpoints
and Ray's own run state live in the run directory (RunConfig storage_path = `run.dir`, name = run id),
which must be shared storage on a multi-node cluster.

    python -m shardline.engines.ray.train --spec spec.yaml [--task train]     # what a Ray job runs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardline.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, ShardlineError
from shardline.spec import JobSpec
from shardline.spec.resolve import read_spec_file
from shardline.spec.rules import check_batch_divides


def train_loop_per_worker(config: dict) -> None:
    """One rank: the worker's run() inside the process group Ray created; any non-zero exit is a failure
    Ray retries (75, preempted, included: the retry resumes from the checkpoint it just wrote)."""
    import logging

    from rich.console import Console

    from shardline.ops.checks.runner import OPS_TASKS, run_task
    from shardline.worker import run

    logging.getLogger("shardline").propagate = False  # rank logs go to logs/rank-k.log, not Ray's console too
    spec, task, console = JobSpec.model_validate(config["spec"]), config["task"], Console(soft_wrap=True)
    code = run_task(spec, task, console, None) if task in OPS_TASKS else run(spec, task, console)
    if code != EXIT_OK:
        raise RuntimeError(f"shardline worker exited with {code}")


def num_workers(spec: JobSpec) -> int | tuple[int, int]:
    """Ray Train's `num_workers`: the world size, or for an elastic spec (launch.min_nnodes) the range
    (min_nnodes, nnodes) × nproc_per_node. Ray Train then starts with as many workers as the cluster's free
    resources fit, restarts smaller after losing a node and grows back as nodes return (checking every 60 s);
    each restart resumes from the last checkpoint at the new world size. Ray may pick any count in the range,
    so the global batch must divide by every one of them."""
    if not spec.is_elastic:
        return spec.world_size
    p = spec.parallel.nproc_per_node or 1
    lo, hi = spec.launch.min_nnodes * p, spec.launch.nnodes * p
    why = f"and Ray Train's elastic worker group may run any size from {lo} to {hi} workers"
    check_batch_divides(spec, range(lo, hi + 1), lambda _: why, "use a global batch divisible by every size in that "
                        "range times the micro-batch, or narrow it with launch.min_nnodes")
    return lo, hi


def build_trainer(spec: JobSpec, task: str = "train"):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    r = spec.launch.ray
    gpu = r.gpus_per_worker > 0
    resources = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec.model_dump(mode="json"), "task": task},
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=num_workers(spec), use_gpu=gpu, resources_per_worker=resources),
        run_config=RunConfig(name=spec.run.id, storage_path=str(Path(spec.run.dir).resolve()),
                             failure_config=FailureConfig(max_failures=r.max_failures)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardline.engines.ray.train")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="resolved spec.yaml (with run.id)")
    source.add_argument("--spec-json", help="the resolved spec as JSON (Ray job entrypoints carry it inline)")
    parser.add_argument("--task", choices=["train", "eval", "netcheck", "gpucheck"], default="train")
    args = parser.parse_args(argv)
    try:
        if args.spec is not None:
            from shardline.rundir import read_spec

            spec = read_spec(args.spec)
        else:
            spec = read_spec_file("--spec-json", args.spec_json)  # JSON is YAML: one reader, named errors
        if spec.run.id is None:
            raise ShardlineError("run.id", "is not set", "launch through `shardline launch --target ray`")
    except ShardlineError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import ray

    ray.init()  # inside a Ray job RAY_ADDRESS names the cluster; otherwise a local one starts
    try:
        build_trainer(spec, args.task).fit()
    except Exception as e:  # noqa: BLE001 - Ray wraps worker errors; the job's exit code carries the verdict
        print(f"shardline: Ray Train failed after launch.ray.max_failures={spec.launch.ray.max_failures} "
              f"restarts: {e}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"shardline: run {spec.run.id} finished under Ray Train", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
