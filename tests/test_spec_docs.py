"""The spec's documentation cannot drift: docs/spec.md's field reference is generated, the README names every preset."""

import re
from pathlib import Path

from shardline.spec.reference import undocumented_fields, with_reference
from shardline.spec.resolve import preset_names

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_of_the_spec_has_a_docstring():
    assert undocumented_fields() == []


def test_docs_spec_md_holds_the_current_field_reference():
    document = (ROOT / "docs/spec.md").read_text()
    assert document == with_reference(document), "stale: run python -m shardline.spec.reference docs/spec.md"
    for section, field in (("parallel", "tp"), ("parallel", "cp"), ("parallel", "async_tp"),
                           ("checkpoint", "resume_from"), ("launch", "image"), ("observe", "profile_steps")):
        table = document.split(f"### `{section}`\n")[1].split("### ")[0]
        assert f"| `{field}` |" in table
    for section in ("launch.kubernetes", "launch.kubernetes.storage", "launch.vertex", "data.sources[]"):
        assert f"### `{section}`" in document


def test_the_readme_names_every_preset_and_only_presets():
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("`SPEC` is a preset name"):].split("or a YAML")[0]
    named = set(re.findall(r"`([a-z0-9.-]+)`", paragraph))
    assert named == set(preset_names())
