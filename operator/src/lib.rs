//! Diphoma's operator: the `DiphomaJob` API and the reconciler that keeps each job's ring alive.
//!
//! # Layout
//! - [`api`]: the CRD types (spec, status, schema bounds, CEL rules). Types only, and all there is
//!   without the `controller` feature (on by default): what the job's readers link
//!   (`kubectl-diphoma`), without the reconciler and its dependencies. Everything below, the CRD's
//!   YAML and reference, and the `diphoma-operator` binary need that feature.
//! - [`build`]: the desired children (worker pods, Service, RBAC, ring ConfigMap, key Secret) as
//!   typed k8s-openapi objects. Pure.
//! - [`plan`]: the decision of one reconcile, as named steps (one module each): failures (which
//!   nodes are lost or late, judged by `plan::nodes` with the operator's own clocks, which pods
//!   and members are lost) → lifecycle (finish, deadline,
//!   TTL, suspend) → workers (create, delete) → ring (next generation) → status; plus when the
//!   static children are re-applied and when to look again. Pure, and where most tests live.
//! - [`controller`]: observe → plan → apply against the API server, and leader election.
//!   `controller::caches` holds what the watches keep (the jobs' children, node Leases and
//!   readiness, the `resourceVersion`s delivered): `observe` reads only from it, so a steady job
//!   costs no API request (children are a job's by owner UID). Decides nothing; the metrics
//!   listener is injected.
//! - [`queue`]: Kueue I/O (a queued job's Workload, its WorkloadPriorityClass, the admitted
//!   ResourceFlavors), carrying out what `plan::queue` decides. Decides nothing.
//! - [`gang`]: gang scheduling I/O (the gang Workloads' watch and store, their creation and
//!   deletion), carrying out what `plan::gang` decides. Decides nothing.
//! - [`error`]: the reconcile errors, one variant per step, each with a bounded metric label.
//!   Imported by `controller` and `metrics`, importing neither.
//! - [`docs`]: the DiphomaJob reference (Markdown) generated from the CRD. Pure.
//! - [`metrics`]: Prometheus metrics and the `/metrics`, `/healthz`, `/readyz` server. Never
//!   imports `controller`.
//!
//! The operator/worker contract (env names, labels, membership format, key file) is imported
//! from `diphoma_contract`, never restated here. The operator must not import `diphoma-ring` or
//! `diphoma-worker` (nor, through them, candle): the contract is all it shares with the workers.

// The layout above links the modules the `controller` feature gates.
#![cfg_attr(not(feature = "controller"), allow(rustdoc::broken_intra_doc_links))]

pub mod api;
#[cfg(feature = "controller")]
pub mod build;
#[cfg(feature = "controller")]
pub mod controller;
#[cfg(feature = "controller")]
pub mod docs;
#[cfg(feature = "controller")]
pub mod error;
#[cfg(feature = "controller")]
pub mod gang;
#[cfg(feature = "controller")]
pub mod metrics;
#[cfg(feature = "controller")]
pub mod plan;
#[cfg(feature = "controller")]
pub mod queue;

#[cfg(feature = "controller")]
use kube::CustomResourceExt;

/// The CRD of [`api::DiphomaJob`] as YAML (what `diphoma-operator crd` prints and `crds/` holds).
#[cfg(feature = "controller")]
pub fn crd_yaml() -> String {
    serde_saphyr::to_string(&api::DiphomaJob::crd()).expect("the CRD serializes")
}

/// The DiphomaJob reference in Markdown (what `diphoma-operator crd --markdown` prints and
/// `docs/crd-reference.md` holds).
#[cfg(feature = "controller")]
pub fn crd_markdown() -> String {
    docs::crd_markdown(&api::DiphomaJob::crd())
}

#[cfg(all(test, feature = "controller"))]
mod tests {
    /// CI's diff-check: the committed CRD, and the chart's copy of it, are what the Rust types
    /// generate.
    #[test]
    fn committed_crds_are_fresh() {
        for file in [
            "crds/diphomajob.yaml",
            "charts/diphoma-operator/files/crds/diphomajob.yaml",
        ] {
            let path = format!("{}/../{file}", env!("CARGO_MANIFEST_DIR"));
            let committed = std::fs::read_to_string(&path).expect(&path);
            assert!(
                committed == super::crd_yaml(),
                "{file} is stale: run `make generate`"
            );
        }
        let committed = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/crd-reference.md"
        ))
        .expect("docs/crd-reference.md");
        assert!(
            committed == super::crd_markdown(),
            "docs/crd-reference.md is stale: run `make generate`"
        );
    }
}
