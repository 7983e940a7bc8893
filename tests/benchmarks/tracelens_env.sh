#!/usr/bin/env bash
# Create (idempotently) a separate venv with AMD's TraceLens for the per-op cross-check, outside the project.
# TraceLens is not on PyPI under that name (PyPI's `tracelens` is another project): it is installed from a
# checkout of github.com/AMD-AGI/TraceLens, given as TRACELENS_SRC (a folder with setup.py), without its
# optional heavy dependencies (xprof, office365, msal: not used by the PyTorch perf model).
# Usage: TRACELENS_SRC=/path/to/TraceLens bash tests/benchmarks/tracelens_env.sh  -> the venv's python on the last line.
set -euo pipefail
VENV="${TRACELENS_VENV:-/tmp/steplens-tracelens-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import TraceLens, pandas' 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet pandas tqdm tabulate orjson pyyaml openpyxl
    "$VENV/bin/python" -m pip install --quiet --no-deps "${TRACELENS_SRC:?set TRACELENS_SRC to a TraceLens checkout}"
fi
echo "$VENV/bin/python"
