#!/usr/bin/env bash
# Builds the wheel (dev profile: the workspace's debug build), installs it into the cached torch
# venv (python/venv.sh test) and prints the venv's path. Used by `make test-python`
# (python/test.sh) and by the PyTorch e2e test, whose process kubelet runs the image
# `diphoma-pytorch` as this venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash python/venv.sh test)
out="${CARGO_TARGET_DIR:-target}/wheels-test"  # beside the build: outside the repository when CARGO_TARGET_DIR is
rm -rf "$out"
"$venv/bin/maturin" build --quiet -m python/Cargo.toml --profile dev -o "$out" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$out"/diphoma-*.whl >&2
echo "$venv"
