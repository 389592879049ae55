"""Kubernetes backend: render, submit, status, logs and cancel for the Indexed Job, JobSet and TrainJob targets."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import yaml

from shardline.engines.backend import TERMINAL, JobState, LaunchRecord
from shardline.engines.kubernetes import pod as k8s_pod
from shardline.engines.kubernetes.api import Api, ClusterApi, create_all
from shardline.engines.kubernetes.objects import render_objects
from shardline.engines.kubernetes.preemption import preemption_notes
from shardline.engines.kubernetes.status import INDEX_ANNOTATION, explain
from shardline.engines.kubernetes.trainer_api import TRAINJOB_CRD, check_trainer
from shardline.errors import ClusterError
from shardline.spec import JobSpec


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the spec inside the ConfigMap) as literal blocks, readable in review."""


_ManifestDumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False, width=120)


class KubernetesBackend:
    def __init__(self, target: str, api_factory: Callable[[str | None], Api] = ClusterApi, poll_s: float = 3.0):
        self.target = target
        self._api_factory = api_factory
        self.poll_s = poll_s

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        """The manifests, headed by the capacity's risks as YAML comments (preemption grace, run limits)."""
        objects = render_objects(spec, self.target, task)
        notes = "".join(f"# warning: {n}\n" for n in preemption_notes(spec))
        return {f"{k8s_pod.object_name(spec)}-{self.target}.yaml": notes + to_yaml(objects)}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        objects = render_objects(spec, self.target, task)
        api = self._api_factory(spec.launch.kubernetes.context)
        if self.target == "trainjob":  # before anything is created: a too-old Trainer leaves nothing behind
            check_trainer(api.get_crd(TRAINJOB_CRD), f"--target trainjob on context "
                          f"{spec.launch.kubernetes.context or '(current)'}")
        create_all(api, objects)
        return LaunchRecord(
            target=self.target, run_id=spec.run.id or "", submitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
            namespace=spec.launch.kubernetes.namespace, context=spec.launch.kubernetes.context,
            nnodes=spec.launch.nnodes,
            objects=[{"apiVersion": o["apiVersion"], "kind": o["kind"], "name": o["metadata"]["name"]}
                     for o in objects])

    def _workload_object(self, record: LaunchRecord) -> dict[str, str]:
        return next(o for o in record.objects if o["kind"] in ("Job", "JobSet", "TrainJob"))

    def _selector(self, record: LaunchRecord) -> str:
        return f"shardline.dev/run-id={self._workload_object(record)['name']}"

    def status(self, record: LaunchRecord) -> JobState:
        api = self._api_factory(record.context)
        ref = self._workload_object(record)
        ns = record.namespace or "default"
        work = api.get(ref["apiVersion"], ref["kind"], ns, ref["name"])
        pods = api.list_pods(ns, self._selector(record))
        workload = next((w for w in api.list_workloads(ns)
                         if any(o.get("name") == ref["name"] and o.get("kind") == ref["kind"]
                                for o in (w.get("metadata") or {}).get("ownerReferences") or [])), None)
        return explain(work, pods, workload, record.nnodes)

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        api = self._api_factory(record.context)
        ns = record.namespace or "default"
        wanted = list(range(record.nnodes)) if rank is None else [rank]
        pods = self._wait_for_pods(api, record, wanted) if follow else self._current_pods(api, record)
        lines: queue.Queue = queue.Queue()

        def pump(r: int, pod: str) -> None:
            try:
                for line in api.pod_log(ns, pod, k8s_pod.CONTAINER, follow):
                    lines.put(f"[rank {r}] {line}")
            except ClusterError as e:  # raised in the caller's thread, not lost with this one
                lines.put(e)
            finally:
                lines.put(None)

        threads = [threading.Thread(target=pump, args=(r, pods[r]), daemon=True) for r in wanted if r in pods]
        for t in threads:
            t.start()
        done = 0
        while done < len(threads):
            item = lines.get()
            if item is None:
                done += 1
            elif isinstance(item, ClusterError):
                raise item
            else:
                yield item

    def _current_pods(self, api: Api, record: LaunchRecord) -> dict[int, str]:
        newest: dict[int, dict] = {}
        for p in api.list_pods(record.namespace or "default", self._selector(record)):
            r = int((p["metadata"].get("annotations") or {}).get(INDEX_ANNOTATION, 0))
            if r not in newest or (p["metadata"].get("creationTimestamp") or "") >= (
                    newest[r]["metadata"].get("creationTimestamp") or ""):
                newest[r] = p
        return {r: p["metadata"]["name"] for r, p in newest.items()}

    def _wait_for_pods(self, api: Api, record: LaunchRecord, ranks: list[int]) -> dict[int, str]:
        """Follow waits for the pods to start (queued jobs have none yet) or for the job to end."""
        while True:
            state = self.status(record)
            started = {r.rank for r in state.ranks if r.state not in ("pending", "unschedulable", "image-error")}
            if set(ranks) <= started or state.phase in TERMINAL:
                return self._current_pods(api, record)
            time.sleep(self.poll_s)

    def cancel(self, record: LaunchRecord) -> None:
        api = self._api_factory(record.context)
        for ref in reversed(record.objects):
            api.delete(ref["apiVersion"], ref["kind"], record.namespace or "default", ref["name"])
