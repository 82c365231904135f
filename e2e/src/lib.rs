//! Diphoma's end-to-end harness: a real Kubernetes control plane on 127.0.0.1 and a *process
//! kubelet* that plays GPU nodes by running each pod's containers as local processes.
//!
//! # Layout
//! The library imports the contract (`diphoma-contract`) and nothing else of ours; the tests
//! also use the operator (in-process mode) and the worker (its `Checkpoint` format).
//! - [`cluster`]: start/stop the control plane through the scripts in `e2e/cluster/` (also used by
//!   `make cluster-up`), temp namespaces for tests.
//! - [`kubelet`]: the process kubelet. Its pure parts (node and lease objects, pod status, env and
//!   path resolution, IP and GPU allocation, the image table) are plain functions with unit tests;
//!   [`kubelet::Kubelet`] is the I/O shell that watches pods and runs processes, captures their
//!   output per run and serves it to `kubectl logs` (the kubelet API's `/containerLogs` over TLS).
//! - [`prometheus`]: a real Prometheus server (Debian's package) for the dashboard tests.
//! - [`kit`]: the test kit shared by `tests/` and the benchmark: the one `DiphomaJob` manifest
//!   builder, JSON deep merge, process lookup for pods (pid, state, start time, signals), free
//!   loopback ports. No API calls and no waits.
//! - `src/bin/diphoma-kubelet.rs`: the kubelet as a daemon with a control socket (`fail-node`).
//! - `src/bin/diphoma-probe.rs`: a tiny program used as a pod image by the tests.
//! - `tests/`: acceptance tests against the real control plane (custom harness: one control plane
//!   per test binary, a temp namespace per test, torn down even when a test panics);
//!   `tests/common` holds their harness and the waits (polls with a deadline, or
//!   `await_condition`) on the API server.

#![warn(missing_docs)]

pub mod cluster;
pub mod kit;
pub mod kubelet;
pub mod prometheus;

use std::path::PathBuf;

/// Everything that can go wrong in the harness; each variant names what failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A control-plane script exited non-zero.
    #[error("{script}: exited with {status}: {stderr}")]
    Script {
        /// The script that failed.
        script: PathBuf,
        /// Its exit status.
        status: String,
        /// Its standard error.
        stderr: String,
    },
    /// A kubeconfig could not be read or turned into a client.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// Why it was refused.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A request to the API server failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A file or process operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file, directory or program involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key the kubelet's HTTPS server refused.
    #[error("TLS {what}: {message}")]
    Tls {
        /// The file involved.
        what: PathBuf,
        /// Why it was refused.
        message: String,
    },
    /// A node name that this kubelet does not run.
    #[error("unknown node {name:?} (this kubelet runs: {known})")]
    UnknownNode {
        /// The name asked for.
        name: String,
        /// The nodes this kubelet runs, comma-separated.
        known: String,
    },
    /// An image that the image table does not map to a binary.
    #[error("image {image:?} is not in the process kubelet's image table (known: {known})")]
    UnknownImage {
        /// The pod's image reference.
        image: String,
        /// The repositories the table knows, comma-separated.
        known: String,
    },
    /// The image table maps an image to a binary that does not exist (not built yet?).
    #[error("image {image:?} maps to {path}, which does not exist (run `cargo build` first)")]
    MissingBinary {
        /// The pod's image reference.
        image: String,
        /// The binary it maps to.
        path: PathBuf,
    },
    /// Container mode: an image that is not in the local image store (nothing is pulled).
    #[error(
        "image {image:?} is not in the local image store (podman images); this kubelet pulls nothing: `make images` builds diphoma-operator, diphoma-worker and diphoma-probe, `make image-pytorch` diphoma-pytorch, each tagged localhost/NAME:VERSION and ghcr.io/diphoma/NAME:VERSION"
    )]
    ImageNotPresent {
        /// The pod's image reference.
        image: String,
        /// Whether the container's `imagePullPolicy` is `Never`.
        never: bool,
    },
    /// A pod's spec uses something the process kubelet cannot provide.
    #[error("pod {pod}: {what}")]
    Unsupported {
        /// `namespace/name` of the pod.
        pod: String,
        /// What it asked for.
        what: String,
    },
    /// A pod whose first container has no process (yet): no `process://<pid>` containerID.
    #[error("pod {pod}: no process (no process:// containerID yet)")]
    NoProcess {
        /// `namespace/name` of the pod.
        pod: String,
    },
    /// A wait on the API server ended without the condition.
    #[error("wait: {0}")]
    Wait(String),
    /// A bad command-line or configuration value.
    #[error("{field}: {message}")]
    Config {
        /// The flag or field.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}
