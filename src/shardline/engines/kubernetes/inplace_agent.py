"""The in-place restart agent of a JobSet with `failurePolicy.restartStrategy: InPlaceRestart`, as the pod's
main container: it holds a barrier, runs the node command when the JobSet controller lifts it, and exits
with EXIT_IN_PLACE_RESTART when the controller asks this pod to restart (the container's `restartPolicyRules`
then restart it in place, on the same node, without rescheduling).

The protocol is JobSet's (KEP-467; the JobSet controller's `reconcileInPlaceRestart`), implemented here
so that no second image runs beside the trainer:
- at start the agent writes its pod's annotation `jobset.sigs.k8s.io/in-place-restart-attempt`: 0 for a new
  JobSet (no `status.currentInPlaceRestartAttempt` yet), else current + 1 — a restarted container or a
  replacement pod announces the next attempt;
- the controller sets `status.previousInPlaceRestartAttempt` to (highest pod attempt − 1) when the pods
  disagree: every agent at or below it stops its command and exits EXIT_IN_PLACE_RESTART;
- when every pod reports the same attempt, the controller sets `status.currentInPlaceRestartAttempt` to it:
  agents at that attempt lift the barrier and start the node command (which resumes from the last
  checkpoint);
- the command's exit code becomes the container's (0 finishes, 2 fails the JobSet, anything else restarts
  the container in place and so starts the next attempt).

It watches only its own JobSet (a field-selected watch, no polling), and reads the JobSet and patches its own
pod with the pod's ServiceAccount (the `shardline-inplace-agent` Role from `shardline cluster bootstrap`).
SIGTERM from the kubelet (preemption, deletion) goes to the command, whose exit code is then the agent's.

    python -m shardline.engines.kubernetes.inplace_agent -- <node command ...>
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from shardline.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_IN_PLACE_RESTART

ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/in-place-restart-attempt"
DISABLE_ANNOTATION = "alpha.jobset.sigs.k8s.io/disable-in-place-restart"
GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
STOP_GRACE_SECONDS = 5.0
"""How long the node command gets between SIGTERM and SIGKILL when this pod must restart for another pod's
failure: its peers are gone, so nothing it could still save would be consistent; the last commit is resumed."""
WATCH_SECONDS = 300
PATCH_PATIENCE_SECONDS = 300.0
"""How long the agent keeps retrying its pod annotation through a control-plane outage before it gives up
(and its container restarts)."""


def _log(message: str) -> None:
    print(f"[inplace-agent {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _api():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()  # outside a pod (tests, debugging): KUBECONFIG
    return client.CustomObjectsApi(), client.CoreV1Api()


class _Backoff:
    """Waits 1, 2, 4 … 30 s between tries of a call to the API server, saying what failed."""

    def __init__(self) -> None:
        self.seconds = 1.0

    def reset(self) -> None:
        self.seconds = 1.0

    def wait(self, what: str, problem: str) -> None:
        _log(f"{what} failed ({problem}); retrying in {self.seconds:.0f} s")
        time.sleep(self.seconds)
        self.seconds = min(self.seconds * 2, 30.0)


FATAL_STATUS = (401, 403, 404)
"""API answers no retry fixes: no credentials, no permission (the Role is missing), no such JobSet."""


def _watch_jobset(custom, namespace: str, name: str, events: queue.Queue) -> None:
    """Every state of the JobSet, as the API server reports it, into `events`. A dropped connection or an
    unavailable API server is retried with backoff while the command keeps running (a blip of the control plane
    must not restart a whole job); only a fatal answer or the JobSet's deletion ends the watch."""
    from kubernetes import watch
    from kubernetes.client.exceptions import ApiException

    version, backoff = None, _Backoff()
    while True:
        kwargs = {"field_selector": f"metadata.name={name}", "timeout_seconds": WATCH_SECONDS}
        if version:
            kwargs["resource_version"] = version
        try:
            for event in watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION, namespace,
                                              PLURAL, **kwargs):
                backoff.reset()
                obj = event["object"]
                if event["type"] == "ERROR":  # e.g. 410 Gone: the version is too old; list again from now
                    version = None
                    break
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if event["type"] in ("ADDED", "MODIFIED"):
                    events.put(obj)
                elif event["type"] == "DELETED":
                    events.put(None)
                    return
            continue
        except ApiException as e:
            if e.status in FATAL_STATUS:
                events.put(e)
                return
            if e.status == 410:
                version = None
                continue
            problem = f"{e.status} {e.reason}"
        except Exception as e:  # noqa: BLE001 - connection refused/reset, timeouts: the control plane is away
            problem = f"{type(e).__name__}: {e}"
        backoff.wait(f"watching JobSet {name}", problem)


class Agent:
    """One pod's barrier and command; `on_jobset` is the reconcile step, driven by the watch."""

    def __init__(self, command: list[str], pod: str, namespace: str, patch_pod) -> None:
        self.command, self.pod, self.namespace, self.patch_pod = command, pod, namespace, patch_pod
        self.attempt: int | None = None
        self.child: subprocess.Popen | None = None
        self.terminating = False
        """SIGTERM came before the command started: it never starts."""

    def on_jobset(self, js: dict) -> int | None:
        """Act on one observed JobSet state; an exit code when this agent must exit now."""
        status = js.get("status") or {}
        current, previous = status.get("currentInPlaceRestartAttempt"), status.get("previousInPlaceRestartAttempt")
        strategy = ((js.get("spec") or {}).get("failurePolicy") or {}).get("restartStrategy")
        if strategy != "InPlaceRestart" or DISABLE_ANNOTATION in (js.get("metadata", {}).get("annotations") or {}):
            self._start("the JobSet does not restart in place: no barrier")
            return None
        if self.attempt is None:
            self.attempt = 0 if current is None else current + 1
            self.patch_pod({"metadata": {"annotations": {ATTEMPT_ANNOTATION: str(self.attempt)}}})
            _log(f"pod {self.pod} is at in-place restart attempt {self.attempt}")
        if previous is not None and self.attempt <= previous:
            _log(f"attempt {self.attempt} is outdated (previous={previous}): restarting this pod in place")
            self.stop(STOP_GRACE_SECONDS)
            return EXIT_IN_PLACE_RESTART
        if current is not None and self.attempt == current:
            self._start(f"every pod is at attempt {current}: barrier lifted")
        return None

    def _start(self, why: str) -> None:
        if self.child is None and not self.terminating:
            _log(f"{why}; starting the node command")
            self.child = subprocess.Popen(self.command, start_new_session=True)

    def stop(self, grace: float) -> None:
        """SIGTERM to the command's process group, SIGKILL after `grace` seconds."""
        if self.child is None or self.child.poll() is not None:
            return
        os.killpg(self.child.pid, signal.SIGTERM)
        try:
            self.child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()

    def forward(self, signum: int) -> None:
        self.terminating = True
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signum)


def _patch_with_retries(patch, body: dict, patience: float = PATCH_PATIENCE_SECONDS) -> None:
    """`patch(body)`, retried with backoff through transient API errors (5xx, 429, dropped connections) for up
    to `patience` seconds; fatal answers (FATAL_STATUS) and the last error are raised."""
    from kubernetes.client.exceptions import ApiException

    deadline, backoff = time.monotonic() + patience, _Backoff()
    while True:
        try:
            return patch(body)
        except ApiException as e:
            if e.status in FATAL_STATUS or time.monotonic() > deadline:
                raise
            problem = f"{e.status} {e.reason}"
        except Exception as e:  # noqa: BLE001 - connection errors: retried like a 503
            if time.monotonic() > deadline:
                raise
            problem = f"{type(e).__name__}: {e}"
        backoff.wait("annotating the pod", problem)


POD_ENV = ("POD_NAMESPACE", "POD_NAME", "JOBSET_NAME")
"""Set by the rendered pod (downward API and the JobSet's name): the agent cannot act without them."""


def run(command: list[str]) -> int:
    if missing := [k for k in POD_ENV if not os.environ.get(k)]:
        # bad setup: exit 2 fails the JobSet at once, where a traceback's 1 would be restarted in place forever
        print(f"error: the in-place restart agent needs {', '.join(missing)} in its environment — render the pod "
              "with `shardline render` (downward API fields metadata.namespace and metadata.name)", file=sys.stderr)
        return EXIT_BAD_INPUT
    namespace, pod, jobset = (os.environ[k] for k in POD_ENV)
    custom, core = _api()
    agent = Agent(command, pod, namespace, lambda body: _patch_with_retries(
        lambda b: core.patch_namespaced_pod(pod, namespace, b), body))
    from kubernetes.client.exceptions import ApiException

    def on_term(signum, frame) -> None:
        agent.forward(signum)

    signal.signal(signal.SIGTERM, on_term)
    events: queue.Queue = queue.Queue()
    threading.Thread(target=_watch_jobset, args=(custom, namespace, jobset, events), daemon=True).start()
    while True:
        if agent.child is not None and (code := agent.child.poll()) is not None:
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
            _log(f"the node command exited with {code}")
            return code
        if agent.terminating and agent.child is None:
            return 128 + signal.SIGTERM
        try:
            event = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if event is None:
            _log(f"JobSet {jobset} was deleted: stopping")
            agent.stop(STOP_GRACE_SECONDS)
            return EXIT_FAILURE
        try:
            if isinstance(event, Exception):
                raise event
            if (code := agent.on_jobset(event)) is not None:
                return code
        except ApiException as e:
            if e.status not in FATAL_STATUS:
                raise
            # bad setup, not a failure a restart fixes: exit 2 fails the JobSet at once (podFailurePolicy)
            print(f"error: pod {pod}: the Kubernetes API answered {e.status} {e.reason} to the in-place restart "
                  f"agent (watch JobSet {jobset}, patch its own pod) — apply the shardline-inplace-agent Role and "
                  "RoleBinding (`shardline cluster bootstrap`) for the pod's ServiceAccount", file=sys.stderr)
            agent.stop(STOP_GRACE_SECONDS)
            return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["--"] or len(args) < 2:
        print("usage: python -m shardline.engines.kubernetes.inplace_agent -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    return run(args[1:])


if __name__ == "__main__":
    sys.exit(main())
