"""Which Kubeflow Trainer the cluster runs, read off the TrainJob CRD it serves, and a named error when it is too old.

A TrainJob carries the pod settings in `spec.runtimePatches` (Trainer 2.2; 2.0 had `podSpecOverrides`, 2.1
`podTemplateOverrides`) and the grace period in a patch's pod spec (Trainer 2.3). An older API server does not
know those fields: without strict field validation it drops them and the pods lose the spec ConfigMap, node
selectors and NICs. So the launcher reads the CRD's schema first and refuses a Trainer that cannot carry what
it renders; every create then asks for `fieldValidation=Strict` (engines/kubernetes/api.py), so nothing it
missed is dropped silently either.
"""

from __future__ import annotations

from shardline.errors import ClusterError

TRAINJOB_CRD = "trainjobs.trainer.kubeflow.org"
MIN_TRAINER = "2.3"


def _props(node: dict | None, *path: str) -> dict:
    """The `properties` at `path` below an openAPIV3Schema node (array items followed); {} where absent."""
    def items(n: dict | None) -> dict | None:
        while n and n.get("type") == "array":
            n = n.get("items")
        return n

    node = items(node)
    for key in path:
        node = items((node or {}).get("properties", {}).get(key))
    return (node or {}).get("properties", {})


def trainer_version(crd: dict, api_version: str = "v1alpha1") -> str:
    """The Trainer release line a TrainJob CRD belongs to: "2.0", "2.1", "2.2" or "2.3" (2.3 or later)."""
    version = next((v for v in crd.get("spec", {}).get("versions", []) if v.get("name") == api_version), None)
    if version is None:
        return "unknown"
    spec = _props(version.get("schema", {}).get("openAPIV3Schema"), "spec")
    if "runtimePatches" in spec:
        pod = _props(spec["runtimePatches"], "trainingRuntimeSpec", "template", "spec", "replicatedJobs", "template",
                     "spec", "template", "spec")
        return "2.3" if "terminationGracePeriodSeconds" in pod else "2.2"
    if "podTemplateOverrides" in spec:
        return "2.1"
    if "podSpecOverrides" in spec:
        return "2.0"
    return "unknown"


def check_trainer(crd: dict | None, where: str) -> None:
    """Refuse a cluster whose TrainJob CRD is missing (None) or older than MIN_TRAINER, naming what it found; an
    unreadable CRD ({}: no RBAC to read it) passes, and the strict create is the check."""
    if crd == {}:
        return
    if crd is None:
        raise ClusterError(where, f"the cluster has no {TRAINJOB_CRD} CRD: Kubeflow Trainer is not installed",
                           f"install Kubeflow Trainer {MIN_TRAINER} or later, or choose --target jobset or k8s-job")
    found = trainer_version(crd)
    if found == "unknown" or found < MIN_TRAINER:
        raise ClusterError(where, f"the cluster's Kubeflow Trainer is {found} (its TrainJob CRD has "
                           + {"2.0": "podSpecOverrides", "2.1": "podTemplateOverrides",
                              "2.2": "runtimePatches without terminationGracePeriodSeconds"}.get(found, "neither")
                           + f"), but the rendered TrainJob needs runtimePatches with a grace period: Trainer "
                           f"{MIN_TRAINER} or later", f"upgrade Kubeflow Trainer to {MIN_TRAINER} or later, or "
                           "launch with --target jobset or k8s-job (no Trainer needed)")
