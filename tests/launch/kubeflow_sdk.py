"""The Kubeflow SDK as the tests use it: scripts/setup installs it into .kubeflow-sdk/ (not .venv: it pins
kubernetes<36), and a test module that imports this one has it on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parents[2] / ".kubeflow-sdk"

if not (SDK_DIR / "kubeflow" / "trainer").is_dir():
    raise RuntimeError(f"the Kubeflow SDK is not installed in {SDK_DIR}: run ./scripts/setup")
if str(SDK_DIR) not in sys.path:
    sys.path.insert(0, str(SDK_DIR))
