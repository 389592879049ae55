"""shardline's Kubeflow Trainer runtime validates strictly (pinned CRDs, kubeflow-trainer-api models), the SDK's
own Kubernetes-backend code reads it as a torch runtime and builds from it a TrainJob that carries the spec, and
`cluster bootstrap --trainer-runtime` writes it; `--target trainjob` references it by default."""

from __future__ import annotations

import base64
import re

import pytest
import yaml

import tests.launch.kubeflow_sdk  # noqa: F401 - the SDK on sys.path
from shardline.cli import main
from shardline.engines.kubeflow_sdk import trainer_arguments
from shardline.engines.kubernetes.objects import render_objects
from shardline.engines.kubernetes.runtime import training_runtime
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec, spec_to_yaml
from tests.k8s_schemas import validate

DIGEST = "sha256:" + "ab" * 32
GPU = ["launch.image=ghcr.io/acme/shardline:1", f"launch.image_digest={DIGEST}", "observe.metrics_port=9405",
       "launch.profile=a3-ultra", "parallel.nproc_per_node=8", "train.global_batch_size=64",
       "launch.kubernetes.gpu_resource=nvidia.com/gpu", "launch.kubernetes.storage.kind=gcsfuse",
       "launch.kubernetes.storage.bucket=acme-runs", "run.id=sdk-run"]


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_runtime_validates_against_the_pinned_crds_and_the_trainer_api_models(scope):
    from kubeflow_trainer_api import models

    rt = training_runtime(load_spec("tiny", GPU), scope)
    validate(rt)
    model = {"cluster": models.TrainerV1alpha1ClusterTrainingRuntime,
             "namespaced": models.TrainerV1alpha1TrainingRuntime}
    assert model[scope].from_dict(rt).to_dict() == rt  # nothing the model does not know
    node = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    container = node["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/acme/shardline@{DIGEST}"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9405, "protocol": "TCP"}]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]  # RDMA
    assert "networking.gke.io/interfaces" in node["metadata"]["annotations"]
    assert "gke-gcsfuse/volumes" in node["metadata"]["annotations"]
    rules = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules[:2]] == ["FailJob", "Ignore"] and rules[1]["onExitCodes"]["values"] == [75]


def test_runtime_refuses_an_image_without_a_digest():
    with pytest.raises(SpecError) as e:
        training_runtime(load_spec("tiny", [g for g in GPU if "digest" not in g]))
    assert e.value.where == "launch.image_digest"


def test_the_sdks_kubernetes_backend_builds_a_valid_trainjob_that_carries_the_spec():
    from kubeflow.trainer import CustomTrainer
    from kubeflow.trainer.backends.kubernetes import utils
    from kubeflow.trainer.types import types
    from kubeflow_trainer_api import models

    spec = load_spec("tiny", GPU)
    cr = models.TrainerV1alpha1ClusterTrainingRuntime.from_dict(training_runtime(spec))
    runtime = types.Runtime(name=cr.metadata.name, kind=types.RuntimeKind(cr.kind), trainer=utils.get_runtime_trainer(
        cr.metadata.labels["trainer.kubeflow.org/framework"], cr.spec.template.spec.replicated_jobs, cr.spec.ml_policy))
    assert runtime.trainer.framework == "torch" and runtime.trainer.device_count == "8"
    trainer = utils.get_trainer_cr_from_custom_trainer(runtime, CustomTrainer(**trainer_arguments(spec)))
    tj = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
          "metadata": {"name": "sdk-run", "namespace": "default"},
          "spec": {"runtimeRef": {"name": "shardline", "kind": "ClusterTrainingRuntime"}, "trainer": trainer.to_dict()}}
    validate(tj)
    script = tj["spec"]["trainer"]["command"][-1]
    assert "torchrun" in script and "def shardline_train" in script
    encoded = re.search(r"shardline_train\(\*\*\{'spec_b64': '([A-Za-z0-9+/=]+)'\}\)", script).group(1)
    assert yaml.safe_load(base64.b64decode(encoded))["run"]["id"] == "sdk-run"
    assert base64.b64decode(encoded).decode() == spec_to_yaml(
        spec.model_copy(update={"observe": spec.observe.model_copy(update={"metrics_host": "0.0.0.0"})}))
    assert tj["spec"]["trainer"]["image"] == f"ghcr.io/acme/shardline@{DIGEST}"


def test_trainjob_target_references_shardlines_runtime_by_default():
    tj = render_objects(load_spec("tiny", GPU), "trainjob")[-1]
    assert tj["spec"]["runtimeRef"] == {"name": "shardline"}


def test_cluster_bootstrap_writes_the_runtime(tmp_path):
    assert main(["cluster", "bootstrap", "tiny", *[a for g in GPU for a in ("--set", g)], "--trainer-runtime",
                 "cluster", "--out", str(tmp_path)]) == 0
    docs = list(yaml.safe_load_all((tmp_path / "bootstrap.yaml").read_text()))
    assert docs[-1]["kind"] == "ClusterTrainingRuntime" and docs[-1]["metadata"]["name"] == "shardline"
    validate(docs[-1])
