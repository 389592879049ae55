"""A local Ray head on loopback for tests: `ray start --head --block` in a new session, stopped by its PIDs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port


def session_pids(leader: int) -> list[int]:
    """Every process of the session `leader` started (Ray gives actors their own process groups)."""
    out = subprocess.run(["ps", "-eo", "pid=,sess="], capture_output=True, text=True).stdout
    return [int(pid) for pid, sess in (line.split() for line in out.splitlines()) if int(sess) == leader]


FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                   "RAY_health_check_failure_threshold": "3"}
"""The GCS declares a killed node dead after ~1.5 s instead of Ray's default ~15 s (3 s × 5 failed checks): the
cluster is one host, where a check that fails is a node that is gone."""

FAST_REGROUP = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
"""Ray Train gives up on a worker group whose placement group is not ready after 10 s instead of 60 s. After a node
is lost, its elastic controller still counts the dead node's CPUs until Ray's autoscaling coordinator refreshes
(every 20 s), so its first restart asks for the old size and can only time out; here, where free resources are
reserved at once, 10 s is ample for a group that fits."""


class RayHead:
    """`with RayHead(tmp) as head:` — head.address is the Jobs API URL."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        self.proc: subprocess.Popen | None = None
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false",
                        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                        **FAST_NODE_DEATH, **FAST_REGROUP)

    def __enter__(self) -> RayHead:
        ray = Path(sys.executable).parent / "ray"
        # Ray's session directory needs a short path (unix socket names are limited to 107 bytes)
        self.temp = Path(f"/tmp/shardline-ray-{os.getpid()}-{self.dashboard_port}")
        self.gcs_port = free_port()
        cmd = [str(ray), "start", "--head", "--block", f"--port={self.gcs_port}", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}", f"--num-cpus={self.cpus}",
               "--num-gpus=0", "--disable-usage-stats", f"--temp-dir={self.temp}"]
        self.log = (self.root / "ray-head.log").open("w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float = 120) -> None:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {(self.root / 'ray-head.log').read_text()[-3000:]}")
            try:
                JobSubmissionClient(self.address).list_jobs()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        raise TimeoutError(f"Ray Jobs API not up at {self.address}")

    def _session(self) -> list[int]:
        """Every process of the session our head started (Ray gives actors their own process groups)."""
        return session_pids(self.proc.pid)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # `ray start --block` stops its processes on SIGTERM
        deadline = time.monotonic() + 5
        while self._session() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self._session():  # Ray's state is disposable here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()
        self.proc = None
        shutil.rmtree(self.temp, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.stop()


class RayNode:
    """A second Ray node on this host joined to `head` (`ray start --address --block`, its own session), with
    `cpus` CPUs; `kill()` takes it down at once, raylet and workers, as a lost machine."""

    def __init__(self, head: RayHead, cpus: int = 1) -> None:
        self.head, self.cpus = head, cpus
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RayNode:
        ray = Path(sys.executable).parent / "ray"
        cmd = [str(ray), "start", "--block", f"--address=127.0.0.1:{self.head.gcs_port}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}", "--num-gpus=0", "--disable-usage-stats"]
        self.log = (self.head.root / "ray-node.log").open("w")
        self.proc = subprocess.Popen(cmd, env=self.head.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        total = float(self.head.cpus + self.cpus)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # joined: the cluster's CPU total includes ours
            out = subprocess.run([str(ray), "status", f"--address=127.0.0.1:{self.head.gcs_port}"],
                                 env=self.head.env, capture_output=True, text=True).stdout
            if f"/{total} CPU" in out:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray node exited: {(self.head.root / 'ray-node.log').read_text()[-3000:]}")
            time.sleep(1)
        raise TimeoutError("the second Ray node did not join")

    def kill(self) -> None:
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        self.log.close()


def submit_until_committed(spec, step: int, timeout: float):
    """Submit `spec` with `--target ray` and wait until checkpoint `step` is committed (the job still queued or
    running all along); returns (backend, record, run directory)."""
    from shardline.engines.registry import get_backend

    backend = get_backend("ray")
    record = backend.submit(spec)
    run = Path(record.objects[0]["runDir"])
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / f"step-{step:08d}" / "COMMITTED").exists():
        assert time.monotonic() < deadline, "\n".join(backend.logs(record, None, False))[-4000:]
        assert backend.status(record).phase in ("queued", "running")
        time.sleep(0.5)
    return backend, record, run
