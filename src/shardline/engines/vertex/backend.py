"""Vertex AI backend (`--target vertex`): a CustomJob per run, through `google-cloud-aiplatform`'s JobServiceClient.

render: the CustomJob of engines/vertex/job.py, parsed strictly into `aiplatform_v1.CustomJob` (unknown fields and
enum values are errors) and written back out from it, as `custom-job.json` (the body of a REST create request).
launch: `create_custom_job` under projects/<launch.vertex.project>/locations/<launch.vertex.region>.
status/wait: `get_custom_job`, its state in the phases every backend reports; a replica that exited 75 (preempted,
checkpoint saved) makes the run `preempted`, so `wait` returns 75. cancel: `cancel_custom_job`.
logs: Vertex AI sends each replica's output to Cloud Logging, which this client does not stream; `logs` prints
where to find it and streams the workers' own `logs/rank-<k>.log` from the run directory in the bucket (reading
gs:// needs gcsfs; Cloud Storage FUSE uploads a file when it is flushed, so lines arrive in bursts).

`google-cloud-aiplatform` (the `vertex` extra) is imported only here, when a Vertex verb runs.
"""

from __future__ import annotations

import importlib
import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from shardline.engines.backend import TERMINAL, JobState, LaunchRecord
from shardline.engines.vertex.job import custom_job, run_dir_url
from shardline.errors import ClusterError, ShardlineError, SpecError
from shardline.rundir import with_run_id
from shardline.spec import JobSpec

FILE = "custom-job.json"
EXTRA = "pip install 'shardline[vertex]'"
_NAME = re.compile(r"^projects/([^/]+)/locations/([^/]+)/customJobs/([^/]+)$")
_EXIT = re.compile(r"non-zero status of (\d+)")
_RANK_LOG = re.compile(r"rank-(\d+)\.log$")

# JobState name → (phase, what it means in plain words)
STATES = {
    "JOB_STATE_QUEUED": ("queued", "queued: Vertex AI accepted the job and has not started preparing it"),
    "JOB_STATE_PENDING": ("starting", "pending: Vertex AI is provisioning the machines and pulling the image"),
    "JOB_STATE_RUNNING": ("running", "running"),
    "JOB_STATE_SUCCEEDED": ("succeeded", "succeeded"),
    "JOB_STATE_FAILED": ("failed", "failed"),
    "JOB_STATE_CANCELLING": ("running", "cancelling: the replicas are being stopped"),
    "JOB_STATE_CANCELLED": ("failed", "cancelled (shardline cancel, gcloud or the console)"),
    "JOB_STATE_PAUSED": ("queued", "paused: stopped by Vertex AI, it can be resumed"),
    "JOB_STATE_EXPIRED": ("failed", "expired: no capacity within the flex-start wait (launch.vertex.max_wait_seconds)"),
    "JOB_STATE_UPDATING": ("running", "running (being updated)"),
    "JOB_STATE_PARTIALLY_SUCCEEDED": ("failed", "partially succeeded, which a training job never should"),
}
HINTS = {  # Vertex AI's messages for its common errors → what to do
    "ran out of memory": "a replica ran out of host memory: a larger machine, or fewer data loader workers",
    "Resources are insufficient in region": "stockout: the region has no free machines of this type now; queue for "
                                            "them with cost.provisioning=dws-flex-start, or try another region",
    "Internal error occurred": "Vertex AI failed internally after its own retries; launch again (it resumes)",
}
WAITING = {"FLEX_START": "flex-start: waiting for Dynamic Workload Scheduler to find capacity for all replicas",
           "SPOT": "spot: waiting for spot capacity"}


def aiplatform() -> ModuleType:
    """`google.cloud.aiplatform_v1`, or a named error saying which extra installs it."""
    try:
        return importlib.import_module("google.cloud.aiplatform_v1")
    except ImportError as e:
        raise ShardlineError("--target vertex", f"needs the google-cloud-aiplatform package ({e})",
                             f"{EXTRA} (or pip install google-cloud-aiplatform)") from None


def check_custom_job(payload: dict, accelerator_field: str = "launch.vertex.accelerator") -> str:
    """The payload as `aiplatform_v1.CustomJob` writes it, after a strict parse; a field the types drop or change
    is an error, so what is submitted is exactly what was rendered. `accelerator_field` chose the accelerator."""
    av = aiplatform()
    from google.protobuf.json_format import ParseError

    accelerators = set(av.AcceleratorType.__members__)
    for pool in payload["jobSpec"]["workerPoolSpecs"]:
        if (name := pool["machineSpec"].get("acceleratorType")) and name not in accelerators:
            raise SpecError(accelerator_field, f"{name!r} is not a Vertex AI accelerator type",
                            "use one of " + ", ".join(sorted(a for a in accelerators if a.startswith("NVIDIA"))))
    try:
        job = av.CustomJob.from_json(json.dumps(payload), ignore_unknown_fields=False)
    except ParseError as e:
        raise ShardlineError(FILE, f"the aiplatform_v1.CustomJob type rejects the rendered job: {e}",
                             "this is a shardline bug: report it with the spec") from None
    text = av.CustomJob.to_json(job, use_integers_for_enums=False, always_print_fields_with_no_presence=False)
    if json.loads(text) != payload:
        raise ShardlineError(FILE, "the aiplatform_v1.CustomJob type does not keep every rendered field",
                             "this is a shardline bug: report it with the spec")
    return text + "\n"


_FIXES = {
    "PermissionDenied": "grant the caller roles/aiplatform.user on the project (and roles/iam.serviceAccountUser on "
                        "launch.vertex.service_account); check that the Vertex AI API is enabled",
    "NotFound": "check launch.vertex.project and launch.vertex.region, and that the job still exists",
    "InvalidArgument": "fix the field the message names; `shardline render --target vertex` shows the request",
    "FailedPrecondition": "fix what the message names (network peering, bucket, reservation) and launch again",
    "ResourceExhausted": "the project's quota for these machines in this region is used up: request more quota, "
                         "use fewer nodes, or another region",
    "Unauthenticated": "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS",
}
# the same refusals as the REST transport raises them (by HTTP status)
_FIXES |= {"Forbidden": _FIXES["PermissionDenied"], "BadRequest": _FIXES["InvalidArgument"],
           "TooManyRequests": _FIXES["ResourceExhausted"], "Unauthorized": _FIXES["Unauthenticated"],
           "PreconditionFailed": _FIXES["FailedPrecondition"]}


def _default_client(region: str) -> Any:
    av = aiplatform()
    from google.api_core.client_options import ClientOptions
    from google.auth.exceptions import DefaultCredentialsError

    try:
        return av.JobServiceClient(client_options=ClientOptions(api_endpoint=f"{region}-aiplatform.googleapis.com"))
    except DefaultCredentialsError as e:
        raise ClusterError("--target vertex", f"no Google Cloud credentials ({e})", _FIXES["Unauthenticated"]) from None


def _call(what: str, fn: Callable, **kwargs) -> Any:
    from google.api_core.exceptions import GoogleAPICallError
    from google.auth.exceptions import GoogleAuthError

    try:
        return fn(**kwargs)
    except GoogleAPICallError as e:
        fix = _FIXES.get(type(e).__name__, "retry; if it persists, check the Vertex AI status page")
        raise ClusterError(what, f"Vertex AI answered {e.code} {type(e).__name__}: {e.message}", fix) from None
    except GoogleAuthError as e:
        raise ClusterError(what, f"could not authenticate ({e})", _FIXES["Unauthenticated"]) from None


def _enum_name(enum: Any, value: int) -> str:
    try:
        return enum(value).name
    except ValueError:  # a value newer than the installed types
        return str(value)


def explain(job: Any, av: ModuleType) -> JobState:
    """A CustomJob's state as a phase and plain-word reasons."""
    state = _enum_name(av.JobState, job.state)
    phase, reason = STATES.get(state, ("unknown", f"Vertex AI state {state}"))
    reasons = [reason]
    strategy = _enum_name(av.Scheduling.Strategy, job.job_spec.scheduling.strategy)
    if state == "JOB_STATE_PENDING" and strategy in WAITING:
        reasons.append(WAITING[strategy])
    if state == "JOB_STATE_RUNNING" and job.start_time:
        reasons[0] = f"running since {job.start_time.isoformat(timespec='seconds')}"
    message = job.error.message
    code = int(m.group(1)) if message and (m := _EXIT.search(message)) else None
    if state == "JOB_STATE_FAILED" and code == 75:
        phase = "preempted"
        reasons = ["preempted: a worker stopped with exit 75 after saving a checkpoint; launch the spec again with "
                   "the same run.id to resume"]
    elif state == "JOB_STATE_FAILED" and code == 2:
        reasons = ["failed on bad input (exit 2: spec, data or paths); fix it and launch again, a retry fails the same"]
    elif code is not None:
        reasons.append(f"exit code {code}")
    if message:
        reasons.append(f"Vertex AI: {message}")
        reasons += [hint for text, hint in HINTS.items() if text in message]
    return JobState(phase=phase, reasons=reasons)


class VertexBackend:
    target = "vertex"

    def __init__(self, client_factory: Callable[[str], Any] | None = None, poll_s: float = 10.0):
        """`client_factory(region)` returns a JobServiceClient (default: the region's endpoint, default credentials)."""
        self._client_factory = client_factory or _default_client
        self.poll_s = poll_s

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        field = "launch.vertex.accelerator" if spec.launch.vertex.accelerator else "launch.profile"
        return {FILE: check_custom_job(custom_job(with_run_id(spec), task), field)}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        spec = with_run_id(spec)
        v = spec.launch.vertex
        if not v.project:
            raise SpecError("launch.vertex.project", "is not set", "name the Google Cloud project to run in: "
                            "--set launch.vertex.project=my-project")
        text = self.render(spec, task)[FILE]
        av = aiplatform()
        parent = f"projects/{v.project}/locations/{v.region}"
        created = _call(f"create CustomJob in {parent}", self._client_factory(v.region).create_custom_job,
                        parent=parent, custom_job=av.CustomJob.from_json(text))
        return LaunchRecord(target=self.target, run_id=str(spec.run.id), job_id=created.name, nnodes=spec.launch.nnodes,
                            submitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
                            objects=[{"kind": "CustomJob", "name": created.name, "region": v.region,
                                      "runDir": run_dir_url(spec)}])

    def _job_name(self, record: LaunchRecord) -> tuple[str, str]:
        name = str(record.job_id)
        if not (m := _NAME.match(name)):
            raise SpecError(str(record.run_id), f"its launch record names no Vertex AI CustomJob ({name!r})",
                            "pass the run id or directory `shardline launch --target vertex` printed")
        return name, m.group(2)

    def _get(self, record: LaunchRecord) -> Any:
        name, region = self._job_name(record)
        return _call(f"get CustomJob {name}", self._client_factory(region).get_custom_job, name=name)

    def status(self, record: LaunchRecord) -> JobState:
        return explain(self._get(record), aiplatform())

    def cancel(self, record: LaunchRecord) -> None:
        name, region = self._job_name(record)
        _call(f"cancel CustomJob {name}", self._client_factory(region).cancel_custom_job, name=name)

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        """Where Cloud Logging has each replica's output, then the workers' rank logs from the run directory."""
        name, region = self._job_name(record)
        run_dir = record.objects[0]["runDir"] if record.objects else None
        job_id = name.rsplit("/", 1)[1]
        yield (f"[vertex] replica output is in Cloud Logging (resource.type=ml_job, resource.labels.job_id={job_id}): "
               f"gcloud ai custom-jobs stream-logs {job_id} --region={region}")
        if not run_dir:
            return
        from shardline.storage import filesystem_for

        try:
            fs, root = filesystem_for(run_dir, "runDir")
        except SpecError as e:
            yield f"[vertex] the rank logs in {run_dir}/logs/ cannot be read here: {e.problem} — {e.fix}"
            return
        yield f"[vertex] rank logs from {run_dir}/logs/"
        offsets: dict[str, int] = {}
        while True:
            ended = not follow or self.status(record).phase in (*TERMINAL, "unknown")
            for k, path in self._rank_logs(fs, root, rank):
                with fs.open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
                cut = len(data) if ended else data.rfind(b"\n") + 1  # a line still being written waits
                offsets[path] = offsets.get(path, 0) + cut
                for line in data[:cut].decode(errors="replace").splitlines():
                    yield f"[rank {k}] {line}"
            if ended:
                return
            time.sleep(self.poll_s)

    @staticmethod
    def _rank_logs(fs: Any, root: str, rank: int | None) -> list[tuple[int, str]]:
        pattern = f"{root.rstrip('/')}/logs/rank-{'*' if rank is None else rank}.log"
        found = [(m.group(1), p) for p in fs.glob(pattern) if (m := _RANK_LOG.search(p))]
        return sorted((int(k), p) for k, p in found)
