# Diphoma's entry points. `make test` runs every test (the README's test command, and CI's).
SHELL := /bin/bash
.DEFAULT_GOAL := help
CLUSTER_DIR ?= $(CURDIR)/.local/cluster
NODES ?= 4
GPUS ?= 8
CARGO ?= cargo
# How the local kubelet runs pods: process (fast) or podman (containers of the local images).
RUNTIME ?= process
# 1: cluster-up maps the image diphoma-pytorch (the PyTorch examples) to the cached torch venv.
PYTORCH ?= 0

.PHONY: help deps tools build generate test licenses integrations release unit e2e fmt-check clippy bench bench-repair bench-scale cluster-up cluster-down demo wheel test-python images image-pytorch bench-torch bench-balance gpu-check

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

deps: ## install Debian packages the scripts need (idempotent)
	@bash scripts/install-deps.sh

tools: deps ## build the pinned control plane, etcd and helm from Go modules (and Kueue, the scheduler-plugins scheduler); fetch Prometheus; install helm-docs and cargo-deny (all cached outside the repo)
	@bash e2e/cluster/build-bins.sh >/dev/null
	@bash scripts/tools.sh helm-docs >/dev/null
	@bash scripts/tools.sh cargo-deny >/dev/null
	@bash e2e/cluster/build-kueue.sh >/dev/null
	@bash e2e/cluster/build-coscheduling.sh >/dev/null
	@bash e2e/cluster/fetch-prometheus.sh >/dev/null

build: deps ## build every binary of the workspace
	$(CARGO) build --workspace --bins --locked

generate: tools ## regenerate the derived files: the CRD (crds/, the chart's copy, docs/crd-reference.md), manifests/install.yaml, docs/prometheus-rules.yaml, the chart's README.md
	$(CARGO) run -q -p diphoma-operator -- crd > crds/diphomajob.yaml
	$(CARGO) run -q -p diphoma-operator -- crd --markdown > docs/crd-reference.md
	cp crds/diphomajob.yaml charts/diphoma-operator/files/crds/diphomajob.yaml
	bash scripts/render-install.sh "$$(bash e2e/cluster/build-bins.sh 2>/dev/null)/helm" > manifests/install.yaml
	bash scripts/render-rules.sh "$$(bash e2e/cluster/build-bins.sh 2>/dev/null)/helm" > docs/prometheus-rules.yaml
	"$$(bash scripts/tools.sh helm-docs)" --log-level error --chart-search-root charts/diphoma-operator

fmt-check:
	$(CARGO) fmt --all -- --check

clippy: ## lint every crate and target; warnings are errors
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

licenses: deps ## check the third-party licenses of the crates against deny.toml (cargo deny check licenses; the Python side is in test-python)
	bash scripts/check-licenses.sh

integrations: deps ## test docs/integrations: the Argo CD health check under lua5.1 on sample jobs, kube-state-metrics' paths against the CRD's schema
	bash scripts/check-integrations.sh

test: tools build fmt-check clippy licenses integrations ## run every test: unit, loopback TCP, end-to-end on a real control plane, the license checks, and the Python package's
	DIPHOMA_K8S_BIN=$$(bash e2e/cluster/build-bins.sh 2>/dev/null) $(CARGO) test --workspace --locked
	$(MAKE) --no-print-directory test-python

wheel: ## build the `diphoma` Python wheel (abi3, CPython >= 3.9) into target/wheels (maturin in a venv cached in ~/.cache/diphoma/python)
	"$$(bash python/venv.sh build)/bin/maturin" build --release --strip --locked -m python/Cargo.toml -o target/wheels

test-python: ## build the wheel, install it into a cached torch venv (created once: torch from PyPI, ~5.4 GB) and run python/tests with pytest
	bash python/test.sh

bench: deps ## allreduce benchmark side by side with gloo and Open MPI (prints the merged table); PROFILE=1g or PROFILES="1g 2.5g 10g loopback" runs it in a network namespace of its own with each rank's link shaped by tc htb (root; worker/bench/netns.sh, results in worker/bench/PROFILES.md)
	bash worker/bench/run.sh

bench-torch: deps ## DDP step time gloo vs diphoma with and without frame protection, and diphoma DIPHOMA_COMPRESSION=bf16 vs gloo with DDP's bf16_compress_hook (step ratio, max |dparam| after the same steps), each cell beside its physical floor and the bars (ResNet-18/50, CPU, world 2 and 4, interleaved rounds), all_reduce from Python vs the Rust bench, and all_reduce's time beyond the ring; PARTS=layout: 2 pods x 2 processes vs 4 x 1 and gloo at world 4; PARTS selects (e.g. PARTS=allreduce SIZES=1M ROUNDS=5 WORLDS=2); PROFILE=1g or PROFILES="1g 2.5g 10g loopback" runs the ddp and allreduce parts with every rank's link shaped as make bench does (root; worker/bench/netns.sh); writes python/bench/RESULTS.md
	bash python/bench/run.sh

gpu-check: deps ## issue 27's GPU check on one NVIDIA GPU (< 8 min): CUDA all_reduce via the host-staged ring vs gloo (f32/bf16, 1 KiB-256 MiB, exact, bar 1.3x from 16 MiB), DDP ResNet-50 diphoma vs gloo on CUDA, kill -9 of one of 2 elastic CUDA ranks; says "no CUDA device" and exits 0 without one (PYTHON= a CUDA torch)
	bash python/bench/gpu_check.sh

bench-balance: deps ## speed-weighted shares (4 ranks, one sharing its CPU with a burner; compute-dominated steps) vs equal vs ideal with a 15%-of-ideal verdict (~5 min), and periodic averaging H=1,4,16 vs every step on the 50 M synthetic model (16 steps, ~8 min); prints the report (worker/bench/BALANCE.md is a committed one)
	bash worker/bench/balance.sh

bench-repair: tools build ## ring repair on the local control plane: time-to-repair, node-loss detection, join time, repeated steps (median/min/max of 5 runs)
	DIPHOMA_K8S_BIN="$$(bash e2e/cluster/build-bins.sh)" target/debug/diphoma-repair-bench --runs 5

images: deps ## build the release binaries and the images (operator, worker, probe) into the local image store, tagged with the chart's appVersion
	$(CARGO) build --release --locked -p diphoma-operator -p diphoma-worker -p diphoma-e2e --bin diphoma-operator --bin diphoma-worker --bin diphoma-probe
	bash images/build.sh release

release: deps tools ## build a release into target/release-dir/VERSION (VERSION: the chart's appVersion) and check it: chart package, install.yaml, CRD, images as OCI archives, wheel, plugin tarball, krew manifest, notices, SHA256SUMS; PROFILE=debug for debug binaries, PYTORCH_IMAGE=1 adds the PyTorch image (several GB)
	dir=$$(bash scripts/release.sh --profile $(or $(PROFILE),release) $(if $(filter 1,$(PYTORCH_IMAGE)),--pytorch)) && bash scripts/check-release.sh "$$dir"

image-pytorch: deps wheel ## build the PyTorch worker image (Python, torch from PyPI, the diphoma wheel) into the local image store: several GB, not part of make test
	bash images/build-pytorch.sh

bench-scale: tools ## the operator at scale: N=100, 300, 1000 jobs x 4 workers on kwok's fake GPU nodes, side by side with Kubeflow's training operator (builds kwok and it, cached); SIZES, IDLE_S (300) and FAILOVER (1) override; writes e2e/bench/scale/out/
	$(CARGO) build --release --locked -p diphoma-operator --bin diphoma-operator
	bash e2e/bench/scale/run.sh $(or $(SIZES),100 300 1000)

cluster-up: tools build ## start the control plane and the local kubelet (RUNTIME=process or podman; PYTORCH=1 maps the image diphoma-pytorch to the cached torch venv); writes .local/cluster/env
	@PYTORCH=$(PYTORCH) bash e2e/cluster/cluster-up.sh "$(CLUSTER_DIR)" $(NODES) $(GPUS) $(RUNTIME)

cluster-down: ## stop what cluster-up started
	@bash e2e/cluster/stop.sh "$(CLUSTER_DIR)"

demo: RUNTIME = podman
demo: cluster-up ## from the images: helm install the operator, train the digits example through a kill -9 to Succeeded, then tear down (KEEP=1 keeps it)
	@bash e2e/cluster/demo.sh "$(CLUSTER_DIR)"; rc=$$?; [[ -n "$(KEEP)" ]] || bash e2e/cluster/stop.sh "$(CLUSTER_DIR)"; exit $$rc
