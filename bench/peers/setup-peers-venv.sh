#!/usr/bin/env bash
# The peer trainers' venv for bench/peers/*_contender.py (see FINDINGS.md), apart from shardline's .venv.
# torch first and pinned (the CPU wheel on disk, as scripts/setup does) so nothing below pulls a CUDA build;
# triton only because torchtitan 0.3.0 imports it unconditionally; torchao 0.11.0 because torchtune 0.6.1 does
# not import with torchao >= 0.12 (torchao.dtypes.nf4tensor moved).
set -euo pipefail
VENV="${1:-/tmp/peers-venv}"
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0" numpy "torchtitan==0.3.0" "triton==3.9.0"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0" "torchtune==0.6.1" "torchao==0.11.0"
"$VENV/bin/python" -c "import torch, torchtitan, torchtune; print(torch.__version__, torchtitan.__version__, torchtune.__version__)"
