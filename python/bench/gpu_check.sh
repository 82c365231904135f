#!/usr/bin/env bash
# python/bench/gpu_check.sh — `make gpu-check`: issue 27's prepared GPU check
# (python/bench/gpu_check.py: CUDA all_reduce through the host-staged ring vs gloo's CUDA path,
# DDP ResNet-50 on CUDA diphoma vs gloo, a kill -9 of one of 2 elastic CUDA ranks), on a machine
# with one NVIDIA GPU, within 8 minutes. Where there is none it says "no CUDA device" and exits 0.
#
# Python: $PYTHON when set (a python whose torch has CUDA, with torchvision), else the cached
# test venv (python/venv.sh test). The diphoma wheel is built and installed into it
# (python/install.sh) unless DIPHOMA_INSTALLED=1 says it is there already.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -n ${PYTHON:-} ]]; then
  py=$PYTHON
  if [[ ${DIPHOMA_INSTALLED:-0} != 1 ]]; then
    venv=$("$py" -c 'import sys; print(sys.prefix)')
    echo "gpu-check: building the diphoma wheel into $venv" >&2
    "$py" -m maturin build --quiet -m python/Cargo.toml --profile dev -o target/wheels-gpu-check >&2
    "$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels-gpu-check/diphoma-*.whl >&2
  fi
else
  if [[ ${DIPHOMA_INSTALLED:-0} == 1 ]]; then
    py=$(bash python/venv.sh test)/bin/python
  else
    py=$(bash python/install.sh)/bin/python
  fi
fi
exec timeout 480 "$py" python/bench/gpu_check.py
