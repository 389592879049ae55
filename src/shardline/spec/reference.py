"""The job spec's field reference (docs/spec.md), generated from the typed sections so that it cannot drift.

`python -m shardline.spec.reference docs/spec.md` rewrites the block between the markers; tests/test_spec_docs.py
fails when the file is stale.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from shardline.spec.job import JobSpec

BEGIN = "<!-- BEGIN generated field reference: python -m shardline.spec.reference docs/spec.md -->"
END = "<!-- END generated field reference -->"


def _section_type(annotation: object) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_name(annotation: object) -> str:
    """`int | null`, `sdpa | flash_attention_2 | eager`, `list[str]`: a field's type as a spec author reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(prefix: str, model: type[BaseModel], out: list[str]) -> None:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            nested.append((f"{prefix}.{name}", sub))
            continue
        element = _section_type(next(iter(typing.get_args(field.annotation)), None))
        if element is not None:  # a list of sections (data.sources, tolerations): its rows follow as their own table
            nested.append((f"{prefix}.{name}[]", element))
        rows.append(f"| `{name}` | {_cell(type_name(field.annotation))} | `{_cell(default_text(field))}` "
                    f"| {_cell(field.description or '')} |")
    out += [f"### `{prefix}`", ""]
    if model.__doc__ and model.__doc__ != BaseModel.__doc__ and not model.__doc__.startswith(model.__name__ + "("):
        out += [" ".join(model.__doc__.split()), ""]
    out += ["| field | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    for sub_prefix, sub in nested:
        _section(sub_prefix, sub, out)


def render_reference() -> str:
    """Every field of the job spec, section by section: type, default and its docstring."""
    out: list[str] = [BEGIN, ""]
    for name, field in JobSpec.model_fields.items():
        _section(name, field.annotation, out)
    return "\n".join([*out, END])


def undocumented_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Leaf fields without a docstring (a nested section is documented by its own fields)."""
    missing = []
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            missing += undocumented_fields(sub, f"{prefix}{name}.")
        elif not field.description:
            missing.append(prefix + name)
        element = _section_type(next(iter(typing.get_args(field.annotation)), None))
        if element is not None:
            missing += undocumented_fields(element, f"{prefix}{name}[].")
    return missing


def with_reference(document: str) -> str:
    """`document` with the block between the markers replaced by the current reference."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the document has no generated block: add the lines {BEGIN!r} and {END!r}")
    return head + render_reference() + tail


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/spec.md")
    path.write_text(with_reference(path.read_text()))
    print(f"wrote the field reference to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
