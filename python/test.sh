#!/usr/bin/env bash
# `make test-python`: builds the wheel, installs it into the cached torch venv (python/venv.sh
# test) and runs python/tests with pytest. pytest fails the run when it collects no test (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash python/venv.sh test)
out=target/wheels-test
rm -rf "$out"
# The dev profile reuses the workspace's debug build (the ring itself is built at opt-level 2).
"$venv/bin/maturin" build --quiet -m python/Cargo.toml --profile dev -o "$out" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$out"/diphoma-*.whl
cd python/tests
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
