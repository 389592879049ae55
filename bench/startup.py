"""Where `shardline train`'s start-up goes before the first step, part by part, on this machine (issue 57: ≤ 15 s for
the 8B LoRA spec on a GPU, eager; the trainer's own laps, `start-up:` in a run's log, say the same on a real run).

    .venv/bin/python bench/startup.py [--spec bench/gpu-8b-lora.yaml] [--repeat 2] [--json OUT]

1. Imports, each in a fresh interpreter (best of --repeat), as each of a local run's three processes does them: the
   launcher (`shardline.cli`), torchrun (`torch.distributed.run`) and the worker (`shardline.worker`), beside a bare
   interpreter and `import torch`.
2. In this process: the process group (gloo, world 1), the spec's model on the meta device with its LoRA adapters,
   and `parallelize` (FSDP2 on the world-1 mesh) — no weights, so an 8B spec costs what it costs on a GPU host.
3. Random init: the draw rate of `materialize` on one decoder block of the spec's shapes (small vocabulary, so a CPU
   holds it), and the seconds that rate gives for the whole model's parameters at torch's thread count here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORTS = {"interpreter": "pass", "torch": "import torch", "launcher (shardline.cli)": "import shardline.cli",
           "torchrun (torch.distributed.run)": "import torch.distributed.run",
           "worker (shardline.worker)": "import shardline.worker"}


def import_seconds(statement: str, repeat: int) -> dict[str, float]:
    """Best wall and CPU seconds (user + system) of a fresh interpreter running `statement`: on a shared machine the
    CPU seconds are what a quiet host of the same core speed would wait."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], cwd=REPO, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"wall": round(wall, 2), "cpu": round(cpu, 2)}


def in_process(spec_path: str) -> dict[str, dict[str, float]]:
    """Process group, meta build + LoRA, parallelize, and the random init rate, timed in this process (wall, and
    CPU seconds of every thread)."""
    import torch
    import torch.distributed as dist

    from shardline.model.build import build_model
    from shardline.model.lora import apply_lora
    from shardline.model.sharded_load import materialize
    from shardline.parallel.fsdp import device_mesh, parallelize
    from shardline.spec.resolve import load_spec

    spec = load_spec(spec_path)
    laps: dict[str, dict[str, float]] = {}
    clock = (time.perf_counter(), time.process_time())

    def lap(name: str, scale: float = 1.0) -> None:
        nonlocal clock
        now = (time.perf_counter(), time.process_time())
        laps[name] = {"wall": round(scale * (now[0] - clock[0]), 2), "cpu": round(scale * (now[1] - clock[1]), 2)}
        clock = (time.perf_counter(), time.process_time())

    ours = not dist.is_initialized()  # a caller's group (a test's) is reused, not timed
    if ours:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
        dist.init_process_group("gloo", rank=0, world_size=1)
    lap("process group (gloo, world 1)")
    model = build_model(spec.model, spec.model.arch.vocab_size, {}, device="meta")
    if spec.model.lora.enabled:
        model = apply_lora(model, spec.model.lora)
    lap("model on meta (+ LoRA)")
    params = sum(p.numel() for p in model.parameters())
    parallelize(model, device_mesh(spec.parallel, 1, "cpu"), spec.parallel, spec.train.precision)
    lap("parallelize (FSDP2, meta)")
    block = spec.model.model_copy(deep=True)
    block.arch.num_layers, block.arch.vocab_size, block.lora.enabled = 1, 256, False
    one = build_model(block, 256, {}, device="meta")
    drawn = sum(p.numel() for p in one.parameters())
    lap("one block on meta")
    materialize(one, block, torch.device("cpu"))
    lap(f"random init of {params / 1e9:.2f}B params, from one block's draws ({torch.get_num_threads()} threads)",
        scale=params / drawn)
    if ours:
        dist.destroy_process_group()
    return laps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "bench" / "gpu-8b-lora.yaml"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = {"imports_s": {name: import_seconds(statement, args.repeat) for name, statement in IMPORTS.items()},
              "in_process_s": in_process(args.spec), "spec": args.spec, "cpus": os.cpu_count()}
    print(f"{'wall s':>8} {'CPU s':>8}")
    for section in ("imports_s", "in_process_s"):
        for name, seconds in result[section].items():
            print(f"{seconds['wall']:8.2f} {seconds['cpu']:8.2f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
