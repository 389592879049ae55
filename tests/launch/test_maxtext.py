"""TPU slices with MaxText (issue 16): the spec as MaxText's config, the multislice JobSet, the KubeRay RayJob, the
TPU catalogue, plan and cost. Nothing here runs MaxText or touches a TPU: what is checked is what is rendered.

Upstream sources: MaxText 0.2.5 from PyPI (`maxtext`, its wheel fetched once into ~/.cache/shardline-test; Python
≥ 3.12, so it is read as an archive, never installed): maxtext/configs/base.yml (every key a MaxText config may set),
configs/models/*.yml (model names), configs/types.py (enum values). JobSet and RayJob objects: the pinned CRDs of
tests/crds (SOURCES.txt) and the Kubernetes 1.31 schemas, strictly (tests/k8s_schemas.py).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from shardline.api import plan, render
from shardline.engines.kubernetes.status import explain, kueue_reasons
from shardline.engines.tpu.maxtext import ATTENTION, REMAT_POLICIES, maxtext_overrides
from shardline.engines.tpu.rayjob import ray_head_resource
from shardline.errors import SpecError
from shardline.hardware import match_device, tpu_slice
from shardline.planning.cost import project_cost
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import validate_all

MAXTEXT = "maxtext==0.2.5"
WHEEL = "maxtext-0.2.5-py3-none-any.whl"
WHEEL_SHA256 = "2fe8e4ffc3a06bd06f94daeaaf5fe3ecee748bb6f661c0f426e07e2ca10c9406"
CACHE = Path.home() / ".cache" / "shardline-test" / "maxtext"
PRESET = "maxtext-v6e-multislice"
RUN = ["run.id=mt-20261125-000000-abcd"]


@pytest.fixture(scope="module")
def maxtext_wheel() -> zipfile.ZipFile:
    """The released MaxText wheel, downloaded once with pip (no dependencies, for Python 3.12) and pinned by sha256."""
    wheel = CACHE / WHEEL
    if not wheel.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12",
                               "--only-binary=:all:", MAXTEXT, "-d", str(CACHE)], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0 or not wheel.is_file():
            pytest.fail(f"cannot download {MAXTEXT} from PyPI (the key check needs it): {done.stderr[-300:]}")
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == WHEEL_SHA256
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def base_yml(maxtext_wheel) -> dict:
    return yaml.safe_load(maxtext_wheel.read("maxtext/configs/base.yml"))


def spec(*sets: str):
    return load_spec(PRESET, [*RUN, *sets])


CUSTOM_ARCH = ("model.path=null", "model.tokenizer=gs://my-bucket/tokenizer", "launch.tpu.load_parameters_path=null")


@pytest.mark.parametrize("sets", [(), CUSTOM_ARCH, ("parallel.dp_replicate=1", "launch.tpu.tensor_parallelism=4")])
def test_every_key_shardline_emits_is_a_key_of_maxtexts_base_yml(base_yml, sets):
    emitted = maxtext_overrides(spec(*sets))
    assert sorted(set(emitted) - set(base_yml)) == []


def test_emitted_values_are_ones_maxtext_knows(maxtext_wheel):
    """Model configs exist as configs/models/<name>.yml; remat, attention, dataset and tokenizer names are the ones
    base.yml and types.py list."""
    o = maxtext_overrides(spec())
    names = set(maxtext_wheel.namelist())
    assert f"maxtext/configs/models/{o['model_name']}.yml" in names
    text = maxtext_wheel.read("maxtext/configs/base.yml").decode()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# Choose 'remat_policy'"))
    for policy in REMAT_POLICIES.values():  # the comment lists the policies on two lines
        assert f"'{policy}'" in lines[at] + lines[at + 1], policy
    attention_line = next(line for line in lines if line.startswith("attention:"))
    for kernel in ATTENTION.values():
        assert kernel in attention_line, kernel
    types = maxtext_wheel.read("maxtext/configs/types.py").decode()
    assert f'= "{o["dataset_type"]}"' in types and f'= "{o["tokenizer_type"]}"' in types
    assert f'"{o["model_name"]}"' in types  # ModelName literal


def test_the_spec_maps_to_maxtext_config():
    o = maxtext_overrides(spec())
    assert o["model_name"] == "llama3.1-8b" and o["load_parameters_path"].startswith("gs://")
    assert (o["steps"], o["per_device_batch_size"], o["max_target_length"]) == (2000, 2, 2048)
    assert o["gradient_accumulation_steps"] == 1  # 64 rows = 2 per chip × 32 chips
    assert (o["ici_fsdp_parallelism"], o["ici_tensor_parallelism"]) == (16, 1)
    assert (o["dcn_data_parallelism"], o["dcn_fsdp_parallelism"]) == (2, 1)
    assert o["warmup_steps_fraction"] == 0.05 and o["checkpoint_period"] == 100
    assert (o["remat_policy"], o["attention"]) == ("full", "flash")
    assert o["base_output_directory"] == "gs://my-bucket/maxtext" and o["run_name"] == RUN[0].split("=")[1]
    fsdp_everywhere = maxtext_overrides(spec("parallel.dp_replicate=1", "launch.tpu.tensor_parallelism=4"))
    assert (fsdp_everywhere["ici_fsdp_parallelism"], fsdp_everywhere["ici_tensor_parallelism"]) == (4, 4)
    assert (fsdp_everywhere["dcn_data_parallelism"], fsdp_everywhere["dcn_fsdp_parallelism"]) == (1, 2)


@pytest.mark.parametrize("sets, field", [
    (("model.lora.enabled=true",), "model.lora.enabled"),
    (("data.path=null", "data.task=text_to_sql"), "data.path"),
    (("data.prompt_format=plain",), "data.prompt_format"),
    (("data.columns.answer=sql",), "data.columns"),
    (("parallel.offload=true",), "parallel.offload"),
    (("checkpoint.every_minutes=30",), "checkpoint.every_minutes"),
    (("checkpoint.dir=/mnt/ckpt",), "checkpoint.dir"),
    (("launch.tpu.load_parameters_path=null",), "launch.tpu.load_parameters_path"),
    (("model.path=mistralai/Mistral-7B-v0.1",), "model.path"),
])
def test_what_maxtext_cannot_honour_is_a_named_error(sets, field):
    with pytest.raises(SpecError) as e:
        maxtext_overrides(spec(*sets))
    assert e.value.field == field and e.value.fix


@pytest.mark.parametrize("sets, field", [
    (("launch.nnodes=4",), "launch.nnodes"),
    (("parallel.nproc_per_node=8",), "parallel.nproc_per_node"),
    (("launch.tpu.topology=4x4x4",), "launch.tpu.topology"),
    (("launch.tpu.type=v7x",), "launch.tpu.type"),
    (("launch.tpu.tensor_parallelism=3",), "launch.tpu.tensor_parallelism"),
])
def test_slices_hosts_and_chips_must_agree_with_the_world_size(sets, field):
    with pytest.raises(SpecError) as e:
        spec(*sets)
    assert e.value.field == field


def test_tpu_catalogue_slices():
    """GKE's TPU tables: v6e 4x4 = 16 chips on 4 ct6e-standard-4t hosts; v5p 2x2x4 = 16 chips on 4 hosts; a v5e 2x4
    is one 8-chip VM. JAX's device_kind and GKE's accelerator label find the same catalogue entry."""
    v6e = tpu_slice("v6e", "4x4")
    assert (v6e.chips, v6e.hosts, v6e.chips_per_host, v6e.machine_type) == (16, 4, 4, "ct6e-standard-4t")
    v5p = tpu_slice("v5p", "2x2x4")
    assert (v5p.chips, v5p.hosts, v5p.machine_type) == (16, 4, "ct5p-hightpu-4t")
    assert (tpu_slice("v5e", "2x4").hosts, tpu_slice("v5e", "2x4").machine_type) == (1, "ct5lp-hightpu-8t")
    for name, key in [("TPU v6 lite", "v6e"), ("tpu-v6e-slice", "v6e"), ("TPU v5 lite", "v5e"),
                      ("tpu-v5-lite-podslice", "v5e"), ("TPU v5", "v5p"), ("tpu-v5p-slice", "v5p")]:
        assert match_device(name).key == key, name
    assert ray_head_resource(v6e) == "TPU-v6e-16-head" and ray_head_resource(v5p) == "TPU-v5p-32-head"


def _objects(target: str, *sets: str, tmp_path: Path) -> list[dict]:
    return render(spec(*sets), target, out=tmp_path).objects


def test_jobset_multislice_validates_strictly_and_runs_maxtext(tmp_path):
    objs = _objects("jobset", tmp_path=tmp_path)
    validate_all(objs)
    js = next(o for o in objs if o["kind"] == "JobSet")
    assert js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-v6e"
    rj = js["spec"]["replicatedJobs"][0]
    assert rj["replicas"] == 2 and rj["template"]["spec"]["parallelism"] == 4
    pod = rj["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    c = pod["containers"][0]
    assert c["resources"]["limits"]["google.com/tpu"] == "4"
    env = {e["name"]: e for e in c["env"]}
    assert {"MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"} <= set(env)
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"].startswith(f"{js['metadata']['name']}-slice-0-0.")
    assert c["command"][:3] == ["python3", "-m", "maxtext.trainers.pre_train.train"]
    assert "dcn_data_parallelism=2" in c["command"]
    assert any(v.get("csi", {}).get("driver") == "gcsfuse.csi.storage.gke.io" for v in pod["volumes"])
    rules = {r["name"]: r["action"] for r in js["spec"]["failurePolicy"]["rules"]}
    assert rules == {"bad-input": "FailJobSet", "preempted": "RestartJobSetAndIgnoreMaxRestarts"}


def test_flex_start_jobset_carries_the_dws_annotation(tmp_path):
    objs = _objects("jobset", "cost.provisioning=dws-flex-start", "launch.kubernetes.max_run_seconds=86400",
                    tmp_path=tmp_path)
    validate_all(objs)
    js = next(o for o in objs if o["kind"] == "JobSet")
    assert js["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "86400"
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "cloud.google.com/gke-spot" not in pod["nodeSelector"]


def test_rayjob_has_one_tpu_group_of_slices_and_validates_strictly(tmp_path):
    objs = _objects("rayjob", "launch.tpu.min_slices=1", tmp_path=tmp_path)
    validate_all(objs)
    rayjob = next(o for o in objs if o["kind"] == "RayJob")
    cluster = rayjob["spec"]["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (2, 1, 2, 4)
    assert cluster["enableInTreeAutoscaling"] is True
    worker = group["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert worker["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert "nodeSelector" not in cluster["headGroupSpec"]["template"]["spec"]
    entry = rayjob["spec"]["entrypoint"]
    assert "shardline.engines.tpu.ray_driver" in entry and "TPU-v6e-16-head" in entry
    assert "dcn_data_parallelism=1" in entry and "dcn_data_parallelism=2" in entry  # one command per slice count


def test_other_kubernetes_targets_refuse_maxtext(tmp_path):
    with pytest.raises(SpecError) as e:
        render(spec(), "k8s-job")
    assert e.value.field == "--target" and "jobset" in e.value.fix


@pytest.mark.parametrize("target", ["local", "slurm", "ray", "vertex"])
def test_torch_targets_refuse_a_maxtext_spec_by_its_field(target, tmp_path):
    with pytest.raises(SpecError) as e:
        render(spec(f"run.dir={tmp_path}"), target)
    assert e.value.field == "train.engine" and "jobset or rayjob" in e.value.fix


def test_plan_and_cost_answer_for_tpu_chips():
    planned = plan(spec())
    assert planned.device.kind == "tpu" and planned.device.name.startswith("TPU v6e")
    assert planned.fits and planned.memory.dp_shard == 16
    assert planned.memory.capacity_bytes - planned.memory.total_bytes >= 0.1 * planned.memory.capacity_bytes
    # 8.03B params: fp32 weights + grads + 2 moments = 16 B/param over 16 chips ≈ 7.5 GiB per chip
    state = planned.memory.params + planned.memory.grads + planned.memory.optimizer
    assert 7.0 < state / 2**30 < 8.0
    p = project_cost(spec(), "TPU v6e 32GB", 1.0, "test")
    assert p.devices == 32 and p.price.usd_per_device_hour == 1.35  # spot row of hardware.py
    assert p.by_provisioning["on-demand"] == pytest.approx(2000 * 32 / 3600 * 2.70)


def test_status_names_tpu_capacity_and_quota():
    pending = {"metadata": {"name": "p0", "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
               "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                          "message": "0/3 nodes are available: 3 Insufficient google.com/tpu."}]}}
    state = explain({"status": {}}, [pending], None, 1)
    assert any("no TPU node pool" in r for r in state.reasons)
    wl = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False",
                                     "message": "couldn't assign flavors: insufficient quota for google.com/tpu"}]}}
    assert any(re.search("TPU quota", r) for r in kueue_reasons(wl))


def test_status_tells_apart_the_hosts_of_every_slice():
    """Each slice's Job numbers its pods from 0 (completion index), so the node rank also needs the Job's index:
    the labels JobSet puts on every pod (kubernetes-sigs/jobset api: `jobset.sigs.k8s.io/job-index`,
    `jobset.sigs.k8s.io/replicatedjob-replicas`)."""
    s = spec()
    hosts = s.launch.nnodes // s.launch.tpu.slices
    pods = [{"metadata": {"name": f"mt-slice-{job}-{host}", "creationTimestamp": "2026-11-25T00:00:00Z",
                          "annotations": {"batch.kubernetes.io/job-completion-index": str(host)},
                          "labels": {"jobset.sigs.k8s.io/job-index": str(job),
                                     "jobset.sigs.k8s.io/replicatedjob-replicas": str(s.launch.tpu.slices)}},
             "status": {"phase": "Running"}}
            for job in range(s.launch.tpu.slices) for host in range(hosts)]
    state = explain({"status": {}}, pods, None, s.launch.nnodes)
    assert [r.rank for r in state.ranks] == list(range(s.launch.nnodes)) and state.phase == "running"
    assert state.ranks[hosts].name == "mt-slice-1-0"
