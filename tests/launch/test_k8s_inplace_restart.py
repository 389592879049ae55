"""JobSet InPlaceRestart (`launch.kubernetes.restart_strategy: InPlaceRestart`): the rendered JobSet, the agent
that every pod runs (engines/kubernetes/inplace_agent.py) against the JobSet controller's in-place rules, and a
two-node training run that loses one node's container mid-run, restarts both in place and finishes.

Stand-ins for the API server, the JobSet controller and the kubelet: tests/launch/jobset_inplace.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.engines.kubernetes.objects import MAX_BACKOFF_LIMIT, render_objects
from shardline.engines.kubernetes.pod import SPEC_MOUNT
from shardline.errors import EXIT_IN_PLACE_RESTART, SpecError
from shardline.ops.cluster.bootstrap import BootstrapOptions, bootstrap_objects
from shardline.spec.resolve import load_spec
from tests.conftest import small_overrides
from tests.k8s_schemas import validate_all
from tests.launch.jobset_inplace import Container, JobSetServer, rule_restarts
from tests.launch.k8s_apiserver import kubeconfig
from tests.launch.k8s_pods import NetnsCluster, mount_map, netns_available, netns_missing, pod_env, pods_from

BASE = ["launch.image=registry.example/shardline:test", "launch.kubernetes.gpu_resource=null"]


def _spec(*overrides: str):
    return load_spec("tiny", [*BASE, "run.id=inplace", "launch.nnodes=2", "parallel.nproc_per_node=1",
                              "launch.kubernetes.restart_strategy=InPlaceRestart",
                              "checkpoint.dir=s3://bucket/ckpt", *overrides])


def test_the_rendered_jobset_restarts_in_place_and_validates_against_the_pinned_crd():
    objects = render_objects(_spec(), "jobset")
    validate_all(objects)
    js = objects[-1]
    assert js["spec"]["failurePolicy"]["restartStrategy"] == "InPlaceRestart"
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == MAX_BACKOFF_LIMIT and job["podReplacementPolicy"] == "Failed"
    assert job["completions"] == job["parallelism"] == 2  # the controller's pod count needs both
    pod = job["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"][:4] == ["python", "-m", "shardline.engines.kubernetes.inplace_agent", "--"]
    assert c["command"][4:] == render_objects(_spec("launch.kubernetes.restart_strategy=Recreate"),
                                              "jobset")[-1]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"][0]["command"]
    # restarted in place on a crash, a hang or the agent's request; success, bad input and preemption end the pod
    assert [rule_restarts(c["restartPolicyRules"], code) for code in (0, 1, 2, 75, 76, 77, 137)] == \
        [False, True, False, False, True, True, True]
    env = {e["name"]: e for e in c["env"]}
    assert env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    # the default render is unchanged: no token, Jobs fail on the first pod failure, the JobSet recreates
    plain = render_objects(_spec("launch.kubernetes.restart_strategy=Recreate"), "jobset")[-1]
    plain_job = plain["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert plain_job["backoffLimit"] == 0 and "podReplacementPolicy" not in plain_job
    assert plain_job["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("target", ["k8s-job", "trainjob"])
def test_targets_that_are_not_a_jobset_refuse_a_jobset_restart_strategy(target):
    with pytest.raises(SpecError) as e:
        render_objects(_spec(), target)
    assert e.value.field == "launch.kubernetes.restart_strategy"


def test_bootstrap_grants_the_agent_its_jobset_and_its_pod_and_nothing_else():
    quota = BootstrapOptions(cpu="8", memory="32Gi")
    objs = bootstrap_objects(_spec(), quota)
    validate_all(objs)
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == "shardline-inplace-agent")
    assert role["rules"] == [{"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"],
                              "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]
    binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "shardline-inplace-agent")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shardline-trainer", "namespace": "default"}]
    plain = bootstrap_objects(_spec("launch.kubernetes.restart_strategy=Recreate"), quota)
    assert not [o for o in plain if o["metadata"]["name"] == "shardline-inplace-agent"]


CHILD = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # as the worker does: checkpoint, then exit 75
d = Path(sys.argv[1])
with (d / "starts").open("a") as f:
    f.write(f"{os.environ['POD_NAME']} {time.monotonic()}\\n")
(d / f"{os.environ['POD_NAME']}.pid").write_text(str(os.getpid()))
while not (d / "finish").exists():
    time.sleep(0.05)
"""


def _agent_env(pod, cfg: Path) -> dict[str, str]:
    env = pod_env(pod, {})
    return {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "KUBECONFIG": str(cfg),
            **{k: env[k] for k in ("JOBSET_NAME", "POD_NAME", "POD_NAMESPACE")}}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := predicate():
            return out
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_agents_hold_the_barrier_until_every_pod_is_in_and_restart_both_pods_when_one_fails(tmp_path):
    objects = render_objects(_spec(), "jobset")
    pods = pods_from(objects)
    js = objects[-1]
    starts = tmp_path / "starts"
    with JobSetServer(js, [p.hostname for p in pods]) as server:
        cfg = kubeconfig(tmp_path / "kubeconfig", server.url)
        containers = []
        for pod in pods:
            def start(restarts, pod=pod):
                log = (tmp_path / f"{pod.hostname}-{restarts}.log").open("w")
                return subprocess.Popen([sys.executable, "-m", "shardline.engines.kubernetes.inplace_agent", "--",
                                         sys.executable, "-c", CHILD, str(tmp_path)],
                                        env=_agent_env(pod, cfg), stdout=log, stderr=subprocess.STDOUT)
            containers.append(Container(pod.container, start))
        containers[0].__enter__()
        time.sleep(3)  # pod 0 alone: it announces attempt 0, but its barrier stays down
        assert not starts.exists()
        containers[1].__enter__()
        _wait(lambda: starts.exists() and len(starts.read_text().splitlines()) == 2, 60, "both commands to start")
        assert [(e["field"], e["value"]) for e in server.events if e["kind"] == "status"] == \
            [("currentInPlaceRestartAttempt", 0)]

        killed_at = time.monotonic()
        os.kill(int((tmp_path / f"{pods[1].hostname}.pid").read_text()), signal.SIGKILL)  # node 1's command dies
        _wait(lambda: len(starts.read_text().splitlines()) == 4, 60, "both commands to start again")
        restarted = [float(line.split()[1]) for line in starts.read_text().splitlines()[2:]]
        recovery = max(restarted) - killed_at
        containers[0].proc.send_signal(signal.SIGTERM)  # the kubelet stops pod 0 (preemption): forwarded
        assert containers[0].wait(60) == 75
        (tmp_path / "finish").touch()
        codes = [c.wait(60) for c in containers]
        for c in containers:
            c.__exit__()
    assert codes == [75, 0]  # 75 ends the pod (the Job's podFailurePolicy replaces it); 0 completes it
    # pod 1 restarted for its own failure (137, SIGKILL), pod 0 because the controller asked (77): each once
    assert [code for _, code in containers[1].exits] == [137, 0]
    assert [code for _, code in containers[0].exits] == [EXIT_IN_PLACE_RESTART, 75]
    annotated = [(e["pod"], e["attempt"]) for e in server.events if e["kind"] == "annotate"]
    assert annotated == [(pods[0].hostname, 0), (pods[1].hostname, 0), (pods[1].hostname, 1), (pods[0].hostname, 1)]
    status = [(e["field"], e["value"]) for e in server.events if e["kind"] == "status"]
    assert status == [("currentInPlaceRestartAttempt", 0), ("previousInPlaceRestartAttempt", 0),
                      ("currentInPlaceRestartAttempt", 1)]
    print(f"in-place restart of 2 pods: {recovery:.2f} s from the kill to both commands running again")
    assert json.dumps(server.js["status"]) == json.dumps({"currentInPlaceRestartAttempt": 1,
                                                          "previousInPlaceRestartAttempt": 0})


def _one_agent(tmp_path: Path, server: JobSetServer, pod) -> subprocess.Popen:
    cfg = kubeconfig(tmp_path / "kubeconfig", server.url)
    return subprocess.Popen([sys.executable, "-m", "shardline.engines.kubernetes.inplace_agent", "--",
                             sys.executable, "-c", CHILD, str(tmp_path)], env=_agent_env(pod, cfg),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_an_agent_without_its_role_fails_the_job_at_once_and_says_which_role(tmp_path):
    objects = render_objects(_spec(), "jobset")
    pods = pods_from(objects)
    with JobSetServer(objects[-1], [p.hostname for p in pods], forbid_patch=True) as server:
        agent = _one_agent(tmp_path, server, pods[0])
        out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 2, out  # bad input: the podFailurePolicy fails the Job, the JobSet fails
    assert "403 Forbidden" in out and "shardline-inplace-agent Role" in out, out
    assert not (tmp_path / "starts").exists()


def test_an_api_server_that_is_away_for_a_moment_is_waited_for_not_restarted_around(tmp_path):
    objects = render_objects(_spec(), "jobset")
    pods = pods_from(objects)
    with JobSetServer(objects[-1], [p.hostname for p in pods], unavailable_watches=2,
                      unavailable_patches=2) as server:
        agents = [_one_agent(tmp_path, server, pod) for pod in pods]
        _wait(lambda: (tmp_path / "starts").exists() and len((tmp_path / "starts").read_text().splitlines()) == 2,
              60, "both commands to start once the API server answers")
        (tmp_path / "finish").touch()
        outs = [a.communicate(timeout=60)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert any("watching JobSet" in out and "503" in out and "retrying" in out for out in outs), outs
    assert any("annotating the pod failed (503" in out for out in outs), outs
    assert len((tmp_path / "starts").read_text().splitlines()) == 2  # each command started once: no restart


EVERY, STEPS = 4, 24


@pytest.mark.slow
@pytest.mark.skipif(not netns_available(), reason=netns_missing() or "")
def test_a_training_run_that_loses_a_node_restarts_both_pods_in_place_and_finishes(tmp_path):
    """Each pod in its own network namespace, its container in its own PID namespace (when the agent, PID 1,
    exits, everything in the container dies, as in a real container); the API server and controller stand-in
    in a third namespace. Node 1's container is killed after a checkpoint; both pods restart in place, resume
    from the checkpoint and finish every step."""
    storage, read = tmp_path / "storage", tmp_path / "read-only"
    storage.mkdir()
    read.mkdir()
    spec = load_spec("tiny", [
        *small_overrides(Path("runs")), *BASE, "launch.nnodes=2", "parallel.nproc_per_node=1", "run.id=inplace-e2e",
        "launch.kubernetes.restart_strategy=InPlaceRestart", "launch.kubernetes.storage.kind=pvc",
        "launch.kubernetes.storage.claim=shared", f"launch.kubernetes.storage.mount_path={storage}",
        f"launch.kubernetes.storage.read_path={read}", f"checkpoint.every_steps={EVERY}", f"train.max_steps={STEPS}",
        "checkpoint.async_save=false"])
    objects = render_objects(spec, "jobset")
    validate_all(objects)
    pods = pods_from(objects)
    (tmp_path / "jobset.json").write_text(json.dumps(objects[-1]))
    logs = tmp_path / "logs"
    logs.mkdir()
    run_dir = storage / "runs" / "inplace-e2e"
    with NetnsCluster("sli", 3) as net:
        net.publish([*pods, pods[0]], visible=[0, 1])  # namespace 2 (the API server) needs no DNS record
        api_log = tmp_path / "api.jsonl"
        server = subprocess.Popen(["ip", "netns", "exec", net.names[2], sys.executable, "-m",
                                   "tests.launch.jobset_inplace", "--jobset", str(tmp_path / "jobset.json"),
                                   "--pods", ",".join(p.hostname for p in pods), "--host", net.ips[2],
                                   "--port", "6443", "--log", str(api_log)],
                                  cwd=Path(__file__).resolve().parents[2])
        try:
            _wait(lambda: api_log.with_suffix(".ready").exists(), 60, "the API server stand-in")
            cfg = kubeconfig(tmp_path / "kubeconfig", f"http://{net.ips[2]}:6443")
            containers = []
            for pod in pods:
                mounts = mount_map(pod, objects, tmp_path / "volumes")
                command = [str(mounts[SPEC_MOUNT] / a[len(SPEC_MOUNT) + 1:]) if a.startswith(SPEC_MOUNT + "/")
                           else a for a in pod.container["command"]]
                env = pod_env(pod, {}) | {"KUBECONFIG": str(cfg)}

                def start(restarts, pod=pod, command=command, env=env):
                    return net.start(pod.index, pod, env, ["unshare", "--pid", "--fork", "--kill-child",
                                                           "--mount-proc", *command],
                                     Path(pod.container["workingDir"]), logs / f"pod-{pod.index}-{restarts}.log")
                containers.append(Container(pod.container, start).__enter__())

            def committed_and_past() -> bool:
                ckpts = list(storage.glob("**/step-*/COMMITTED"))
                metrics = run_dir / "metrics.jsonl"
                steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
                         if '"kind": "train"' in line] if metrics.exists() else []
                return bool(ckpts) and max(steps, default=0) >= EVERY + 2
            _wait(committed_and_past, 400, "a committed checkpoint and two more steps")
            containers[1].proc.kill()  # node 1's container dies (its PID namespace with it)
            codes = [c.wait(600) for c in containers]
        finally:
            for c in containers:
                c.__exit__()
            server.kill()
            server.wait()
    out = {f.name: f.read_text()[-2500:] for f in sorted(logs.glob("*.log"))}
    assert codes == [0, 0], out
    assert [code for _, code in containers[1].exits] == [137, 0], out
    assert [code for _, code in containers[0].exits] == [EXIT_IN_PLACE_RESTART, 0], out
    events = [json.loads(line) for line in api_log.read_text().splitlines()]
    assert [(e["field"], e["value"]) for e in events if e["kind"] == "status"] == [
        ("currentInPlaceRestartAttempt", 0), ("previousInPlaceRestartAttempt", 0), ("currentInPlaceRestartAttempt", 1)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps[-1] == STEPS and set(steps) == set(range(1, STEPS + 1))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == 2
    redo = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert (steps[redo] - 1) % EVERY == 0  # resumed right after a committed checkpoint
    killed_at = containers[1].exits[0][0]
    back = max(t for t, _ in (containers[0].exits[0], containers[1].exits[0])) - killed_at
    print(f"in-place restart after node 1's container died: both containers restarted {back:.1f} s after the kill; "
          f"training resumed at step {steps[redo]} (lost steps {steps[redo]}..{steps[redo - 1]})")


def test_an_agent_without_its_pod_environment_fails_the_job_at_once_naming_the_variable(tmp_path):
    # a traceback's exit 1 would be restarted in place forever; 2 fails the JobSet (podFailurePolicy)
    env = {k: v for k, v in os.environ.items() if k not in ("POD_NAMESPACE", "POD_NAME", "JOBSET_NAME")}
    env.update(POD_NAME="trainer-0", JOBSET_NAME="js")
    res = subprocess.run([sys.executable, "-m", "shardline.engines.kubernetes.inplace_agent", "--", "true"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "POD_NAMESPACE" in res.stderr and "Traceback" not in res.stderr
