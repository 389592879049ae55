"""Shared fixtures: a small spec and its prepared data, built once per session."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shardline.data.prepare import PreparedData, prepare
from shardline.precision import cpu_bf16_feature
from shardline.rundir import read_spec
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec
from tests import skip_policy, tiers
from tests.skip_policy import pytest_make_collect_report, pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
LOADED_SLACK_S = 15.0
"""What a wall-clock bound adds above the timeout it tests: a process on a 2-core machine that runs the suite beside
other work can be held off the CPU for seconds. A call that ignores its timeout never returns, so it still fails;
a bound tighter than timeout + this is an ordering or a ratio instead."""
_SECONDS: dict[str, float] = {}
_CONFIG: list[pytest.Config] = []


def pytest_addoption(parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help=f"the fast tier only: -m '{tiers.FAST}' (tests/tiers.py), every module's unit tests")


def pytest_configure(config) -> None:
    tiers.configure(config)
    _CONFIG.append(config)


def pytest_unconfigure(config) -> None:
    tiers.unconfigure()


def pytest_report_header(config) -> str:
    """The CPU class decides the suite's time and what `train.precision: auto` picks: say which one this is."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    feature = cpu_bf16_feature()
    bf16 = f"native bf16 matmul ({feature})" if feature else "bf16 emulated (the slow class: AVX2 only)"
    return f"cpu: {model}, {os.cpu_count()} cores, {bf16}"


def pytest_runtest_logreport(report) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Where the suite's time goes, by tier against its budget and by module: the budget is spent by the few modules
    that launch real runs; then the skips (tests/skip_policy.py: under CI=true or SHARDLINE_NO_SKIPS=1 only GPU
    tests may skip)."""
    if _SECONDS:
        _time_by_tier(terminalreporter)
        _time_by_module(terminalreporter)
    skip_policy.pytest_terminal_summary(terminalreporter)


def _by_module(seconds: dict[str, float]) -> list[tuple[str, float, int]]:
    modules: dict[str, list[float]] = {}
    for nodeid, s in seconds.items():
        modules.setdefault(nodeid.split("::")[0], []).append(s)
    return sorted(((m, sum(t), len(t)) for m, t in modules.items()), key=lambda row: -row[1])


def _time_by_tier(terminalreporter) -> None:
    """The fast tier against its budget, the whole run against the full suite's; a warning naming the slowest
    modules when one is passed (a warning, not a failure: the slower CPU class would make CI flaky)."""
    write = terminalreporter.write_line
    terminalreporter.section("time by tier (setup + call + teardown; budgets on the AVX512/AMX class, 2 cores)")
    by_tier: dict[str, float] = {}
    for nodeid, seconds in _SECONDS.items():
        by_tier[tiers.TIER_OF.get(nodeid, "fast")] = by_tier.get(tiers.TIER_OF.get(nodeid, "fast"), 0.0) + seconds
    for name in ("fast", *tiers.SLOW_TIERS):
        if name in by_tier:
            count = sum(1 for n in _SECONDS if tiers.TIER_OF.get(n, "fast") == name)
            write(f"{by_tier[name] / 60:8.1f} min  {count:4d} tests  {name}")
    total = sum(_SECONDS.values())
    checks = [("fast", by_tier.get("fast", 0.0), {n: s for n, s in _SECONDS.items()
                                                  if tiers.TIER_OF.get(n, "fast") == "fast"})]
    if len(by_tier) > 1:
        checks.append(("full", total, _SECONDS))
    for name, seconds, members in checks:
        budget = tiers.BUDGET_MINUTES[name]
        verdict = "within" if seconds <= budget * 60 else "OVER"
        write(f"{name} tier: {seconds / 60:.1f} min, {verdict} its budget of {budget} min")
        if seconds > budget * 60:
            slowest = ", ".join(f"{m} {s:.0f} s" for m, s, _ in _by_module(members)[:5])
            terminalreporter.write_line(f"warning: the {name} tier is over its budget; slowest modules: {slowest}",
                                        yellow=True, bold=True)


def _time_by_module(terminalreporter) -> None:
    """The slowest modules with the launches their tests started (torchrun, `shardline train`, ...: each costs
    seconds of interpreter and process-group start-up before its first step, so sharing launches is what saves)."""
    terminalreporter.section("time by module (setup + call + teardown; launches started from the test process)")
    launches: dict[str, int] = {}
    for nodeid, commands in tiers.launches().items():
        launches[nodeid.split("::")[0]] = launches.get(nodeid.split("::")[0], 0) + len(commands)
    for module, seconds, count in _by_module(_SECONDS)[:20]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {count:4d} tests  {launches.get(module, 0):3d} launches  "
                                    f"{module}")
    total = sum(_SECONDS.values())
    terminalreporter.write_line(f"{total:8.1f} s  {len(_SECONDS):4d} tests  {sum(launches.values()):3d} launches  "
                                f"in all ({total / 60:.1f} min)")


def bench_module(name: str):
    """`bench/NAME.py` imported as a module (registered in sys.modules: dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def shared_prepared_cache() -> Path | None:
    """The test session's one prepared-data cache, under pytest's base temporary directory; None outside pytest (a
    worker process importing this module)."""
    return _CONFIG[0]._tmp_path_factory.getbasetemp() / "prepared-cache" if _CONFIG else None


def small_overrides(run_dir: Path, *, shared_cache: bool = True) -> list[str]:
    """A model and dataset small enough for a multi-process run in seconds on 2 cores.

    `data.cache_dir` is the session's shared cache (content-addressed, shared by many runs as users share one): each
    distinct dataset is prepared once per session, not once per test (~3 s of CPU each, and in the launcher of
    `shardline train` the tokenizer's torch and transformers imports on top). `shared_cache=False` gives the runs
    their own cache beside `run_dir`, for a test that empties, damages or inspects it."""
    cache = (shared_cache and shared_prepared_cache()) or run_dir.parent / "prepared-cache"
    return [
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        "model.arch.vocab_size=512", "model.arch.hidden_size=64", "model.arch.intermediate_size=172",
        "model.arch.num_layers=2", "model.arch.num_heads=4", "model.arch.num_kv_heads=2",
        "model.arch.max_position_embeddings=256",
        "data.train_size=600", "data.validation_size=40", "data.test_size=16",
        "train.seq_len=192", "train.micro_batch_size=4", "train.global_batch_size=8",
        "train.max_steps=6", "train.warmup_steps=2", "train.eval_every=100", "train.log_every=1",
        "train.eval_examples=0", "train.lr=3e-3",
        # fp32: CPUs without bf16 matrix units (AVX2 only) emulate bf16 ~15x slower than fp32; the bf16 path is
        # tested where it is the subject (test_training's FSDP run, test_knobs, the real checkpoint's loss).
        "train.precision=fp32",
        # the report (matplotlib, ~1.3 s at the end of every run) only where a test reads it: observe.report=true
        "observe.report=false",
        # the CPU's matmul peak for MFU is probed (0.5-1 s per rank) only where a test reads it: train.peak_tflops=null
        "train.peak_tflops=1",
    ]


def small_spec(tmp: Path, *extra: str, shared_cache: bool = True) -> JobSpec:
    return load_spec("tiny", [*small_overrides(tmp / "runs", shared_cache=shared_cache), "parallel.nproc_per_node=1",
                              *extra])


def prepared_of_run(run: Path) -> PreparedData:
    """The prepared data a run trained on: its spec's cache directory, the dataset version its manifest names."""
    version = json.loads((run / "manifest.json").read_text())["dataset_version"]
    return PreparedData(Path(read_spec(run / "spec.yaml").data.cache_dir) / version)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ctx():
    """One in-process gloo rank (world 1) for tests that drive the Trainer directly."""
    from shardline.parallel.mesh import distributed

    mp = pytest.MonkeyPatch()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}.items():
        mp.setenv(k, v)
    with distributed() as c:
        yield c
    mp.undo()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shardline")


@pytest.fixture(scope="session")
def prepared(session_dir) -> PreparedData:
    return prepare(small_spec(session_dir))


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "shardline.cli", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@contextmanager
def cli_in_background(*args: str, cwd: Path | None = None, fault: str | None = None) -> Iterator[subprocess.Popen]:
    """`shardline ARGS` running in the background (stdout and stderr in one pipe) for a drill that acts while it
    runs, with `SHARDLINE_FAULT` set to `fault` (and only then: a drill never leaks into a run that wants none);
    its whole process group is killed if the drill fails half-way."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDLINE_FAULT"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if fault:
        env["SHARDLINE_FAULT"] = fault
    proc = subprocess.Popen([sys.executable, "-m", "shardline.cli", *args], cwd=cwd or REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def workers(run: Path) -> list[int]:
    """The PIDs of the run's training workers: torchrun starts them `python -u -m shardline.worker …` (its own
    command line has `-m shardline.worker` without the `-u`)."""
    out = subprocess.run(["pgrep", "-f", "--", f"-u -m shardline.worker --spec {run}/spec.yaml"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def the_stopped_worker(runs: Path, proc: subprocess.Popen, after_step: int = 0) -> tuple[Path, int]:
    """The run under `runs` and the worker a `SHARDLINE_FAULT=…:action=stop` drill stopped, once the run has recorded
    `after_step`."""
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the drill never stopped a worker"
        run = next((p.parent for p in runs.glob("*/spec.yaml")), None)
        victim = next((pid for pid in workers(run) if stopped(pid)), None) if run else None
        if victim and (after_step == 0 or (run / "metrics.jsonl").exists() and any(
                r["step"] >= after_step for r in read_metrics(run, "train"))):
            return run, victim
        time.sleep(0.05)


def kill_the_stopped_worker(runs: Path, proc: subprocess.Popen, after_step: int = 0) -> Path:
    """kill -9 of the worker a drill stopped (`the_stopped_worker`): the rank dies at exactly the drill's point.
    Returns the run directory."""
    run, victim = the_stopped_worker(runs, proc, after_step)
    os.kill(victim, signal.SIGKILL)
    return run


def read_metrics(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def only_run(runs: Path) -> Path:
    found = [p for p in runs.iterdir() if (p / "spec.yaml").exists()]
    assert len(found) == 1, found
    return found[0]
