#!/usr/bin/env bash
# `make test-python`: builds the wheel, installs it into the cached torch venv (python/install.sh)
# checks the venv's third-party licenses (python/check-licenses.sh) and runs python/tests with pytest. pytest fails the run when it collects no test (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash python/install.sh)
bash python/check-licenses.sh "$venv"
cd python/tests
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
