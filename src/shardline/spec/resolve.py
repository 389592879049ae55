"""Spec resolution: preset or YAML file → `--set` overrides → derived defaults → validated `JobSpec`."""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import typing
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from shardline.errors import SpecError
from shardline.spec import JobSpec

DEFAULT_PRESET = "tiny"


def preset_names() -> list[str]:
    files = resources.files("shardline.presets").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def _read_source(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpecError(source, "spec file not found", f"give a YAML path or a preset: {preset_names()}")
        text = path.read_text()
    elif source in preset_names():
        text = resources.files("shardline.presets").joinpath(f"{source}.yaml").read_text()
    else:
        raise SpecError(source, "neither a spec file nor a preset", f"presets: {', '.join(preset_names())}")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise SpecError(source, f"invalid YAML ({e})", "fix the YAML syntax") from e
    if not isinstance(data, dict):
        raise SpecError(source, "the spec must be a mapping of sections", "start with e.g. 'train:'")
    return data


def source_data(source: str | None) -> dict[str, Any]:
    """A spec's own data before overrides and defaults: a preset, a YAML file, or a run directory's spec.yaml."""
    if source is not None and Path(source).is_dir():
        source = str(Path(source) / "spec.yaml")
    return _read_source(source or DEFAULT_PRESET)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one Helm-style `a.b.c=value` override in place; the value is parsed as a YAML scalar."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SpecError(f"--set {assignment}", "expected KEY=VALUE", "write e.g. --set train.lr=2e-5")
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as e:
        raise SpecError(f"--set {assignment}", f"value is not valid YAML ({e})", "quote the value") from e
    set_field(data, key, value)


def set_field(data: dict[str, Any], key: str, value: object) -> None:
    """Set the dotted field `key` (e.g. `train.lr`) to `value` in place, creating sections on the way."""
    node = data
    parts = key.split(".")
    if not all(parts):
        raise SpecError(key, "is not a dotted field name", "write e.g. train.lr")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(key, f"'{part}' is a value, not a section", "override a leaf field")
        node = child
    node[parts[-1]] = value


GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""Device files of a GPU driver (NVIDIA, ROCm, WSL): without any, CUDA cannot be available and torch is not asked."""


def _default_nproc() -> int:
    """The machine's GPUs, or 2 CPU processes; torch (seconds of imports) only where a GPU driver's files exist."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _validation_to_spec_error(err: ValidationError, data: dict[str, Any]) -> SpecError:
    first = err.errors()[0]
    path = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        section = ".".join(str(p) for p in first["loc"][:-1])
        fields = _known_fields(section)
        close = difflib.get_close_matches(str(first["loc"][-1]), fields, n=1, cutoff=0.6)
        hint = f"did you mean {section + '.' if section else ''}{close[0]}? " if close else ""
        return SpecError(path, "unknown field",
                         f"{hint}remove it; fields of '{section or 'spec'}': {', '.join(fields)}")
    value = first.get("input")
    if isinstance(value, dict):
        value = "{...}"
    if kind == "value_error" and isinstance(first.get("ctx", {}).get("error"), SpecError):
        return first["ctx"]["error"]
    return SpecError(path, f"invalid value {value!r}: {first['msg']}", "see `shardline config show` for types")


def _known_fields(section: str) -> list[str]:
    model: Any = JobSpec
    for part in filter(None, section.split(".")):
        if part.isdigit():  # an entry of a list of sections (data.sources.0)
            continue
        model = model.model_fields[part].annotation
        while not hasattr(model, "model_fields"):  # list[Section], Section | None
            model = next(a for a in typing.get_args(model) if a is not type(None))
    return list(model.model_fields)


def load_spec(source: str | None = None, overrides: list[str] | None = None,
              values: Mapping[str, object] | None = None) -> JobSpec:
    """Resolve a spec from a preset name or YAML path plus `--set` overrides, then typed `values` by dotted
    field (the Python API's); raises `SpecError`."""
    return resolve_data(_read_source(source or DEFAULT_PRESET), overrides, values)


def resolve_data(data: dict[str, Any], overrides: list[str] | None = None,
                 values: Mapping[str, object] | None = None) -> JobSpec:
    """Validate spec data after applying overrides: the one path every spec takes."""
    for assignment in overrides or []:
        apply_override(data, assignment)
    for key, value in (values or {}).items():
        set_field(data, key, value)
    parallel = data.setdefault("parallel", {})
    if isinstance(parallel, dict) and parallel.get("nproc_per_node") is None:
        parallel["nproc_per_node"] = _default_nproc()
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise _validation_to_spec_error(e, data) from None


def read_spec_file(path: str, text: str) -> JobSpec:
    """A resolved spec written by shardline (a run's or a checkpoint's `spec.yaml`); a bad field is a SpecError
    naming the field and the file."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(path, f"is not YAML ({e})", "restore the file or start a new run") from None
    if not isinstance(data, dict):
        raise SpecError(path, "is not a spec (not a mapping)", "restore the file or start a new run")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        error = _validation_to_spec_error(e, data)
        raise SpecError(error.where, f"{error.problem} (in {path})",
                        f"{error.fix}; a file written by another shardline version needs that version") from None


def spec_to_yaml(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


def spec_hash(spec: JobSpec) -> str:
    """sha256 of the canonical JSON of the resolved spec, without the run identity."""
    data = spec.model_dump(mode="json")
    data["run"].pop("id", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
