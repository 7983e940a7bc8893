#!/usr/bin/env bash
# Create (idempotently) a separate venv with Holistic Trace Analysis for the peer benchmark.
# Usage: bash tests/benchmarks/hta_env.sh   -> prints the venv's python path on the last line.
# pandas<3: some HTA analyses crash under pandas 3.
set -euo pipefail
VENV="${HTA_VENV:-/tmp/steplens-hta-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import hta, pandas, psutil' 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet HolisticTraceAnalysis 'pandas<3' psutil
fi
"$VENV/bin/python" - <<'PY' >&2
from importlib.metadata import version
print("HolisticTraceAnalysis", version("HolisticTraceAnalysis"), "| pandas", version("pandas"))
PY
echo "$VENV/bin/python"
