"""The fault matrix prints what each fault does and what it keeps, after the tests ran."""

from __future__ import annotations

MATRIX: list[tuple[str, str, str]] = []
"""(case, what happens, what is kept), appended by each fault test once its assertions passed."""


def pytest_terminal_summary(terminalreporter) -> None:
    if not MATRIX:
        return
    terminalreporter.section("fault-injection matrix")
    terminalreporter.write_line("| fault | what happens | what is kept |")
    terminalreporter.write_line("|---|---|---|")
    for case, happens, kept in MATRIX:
        terminalreporter.write_line(f"| {case} | {happens} | {kept} |")
