"""Nothing the launcher renders is dropped by an API server that does not know it (issue 19, item 6): the Trainer
version is read off the TrainJob CRD before creating, and every create of every target asks for strict field
validation. The real `kubernetes` client against tests/launch/k8s_apiserver.py, which serves the pinned CRDs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardline.engines.kubernetes.api import ClusterApi
from shardline.engines.kubernetes.trainer_api import trainer_version
from shardline.engines.registry import get_backend
from shardline.errors import ClusterError
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import load_crd
from tests.launch.k8s_apiserver import CRD_PATH, ApiServerStub, forbidden, kubeconfig

NAME, NS = "strict-20261122-000000", "ml"
SPEC = load_spec("tiny", [f"run.id={NAME}", "launch.image=registry.example/shardline:1", "launch.nnodes=1",
                          f"launch.kubernetes.namespace={NS}"])
TRAINJOBS = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"


def trainjob_crd(release: str) -> dict:
    """The pinned TrainJob CRD (kubeflow/trainer manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml, a 2.3+
    release) reshaped as an older release served it: 2.2 had runtimePatches without a grace period in the pod
    patch, 2.1 `podTemplateOverrides`, 2.0 `podSpecOverrides` (kubeflow/trainer CHANGELOG.md)."""
    crd = load_crd("trainer.kubeflow.org_trainjobs")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    if release == "2.2":
        node = spec["runtimePatches"]["items"]
        for key in ("trainingRuntimeSpec", "template", "spec", "replicatedJobs", "template", "spec", "template",
                    "spec"):
            node = node["properties"][key]
            node = node.get("items", node)
        del node["properties"]["terminationGracePeriodSeconds"]
    elif release in ("2.1", "2.0"):
        spec["podTemplateOverrides" if release == "2.1" else "podSpecOverrides"] = spec.pop("runtimePatches")
    return crd


def _submit(stub: ApiServerStub, target: str, tmp_path: Path, spec=SPEC):
    config = kubeconfig(tmp_path / "config", stub.url)
    backend = get_backend(target)
    backend._api_factory = lambda ctx: ClusterApi(ctx, config_file=str(config))
    return backend.submit(spec)


@pytest.mark.parametrize("release", ["2.3", "2.2", "2.1", "2.0"])
def test_the_trainer_release_is_read_off_the_served_crd(release):
    """kubeflow/trainer: runtimePatches (2.2), a grace period in the patch (2.3), podTemplateOverrides (2.1),
    podSpecOverrides (2.0)."""
    assert trainer_version(trainjob_crd(release)) == release


@pytest.mark.parametrize("release, named", [("2.2", "terminationGracePeriodSeconds"),
                                            ("2.1", "podTemplateOverrides"), ("2.0", "podSpecOverrides")])
def test_an_older_trainer_is_refused_by_name_before_anything_is_created(tmp_path, release, named):
    """On Trainer < 2.3 the API server would drop runtimePatches (or the grace period) and the pods would lose the
    spec ConfigMap, selectors and NICs: the launch stops first, creating nothing."""
    with ApiServerStub(crds=[trainjob_crd(release)]) as stub, pytest.raises(ClusterError) as e:
        _submit(stub, "trainjob", tmp_path)
    assert f"Kubeflow Trainer is {release}" in e.value.problem and named in e.value.problem
    assert "2.3" in e.value.fix and "--target jobset" in e.value.fix
    assert [m for m, _ in stub.requests] == ["GET"]


def test_a_cluster_without_trainer_is_told_to_install_it(tmp_path):
    with ApiServerStub() as stub, pytest.raises(ClusterError) as e:
        _submit(stub, "trainjob", tmp_path)
    assert "not installed" in e.value.problem and [m for m, _ in stub.requests] == ["GET"]


def test_without_rbac_to_read_the_crd_the_strict_create_still_refuses_unknown_fields(tmp_path):
    """https://kubernetes.io/docs/reference/using-api/api-concepts/#field-validation: with fieldValidation=Strict
    the API server answers 400 for a field the schema lacks, where it would otherwise prune it silently (the stub
    does both, as kube-apiserver does for CRDs with structural schemas)."""
    answers = {("GET", f"{CRD_PATH}trainjobs.trainer.kubeflow.org"): forbidden(
        "get", "customresourcedefinitions", "apiextensions.k8s.io", "")}
    with ApiServerStub(answers, crds=[trainjob_crd("2.1")]) as stub:
        tj = get_backend("trainjob").render(SPEC)
        pruned = stub.create(next(o for o in yaml.safe_load_all(next(iter(tj.values()))) if o["kind"] == "TrainJob"),
                             {})[1]
        assert "runtimePatches" not in pruned["spec"]  # what a non-strict create would have stored
        with pytest.raises(ClusterError) as e:
            _submit(stub, "trainjob", tmp_path)
    assert "HTTP 400" in e.value.problem and 'unknown field "spec.runtimePatches"' in e.value.problem
    assert "removed what this launch had created before: ConfigMap" in e.value.problem


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob", "rayjob"])
def test_every_create_of_every_target_asks_for_strict_field_validation(tmp_path, target):
    """Every object of every target passes the served schemas strictly (the pinned JobSet, Trainer and KubeRay
    CRDs); no create goes without fieldValidation=Strict."""
    crds = [load_crd("jobset.x-k8s.io_jobsets"), load_crd("trainer.kubeflow.org_trainjobs"), load_crd("ray.io_rayjobs")]
    with ApiServerStub(crds=crds) as stub:
        record = _submit(stub, target, tmp_path)
    posts = [q for (method, _), q in zip(stub.requests, stub.queries, strict=True) if method == "POST"]
    assert len(posts) == len(record.objects) and all(q.get("fieldValidation") == ["Strict"] for q in posts)
    work = next(o for o in stub.stored if o["kind"] in ("Job", "JobSet", "TrainJob", "RayJob"))
    assert work["metadata"]["name"] == record.objects[-1]["name"]
