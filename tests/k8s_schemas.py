"""Validate rendered Kubernetes objects offline, strictly.

Built-in kinds: `kubernetes-validate` against the Kubernetes 1.31 OpenAPI schemas, strict (unknown fields fail).
Custom resources: the upstream CRD's `openAPIV3Schema` from tests/crds (pinned upstream copies;
repository, commit and path in SOURCES.txt),
with `additionalProperties: false` added wherever the schema lists properties and does not preserve unknown
fields — the API server prunes/rejects those, so a typo in a field name must fail here too.
CEL rules and admission webhooks (e.g. Trainer's reserved PET_* check) are not enforced offline.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

CRD_DIR = Path(__file__).resolve().parent / "crds"
KUBERNETES_VERSION = "1.31.0"
BUILTIN_GROUPS = {"v1", "apps/v1", "batch/v1", "rbac.authorization.k8s.io/v1", "policy/v1",
                  "scheduling.k8s.io/v1", "networking.k8s.io/v1", "storage.k8s.io/v1"}


def _strict(schema: dict) -> dict:
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            if isinstance(node.get("pattern"), str) and "(?i)" in node["pattern"]:
                node["pattern"] = "(?i)" + node["pattern"].replace("(?i)", "")  # Go allows inline flags anywhere
            if node.get("x-kubernetes-int-or-string"):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    # metadata is validated by the API server's ObjectMeta, not the CRD schema
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return schema


def load_crd(name: str) -> dict:
    """The pinned CRD `tests/crds/<name>.yaml`, parsed by libyaml (pure-Python YAML spends ~10 s on the 5 MB of
    pinned CRDs, libyaml ~1 s); a fresh object on each call."""
    return yaml.load((CRD_DIR / f"{name}.yaml").read_text(), Loader=yaml.CSafeLoader)


@cache
def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for f in sorted(CRD_DIR.glob("*.yaml")):
        crd = load_crd(f.stem)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return out


def validate(obj: dict) -> None:
    """Raise if `obj` is not a valid object of its kind (built-in or one of the pinned CRDs)."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    if api_version in BUILTIN_GROUPS:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    schema = _crd_schemas().get((api_version, kind))
    if schema is None:
        raise AssertionError(f"no schema for {api_version} {kind}: add its pinned CRD to tests/crds (and SOURCES.txt)")
    jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)


def validate_all(objs: list[dict]) -> None:
    for obj in objs:
        validate(obj)
