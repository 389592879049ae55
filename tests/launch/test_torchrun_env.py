"""The torchrun wrapper gives CPU workers the malloc settings that keep freed blocks in the heap; a value the
environment already sets wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shardline.engines.torchrun import CPU_MALLOC_ENV

SCRIPT = """
import json, os, sys
json.dump({k: os.environ.get(k) for k in sys.argv[2:]}, open(sys.argv[1], "w"))
"""


def _worker_env(tmp_path, extra: dict[str, str]) -> dict:
    script, out = tmp_path / "probe.py", tmp_path / "env.json"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra
    subprocess.run([sys.executable, "-m", "shardline.engines.torchrun", "--standalone", "--nproc-per-node=1",
                    str(script), str(out), *CPU_MALLOC_ENV], env=env, check=True, capture_output=True, timeout=120)
    return json.loads(out.read_text())


def test_cpu_workers_start_with_the_heap_keeping_malloc_settings(tmp_path):
    assert _worker_env(tmp_path, {}) == CPU_MALLOC_ENV


def test_a_malloc_setting_the_user_made_is_kept(tmp_path):
    got = _worker_env(tmp_path, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert got == CPU_MALLOC_ENV | {"MALLOC_TRIM_THRESHOLD_": "0"}


def test_a_torchrun_without_newer_flags_gets_the_command_line_without_them(capsys):
    # Seen on a GPU image with torch 2.11: its torchrun refused --shutdown-timeout and no run could start.
    import argparse

    from shardline.engines.torchrun import known_flags

    old = argparse.ArgumentParser()
    old.add_argument("--max-restarts")
    argv = ["--max-restarts=3", "--shutdown-timeout=60", "-m", "shardline.worker", "--spec", "s.yaml"]
    assert known_flags(argv, old) == ["--max-restarts=3", "-m", "shardline.worker", "--spec", "s.yaml"]
    assert "no --shutdown-timeout" in capsys.readouterr().err
    assert known_flags(argv) == argv  # this torch's own torchrun knows it: nothing dropped, nothing said
    assert capsys.readouterr().err == ""


def test_a_sigterm_while_torchrun_is_being_started_reaches_it_and_never_orphans_it(tmp_path, monkeypatch):
    import signal
    import subprocess as real_subprocess

    import shardline.engines.local as local
    from tests.conftest import small_spec

    class Orphaned(Exception):
        pass

    def test_handler(signum, frame):  # what the launcher's own default did: die, leaving torchrun running
        raise Orphaned

    class SignalledDuringStart(real_subprocess.Popen):
        def __init__(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # e.g. `shardline cancel` in the window before the handlers
            super().__init__(*args, **kwargs)

    previous = signal.signal(signal.SIGTERM, test_handler)
    try:
        monkeypatch.setattr(local, "torchrun_command", lambda spec, path, task: ["sleep", "30"])
        monkeypatch.setattr(local.subprocess, "Popen", SignalledDuringStart)
        code = local.run_local(small_spec(tmp_path), tmp_path / "spec.yaml", "train")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == -signal.SIGTERM  # the child got the SIGTERM (and ended by it) instead of running on, orphaned


def test_a_cluster_run_resumed_here_serves_metrics_on_loopback_again():
    from shardline.engines.command import CLUSTER_METRICS_HOST, cluster_spec, local_spec
    from shardline.spec.resolve import load_spec

    shipped = cluster_spec(load_spec("tiny"))  # what a Slurm/Kubernetes run's spec.yaml holds
    assert shipped.observe.metrics_host == CLUSTER_METRICS_HOST
    assert local_spec(shipped, "slurm").observe.metrics_host is None  # was: 0.0.0.0 on a laptop
    assert local_spec(shipped, "local").observe.metrics_host == CLUSTER_METRICS_HOST  # chosen here: kept
    explicit = load_spec("tiny", ["observe.metrics_host=10.0.0.5"])
    assert local_spec(explicit, "k8s-job").observe.metrics_host == "10.0.0.5"



def test_a_signal_reaching_torchrun_exits_by_what_the_workers_recorded(tmp_path, monkeypatch):
    # Ctrl-C or SIGTERM that came after the workers recorded the end of the run made a finished run exit 130/143
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    import shardline.engines.torchrun as wrapper
    from shardline.errors import EXIT_OK, EXIT_PREEMPTED
    from shardline.failures import REPORTER_ENV
    from shardline.rundir import create_run, update_manifest
    from tests.conftest import small_spec

    _, run_dir = create_run(small_spec(tmp_path))

    def interrupted(args):
        raise SignalException("interrupted", signal.SIGINT)

    monkeypatch.setattr(wrapper, "run", interrupted)
    # main() marks this process as the failures' reporter in os.environ: undone after the test, or every bare
    # worker a later test starts would stay silent about its error
    monkeypatch.setenv(REPORTER_ENV, "1")
    argv = ["--standalone", "--nproc-per-node=1", "-m", "shardline.worker", "--spec", str(run_dir / "spec.yaml")]
    for status, code in [("running", 128 + signal.SIGINT), ("preempted", EXIT_PREEMPTED), ("finished", EXIT_OK)]:
        update_manifest(run_dir, status=status)
        assert wrapper.main(argv) == code, status
    # `shardline eval RUN` stopped by a signal was interrupted, although the training run it reads is finished
    assert wrapper.main([*argv, "--task", "eval"]) == 128 + signal.SIGINT


def test_workers_get_this_launchs_prepared_data_and_never_an_inherited_one(tmp_path, monkeypatch):
    """The hand-over names the directory this launcher prepared for this spec; a value inherited from an enclosing
    run (a `shardline eval` started from inside a worker, a shell that exported it) must not reach the workers."""
    import shardline.engines.local as local
    from shardline.data import PREPARED_DATA_ENV
    from tests.conftest import small_spec

    seen = tmp_path / "seen"
    monkeypatch.setattr(local, "torchrun_command", lambda spec, path, task: [
        "sh", "-c", f'printf "%s" "${{{PREPARED_DATA_ENV}:-unset}}" > "$0"', str(seen)])
    monkeypatch.setenv(PREPARED_DATA_ENV, str(tmp_path / "another-runs-data"))
    spec = small_spec(tmp_path)
    assert local.run_local(spec, tmp_path / "spec.yaml", "eval") == 0
    assert seen.read_text() == "unset"
    assert local.run_local(spec, tmp_path / "spec.yaml", "train", prepared=tmp_path / "mine") == 0
    assert seen.read_text() == str((tmp_path / "mine").resolve())
