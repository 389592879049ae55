"""The Python API: the objects the CLI is built on, for notebooks, scripts and pipeline steps.

    import shardline
    spec = shardline.Spec.load("tiny", overrides={"train.max_steps": 20})
    run = shardline.train(spec, nproc=2)      # returns at once; the run trains in the background
    final = run.wait()                        # RunState: phase, reasons, ranks, the run's progress
    losses = [r["loss"] for r in run.metrics("train")]

Nothing here prints or exits: results are returned, failures raised as `ShardlineError` (`SpecError`,
`DataError`, `ClusterError`; each has `.field`, `.problem` and `.fix`) or `TimeoutError` from `Run.wait`.
The walk-through in docs/python-api.md is executed by the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from shardline.engines.backend import (
    EXIT_TIMEOUT,
    TERMINAL,
    JobState,
    LaunchRecord,
    RankState,
    load_record,
    save_record,
    wait_for,
)
from shardline.engines.registry import BACKENDS, get_backend
from shardline.errors import ClusterError, DataError, ShardlineError, SpecError
from shardline.hardware import match_device
from shardline.jsonl import read_jsonl
from shardline.planning import memory
from shardline.planning.devices import Device, current_device, get_device
from shardline.planning.fixes import Suggestion, fixes
from shardline.planning.memory import MemoryPlan
from shardline.planning.world import spec_gpu
from shardline.run_status import RunStatus, list_runs, read_status
from shardline.rundir import run_path, with_run_id
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec, resolve_data, spec_to_yaml

__all__ = ["Attached", "ClusterError", "DataError", "DryRun", "Plan", "Rendered", "Run", "RunState", "RunStatus",
           "ShardlineError", "Spec", "SpecError", "dry_run", "launch", "plan", "render", "runs", "train",
           "train_attached"]


class Spec(JobSpec):
    """The validated job spec (every section typed); what every other call takes."""

    @classmethod
    def load(cls, source: str | Path | None = None,
             overrides: Mapping[str, object] | Sequence[str] | None = None) -> Spec:
        """A preset name (default `tiny`), a YAML file or a run directory, then `overrides`: a mapping of dotted
        fields to values (`{"train.lr": 2e-5}`) or `--set`-style strings (`["train.lr=2e-5"]`). A run directory
        is that run, wherever it lies (its spec, its id). Raises `SpecError` naming the field."""
        assignments: list[str] = []
        values: dict[str, object] = {}
        if isinstance(overrides, Mapping):
            values = dict(overrides)
        elif overrides is not None:
            if isinstance(overrides, str):
                raise SpecError("overrides", "is one string", "pass a mapping or a list of 'key=value' strings")
            assignments = list(overrides)
        text = None if source is None else str(source)
        if text is not None and Path(text).is_dir():
            run_dir = Path(text).resolve()
            if not (run_dir / "spec.yaml").is_file():
                raise SpecError(text, "is a directory without spec.yaml", "give a run directory, preset or YAML")
            text = str(run_dir / "spec.yaml")
            # typed values, not `--set` text: a directory name is never parsed as YAML (` #` would start a comment)
            values = {"run.dir": str(run_dir.parent), "run.id": run_dir.name, **values}
        return cls.of(load_spec(text, assignments, values))

    @classmethod
    def of(cls, spec: JobSpec) -> Spec:
        """The same spec as a `Spec`, validated again (after a lower layer or a direct edit changed it)."""
        return cls.model_validate(spec.model_dump())

    def to_yaml(self) -> str:
        """The resolved spec as `shardline config show` prints it and a run's spec.yaml holds it."""
        return spec_to_yaml(self)

    def with_overrides(self, overrides: Mapping[str, object]) -> Spec:
        """A copy with dotted fields changed (`{"train.lr": 1e-4}`), validated again."""
        return Spec.of(resolve_data(self.model_dump(mode="json"), values=overrides))


# ---- plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Per-device memory of a spec on a device, whether it fits, and the smallest change that makes it fit."""

    memory: MemoryPlan
    fixes: list[Suggestion] = field(default_factory=list)
    """What makes it fit, in the order a user would try it (`shardline.planning.fixes`): [] when it fits, or when
    no change tried makes it fit."""

    @property
    def suggestion(self) -> Suggestion | None:
        """The first of `fixes`, or None."""
        return self.fixes[0] if self.fixes else None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def device(self) -> Device:
        return self.memory.device

    @property
    def components(self) -> dict[str, int]:
        return {name: getattr(self.memory, name) for name in memory.COMPONENTS}


def planning_device(spec: JobSpec, device: str | None = None, memory_gb: float | None = None) -> Device:
    """The device named, else the GPU the spec asks for (`launch.vertex.accelerator`), else this machine's; on a
    CPU-only host a hub model is planned for its profile's GPU."""
    if device is not None:
        return get_device(device, memory_gb)
    if spec.launch.vertex.accelerator:  # Vertex's AcceleratorType (NVIDIA_A100_80GB): the catalogue's GPU
        gpu = match_device(spec.launch.vertex.accelerator.replace("_", " "))
        if gpu is None:
            raise SpecError("launch.vertex.accelerator", f"{spec.launch.vertex.accelerator} is not a GPU shardline's "
                            "catalogue knows, so it cannot be planned or priced", "plan with --device and "
                            "--memory-gb, and price it with cost.usd_per_device_hour")
        return get_device(gpu.key, memory_gb)
    found = current_device()
    if found.kind == "cpu" and (gpu := spec_gpu(spec)) is not None and spec.model.path is not None:
        return get_device(gpu.key, memory_gb)
    if memory_gb is None:
        return found
    return dataclasses.replace(found, name=f"{found.name}, {memory_gb:g} GiB given",
                               memory_bytes=int(memory_gb * 2**30))


def plan(spec: JobSpec, device: str | None = None, memory_gb: float | None = None) -> Plan:
    """`shardline plan`: memory per component at the peak, capacity, and a fix when it does not fit."""
    if spec.train.engine == "maxtext":  # the TPU chips of launch.tpu, whatever this host has
        from shardline.planning.tpu import plan_tpu_memory

        return Plan(plan_tpu_memory(spec))
    target = planning_device(spec, device, memory_gb)
    planned = memory.plan_memory(spec, target)
    return Plan(planned, [] if planned.fits else fixes(spec, target))


@dataclass(frozen=True)
class DryRun:
    """`shardline plan --dry-run`: what the real sharding code and one simulated step (CPU kernels, fake tensors,
    one rank of a fake process group) hold per rank, beside the plan (the JSON of
    `shardline.planning.simulation.dry_run`)."""

    result: dict[str, Any]

    @property
    def simulated_peak(self) -> int | None:
        """The simulated step's peak, or GRPO's sampling's where that is higher."""
        step = self.result.get("step")
        return None if step is None else max(step["peak_bytes"], self.result.get("sampling", {}).get("peak_bytes", 0))

    def rows(self) -> list[tuple[str, int, int | None, float | None]]:
        """(what, simulated, planned for the simulated kernels, planned for the device) per rank, in bytes."""
        shards, cpu, dev = self.result["sharding"], self.result["planned_cpu_kernels"], self.result["planned"]
        rows = [(label, shards[key], cpu[key], dev[key]) for key, label in (
            ("params", "parameters (padded)"), ("grads", "gradients (fp32)"), ("optimizer", "AdamW state"),
            ("gather_buffers", "gather buffers"))]
        if (step := self.result.get("step")) is not None:
            rows.append(("step peak", step["peak_bytes"], cpu["step_peak"], dev["step_peak"]))
        if (sampling := self.result.get("sampling")) is not None:
            rows.append(("GRPO sampling peak", sampling["peak_bytes"], cpu["sampling_peak"], dev["sampling_peak"]))
        return rows

    def difference(self) -> float | None:
        """Planned (for the simulated kernels) minus simulated peak, as a fraction of the simulated peak."""
        peak = self.simulated_peak
        return None if peak is None else self.result["planned_cpu_kernels"]["peak"] / peak - 1


def dry_run(spec: JobSpec, *, rank: int = 0, world: int | None = None, step: bool = True, device: str | None = None,
            memory_gb: float | None = None, progress: Callable[[str], None] | None = None) -> DryRun:
    """Build the spec's model at its world size (or `world`) with shardline's own sharding code as rank `rank` of a
    fake process group, in a child process (the group is process-global); `step` also simulates one training
    step. Raises `ShardlineError` for a sharding the real run would refuse, naming the module and the fix."""
    if spec.train.engine != "torch":
        raise SpecError("train.engine", f"{spec.train.engine} trains with its own (JAX) code: there is no torch model "
                        "to build, so a dry run does not apply", "plan it without --dry-run (shardline plan SPEC)")
    target = planning_device(spec, device, memory_gb)
    with tempfile.TemporaryDirectory(prefix="shardline-dry-run-") as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(spec_to_yaml(spec))
        command = [sys.executable, "-m", "shardline.planning.simulation.dry_run", str(path), "--rank", str(rank),
                   "--device", target.name, str(target.memory_bytes), target.kind]
        command += ([] if world is None else ["--world", str(world)]) + ([] if step else ["--no-step"])
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stderr is not None
        lines: list[str] = []
        for line in child.stderr:  # progress, then (on a bug) a traceback
            lines.append(line.rstrip())
            if progress is not None and not line.startswith((" ", "[rank", "Traceback")) and "Warning" not in line:
                progress(line.rstrip())
        out = child.stdout.read()
        child.wait()
    try:
        result = json.loads(out)
    except ValueError:
        raise RuntimeError("the dry run failed:\n" + "\n".join(lines[-30:])) from None
    if "error" in result:
        error = result["error"]
        kind = SpecError if error.get("type") == "SpecError" else ShardlineError
        raise kind(error["where"], error["problem"], error["fix"])
    return DryRun(result)


# ---- render and launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rendered:
    """What an engine would be given: file name → text, the objects parsed from it, and the files written."""

    target: str
    files: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)
    """Every YAML/JSON document among the files (Kubernetes objects, a CustomJob), in file order."""
    written: list[Path] = field(default_factory=list)


def _targets() -> str:
    return ", ".join(sorted(BACKENDS))


def render(spec: JobSpec, target: str, task: str = "train", out: str | Path | None = None) -> Rendered:
    """The engine's files for `target` (one of the launch targets); written into `out` when given."""
    files = get_backend(target).render(with_run_id(spec), task)
    objects: list[dict[str, Any]] = []
    for name, text in files.items():
        if name.endswith((".yaml", ".yml")):
            objects += [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
        elif name.endswith(".json"):
            objects.append(json.loads(text))
    written: list[Path] = []
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
            written.append(directory / name)
    return Rendered(target, files, objects, written)


def launch(spec: JobSpec, target: str, task: str = "train") -> Run:
    """Submit to `target` and record where it runs (`<run.dir>/<run id>/launch.json`); returns at once."""
    claimed = with_run_id(spec, claim=True)
    try:
        record = get_backend(target).submit(claimed, task)
    except BaseException:
        if spec.run.id is None:  # a refused launch leaves no run behind: only the empty directory it claimed
            with contextlib.suppress(OSError):
                run_path(claimed).rmdir()
        raise
    run_dir = Path(spec.run.dir) / record.run_id
    save_record(run_dir, record)
    return Run(record)


def train(spec: JobSpec, nproc: int | None = None) -> Run:
    """Train on this machine under torchrun with `nproc` processes (default: the spec's), in the background:
    the same run as `shardline train`, detached (its console in logs/launcher.log)."""
    if nproc is not None:  # validated again: the batch must still divide by the new world size
        spec = resolve_data(spec.model_dump(mode="json"), values={"parallel.nproc_per_node": nproc})
    return launch(spec, "local")


@dataclass(frozen=True)
class Attached:
    """How a `train_attached` run ended: its directory and the exit code of its workers (docs/architecture.md §7: 0
    finished, 75 stopped with a committed checkpoint, 76 a hang, 1 any other failure)."""

    run_dir: Path
    exit_code: int

    @property
    def run(self) -> Run:
        return Run.open(self.run_dir)


def train_attached(spec: JobSpec, *, prepare: Callable[[JobSpec], Any] | None = None,
                   say: Callable[[str], None] = lambda line: None) -> Attached:
    """Train on this machine under torchrun until the run ends (`shardline train`): a new run, or the run `run.id`
    names resumed (refused while it still runs). Launch settings, the environment and the data's first rows are
    checked before a run directory exists; `prepare` (default `data.prepare.prepare`) prepares the data once for
    every worker; `say` gets the lines a person wants to see (the run's directory, the precision `auto` chose).
    Bad input raises `ShardlineError`; a run that ends badly returns its exit code."""
    # Imported here: every other verb's start-up stays free of the local launcher's imports.
    from shardline.data.preflight import preflight
    from shardline.data.prepare import prepare as prepare_data
    from shardline.engines.backend import record_path
    from shardline.engines.command import local_spec
    from shardline.engines.local import torchrun_command, train_run
    from shardline.environment import check_environment
    from shardline.procfs import process_start_epoch
    from shardline.run_status import refuse_if_running
    from shardline.rundir import claim_run, create_run, read_manifest

    if spec.run.id is not None:  # a resume: never while the run still runs, and /metrics on loopback here
        if run_path(spec).is_dir():
            claim_run(run_path(spec))  # atomic: of two launches at once, one is refused here
        refuse_if_running(run_path(spec))
        record = record_path(run_path(spec))
        spec = local_spec(spec, json.loads(record.read_text()).get("target") if record.is_file() else None)
    torchrun_command(spec, Path("spec.yaml"))  # validates launch settings before anything is written
    check_environment(spec)  # the workers check too; here the error comes before a run directory exists
    preflight(spec)  # the model's location, the data's format and first rows: before a run directory exists
    spec, run_dir = create_run(spec, started_at=process_start_epoch())  # goodput counts this command's startup
    claim_run(run_dir)  # a new run's directory is new: held for this launcher's life
    say(f"run {spec.run.id} → {run_dir}")
    if chosen := read_manifest(run_dir).get("precision"):
        say(f"precision {chosen['chosen']}: {chosen['reason']}")
    return Attached(run_dir, train_run(spec, run_dir, prepare or prepare_data, say))


# ---- runs ----------------------------------------------------------------------------------------------
class RunState(BaseModel):
    """Where a run is: the engine's phase and reasons, each rank, and (where the run directory is readable
    here) the run's own progress — step, loss, ETA, cost, the failure."""

    phase: str
    reasons: list[str] = []
    ranks: list[RankState] = []
    restarts: int = 0
    run: RunStatus | None = None

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL


class Run:
    """A run, wherever it runs: open it by directory or id, ask it, follow it, stop it, read its results."""

    def __init__(self, record: LaunchRecord) -> None:
        self.record = record

    @classmethod
    def open(cls, run: str | Path, runs_dir: str | Path = "runs") -> Run:
        """A run directory, or a run id under `runs_dir` (one started by `train`, `launch` or the CLI)."""
        return cls(load_record(str(run), str(runs_dir)))

    @property
    def id(self) -> str:
        return self.record.run_id

    @property
    def target(self) -> str:
        return self.record.target

    @property
    def dir(self) -> Path:
        """The run directory on this machine (for cluster runs: where the launch record lives)."""
        return Path(self.record.run_dir) if self.record.run_dir else Path("runs") / self.record.run_id

    def __repr__(self) -> str:
        return f"Run({self.id!r}, target={self.target!r})"

    def _backend(self):
        return get_backend(self.record.target)

    def _state(self, job: JobState) -> RunState:
        local = self.dir / "manifest.json"
        return RunState(phase=job.phase, reasons=job.reasons, ranks=job.ranks, restarts=job.restarts,
                        run=read_status(self.dir, self.target) if local.is_file() else None)

    def status(self) -> RunState:
        return self._state(self._backend().status(self.record))

    def logs(self, rank: int | None = None, follow: bool = False) -> Iterator[str]:
        """Log lines prefixed with `[rank k]`; with `follow`, streams until the run ends."""
        return self._backend().logs(self.record, rank, follow)

    def wait(self, timeout: float | None = None, poll: float = 2.0,
             on_change: Callable[[RunState], None] | None = None) -> RunState:
        """Block until the run ends and return its final state; `TimeoutError` after `timeout` seconds."""
        last: list[JobState] = []

        def seen(job: JobState) -> None:
            last.append(job)
            if on_change is not None:
                on_change(self._state(job))

        code = wait_for(self._backend(), self.record, timeout, poll, on_change=seen)
        if code == EXIT_TIMEOUT:
            raise TimeoutError(f"run {self.id} still {last[-1].phase if last else 'unknown'} after {timeout} s")
        return self._state(last[-1])

    def cancel(self) -> None:
        """Stop it: Kubernetes objects deleted, the Slurm/Ray/Vertex job cancelled; a local run gets SIGTERM,
        checkpoints and ends `preempted`."""
        self._backend().cancel(self.record)

    def metrics(self, kind: str = "train", frame: bool = False) -> Any:
        """The run's records of one kind (`train`, `eval`, `event`) from metrics.jsonl, as dicts with the
        fields of docs/architecture.md §5; `frame=True` gives a pandas DataFrame (pandas must be installed)."""
        path = self.dir / "metrics.jsonl"
        if not path.is_file():
            raise ShardlineError(str(path), "does not exist (yet)",
                                 "wait until the run logs its first step; cluster runs write it under run.dir")
        rows = [record for record in read_jsonl(path) if record.get("kind") == kind]
        if not frame:
            return rows
        try:
            import pandas
        except ImportError:
            raise ShardlineError("frame=True", "needs pandas", "pip install pandas, or use the rows") from None
        return pandas.DataFrame(rows)

    def report(self) -> Path:
        """Write the run report (report/index.html + plots) and return the page."""
        from shardline.observe.report import write_report

        return write_report(self.dir)

    def export(self, out: str | Path, step: int | None = None, merge_lora: bool = False,
               dtype: str = "auto", say: Callable[[str], None] = lambda line: None) -> Path:
        """A Hugging Face directory (or LoRA adapter) from a committed checkpoint (default: the latest), its weights
        in `dtype` (bf16, fp32, fp16; default auto: the checkpoint's own, fp32 for an adapter); `say` gets its
        warnings (router biases the export leaves out)."""
        from shardline.export import export_run

        return export_run(self.dir, Path(out), step=step, merge_lora=merge_lora, dtype=dtype, say=say)


def runs(directory: str | Path = "runs") -> list[RunStatus]:
    """Every run under `directory`, newest first (the rows of `shardline runs`)."""
    return list_runs(Path(directory))
