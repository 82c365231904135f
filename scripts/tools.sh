#!/usr/bin/env bash
# tools.sh TOOL — prints the path of a pinned release tool, installed once per machine under
# ~/.cache/diphoma/tools (DIPHOMA_TOOLS_CACHE overrides it), never in the repository:
#   cargo-deny  `cargo install --locked cargo-deny` (crates.io) into its own CARGO_INSTALL_ROOT
#   helm-docs   `go install github.com/norwoodj/helm-docs/cmd/helm-docs` (the Go module proxy)
# Idempotent: a tool already installed at its pinned version is only printed. A half-finished
# install (interrupted) leaves no binary behind, so the next run installs again.
set -euo pipefail
CARGO_DENY_VERSION=0.20.2
HELM_DOCS_VERSION=v1.14.2
cache=${DIPHOMA_TOOLS_CACHE:-$HOME/.cache/diphoma/tools}
case "${1:-}" in
  cargo-deny)
    root=$cache/cargo-deny-$CARGO_DENY_VERSION bin=$root/bin/cargo-deny
    if [[ ! -x $bin ]]; then
      command -v cargo >/dev/null || { echo "tools.sh: cargo is required to install cargo-deny" >&2; exit 1; }
      echo "installing cargo-deny $CARGO_DENY_VERSION into $root (once; a few minutes)" >&2
      # Its own build directory (removed afterwards), so that the workspace's target is untouched.
      build=$(mktemp -d); trap 'rm -rf "$build"' EXIT
      CARGO_INSTALL_ROOT=$root CARGO_TARGET_DIR=$build \
        cargo install --quiet --locked cargo-deny --version "$CARGO_DENY_VERSION" >&2
    fi ;;
  helm-docs)
    root=$cache/helm-docs-$HELM_DOCS_VERSION bin=$root/helm-docs
    if [[ ! -x $bin ]]; then
      command -v go >/dev/null || { echo "tools.sh: Go is required to install helm-docs" >&2; exit 1; }
      echo "installing helm-docs $HELM_DOCS_VERSION into $root (once)" >&2
      GOBIN=$root go install "github.com/norwoodj/helm-docs/cmd/helm-docs@$HELM_DOCS_VERSION" >&2
    fi ;;
  *) echo "usage: $0 cargo-deny|helm-docs" >&2; exit 2 ;;
esac
[[ -x $bin ]] || { echo "tools.sh: $bin missing after its install" >&2; exit 1; }
echo "$bin"
