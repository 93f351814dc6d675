#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (and no network): the GPU tests, then the providers' table
# (bench/gpu_providers.py). Needs the checkout's .venv and built models; onnxruntime-gpu comes
# from wheels carried with the tree when the venv has only the CPU build:
#   GPU_WHEELS=dir-with-onnxruntime_gpu-*.whl bash bench/gpu_check.sh
# PY=python picks another interpreter than .venv/bin/python: a machine where the checkout's venv
# cannot run (another Python), with edged's needs installed beside it, e.g. from carried wheels:
#   pip install --no-index --no-deps --target /tmp/site WHEELS...
#   PYTHONPATH=/tmp/site:$PWD PY=python3 bash bench/gpu_check.sh --runs 20
# (GPU_WHEELS installs into that interpreter's environment with pip, so leave it unset then.)
# On a machine without a GPU the GPU tests skip with their reason and the table has CPU rows.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ -n "${GPU_WHEELS:-}" ] && ! $PY -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())'; then
  $PY -m pip uninstall -q -y onnxruntime
  $PY -m pip install -q --no-index --find-links "$GPU_WHEELS" onnxruntime-gpu
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
$PY -m pytest -q -rs -p no:cacheprovider tests/unit/edged/test_gpu_options.py tests/unit/edged/test_tensorrt_runtime.py \
  tests/unit/edged/test_process_runtime.py
$PY bench/gpu_providers.py "$@"
