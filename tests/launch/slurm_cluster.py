"""A real single-host Slurm for tests: munged, slurmctld and two slurmd as two simulated nodes.

Debian's slurm-wlm and munge packages (installed by scripts/setup). Everything lives in a scratch directory
(config, state, logs, a private munge socket), clients find it through SLURM_CONF, and every daemon is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")


def _exe(name: str) -> str:
    """Daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(name) or f"/usr/sbin/{name}"


def missing() -> str | None:
    """Why a Slurm cluster cannot start here, or None."""
    absent = [d for d in DAEMONS if not Path(_exe(d)).exists()]
    if absent:
        return f"not installed: {', '.join(absent)} (scripts/setup installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


def _wait_pid(pidfile: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pidfile.is_file() and pidfile.read_text().strip():
            return int(pidfile.read_text().split()[0])
        time.sleep(0.05)
    raise TimeoutError(f"{pidfile} not written")


class SlurmCluster:
    """`with SlurmCluster(dir) as c:` — c.env holds SLURM_CONF for clients."""

    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 1) -> None:
        self.root, self.nodes, self.cpus = root, nodes, cpus_per_node
        self.pids: list[int] = []
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.munge_dir: Path | None = None

    def _write_conf(self, munge_socket: Path) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        names = [f"node{i + 1}" for i in range(self.nodes)]
        lines = [
            "ClusterName=shardline-test", "SlurmctldHost=localhost", f"SlurmctldPort={free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            # a requeued job may start again once its credential expired (default 120 s; BeginTime holds it)
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SwitchType=switch/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "MailProg=/bin/true", "KillWait=10", "SchedulerParameters=sched_interval=1",
        ]
        lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.cpus} "
                  "RealMemory=4000 State=UNKNOWN" for n in names]
        lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        # munged runs as the munge user, so its socket lives outside pytest's root-only tmp tree
        self.munge_dir = Path(tempfile.mkdtemp(prefix="shardline-munge-"))
        os.chmod(self.munge_dir, 0o755)
        shutil.chown(self.munge_dir, "munge", "munge")
        sock = self.munge_dir / "munge.socket"
        self._write_conf(sock)
        m = self.munge_dir
        subprocess.run(["runuser", "-u", "munge", "--", _exe("munged"), f"--socket={sock}",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True, timeout=30)
        self.pids.append(_wait_pid(m / "munged.pid"))
        subprocess.run([_exe("slurmctld")], env=self.env, check=True, timeout=30)
        self.pids.append(_wait_pid(self.root / "slurmctld.pid"))
        for i in range(self.nodes):
            subprocess.run([_exe("slurmd"), "-N", f"node{i + 1}"], env=self.env, check=True, timeout=30)
            self.pids.append(_wait_pid(self.root / f"slurmd-node{i + 1}.pid"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            idle = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], env=self.env, capture_output=True,
                                  text=True).stdout.strip()
            if idle == str(self.nodes):
                return
            time.sleep(0.1)
        raise TimeoutError(f"nodes not idle: {self.log('slurmctld')[-2000:]}")

    def log(self, name: str) -> str:
        f = self.root / "log" / f"{name}.log"
        return f.read_text() if f.is_file() else ""

    def stop(self) -> None:
        """SIGTERM to the slurm daemons together, then munged; SIGKILL what is still there after 10 s."""
        slurm, munge = self.pids[1:], self.pids[:1]
        for group in (slurm, munge):
            for pid in group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for pid in group:
                while True:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    if time.monotonic() > deadline:
                        os.kill(pid, signal.SIGKILL)
                        break
                    time.sleep(0.05)
        self.pids.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, *cmd: str) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=True, timeout=30).stdout
