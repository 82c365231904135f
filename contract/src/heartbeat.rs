//! The heartbeat ConfigMap `<job>-heartbeat` (docs/design/heartbeat.md): rank 0's progress
//! record and the workers' failure reports. Serde types and key names; no I/O.

use serde::{Deserialize, Serialize};

/// Name of the per-job heartbeat ConfigMap, `<job>-heartbeat`: rank 0's progress record and the
/// workers' failure reports (docs/design/heartbeat.md). Workers may get, patch and update it.
pub fn heartbeat_configmap_name(job: &str) -> String {
    format!("{job}-heartbeat")
}

/// Key of rank 0's [`ProgressReport`] in the heartbeat ConfigMap (JSON).
pub const PROGRESS_KEY: &str = "progress.json";
/// Prefix of the failure-report keys in the heartbeat ConfigMap: `report.<pod>` holds that pod's
/// latest [`FailureReport`] (JSON).
pub const REPORT_KEY_PREFIX: &str = "report.";

/// Prefix of the in-place restart keys in the heartbeat ConfigMap: `restarts.<pod>` holds that
/// pod's [`RestartReport`] (JSON), kept for the job's life (a departed pod's restarts still
/// count).
pub const RESTARTS_KEY_PREFIX: &str = "restarts.";

/// Causes of a [`RestartReport`]: the new generation lacks a member the process's had.
pub const RESTART_MEMBER_LOST: &str = "MemberLost";
/// … it only adds members (a replacement or a scale-up joined).
pub const RESTART_MEMBER_JOINED: &str = "MemberJoined";
/// … the same generation again, after the ring failed under the process with no newer one.
pub const RESTART_RING_FAULT: &str = "RingFault";

/// How often a worker pod's launcher (`python -m diphoma.run` in a pod) restarted its training
/// process in place at a new ring generation, by cause ([`RESTART_MEMBER_LOST`], …): written by
/// the launcher at each restart, summed over the pods into `status.inPlaceRestarts`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestartReport {
    /// Restarts so far, by cause.
    pub by_cause: std::collections::BTreeMap<String, i32>,
    /// The generation the process was last restarted at.
    pub generation: u64,
    /// When it was written (RFC 3339).
    pub time: String,
    /// UID of the job (see [`ProgressReport::job_uid`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_uid: Option<String>,
}

/// Training progress, written by rank 0 every few seconds (one write per job, whatever the
/// number of workers): the operator copies it into the job's status.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgressReport {
    /// Ring generation the step was committed in.
    pub generation: u64,
    /// Last committed step.
    pub step: u64,
    /// Steps to train in total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
    /// Training loss at `step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Samples per second over the ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_second: Option<f64>,
    /// Step of the newest checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint_step: Option<u64>,
    /// Accuracy of the trained model on the held-out test split, in [0, 1]: only in the last
    /// report, written after the final step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Smallest share of the global batch a rank computes at `step` (samples; speed-weighted
    /// shares differ between ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_share: Option<u64>,
    /// Largest share of the global batch a rank computes at `step` (samples).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_share: Option<u64>,
    /// When it was written (RFC 3339).
    pub time: String,
    /// UID of the job whose worker wrote it; the operator ignores a record of another job (the
    /// orphaned workers of a deleted job of the same name). Absent (older workers): trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_uid: Option<String>,
}

/// `(min_share, max_share)` of a split of the global batch (samples per rank), `None` for none.
pub fn share_range(shares: &[usize]) -> (Option<u64>, Option<u64>) {
    (
        shares.iter().min().map(|&x| x as u64),
        shares.iter().max().map(|&x| x as u64),
    )
}

/// A worker's report that a collective failed at `generation` because of `suspect` (the peer
/// whose connection broke or went silent), written once per failure, never in steady state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailureReport {
    /// Generation of the failed collective.
    pub generation: u64,
    /// The reporting pod (alive, since it reports).
    pub reporter: String,
    /// The pod it blames, if it could tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspect: Option<String>,
    /// The error kind (`PeerLost`, `Timeout`, …).
    pub error: String,
    /// When it was written (RFC 3339).
    pub time: String,
    /// UID of the reporter's job, as in [`ProgressReport::job_uid`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_uid: Option<String>,
}
