#!/usr/bin/env bash
# check-licenses.sh VENV — the third-party license check of the Python side (run by python/test.sh,
# so by `make test`): pip-licenses (PyPI, installed by python/venv.sh) over every package of VENV,
# the venv the wheel is tested in (the wheel, its dependency prometheus-client, torch and what
# torch pulls in). Fails, naming the package, when one is under a license of the GPL family
# (GPL, AGPL, LGPL) or the SSPL: the wheel and what it ships with must stay redistributable under
# Apache-2.0. NVIDIA's proprietary CUDA wheels (torch's own dependencies, not shipped by the
# wheel) are allowed, as in every torch environment. Then a self-check: the same invocation
# with Apache-2.0 denied must fail on `diphoma` itself, so a check that can no longer fail is
# noticed.
set -euo pipefail
venv=${1:?usage: $0 VENV}
pl=$venv/bin/pip-licenses
[[ -x $pl ]] || { echo "check-licenses.sh: $pl missing (python/venv.sh test installs it)" >&2; exit 1; }
DENY="GPL;General Public License;Affero;SSPL;Server Side Public License"
if ! out=$("$pl" --from=mixed --partial-match --fail-on="$DENY" --format=plain 2>&1); then
  echo "python/check-licenses.sh: a package of $venv has an incompatible license:" >&2
  echo "$out" | grep -Ei 'gpl|general public|affero|sspl|server side' >&2 || echo "$out" >&2
  exit 1
fi
n=$(($(echo "$out" | wc -l) - 1))
if self=$("$pl" --from=mixed --partial-match --fail-on="Apache-2.0" --packages diphoma 2>&1) ||
   ! grep -q diphoma <<<"$self"; then
  echo "python/check-licenses.sh: pip-licenses did not fail on a denied license (diphoma, Apache-2.0): $self" >&2
  exit 1
fi
echo "python licenses: $n packages in $venv, none GPL/AGPL/LGPL/SSPL" >&2
