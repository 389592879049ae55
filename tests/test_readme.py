"""The README's first screen says what shardline is and shows what a user writes, runs and sees; its two commands
are the ones CI runs; its spec is a real, valid spec."""

import re
from pathlib import Path

from shardline import api
from shardline.spec.resolve import load_spec

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:60])
COMMANDS = ["./scripts/setup && .venv/bin/shardline train", "./scripts/setup && .venv/bin/python -m pytest"]


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_the_readme_starts_with_a_tagline_and_exactly_the_two_setup_commands():
    lines = README.splitlines()
    assert lines[0] == "# shardline" and "one job spec" in lines[2]
    first = _blocks("bash")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == COMMANDS
    assert README.index("```bash") < 200  # the commands come before anything else


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci/run").read_text()
    assert COMMANDS[1] in ci


def test_the_first_screen_holds_a_spec_the_launch_command_what_the_default_prints_and_where_to_read(tmp_path):
    [spec_text] = _blocks("yaml", FIRST_SCREEN)
    assert 10 <= len(spec_text.splitlines()) <= 20
    spec_file = tmp_path / "sft.yaml"
    spec_file.write_text(spec_text)
    spec = load_spec(str(spec_file))  # a real spec: unknown keys or bad values fail here
    assert spec.model.lora.enabled and spec.parallel.nproc_per_node == 8 and spec.data.path
    [jobset] = [o for o in api.render(spec, "jobset").objects if o["kind"] == "JobSet"]
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == spec.launch.kubernetes.queue
    assert re.search(r"shardline launch sft\.yaml --target \w+", FIRST_SCREEN)
    excerpt = FIRST_SCREEN.split("## What the default run prints when it ends", 1)[1]
    assert "execution accuracy" in excerpt and "@@" not in excerpt
    linked = re.findall(r"\[(src/shardline/[\w/]+\.py)\]", FIRST_SCREEN)
    assert len(linked) == 5 and all((ROOT / path).is_file() for path in linked)


def test_no_readme_line_is_a_wall():
    long = [line[:60] for line in README.splitlines() if len(line) > 400]
    assert long == []


def test_the_license_is_apache_2_and_pyproject_says_so():
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
