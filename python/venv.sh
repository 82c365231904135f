#!/usr/bin/env bash
# Prints the path of a Python virtual environment cached outside the repository (like the
# Kubernetes binaries): `python/venv.sh build` has maturin (to build the wheel), `python/venv.sh
# test` has torch, maturin and pytest (to run python/tests). Each is keyed by its pinned versions
# and created once per machine (DIPHOMA_PYTHON_CACHE overrides ~/.cache/diphoma/python). PyPI's
# torch for Linux x86-64 is the CUDA build: the test venv takes minutes and gigabytes the first
# time (see python/README.md).
set -euo pipefail
TORCH_VERSION=2.15.0
MATURIN_VERSION=1.16.0
PYTEST_VERSION=9.2.0
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
echo "$venv"
