"""The skip policy (tests/skip_policy.py) on a tiny suite of its own: under CI=true or SHARDLINE_NO_SKIPS=1 a skip
for a missing tool, package or privilege fails and names what is missing; a GPU-only skip still skips."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SUITE = '''
import pytest

@pytest.mark.gpu
def test_gpu_kernel():
    pytest.skip("needs a CUDA GPU: which kernel runs")

@pytest.mark.no_gpu
@pytest.mark.skipif(True, reason="this machine has a GPU")
def test_the_no_gpu_path():
    pass

def test_unmarked_gpu_words():
    pytest.skip("needs a CUDA GPU, it says")

@pytest.mark.skipif(True, reason="needs root and network namespaces")
def test_netns():
    pass

@pytest.fixture(scope="module")
def daemon():
    pytest.skip("Debian package prometheus (scripts/apt-packages.txt)")

def test_scrape(daemon):
    pass

def test_runs():
    pass
'''


def _pytest(tmp_path: Path, env: dict[str, str], *files: str) -> subprocess.CompletedProcess:
    # not the repository's config (addopts, its conftest); the GPU markers registered as tests/tiers.py does
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu\n    no_gpu\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("CI", "SHARDLINE_NO_SKIPS")}, **env,
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skip_policy", "-p", "no:cacheprovider",
                           "-q", "-ra", *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def suite(tmp_path) -> Path:
    (tmp_path / "test_tiny.py").write_text(SUITE)
    return tmp_path


def test_without_the_switch_skips_skip_and_the_summary_names_the_ones_that_are_not_gpu_only(suite):
    out = _pytest(suite, {})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 5 skipped" in out.stdout
    assert "5 tests skipped: 2 GPU-only, 3 not GPU-only (skips here, failures under CI=true or SHARDLINE_NO_SKIPS=1)" \
        in out.stdout
    assert "test_tiny.py::test_netns: needs root and network namespaces" in out.stdout
    assert "test_tiny.py::test_scrape: Debian package prometheus (scripts/apt-packages.txt)" in out.stdout


@pytest.mark.parametrize("switch", [{"CI": "true"}, {"SHARDLINE_NO_SKIPS": "1"}], ids=["CI", "local"])
def test_under_ci_a_skip_that_is_not_gpu_only_fails_naming_what_is_missing(suite, switch):
    out = _pytest(suite, switch)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed, 2 skipped, 2 errors" in out.stdout  # two skips in setup (a mark, a fixture)
    # the markers decide, not the words: a GPU-sounding reason on an unmarked test is a gap
    assert "FAILED test_tiny.py::test_unmarked_gpu_words" in out.stdout
    for test, missing in (("test_netns", "needs root and network namespaces"),
                          ("test_scrape", "Debian package prometheus")):
        assert f"ERROR test_tiny.py::{test}" in out.stdout
        assert f"ERROR test_tiny.py::{test} - skipped ({missing}" in out.stdout
    assert "only GPU-only skips may (tests marked 'gpu' or 'no_gpu'" in out.stdout
    assert "5 tests skipped: 2 GPU-only, 3 not GPU-only (reported as failures)" in out.stdout
    assert "SKIPPED [1] test_tiny.py:6: needs a CUDA GPU: which kernel runs" in out.stdout


def test_under_ci_a_skip_inside_a_test_fails_it_and_only_gpu_skips_give_the_one_line_summary(tmp_path):
    (tmp_path / "test_call.py").write_text("import pytest\n\ndef test_tool():\n    pytest.skip('promtool missing')\n")
    (tmp_path / "test_gpu.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n"
                                          "    pytest.skip('needs a CUDA GPU')\n")
    out = _pytest(tmp_path, {"CI": "true"}, "test_call.py")
    assert out.returncode == 1 and "FAILED test_call.py::test_tool" in out.stdout, out.stdout
    assert "promtool missing" in out.stdout
    out = _pytest(tmp_path, {"CI": "true"}, "test_gpu.py")
    assert out.returncode == 0 and "1 tests skipped, all GPU-only" in out.stdout, out.stdout


def test_under_ci_a_module_skipped_at_collection_fails_the_run_and_is_named(tmp_path):
    """`pytest.importorskip` at module level hides a whole file; the run goes on and fails at its end."""
    (tmp_path / "test_module.py").write_text("import pytest\n\npytest.importorskip('no_such_package_xyz')\n")
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    out = _pytest(tmp_path, {"CI": "true"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout and "1 files skipped at collection" in out.stdout
    assert "test_module.py: could not import 'no_such_package_xyz'" in out.stdout
    assert _pytest(tmp_path, {}).returncode == 0
