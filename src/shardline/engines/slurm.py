"""Slurm backend (`--target slurm`): an sbatch script running the one torchrun line on every node.

The script asks for `launch.nnodes` nodes with one task each; `srun` starts the same
`node_torchrun_command()` on every node, which reads its node rank from `PET_NODE_RANK=$SLURM_NODEID`
and the rendezvous address from `PET_MASTER_ADDR` (the first host of the allocation) and
`PET_MASTER_PORT`. The resolved spec is written next to the script; the worker creates the run
directory from it on first start and resumes from its last committed checkpoint on every later one.

Preemption (docs/architecture.md §7): `--signal=B:USR1@<launch.grace_seconds>` sends SIGUSR1 to the batch shell
before the time limit; its trap forwards the signal to the srun step (srun → torchrun → workers), the
trainer checkpoints and exits 75, and the script runs `scontrol requeue`, so the job starts again with
the same id and resumes. SIGTERM (scancel, node drain) is forwarded the same way without a requeue.

Secrets (`launch.slurm.secret_env`) travel by name only: `shardline launch` checks each is set, submits
with `--export=ALL`, and the script refuses to start without them; no value is written to a file.

Files: `<run dir>/slurm/{job.sbatch,spec.yaml}`; logs `<run dir>/logs/slurm-<job>.out` (batch shell)
and `<run dir>/logs/slurm-<job>-node<N>.out` (each node's torchrun and workers).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from shardline.engines.backend import JobState, LaunchRecord, RankState, save_record
from shardline.engines.command import cluster_spec, node_torchrun_command
from shardline.engines.secret_env import check_no_literal_secrets, from_environment
from shardline.errors import ShardlineError, SpecError
from shardline.network_profiles import RENDEZVOUS_PORT, get_profile, nccl_environment
from shardline.rundir import read_manifest, with_run_id
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml
from shardline.spec.rules import require_torch_engine

SCRIPT = "job.sbatch"
SPEC = "spec.yaml"

# Slurm job states (squeue/scontrol JobState) → the phases every backend reports.
PHASES = {
    "PENDING": "queued", "REQUEUED": "queued", "REQUEUE_HOLD": "queued", "REQUEUE_FED": "queued",
    "SUSPENDED": "queued", "RESV_DEL_HOLD": "queued", "CONFIGURING": "starting", "RUNNING": "running",
    "COMPLETING": "running", "SIGNALING": "running", "STAGE_OUT": "running", "RESIZING": "running",
    "COMPLETED": "succeeded", "FAILED": "failed", "CANCELLED": "failed", "TIMEOUT": "failed",
    "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "failed",
    "PREEMPTED": "failed", "REVOKED": "failed", "SPECIAL_EXIT": "failed",
}
PENDING_REASONS = {
    "Resources": "waiting for free nodes",
    "Priority": "queued behind higher-priority jobs",
    "BeginTime": "held until its begin time (a requeued job waits about 2 minutes; "
                 "`scontrol update jobid=<id> StartTime=now` starts it sooner)",
    "Dependency": "waiting for a job it depends on",
    "ReqNodeNotAvail": "a requested node is unavailable (down, drained or reserved)",
    "PartitionNodeLimit": "asks for more nodes than the partition allows",
    "PartitionTimeLimit": "asks for more time than the partition allows",
    "QOSMaxNodePerJobLimit": "asks for more nodes than its QOS allows",
    "AssocGrpGRES": "the account's GPU quota is used up",
    "JobHeldUser": "held by its user (`scontrol release <id>`)",
    "JobHeldAdmin": "held by an administrator",
}


def _run_dir(spec: JobSpec, workdir: Path) -> Path:
    run_dir = Path(spec.run.dir) / str(spec.run.id)
    return run_dir if run_dir.is_absolute() else workdir / run_dir


def _workdir(spec: JobSpec) -> Path:
    return Path(spec.launch.slurm.workdir or os.getcwd()).resolve()


_DIRECTIVE_VALUE = re.compile(r"[^\s\x00-\x1f\x7f]+")  # one word, no control characters


def _check_directive_values(spec: JobSpec, run_dir: Path, workdir: Path) -> None:
    """`#SBATCH` lines are read by sbatch, not a shell: a value must be one word, or it would split (or, with a
    newline, start a new script line). Everything that reaches the shell itself is quoted where it is used."""
    s = spec.launch.slurm
    values = {"run.dir": str(run_dir), "launch.slurm.workdir": str(workdir), "launch.slurm.partition": s.partition,
              "launch.slurm.account": s.account, "launch.slurm.qos": s.qos, "launch.slurm.time_limit": s.time_limit,
              **{f"launch.slurm.sbatch_args[{i}]": a for i, a in enumerate(s.sbatch_args)}}
    for name, value in values.items():
        if value is not None and not _DIRECTIVE_VALUE.fullmatch(value):
            raise SpecError(name, f"{value!r} has whitespace or control characters, which an #SBATCH line cannot "
                            "carry", "use a value without spaces, tabs or line breaks")
    for i, line in enumerate(s.setup):
        if any(c in line for c in "\r\n\x00"):
            raise SpecError(f"launch.slurm.setup[{i}]", "holds a line break or NUL", "give one shell line per item")
    check_no_literal_secrets(s.setup, "launch.slurm.setup", "launch.slurm.secret_env")
    for i, arg in enumerate(s.sbatch_args):
        if s.secret_env and arg.startswith("--export"):
            raise SpecError(f"launch.slurm.sbatch_args[{i}]", f"{arg!r} would keep launch.slurm.secret_env "
                            "from reaching the job", "drop it: secrets need sbatch's --export=ALL")


def _secret_lines(names: list[str]) -> list[str]:
    """Checks that each secret arrived from the submitting environment, by name only; then exports it to srun."""
    if not names:
        return []
    return ["# secrets from the environment of `shardline launch` (launch.slurm.secret_env); never in this file",
            *(f': "${{{n}:?is not set: export it where shardline launch runs (launch.slurm.secret_env)}}"'
              for n in names),
            f"export {' '.join(names)}"]


def batch_script(spec: JobSpec, task: str, run_dir: Path, workdir: Path) -> str:
    """The sbatch script for a spec whose run id is assigned."""
    require_torch_engine(spec, "--target slurm")
    _check_directive_values(spec, run_dir, workdir)
    s, logs = spec.launch.slurm, run_dir / "logs"
    gpus = spec.parallel.nproc_per_node if s.gpus_per_node is None else s.gpus_per_node
    elastic = spec.is_elastic
    nodes = f"{spec.launch.min_nnodes}-{spec.launch.nnodes}" if elastic else str(spec.launch.nnodes)
    opts = [f"--job-name={spec.run.id}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    opts += ["--no-kill"] if elastic else []  # a lost node leaves the job running on the others
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += [f"--cpus-per-task={s.cpus_per_task}"] if s.cpus_per_task else []
    opts += [f"--time={s.time_limit}"]
    opts += [f"--{name}={value}" for name, value in (("partition", s.partition), ("account", s.account),
                                                      ("qos", s.qos)) if value]
    opts += ["--exclusive"] if s.exclusive else []
    opts += ["--export=ALL"] if s.secret_env else []  # the submitting environment, secrets included
    opts += ["--requeue", f"--signal=B:USR1@{spec.launch.grace_seconds}", "--open-mode=append",
             f"--chdir={workdir}", f"--output={logs}/slurm-%j.out", *s.sbatch_args]
    torchrun = shlex.join(node_torchrun_command(spec, run_dir / "slurm" / SPEC, task))
    node_cmd = f"export PET_NODE_RANK=$SLURM_NODEID; exec {torchrun}"
    env = {**nccl_environment(get_profile(spec.launch.profile)), "PET_MASTER_PORT": str(RENDEZVOUS_PORT)}
    rdzv = ['export PET_RDZV_ENDPOINT="$PET_MASTER_ADDR:$PET_MASTER_PORT"'] if elastic else []
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             f"# shardline run {spec.run.id}, task {task}: the same torchrun line on every node",
             "set -uo pipefail",
             "# rendezvous on the first node of the allocation, at the address Slurm itself uses to reach it",
             'master="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             'PET_MASTER_ADDR="$(scontrol show node "$master" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')"',
             'export PET_MASTER_ADDR="${PET_MASTER_ADDR:-$master}"',
             *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
             *_secret_lines(s.secret_env),
             *s.setup,
             *rdzv,
             "",
             "# The worker checkpoints on SIGUSR1/SIGTERM and exits 75; USR1 (time limit) also requeues the job.",
             "requeue=0",
             "# shellcheck disable=SC2317  # called by the traps",
             "forward() {",
             '  if [ "$1" = USR1 ]; then requeue=1; fi',
             '  echo "shardline: SIG$1 received, forwarding to the training step"',
             '  if [ -n "${step:-}" ]; then kill -s "$1" "$step" 2>/dev/null; fi',
             "}",
             "trap 'forward USR1' USR1",
             "trap 'forward TERM' TERM",
             'echo "shardline: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, '
             'rendezvous $PET_MASTER_ADDR:$PET_MASTER_PORT"',
             "# shellcheck disable=SC2016  # $SLURM_NODEID must expand on each node, not here",
             f"srun --ntasks-per-node=1 --kill-on-bad-exit={0 if elastic else 1} --open-mode=append "
             f"--output={shlex.quote(f'{logs}/slurm-%j-node%n.out')} bash -c {shlex.quote(node_cmd)} &",
             "step=$!",
             "while true; do  # wait returns early (> 128) when a trapped signal arrives; the step may still run",
             '  wait "$step"; rc=$?',
             '  [ "$rc" -gt 128 ] || break',
             '  if kill -0 "$step" 2>/dev/null; then continue; fi',
             '  wait "$step" 2>/dev/null; again=$?; [ "$again" -eq 127 ] || rc=$again',
             "  break",
             "done",
             'if [ "$requeue" = 1 ] && [ "$rc" != 0 ]; then  # stopped early, not finished: run again',
             '  echo "shardline: step ended with $rc after SIGUSR1; requeueing job $SLURM_JOB_ID"',
             '  scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$rc"', ""]
    return "\n".join(lines)


def _slurm(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ShardlineError("--target slurm", f"{cmd[0]} is not on PATH",
                             "run on a Slurm login node (or install slurm-client and set SLURM_CONF)") from None
    if check and out.returncode != 0:
        raise ShardlineError("--target slurm", f"`{shlex.join(cmd)}` failed: {out.stderr.strip() or out.stdout}",
                             "check the partition/account/qos in launch.slurm and `sinfo`")
    return out


def parse_job(text: str) -> dict[str, str]:
    """`scontrol show job -o` output as key → value."""
    return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", text))


class SlurmBackend:
    target = "slurm"

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        spec = with_run_id(spec)
        workdir = _workdir(spec)
        run_dir = _run_dir(spec, workdir)
        return {SCRIPT: batch_script(spec, task, run_dir, workdir), SPEC: spec_to_yaml(cluster_spec(spec))}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        spec = with_run_id(spec)
        secrets = from_environment(spec.launch.slurm.secret_env, "launch.slurm.secret_env")
        workdir = _workdir(spec)
        run_dir = _run_dir(spec, workdir)
        files = self.render(spec, task)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm cannot open --output in a missing directory
        (run_dir / "slurm").mkdir(exist_ok=True)
        for name, text in files.items():
            (run_dir / "slurm" / name).write_text(text)
        export = ["--export=ALL"] if secrets else []  # the command line outranks a site's SBATCH_EXPORT
        out = _slurm("sbatch", "--parsable", *export, str(run_dir / "slurm" / SCRIPT))
        job_id = out.stdout.strip().split(";")[0]
        record = LaunchRecord(target=self.target, run_id=str(spec.run.id), job_id=job_id,
                              submitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
                              objects=[{"kind": "SlurmJob", "name": job_id, "runDir": str(run_dir),
                                        "script": str(run_dir / "slurm" / SCRIPT),
                                        "nprocPerNode": str(spec.parallel.nproc_per_node)}])
        save_record(run_dir, record)
        return record

    @staticmethod
    def _job(record: LaunchRecord) -> dict[str, str] | None:
        out = _slurm("scontrol", "show", "job", "-o", str(record.job_id), check=False)
        return parse_job(out.stdout) if out.returncode == 0 and out.stdout.strip() else None

    @staticmethod
    def _run_dir(record: LaunchRecord) -> Path:
        return Path(record.objects[0]["runDir"])

    def status(self, record: LaunchRecord) -> JobState:
        job = self._job(record)
        if job is None:  # purged from slurmctld (MinJobAge): the run's manifest says how it ended
            status = read_manifest(self._run_dir(record)).get("status")
            phase = {"finished": "succeeded", "failed": "failed"}.get(status, "unknown")
            return JobState(phase=phase, reasons=[f"job {record.job_id} is no longer known to slurmctld; "
                                                  f"run manifest status: {status}"])
        state = job.get("JobState", "UNKNOWN")
        phase = PHASES.get(state, "unknown")
        restarts = int(job.get("Restarts", "0") or 0)
        reasons = []
        reason = job.get("Reason", "None")
        if phase == "queued" and reason != "None":
            reasons.append(f"{state}: {PENDING_REASONS.get(reason, f'Slurm reason {reason}')}")
        elif phase == "failed":
            reasons.append(f"{state}, exit code {job.get('ExitCode', '?')}" + (f" ({reason})" if reason != "None"
                                                                              else ""))
        nodes = []
        if job.get("NodeList") and job["NodeList"] != "(null)" and phase in ("starting", "running"):
            nodes = _slurm("scontrol", "show", "hostnames", job["NodeList"], check=False).stdout.split()
        ranks = [RankState(rank=i, name=n, state=state.lower(), restarts=restarts, detail=f"node rank {i}")
                 for i, n in enumerate(nodes)]
        return JobState(phase=phase, reasons=reasons, ranks=ranks, restarts=restarts)

    def _log_files(self, record: LaunchRecord, rank: int | None) -> list[tuple[str, Path]]:
        logs = self._run_dir(record) / "logs"
        nproc = int(record.objects[0].get("nprocPerNode", "1"))
        if rank is not None:
            node = rank // nproc
            return [(f"node {node}", logs / f"slurm-{record.job_id}-node{node}.out")]
        nodes = sorted(logs.glob(f"slurm-{record.job_id}-node*.out"),
                       key=lambda p: int(p.stem.rsplit("node", 1)[1]))
        return [("batch", logs / f"slurm-{record.job_id}.out")] + [(f"node {p.stem.rsplit('node', 1)[1]}", p)
                                                                   for p in nodes]

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        """Each node's output (its torchrun and workers), prefixed `[node N]`; the batch shell as `[batch]`.

        With a rank, only the node that runs it (rank // nproc_per_node). With follow, streams until the
        job ends."""
        offsets: dict[Path, int] = {}
        while True:
            ended = not follow or self.status(record).phase in ("succeeded", "failed", "unknown")
            for label, path in self._log_files(record, rank):
                if not path.is_file():
                    continue
                with path.open() as f:
                    f.seek(offsets.get(path, 0))
                    text = f.read()
                    offsets[path] = f.tell()
                for line in text.splitlines():
                    yield f"[{label}] {line}"
            if ended:
                return
            time.sleep(1.0)

    def cancel(self, record: LaunchRecord) -> None:
        _slurm("scancel", str(record.job_id))
