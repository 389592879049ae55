"""`shardline cluster plan gke`: setup.sh / teardown.sh are valid, idempotent, reverse each other, follow the profile.

The scripts run for real against stub `gcloud`/`kubectl` commands that log their arguments and answer every
`describe` with "exists" or "absent", so idempotency and teardown order are observed, not just grepped.
Snapshots: SHARDLINE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/ops/test_gke_plan.py rewrites them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shardline.cli import main
from shardline.errors import SpecError
from shardline.ops.cluster.gke_plan import GkePlanOptions, plan_steps, write_plan
from shardline.spec.resolve import load_spec

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("SHARDLINE_UPDATE_SNAPSHOTS") == "1"
BUCKET = ["launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=ckpt-bucket"]
HF_SECRET = ["launch.kubernetes.secret_env.HF_TOKEN.secret=hf-token", "launch.kubernetes.secret_env.HF_TOKEN.key=token"]
CASES = {  # snapshot name: (spec overrides, plan options)
    "a4-dws-spot-bucket": (["launch.profile=a4", "launch.nnodes=2", *BUCKET, *HF_SECRET,
                            "launch.kubernetes.restart_strategy=InPlaceRestart",
                            "launch.kubernetes.topology=cloud.google.com/gce-topology-block"],
                           GkePlanOptions(project="my-project", zone="us-central1-b")),
    "a3-mega-dws": (["launch.profile=a3-mega", "launch.kubernetes.namespace=ml"],
                    GkePlanOptions(project="my-project", zone="europe-west4-b", cluster="mega", max_nodes=4,
                                   spot=False)),
    "a3-high-spot": (["launch.profile=a3-high"],
                     GkePlanOptions(project="my-project", zone="us-east4-a", region="us-east4", dws=False)),
}


def spec_with(*overrides: str):
    return load_spec("tiny", ["parallel.nproc_per_node=1", *overrides])


def render(tmp_path: Path, name: str) -> Path:
    overrides, opts = CASES[name]
    out = tmp_path / name
    write_plan(spec_with(*overrides), opts, out)
    return out


@pytest.mark.parametrize("name", CASES)
def test_rendered_scripts_match_the_reviewed_snapshots(tmp_path, name):
    out = render(tmp_path, name)
    for file in ("setup.sh", "teardown.sh", "bootstrap.yaml"):
        golden = SNAPSHOTS / f"gke-{name}" / file
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text((out / file).read_text())
        assert (out / file).read_text() == golden.read_text(), f"{golden} changed; review, then regenerate"


@pytest.mark.parametrize("name", CASES)
def test_scripts_parse_and_pass_shellcheck_with_no_findings(tmp_path, name):
    assert shutil.which("shellcheck"), "shellcheck missing: run scripts/setup (Debian package shellcheck)"
    out = render(tmp_path, name)
    for script in ("setup.sh", "teardown.sh"):
        subprocess.run(["bash", "-n", out / script], check=True)
        result = subprocess.run(["shellcheck", "--severity=style", out / script], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
        text = (out / script).read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail\n" in text
        assert not re.search(r"\bsleep\b", text)
        assert os.access(out / script, os.X_OK)


def test_every_gcloud_create_is_guarded_by_an_existence_check(tmp_path):
    for name in CASES:
        lines = (render(tmp_path, name) / "setup.sh").read_text().splitlines()
        for n, line in enumerate(lines):
            if re.search(r"gcloud .*\bcreate\b", line):
                guard = lines[n - 1].strip()
                assert guard.startswith("if ! gcloud ") and " describe " in guard, (name, line)
                kind = line.split(" create ")[0].replace("gcloud beta ", "gcloud ").strip()
                assert guard.removeprefix("if ! ").startswith(kind + " describe"), (name, guard, line)


DIGEST = "sha256:" + "d" * 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"
STUBS = {
    "gcloud": f"""#!/usr/bin/env bash
echo "gcloud $*" >> "$FAKE_LOG"
if [[ "$1 $2" == "projects describe" ]]; then echo 123456789; exit 0; fi
if [[ " $* " == *" images describe "*"--format"* ]]; then echo {DIGEST}; exit 0; fi
if [[ " $* " == *" describe "* ]]; then [[ "$FAKE_EXISTS" == 1 ]]; exit $?; fi
""",
    "kubectl": """#!/usr/bin/env bash
echo "kubectl $*" >> "$FAKE_LOG"
if [[ " $* " == *" -f - "* ]]; then cat >> "$FAKE_LOG.stdin"; fi
if [[ "$1" == "get" ]]; then [[ "$FAKE_EXISTS" == 1 ]]; exit $?; fi
for arg in "$@"; do  # what a Secret key would hold: kubectl reads the file it names
  if [[ "$arg" == --from-file=* ]]; then
    kv="${arg#*=}"; echo "${kv%%=*}=$(cat "${kv#*=}")" >> "$FAKE_LOG.secrets"
  fi
done
""",
    "git": f"""#!/usr/bin/env bash
echo "git $*" >> "$FAKE_LOG"
echo {COMMIT}
""",
    # GitHub's compare API as it answers (pretty-printed JSON); FAKE_PIN_STATUS says where the commit is
    "curl": """#!/usr/bin/env bash
echo "curl $*" >> "$FAKE_LOG"
printf '{\\n  "url": "%s",\\n  "status": "%s",\\n  "ahead_by": 0\\n}\\n' "${@: -1}" "${FAKE_PIN_STATUS:-behind}"
""",
}


def run_script(script: Path, tmp_path: Path, exists: bool, args: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / f"{script.name}-{exists}.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_EXISTS": "1" if exists else "0", "HF_TOKEN": "hf_test_token_value", **(env or {})}
    result = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    stdin = Path(f"{log}.stdin").read_text() if Path(f"{log}.stdin").exists() else ""
    return result.returncode, calls, stdin + result.stderr


def resources(calls: list[str], verb: str) -> list[tuple[str, str]]:
    """(gcloud resource type, name) for each create/delete call, in call order."""
    out = []
    for call in calls:
        m = re.match(rf"gcloud (?:beta )?([a-z -]+?) {verb} (\S+)", call)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("name", CASES)
def test_setup_creates_everything_once_and_a_rerun_creates_nothing(tmp_path, name):
    out = render(tmp_path, name)
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    created = resources(calls, "create")
    assert len(created) == len(set(created)) and ("container clusters", "shardline" if name != "a3-mega-dws"
                                                  else "mega") in created
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=True)
    assert rc == 0, err
    assert resources(calls, "create") == []
    # what stays idempotent on its own runs every time: APIs, credentials, kubectl apply
    assert any(c.startswith("kubectl apply --server-side -f") and c.endswith("bootstrap.yaml") for c in calls)


@pytest.mark.parametrize("name", CASES)
def test_teardown_deletes_what_setup_created_in_reverse_order_and_tolerates_absence(tmp_path, name):
    out = render(tmp_path, name)
    _, setup_calls, _ = run_script(out / "setup.sh", tmp_path, exists=False)
    rc, calls, err = run_script(out / "teardown.sh", tmp_path, exists=True, args=("--yes",))
    assert rc == 0, err
    kept = [r for r in resources(setup_calls, "create") if r[0] == "storage buckets"]  # runs and checkpoints
    assert resources(calls, "delete") == [r for r in reversed(resources(setup_calls, "create")) if r not in kept]
    rc, calls, err = run_script(out / "teardown.sh", tmp_path, exists=False, args=("--yes",))
    assert rc == 0, err
    assert resources(calls, "delete") == []


def test_teardown_without_yes_refuses_and_touches_nothing(tmp_path):
    out = render(tmp_path, "a4-dws-spot-bucket")
    rc, calls, err = run_script(out / "teardown.sh", tmp_path, exists=True)
    assert rc == 2 and calls == [] and "--yes" in err


def test_a4_plan_builds_an_rdma_vpc_with_a_subnet_per_nic_and_attaches_gvnic_then_rdma(tmp_path):
    out = render(tmp_path, "a4-dws-spot-bucket")
    _, calls, stdin = run_script(out / "setup.sh", tmp_path, exists=False)
    created = resources(calls, "create")
    assert ("compute networks", "shardline-rdma-net") in created
    assert [n for kind, n in created if kind == "compute networks subnets"] == [
        "shardline-gvnic-sub", *(f"shardline-rdma-sub-{i}" for i in range(8))]
    assert any("--network-profile us-central1-b-vpc-roce" in c for c in calls)
    pools = [c for c in calls if "node-pools create" in c]
    assert len(pools) == 2
    for pool in pools:
        assert "--machine-type a4-highgpu-8g" in pool and "type=nvidia-b200,count=8" in pool
        nets = re.findall(r"--additional-node-network (\S+)", pool)
        assert nets[0] == "network=shardline-gvnic-net,subnetwork=shardline-gvnic-sub" and len(nets) == 9
    dws, spot = pools
    for flag in ("--enable-queued-provisioning", "--flex-start", "--num-nodes 0", "--enable-autoscaling",
                 "--reservation-affinity none", "--total-max-nodes 2"):
        assert flag in dws
    assert "--spot" in spot and "--enable-queued-provisioning" not in spot
    cluster = next(c for c in calls if "clusters create" in c)
    for flag in ("--enable-multi-networking", "--enable-dataplane-v2", "--addons GcsFuseCsiDriver",
                 "--workload-pool my-project.svc.id.goog", "--region us-central1"):
        assert flag in cluster
    networks = {o["metadata"]["name"]: o for o in yaml.safe_load_all(stdin.split("\n\n")[0]) if o
                and o["kind"] == "GKENetworkParamSet"}
    assert list(networks) == ["gvnic-1", *(f"rdma-{i}" for i in range(8))]
    assert networks["rdma-3"]["spec"] == {"vpc": "shardline-rdma-net", "vpcSubnet": "shardline-rdma-sub-3",
                                          "deviceMode": "RDMA"}
    assert any("nccl-rdma-installer.yaml" in c for c in calls)
    assert any("add-iam-policy-binding gs://ckpt-bucket" in c and "/subject/ns/default/sa/shardline-trainer" in c
               for c in calls)


def test_tcpx_profiles_build_one_vpc_per_gpu_nic_and_their_own_installer(tmp_path):
    out = render(tmp_path, "a3-high-spot")
    _, calls, stdin = run_script(out / "setup.sh", tmp_path, exists=False)
    created = resources(calls, "create")
    assert [n for kind, n in created if kind == "compute networks"] == [f"shardline-gpunic-{i}-net" for i in range(4)]
    assert [n for kind, n in created if kind == "compute firewall-rules"] == [
        f"shardline-gpunic-{i}-internal" for i in range(4)]
    (pool,) = [c for c in calls if "node-pools create" in c]
    assert "--machine-type a3-highgpu-8g" in pool and "--spot" in pool and "--flex-start" not in pool
    assert len(re.findall("--additional-node-network", pool)) == 4
    assert any("nccl-tcpx-installer.yaml" in c for c in calls) and not any("gib" in c for c in calls)
    names = [o["metadata"]["name"] for o in yaml.safe_load_all(stdin) if o and o["kind"] == "Network"]
    assert names == [f"gpu-nic{i}" for i in range(4)]  # what the launcher's interfaces annotation names


def test_cluster_network_names_follow_the_specs_gpu_networks(tmp_path):
    spec = spec_with("launch.profile=a3-ultra", "launch.kubernetes.gpu_networks=[r0,r1,r2,r3,r4,r5,r6,r7]")
    write_plan(spec, GkePlanOptions(project="my-project", zone="us-south1-b"), tmp_path / "out")
    text = (tmp_path / "out" / "setup.sh").read_text()
    assert "name: r7\n" in text and "name: rdma-7\n" not in text and 'MACHINE_TYPE="a3-ultragpu-8g"' in text


def test_bootstrap_in_the_plan_matches_its_node_pools(tmp_path):
    objs = list(yaml.safe_load_all((render(tmp_path, "a3-mega-dws") / "bootstrap.yaml").read_text()))
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ResourceFlavor"] == ["shardline-a3-mega-dws"]
    cq = next(o for o in objs if o["kind"] == "ClusterQueue")
    gpus = {r["name"]: r["nominalQuota"] for r in cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert gpus["nvidia.com/gpu"] == 4 * 8  # --max-nodes 4 × 8 GPUs
    assert next(o for o in objs if o["kind"] == "LocalQueue")["metadata"]["namespace"] == "ml"


def test_every_step_that_creates_a_cloud_resource_can_be_torn_down():
    for overrides, opts in CASES.values():
        for step in plan_steps(spec_with(*overrides), opts):
            if re.search(r"gcloud .*\bcreate\b", step.create):
                assert step.exists and (step.delete or step.keep), step.title


@pytest.mark.parametrize("overrides, opts, where", [
    ([], GkePlanOptions(project="my-project", zone="us-central1-b"), "--profile"),
    (["launch.profile=a4"], GkePlanOptions(project="X", zone="us-central1-b"), "--project"),
    (["launch.profile=a4"], GkePlanOptions(project="my-project", zone="us-central1"), "--zone"),
    (["launch.profile=a4"], GkePlanOptions(project="my-project", zone="us-central1-b", region="europe-west4"),
     "--region"),
    (["launch.profile=a4"], GkePlanOptions(project="my-project", zone="us-central1-b", cluster="My_Cluster"),
     "--cluster"),
    (["launch.profile=a4"], GkePlanOptions(project="my-project", zone="us-central1-b", max_nodes=0), "--max-nodes"),
    (["launch.profile=a4"], GkePlanOptions(project="my-project", zone="us-central1-b", dws=False, spot=False),
     "--no-dws/--no-spot"),
    (["launch.profile=a4", "launch.kubernetes.gpu_resource=null"],
     GkePlanOptions(project="my-project", zone="us-central1-b"), "launch.kubernetes.gpu_resource"),
    (["launch.profile=a4", "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=gs://x"],
     GkePlanOptions(project="my-project", zone="us-central1-b"), "launch.kubernetes.storage.bucket"),
])
def test_bad_plan_input_is_an_error_that_names_the_option(tmp_path, overrides, opts, where):
    with pytest.raises(SpecError) as e:
        write_plan(spec_with(*overrides), opts, tmp_path)
    assert e.value.where == where
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_plan_gke_options_reach_the_scripts(tmp_path):
    rc = main(["cluster", "plan", "gke", "tiny", "--set", "parallel.nproc_per_node=1", "--out", str(tmp_path),
               "--project", "proj-123", "--zone", "asia-southeast1-b", "--region", "asia-southeast1",
               "--cluster", "train-b200", "--profile", "a4", "--max-nodes", "6", "--no-spot", "--dws"])
    assert rc == 0
    setup = (tmp_path / "setup.sh").read_text()
    for line in ('PROJECT="proj-123"', 'ZONE="asia-southeast1-b"', 'REGION="asia-southeast1"',
                 'CLUSTER="train-b200"', 'MACHINE_TYPE="a4-highgpu-8g"', "MAX_NODES=6", "GPU_NICS=8"):
        assert f"\n{line}\n" in setup
    assert '"${DWS_POOL}"' in setup and "SPOT_POOL" not in setup
    assert main(["cluster", "plan", "gke", "tiny", "--set", "parallel.nproc_per_node=1", "--out",
                 str(tmp_path / "x"), "--project", "proj-123", "--zone", "asia-southeast1-b"]) == 2  # generic profile


def test_setup_builds_the_image_with_cloud_build_into_artifact_registry_and_records_its_digest(tmp_path):
    out = render(tmp_path, "a4-dws-spot-bucket")
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    assert ("artifacts repositories", "shardline") in resources(calls, "create")
    (build,) = [c for c in calls if c.startswith("gcloud builds submit")]
    cloudbuild = yaml.safe_load((Path(__file__).parents[2] / "cloudbuild.yaml").read_text())
    subs = dict(kv.split("=", 1) for kv in build.split("--substitutions ")[1].split()[0].split(","))
    assert set(subs) <= set(cloudbuild["substitutions"])  # only substitutions cloudbuild.yaml declares
    assert subs == {"_REGION": "us-central1", "_REPOSITORY": "shardline", "_TAG": COMMIT[:12], "_GIT_COMMIT": COMMIT}
    assert "--config ./cloudbuild.yaml" in build and build.startswith("gcloud builds submit . ")
    image = f"us-central1-docker.pkg.dev/my-project/shardline/shardline:{COMMIT[:12]}"
    flags = f"--set launch.image={image} --set launch.image_digest={DIGEST}"
    assert (out / "image.txt").read_text().strip() == flags
    spec = spec_with("launch.profile=a4", *flags.replace("--set ", "").split())  # what a launch takes
    assert spec.launch.image == image and spec.launch.image_digest == DIGEST
    _, calls, _ = run_script(out / "setup.sh", tmp_path, exists=True)
    assert not any(c.startswith("gcloud builds submit") for c in calls)  # this commit's image exists already
    _, calls, _ = run_script(out / "teardown.sh", tmp_path, exists=True, args=("--yes",))
    assert resources(calls, "delete")[-1] == ("artifacts repositories", "shardline")


def test_no_build_leaves_out_the_repository_and_the_build(tmp_path):
    overrides, _ = CASES["a3-high-spot"]
    write_plan(spec_with(*overrides), GkePlanOptions(project="my-project", zone="us-east4-a", build=False), tmp_path)
    text = (tmp_path / "setup.sh").read_text()
    assert "artifacts" not in text and "builds submit" not in text and "cloudbuild" not in text


def test_cluster_runs_managed_prometheus_with_dcgm_and_the_bootstrap_scrapes_rank_0(tmp_path):
    out = render(tmp_path, "a3-mega-dws")
    _, calls, _ = run_script(out / "setup.sh", tmp_path, exists=False)
    cluster = next(c for c in calls if "clusters create" in c)
    assert "--enable-managed-prometheus" in cluster and "--monitoring=SYSTEM,DCGM" in cluster
    objs = list(yaml.safe_load_all((out / "bootstrap.yaml").read_text()))
    (pm,) = [o for o in objs if o["kind"] == "PodMonitoring"]
    assert pm["apiVersion"] == "monitoring.googleapis.com/v1" and pm["metadata"]["namespace"] == "ml"
    assert pm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    write_plan(spec_with("launch.profile=a3-mega", "observe.metrics_port=null"),
               GkePlanOptions(project="my-project", zone="europe-west4-b"), tmp_path / "off")
    assert "PodMonitoring" not in (tmp_path / "off" / "bootstrap.yaml").read_text()


def test_node_pools_take_the_gke_versions_default_gpu_driver(tmp_path):
    out = render(tmp_path, "a4-dws-spot-bucket")
    _, calls, _ = run_script(out / "setup.sh", tmp_path, exists=False)
    pools = [c for c in calls if "node-pools create" in c]
    assert pools and all("gpu-driver-version=default" in c for c in pools)


def test_buckets_the_spec_uses_are_created_with_hierarchical_namespace_and_kept_by_teardown(tmp_path):
    spec = spec_with("launch.profile=a4", *BUCKET, "checkpoint.dir=gs://ckpt-store/runs")
    write_plan(spec, GkePlanOptions(project="my-project", zone="us-central1-b"), tmp_path / "out")
    rc, calls, err = run_script(tmp_path / "out" / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    creates = [c for c in calls if c.startswith("gcloud storage buckets create")]
    assert [c.split()[4] for c in creates] == ["gs://ckpt-bucket", "gs://ckpt-store"]
    for c in creates:
        for flag in ("--location=us-central1", "--uniform-bucket-level-access", "--enable-hierarchical-namespace"):
            assert flag in c
    bindings = [c.split()[4] for c in calls if "add-iam-policy-binding" in c]
    assert bindings == ["gs://ckpt-bucket", "gs://ckpt-store"]
    rc, calls, err = run_script(tmp_path / "out" / "teardown.sh", tmp_path, exists=True, args=("--yes",))
    assert rc == 0 and not any("buckets delete" in c or "storage rm" in c for c in calls)
    assert "kept gs://${CHECKPOINT_BUCKET}" in (tmp_path / "out" / "teardown.sh").read_text()
    with pytest.raises(SpecError) as e:
        write_plan(spec_with("launch.profile=a4", "checkpoint.dir=gs://Bad_Bucket/x"),
                   GkePlanOptions(project="my-project", zone="us-central1-b"), tmp_path / "bad")
    assert e.value.where == "checkpoint.dir"


@pytest.mark.parametrize("source", ["environment", "file"])
def test_the_token_secret_is_created_from_the_environment_or_a_file_and_never_written_or_traced(tmp_path, source):
    token = "hf_Zq9" + "x" * 30
    out = render(tmp_path, "a4-dws-spot-bucket")
    text = (out / "setup.sh").read_text()
    assert "set -x" not in text and "xtrace" not in text and "hf_" not in text
    env = {"HF_TOKEN": token}
    if source == "file":
        (tmp_path / "token").write_text(token)
        env = {"HF_TOKEN": "", "HF_TOKEN_FILE": str(tmp_path / "token")}
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False, env=env)
    assert rc == 0, err
    (create,) = [c for c in calls if c.startswith("kubectl create secret generic")]
    assert "hf-token" in create and "--namespace default" in create
    assert Path(f"{tmp_path}/setup.sh-False.log.secrets").read_text() == f"token={token}\n"  # reached kubectl
    assert token not in "\n".join(calls) and token not in err  # in no argument, no output
    leaked = [f for f in tmp_path.rglob("*") if f.is_file() and not f.name.endswith(".secrets")
              and f.name != "token" and token in f.read_text(errors="ignore")]
    assert leaked == []
    rc, calls, _ = run_script(out / "setup.sh", tmp_path, exists=True, env=env)
    assert rc == 0 and not any("create secret" in c for c in calls)  # a Secret that exists stays as it is


def test_a_missing_token_stops_setup_with_what_to_set(tmp_path):
    out = render(tmp_path, "a4-dws-spot-bucket")
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False, env={"HF_TOKEN": ""})
    assert rc != 0 and "export HF_TOKEN or set HF_TOKEN_FILE" in err
    assert not any("create secret" in c for c in calls)  # never an empty Secret
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False, env={"HF_TOKEN_FILE": "/nonexistent"})
    assert rc != 0 and "cannot read HF_TOKEN_FILE=/nonexistent" in err


@pytest.mark.parametrize("field,value", [("key", "token;touch /tmp/pwned"), ("key", "$(id)"), ("secret", "hf$(id)")])
def test_secret_names_and_keys_that_would_reach_the_setup_shell_are_refused(field, value):
    overrides = [o for o in HF_SECRET if not o.split("=")[0].endswith(f".{field}")]
    with pytest.raises(SpecError, match=f"launch.kubernetes.secret_env.HF_TOKEN.{field}"):
        load_spec("tiny", [*overrides, f"launch.kubernetes.secret_env.HF_TOKEN.{field}={value}"])


def test_the_dws_pool_keeps_auto_upgrade_that_the_release_channel_requires_and_an_exclusion_holds_upgrades(tmp_path):
    """The GKE API rejects auto_upgrade=false on a node pool of a release-channel cluster ("Auto_upgrade cannot be
    false when release_channel REGULAR is set"); https://cloud.google.com/kubernetes-engine/docs/concepts/
    maintenance-windows-and-exclusions: a `no_minor_or_node_upgrades` exclusion keeps upgrades from evicting
    training pods instead. https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest: the DWS pool
    is created with queued provisioning, flex-start and auto-repair off."""
    out = render(tmp_path, "a3-mega-dws")
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    cluster = next(c for c in calls if "clusters create" in c)
    assert "--release-channel regular" in cluster
    (dws,) = [c for c in calls if "node-pools create" in c]
    assert "--no-enable-autoupgrade" not in dws and "--no-enable-autorepair" in dws
    (update,) = [c for c in calls if c.startswith("gcloud container clusters update")]
    assert "--add-maintenance-exclusion-scope no_minor_or_node_upgrades" in update
    start = re.search(r"--add-maintenance-exclusion-start (\S+)", update).group(1)
    end = re.search(r"--add-maintenance-exclusion-end (\S+)", update).group(1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", start) and end > start
    assert calls.index(cluster) < calls.index(update) < calls.index(dws)


def test_every_applied_upstream_file_is_a_pin_from_the_table_with_its_source():
    """The pin table (profiles.PINS), checked offline: each raw.githubusercontent.com URL setup.sh applies names a
    full commit (no branch, no tag) of a table entry that says which release note names it and whether its
    presence on the default branch was verified. The A3 High NRI injector is the generic one GKE's guide applies
    (container-engine-accelerators nri_device_injector/nri-device-injector.yaml), not gpudirect-tcpx's copy whose
    init container edits containerd's config and restarts containerd."""
    from shardline.network_profiles import PINS, PROFILES

    table = {p.url: p for p in PINS.values()}
    for name, (overrides, opts) in CASES.items():
        text = "\n".join(s.create for s in plan_steps(spec_with(*overrides), opts))
        urls = re.findall(r"https://raw\.githubusercontent\.com/[^\s\"']+", text)
        assert urls and all(u in table for u in urls), (name, urls)
    for pin in PINS.values():
        assert re.fullmatch(r"[0-9a-f]{40}", pin.commit) and pin.source and pin.default_branch
        assert pin.default_branch.startswith(("verified", "unverified"))
    assert PINS["nri-device-injector"].path == "nri_device_injector/nri-device-injector.yaml"
    for profile in PROFILES.values():  # the sidecar image is the one the installer's release pairs it with
        if profile.rx_daemon:
            installer = profile.node_manifests[0]
            assert profile.rx_daemon.image.rsplit(":", 1)[1] in installer.source, profile.name


@pytest.mark.parametrize("status, ok", [("behind", True), ("identical", True), ("diverged", False), ("ahead", False)])
def test_setup_stops_before_creating_anything_when_a_pinned_commit_is_not_on_the_default_branch(tmp_path, status, ok):
    """GitHub's compare API (https://docs.github.com/en/rest/commits/commits#compare-two-commits) answers
    `behind` or `identical` for BASE...HEAD when the branch BASE contains HEAD; a commit that exists only in a pull
    request or a fork answers `diverged` (or 404: curl fails). Pins the table could not verify offline are
    checked here, first."""
    out = render(tmp_path, "a3-high-spot")
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False, env={"FAKE_PIN_STATUS": status})
    checks = [c for c in calls if c.startswith("curl ")]
    assert checks and all("api.github.com/repos/GoogleCloudPlatform/container-engine-accelerators/compare/master..."
                          in c for c in checks)
    if ok:
        assert rc == 0, err
    else:
        assert rc != 0 and "is not on its master branch" in err
        assert not any(" create " in c or c.startswith("kubectl apply") for c in calls)


def test_the_plan_states_the_spot_pools_preemption_grace(tmp_path):
    """https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms: 15 s for a preempted pod; setup.sh says
    so in its header and when it ends."""
    out = render(tmp_path, "a3-high-spot")
    text = (out / "setup.sh").read_text()
    header = text.split("set -euo pipefail")[0]
    assert "spot pool: GKE gives a preempted pod 15 s" in header
    rc, _, _ = run_script(out / "setup.sh", tmp_path, exists=True)
    assert rc == 0 and "warning: spot pool" in text.splitlines()[-1]


def test_jobsets_that_restart_in_place_get_jobsets_alpha_gate_turned_on_once(tmp_path):
    """JobSet's webhook refuses restartStrategy InPlaceRestart while its InPlaceRestart gate (alpha, off) is off."""
    out = render(tmp_path, "a4-dws-spot-bucket")
    rc, calls, err = run_script(out / "setup.sh", tmp_path, exists=False)
    assert rc == 0, err
    patches = [c for c in calls if c.startswith("kubectl patch -n jobset-system deployment jobset-controller-manager")]
    assert len(patches) == 1 and '"value": "--feature-gates=InPlaceRestart=true"' in patches[0]
    plain = render(tmp_path, "a3-mega-dws")
    assert "InPlaceRestart" not in (plain / "setup.sh").read_text()
