//! The errors of one reconcile, one variant per step that can fail (observe, build, apply the
//! children, patch the status, mark, delete and create pods, publish the ring, delete the job),
//! each with its cause as `#[source]` and a bounded [`Error::metric_label`]. Types only: this
//! module imports neither the controller nor the metrics, which both import it.

use diphoma_contract::ContractError;

/// Why one reconcile of one job failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading what the job's world looks like failed.
    #[error("observe {what}: {source}")]
    Observe {
        /// What was read: `pods`, `ring ConfigMap`, `heartbeat ConfigMap`, `node Lease`, `Node`,
        /// `invalid job` (a job that does not decode, read as stored).
        what: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The published ring ConfigMap is not valid membership.
    #[error("ring ConfigMap {name}: {source}")]
    Ring {
        /// The ConfigMap.
        name: String,
        /// Why it was refused.
        #[source]
        source: ContractError,
    },
    /// Applying a static child (Service, RBAC, NetworkPolicy, key Secret, heartbeat ConfigMap)
    /// failed.
    #[error("apply {kind} {name}: {source}")]
    ApplyChild {
        /// The child's kind.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting a child the job no longer needs (`Plan::prune`) failed.
    #[error("prune {kind} {name}: {source}")]
    PruneChild {
        /// The child's kind.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Writing the job's status failed.
    #[error("patch status: {source}")]
    PatchStatus {
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Marking a pod (the annotations failure counted and deleted by the operator, the rank
    /// labels) failed.
    #[error("mark pod {pod}: {source}")]
    MarkPod {
        /// The pod.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting a pod failed.
    #[error("delete pod {pod}: {source}")]
    DeletePod {
        /// The pod.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Creating a worker pod failed.
    #[error("create pod {pod}: {source}")]
    CreatePod {
        /// The pod.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Publishing a ring generation failed.
    #[error("publish ring generation {generation}: {source}")]
    PublishRing {
        /// The generation.
        generation: u64,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Creating, deleting or updating the job's Kueue Workload failed.
    #[error("{action} Kueue Workload {name}: {source}")]
    Workload {
        /// `create`, `delete`, `patch status of`.
        action: &'static str,
        /// The Workload.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Creating or deleting the job's gang Workload or PodGroup (`scheduling.k8s.io/v1alpha2`)
    /// failed.
    #[error("{action} gang {kind} {name}: {source}")]
    Gang {
        /// `create`, `delete`.
        action: &'static str,
        /// `Workload`, `PodGroup`.
        kind: &'static str,
        /// The object.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting the job after `ttlSecondsAfterFinished` failed.
    #[error("delete the finished job: {source}")]
    DeleteJob {
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Every value of [`Error::metric_label`] (metric label values are initialized from it).
    pub const LABELS: [&'static str; 11] = [
        "observe",
        "ring",
        "apply_child",
        "patch_status",
        "mark_pod",
        "delete_pod",
        "create_pod",
        "publish_ring",
        "delete_job",
        "workload",
        "gang",
    ];

    /// Bounded label for metrics and logs: the step that failed.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Observe { .. } => "observe",
            Error::Ring { .. } => "ring",
            Error::ApplyChild { .. } => "apply_child",
            Error::PruneChild { .. } => "prune_child",
            Error::PatchStatus { .. } => "patch_status",
            Error::MarkPod { .. } => "mark_pod",
            Error::DeletePod { .. } => "delete_pod",
            Error::CreatePod { .. } => "create_pod",
            Error::PublishRing { .. } => "publish_ring",
            Error::DeleteJob { .. } => "delete_job",
            Error::Workload { .. } => "workload",
            Error::Gang { .. } => "gang",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_is_listed_once() {
        let api = || kube::Error::LinesCodecMaxLineLengthExceeded;
        let all = [
            Error::Observe {
                what: "pods",
                source: api(),
            },
            Error::Ring {
                name: "r".into(),
                source: diphoma_contract::Membership::parse("{").unwrap_err(),
            },
            Error::ApplyChild {
                kind: "Service",
                name: "s".into(),
                source: api(),
            },
            Error::PatchStatus { source: api() },
            Error::MarkPod {
                pod: "p".into(),
                source: api(),
            },
            Error::DeletePod {
                pod: "p".into(),
                source: api(),
            },
            Error::CreatePod {
                pod: "p".into(),
                source: api(),
            },
            Error::PublishRing {
                generation: 1,
                source: api(),
            },
            Error::DeleteJob { source: api() },
            Error::Workload {
                action: "create",
                name: "w".into(),
                source: api(),
            },
            Error::Gang {
                action: "create",
                kind: "PodGroup",
                name: "w".into(),
                source: api(),
            },
        ];
        let labels: Vec<&str> = all.iter().map(Error::metric_label).collect();
        assert_eq!(labels, Error::LABELS);
        assert!(std::error::Error::source(&all[0]).is_some());
    }
}
