#!/usr/bin/env bash
# Prints the path of a Python virtual environment cached outside the repository (like the
# Kubernetes binaries): `python/venv.sh build` has maturin (to build the wheel), `python/venv.sh
# test` has torch, maturin and pytest (to run python/tests). Each is keyed by its pinned versions
# and created once per machine (DIPHOMA_PYTHON_CACHE overrides ~/.cache/diphoma/python). PyPI's
# torch for Linux x86-64 is the CUDA build: the test venv takes minutes and gigabytes the first
# time (see README.md, "PyTorch"). The test venv also gets torchvision (the ResNet models of
# manifests/examples/pytorch-resnet50.yaml and make bench-torch) with numpy and pillow, its
# import-time dependencies, added once with --no-deps: the newest torchvision on PyPI, 0.29,
# is built for torch 2.14, and its models (plain Python) run on 2.15; --no-deps keeps pip from
# replacing torch. Accelerate and PyTorch Lightning are added once too (python/tests/test_libraries.py),
# and pip-licenses (python/check-licenses.sh).
set -euo pipefail
TORCH_VERSION=2.15.0
MATURIN_VERSION=1.16.0
PYTEST_VERSION=9.2.0
VISION=("torchvision==0.29.2" "numpy==2.4.6" "pillow==13.0.0")
# The libraries python/tests/test_libraries.py runs unchanged on the backend (their own
# dependencies from PyPI; torch stays at TORCH_VERSION, which they accept), and the wheel's own
# dependency prometheus-client (python/install.sh installs the wheel with --no-deps).
LIBS=("accelerate==1.15.0" "pytorch-lightning==2.6.6" "prometheus-client==0.26.0")
# The third-party license check of the venv's packages (python/check-licenses.sh).
PIP_LICENSES=pip-licenses==5.5.5
root=${DIPHOMA_PYTHON_CACHE:-$HOME/.cache/diphoma/python}
case "${1:-}" in
  build) venv=$root/maturin-$MATURIN_VERSION; pkgs=("maturin==$MATURIN_VERSION") ;;
  test) venv=$root/torch-$TORCH_VERSION-maturin-$MATURIN_VERSION
        pkgs=("torch==$TORCH_VERSION" "maturin==$MATURIN_VERSION" "pytest==$PYTEST_VERSION" "pytest-timeout==2.4.0") ;;
  *) echo "usage: $0 build|test" >&2; exit 2 ;;
esac
if [[ ! -f $venv/.complete ]]; then
  rm -rf "$venv"
  echo "creating $venv (${pkgs[*]})" >&2
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "${pkgs[@]}" >&2
  touch "$venv/.complete"
fi
if [[ $1 == test && ! -f $venv/.vision-0.29.2 ]]; then
  echo "adding ${VISION[*]} to $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "${VISION[@]}" >&2
  touch "$venv/.vision-0.29.2"
fi
if [[ $1 == test && ! -f $venv/.libs-accelerate-1.15.0-lightning-2.6.6-prometheus-0.26.0 ]]; then
  echo "adding ${LIBS[*]} to $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "${LIBS[@]}" "torch==$TORCH_VERSION" >&2
  touch "$venv/.libs-accelerate-1.15.0-lightning-2.6.6-prometheus-0.26.0"
fi
if [[ $1 == test && ! -f $venv/.$PIP_LICENSES ]]; then
  echo "adding $PIP_LICENSES to $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$PIP_LICENSES" >&2
  touch "$venv/.$PIP_LICENSES"
fi
echo "$venv"
