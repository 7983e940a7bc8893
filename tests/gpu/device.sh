#!/usr/bin/env bash
# The GPU jobs of tests/gpu/gpu_check.py on a machine with one CUDA GPU and torch (DeepSpeed and the packages
# the machine lacks may sit as wheels in .whl/, from `gpu_check.py prepare`), their output packed into OUT_DIR.
# Then, anywhere steplens is installed: python tests/gpu/gpu_check.py check OUT_DIR. See tests/gpu/README.md.
set -euo pipefail
export PYTHONUNBUFFERED=1
out_dir="${1:?usage: bash tests/gpu/device.sh OUT_DIR}"
mkdir -p "$out_dir"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# steplens as a package without installing it: the repo's folders under the names pyproject maps them to.
mkdir -p /tmp/pkg/steplens
for part in analyze collect reports; do ln -sfn "$PWD/$part" "/tmp/pkg/steplens/$part"; done
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/pkg:$PWD
python3 -c "import torch, deepspeed; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'deepspeed', deepspeed.__version__)"
# Bounded, so that what the jobs wrote is packed even when they run long.
timeout "${STEPLENS_GPU_JOBS_S:-480}" python3 tests/gpu/gpu_check.py job /tmp/gpu_run || echo "jobs ended with status $?"
du -sh /tmp/gpu_run/*/traces 2>/dev/null || true
python3 - "$out_dir" <<'PY'
import sys
sys.path.insert(0, "tests/gpu")
from pathlib import Path
from gpu_check import pack
pack(Path("/tmp/gpu_run"), Path(sys.argv[1]))
PY
ls -l "$out_dir"
