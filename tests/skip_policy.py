"""No silent skips: under `CI=true` (or `SHARDLINE_NO_SKIPS=1` locally) a skip is a failure unless a GPU caused it.

The README calls Slurm, Ray, network namespaces, Prometheus and Chromium "tested on every commit on CPU"; a test of
them that skips because a daemon, `promtool`, root or a package is missing would let a commit pass untested. So in
strict mode every skip of a test without a GPU marker becomes a failure (a skip in setup,
e.g. a `skipif` mark or a fixture's `pytest.skip`, is reported as an error) that names what is missing. A skip of a
whole module at collection fails the session at its end (it is listed in the summary) instead of stopping it.

GPU-only means the test carries one of the GPU markers (tests/tiers.py: `needs_gpu`, `without_gpu` put them there
with the skip):
- `gpu` — the test measures something only a GPU has (kernels, device sync, NCCL);
- `no_gpu` — the CPU-side counterpart (what happens without a GPU / without flash-attn), which cannot happen on a
  GPU machine.
The reason string does not decide: a `pytest.skip("needs a CUDA GPU")` in an unmarked test is a gap. Any other skip
(a tool, a package, root, a daemon) is a gap in the machine: scripts/setup installs what the tests need
(scripts/apt-packages.txt, the `test` extra). Registered by tests/conftest.py; usable alone as
`pytest -p tests.skip_policy`.
"""

from __future__ import annotations

import os

import pytest

GPU_MARKERS = ("gpu", "no_gpu")
SWITCHES = "CI=true or SHARDLINE_NO_SKIPS=1"
_SKIPS: dict[str, tuple[str, bool]] = {}  # nodeid -> (reason, GPU-only)
_MODULE_SKIPS: dict[str, str] = {}  # collected file -> reason; strict mode fails the session for these


def strict() -> bool:
    """Whether a non-GPU skip fails: on CI (`CI=true`, as .ci/run sets it) or when asked locally."""
    return os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("SHARDLINE_NO_SKIPS") == "1"


def gpu_only(item) -> bool:
    return any(item.get_closest_marker(name) for name in GPU_MARKERS)


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure(reason: str) -> str:
    return (f"skipped ({reason}); under {SWITCHES} only GPU-only skips may (tests marked "
            f"{' or '.join(map(repr, GPU_MARKERS))}: tests/tiers.py needs_gpu / without_gpu)\n"
            "install what is missing (./scripts/setup: scripts/apt-packages.txt as root, the `test` extra) "
            "or run without the switch")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        _SKIPS[report.nodeid] = (reason, gpu_only(item))
        if strict() and not gpu_only(item):
            report.outcome, report.longrepr = "failed", _failure(reason)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped:  # a module-level skip or importorskip: its tests were never collected, so nothing marks
        _MODULE_SKIPS[report.nodeid] = _reason(report)  # them GPU-only
    return report


def pytest_sessionfinish(session, exitstatus):
    if strict() and _MODULE_SKIPS and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    """One line when every skip was a GPU's doing; otherwise each other skip with its reason."""
    other = {n: r for n, (r, gpu) in _SKIPS.items() if not gpu}
    gpu = len(_SKIPS) - len(other)
    write = terminalreporter.write_line
    if not other and not _MODULE_SKIPS:
        write(f"{gpu} tests skipped, all GPU-only" if gpu else "0 tests skipped")
        return
    verdict = "reported as failures" if strict() else f"skips here, failures under {SWITCHES}"
    terminalreporter.section("skips that are not GPU-only")
    write(f"{len(_SKIPS)} tests skipped: {gpu} GPU-only, {len(other)} not GPU-only ({verdict}); "
          f"{len(_MODULE_SKIPS)} files skipped at collection")
    for nodeid, reason in {**_MODULE_SKIPS, **other}.items():
        write(f"  {nodeid}: {reason}")
