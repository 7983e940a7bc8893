#!/usr/bin/env bash
# On the device machine (the device tool's `run`, from the repo root, with carry [".whl"]): install the
# carried wheels beside the image's torch, run the two jobs of tests/gpu/gpu_check.py, pack them into $OUT.
# Back here: python tests/gpu/gpu_check.py check <files_at>.
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# steplens as a package without installing it: the repo's folders under the names pyproject maps them to.
mkdir -p /tmp/pkg/steplens
for part in analyze collect reports; do ln -sfn "$PWD/$part" "/tmp/pkg/steplens/$part"; done
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD
python3 -c "import torch, deepspeed; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'deepspeed', deepspeed.__version__)"
python3 tests/gpu/gpu_check.py job /tmp/gpu_run
tar czf - -C /tmp gpu_run/job gpu_run/overhead/script | split -b 15m - "$OUT/gpu_run.tgz.part-"
ls -l "$OUT"
