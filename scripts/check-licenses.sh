#!/usr/bin/env bash
# check-licenses.sh — the crates' third-party license check of `make test` (`make licenses`):
# `cargo deny check licenses` against deny.toml's allow list (cargo-deny installed once by
# scripts/tools.sh), offline: no advisories, nothing fetched. Fails naming each crate whose
# license is not allowed. Then a self-check: with Apache-2.0 taken out of the allow list the
# same check must fail, so a check that can no longer fail is noticed.
# (The Python side: python/check-licenses.sh, in `make test-python`.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
deny=$(bash "$ROOT/scripts/tools.sh" cargo-deny)
cd "$ROOT"
if ! out=$("$deny" deny --offline --locked --config deny.toml check licenses 2>&1); then
  echo "$out" >&2
  echo "check-licenses.sh: a crate's license is not allowed by deny.toml (above)" >&2
  exit 1
fi
tmp=$(mktemp); trap 'rm -f "$tmp"' EXIT
grep -v '^  "Apache-2.0",$' deny.toml > "$tmp"
if "$deny" deny --offline --locked --config "$tmp" check licenses >/dev/null 2>&1; then
  echo "check-licenses.sh: cargo deny passed with Apache-2.0 not allowed: the check cannot fail" >&2
  exit 1
fi
echo "crate licenses: ok (deny.toml)" >&2
