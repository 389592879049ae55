"""The suite's tiers: what each test needs, assigned here in one place, and the fast tier that leaves the slow ones out.

A test's tiers come from its path (a directory, a module or a `module::test` prefix of its node id, `BY_PATH`) and
from the fixtures it uses, directly or through other fixtures (`BY_FIXTURE`); GPU tests carry `needs_gpu` /
`without_gpu` where they are written, because the skip goes with the mark. The fast tier is every test with none of
`SLOW_TIERS` (`pytest --fast`, or `pytest -m "<FAST>"`). A test that starts worker processes without the `launch`
tier fails with a message naming this file (`launched`), so the fast tier cannot quietly grow a launch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TIERS = {
    "launch": "starts worker processes: torchrun, `shardline train/eval/launch`, a multi-rank oracle",
    "real_checkpoint": "fetches, converts or trains a real pretrained checkpoint",
    "system": "needs a system daemon, root or network namespaces, a container build or a browser",
    "gpu": "needs a CUDA GPU (skipped without one)",
    "no_gpu": "the CPU side of a GPU path (skipped on a GPU machine)",
}
SLOW_TIERS = ("launch", "real_checkpoint", "system")
FAST = " and ".join(f"not {tier}" for tier in SLOW_TIERS)
BUDGET_MINUTES = {"fast": 5, "full": 30}
"""On the AVX512/AMX class, 2 cores: the fast tier for a person's loop, the full suite (what CI runs)."""

BY_PATH: dict[str, tuple[str, ...]] = {
    "tests/real/": ("real_checkpoint", "launch"),
    "tests/faults/": ("launch",),
    "tests/launch/test_elastic.py": ("launch", "system"),
    "tests/launch/test_local_runs.py": ("launch",),
    "tests/launch/test_torchrun_env.py": ("launch",),
    "tests/launch/test_failures.py": ("launch",),
    "tests/launch/test_slurm.py": ("system",),
    "tests/launch/test_ray.py": ("system",),
    "tests/launch/test_kubeflow_sdk.py": ("launch",),
    "tests/launch/test_k8s_inplace_restart.py": ("launch", "system"),
    "tests/observe/test_observed_run.py": ("launch", "system"),
    "tests/train/test_preemption.py": ("launch",),
    "tests/train/test_hang.py": ("launch",),
    "tests/train/test_tensor_parallel.py": ("launch",),
    "tests/train/test_context_parallel.py": ("launch",),
    "tests/train/test_dpo_end_to_end.py": ("launch",),
    "tests/train/test_grpo_end_to_end.py": ("launch",),
    "tests/train/test_lora_end_to_end.py": ("launch",),
    "tests/train/test_qlora_end_to_end.py": ("launch",),
    "tests/train/test_resume_from_anywhere.py": ("launch",),
    "tests/train/test_stragglers.py": ("launch",),
    "tests/train/test_heap.py": ("launch",),
    "tests/test_image.py": ("system",),
}
BY_FIXTURE: dict[str, tuple[str, ...]] = {
    "slurm": ("system", "launch"),
    "ray_head": ("system", "launch"),
    "prometheus": ("system",),
}


def needs_gpu(why: str):
    """Marks a test GPU-only and skips it without CUDA (the skip policy lets it skip)."""
    import torch

    return _both(pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU: {why}"))


def without_gpu(why: str, gpu_side: bool | None = None):
    """Marks the CPU-side counterpart of a GPU path, skipped on a GPU machine, or where `gpu_side` says this machine
    is on the GPU side (flash-attn installed); the skip policy lets it skip."""
    import torch

    skip = torch.cuda.is_available() if gpu_side is None else gpu_side
    return _both(pytest.mark.no_gpu, pytest.mark.skipif(skip, reason=f"this machine has a GPU: {why}"))


def _both(*marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test

    return apply


def tiers_of(nodeid: str, fixtures: list[str]) -> set[str]:
    found = {tier for prefix, tiers in BY_PATH.items() if nodeid.startswith(prefix) for tier in tiers}
    return found | {tier for name in fixtures for tier in BY_FIXTURE.get(name, ())}


def tier_of(item: pytest.Item) -> str:
    """`fast` or the first slow tier a test is in: where its time is counted."""
    return next((t for t in SLOW_TIERS if item.get_closest_marker(t)), "fast")


def configure(config: pytest.Config) -> None:
    """Registers the tiers as markers and this module as a plugin; `--fast` narrows `-m` to the fast tier."""
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    if config.getoption("fast", False):
        config.option.markexpr = f"({config.option.markexpr}) and {FAST}" if config.option.markexpr else FAST
    config.pluginmanager.register(sys.modules[__name__], "shardline-tiers")
    subprocess.Popen.__init__ = _recording_init


def unconfigure() -> None:
    subprocess.Popen.__init__ = _original_init


TIER_OF: dict[str, str] = {}
"""node id → its tier, for the summary's time by tier."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(tiers_of(item.nodeid, list(getattr(item, "fixturenames", ())))):
            item.add_marker(name)
        TIER_OF[item.nodeid] = tier_of(item)


# ---- the guard: a worker launch outside the launch tier fails the test ----------------------------------------

_LAUNCHES: dict[str, list[str]] = {}
_running: list[str] = []
_original_init = subprocess.Popen.__init__


def _is_launch(args) -> bool:
    argv = [os.path.basename(str(a)) for a in ([args] if isinstance(args, str | bytes | os.PathLike) else args)]
    text = " ".join(argv)
    if "torchrun" in argv or "torch.distributed.run" in text or "shardline.worker" in text:
        return True
    return any(argv[i:i + 3] == ["-m", "shardline.cli", verb] for verb in ("train", "eval", "launch")
               for i in range(len(argv)))


def _recording_init(self, args, *rest, **kwargs):
    if _running and _is_launch(args):
        _LAUNCHES.setdefault(_running[-1], []).append(" ".join(map(str, args if not isinstance(args, str)
                                                                      else [args]))[:200])
    _original_init(self, args, *rest, **kwargs)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item.nodeid)  # fixtures set up for this test count as its launches
    try:
        return (yield)
    finally:
        _running.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    commands = _LAUNCHES.get(item.nodeid)
    if report.when == "teardown" and commands and not item.get_closest_marker("launch"):
        report.outcome = "failed"
        report.longrepr = (f"started worker processes ({commands[0]}) but is not in the `launch` tier: add it to "
                           f"BY_PATH or BY_FIXTURE in tests/tiers.py (the fast tier must not launch)")
    return report
