//! The operator/worker contract: environment variable names, ports, labels, the ring-membership
//! format and the key file. The operator imports this module; nothing here is written down
//! anywhere else.
//!
//! Plain constants and serde types; no I/O (parsing takes strings and bytes the caller read).
//!
//! How a worker pod finds its ring:
//! 1. The operator publishes generation `g` as JSON ([`Membership`]) under the key
//!    [`MEMBERSHIP_KEY`] of the ConfigMap named by [`ENV_MEMBERSHIP`] (`<job>-ring`,
//!    see [`membership_configmap_name`]).
//! 2. The worker finds its own entry by pod name ([`ENV_POD_NAME`]), listens on
//!    [`ENV_RING_PORT`] at [`ENV_POD_IP`], and connects to its peers with the per-job key read
//!    from the file at [`ENV_KEY_FILE`] (a Secret volume; the file holds at least
//!    [`MIN_KEY_LEN`] raw bytes, used as the HMAC-SHA256 key).

use serde::{Deserialize, Serialize};

/// Env: the `DiphomaJob` name.
pub const ENV_JOB_NAME: &str = "DIPHOMA_JOB_NAME";
/// Env: the `DiphomaJob`'s `metadata.uid`, bound into every ring handshake.
pub const ENV_JOB_UID: &str = "DIPHOMA_JOB_UID";
/// Env: the job's namespace (downward API `metadata.namespace`).
pub const ENV_NAMESPACE: &str = "DIPHOMA_NAMESPACE";
/// Env: this pod's name (downward API `metadata.name`).
pub const ENV_POD_NAME: &str = "DIPHOMA_POD_NAME";
/// Env: this pod's IP (downward API `status.podIP`).
pub const ENV_POD_IP: &str = "DIPHOMA_POD_IP";
/// Env: the TCP port of the ring on the pod IP (from `spec.ringPort`).
pub const ENV_RING_PORT: &str = "DIPHOMA_RING_PORT";
/// Env: path of the per-job key file (a mounted Secret).
pub const ENV_KEY_FILE: &str = "DIPHOMA_KEY_FILE";
/// Env: name of the ConfigMap holding the ring membership.
pub const ENV_MEMBERSHIP: &str = "DIPHOMA_MEMBERSHIP";
/// Env: directory of the checkpoints (the mount path of `spec.checkpoint.volume`); unset: none.
pub const ENV_CHECKPOINT_DIR: &str = "DIPHOMA_CHECKPOINT_DIR";
/// Env: steps between two checkpoints (`spec.checkpoint.everySteps`).
pub const ENV_CHECKPOINT_EVERY: &str = "DIPHOMA_CHECKPOINT_EVERY";

/// Default TCP port of the ring (`spec.ringPort`).
pub const DEFAULT_RING_PORT: u16 = 29500;
/// Name of the ring port on the worker container.
pub const RING_PORT_NAME: &str = "ring";

/// Default TCP port of the worker's `/metrics` endpoint (on the pod IP).
pub const DEFAULT_METRICS_PORT: u16 = 9400;
/// Name of the metrics port on the worker container.
pub const METRICS_PORT_NAME: &str = "metrics";

/// Label on every worker pod: the owning job's name.
pub const LABEL_JOB_NAME: &str = "diphoma.io/job-name";
/// Label on every worker pod: its replica index (stable pod identity, not the ring rank, which
/// changes with each generation).
pub const LABEL_REPLICA_INDEX: &str = "diphoma.io/replica-index";

/// Key inside the membership ConfigMap under which [`Membership`] JSON is stored.
pub const MEMBERSHIP_KEY: &str = "membership.json";
/// Key inside the job's Secret, and file name inside its mount, of the per-job HMAC key.
pub const KEY_FILE_NAME: &str = "ring.key";
/// Directory where the operator mounts the key Secret in worker pods.
pub const KEY_MOUNT_DIR: &str = "/var/run/diphoma";
/// Shortest acceptable per-job key, in bytes.
pub const MIN_KEY_LEN: usize = 32;

/// Name of the membership ConfigMap of job `job`: `<job>-ring`.
pub fn membership_configmap_name(job: &str) -> String {
    format!("{job}-ring")
}

/// One generation of the ring, as published by the operator (its single writer).
///
/// Invariants (checked by [`Membership::parse`]): ranks are exactly `0..members.len()` in order,
/// pod names are unique, there is at least one member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Membership {
    /// Generation number; strictly increases with every change.
    pub generation: u64,
    /// The job's `metadata.uid`.
    pub job_uid: String,
    /// The members, ordered by rank.
    pub members: Vec<Member>,
}

/// One member of a ring generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Member {
    /// Rank in this generation, `0..world`.
    pub rank: u32,
    /// Pod name.
    pub pod: String,
    /// Pod IP.
    pub address: std::net::IpAddr,
    /// Ring port.
    pub port: u16,
}

/// Why a membership document or a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// Not valid membership JSON.
    #[error("membership is not valid JSON")]
    Json(#[source] serde_json::Error),
    /// A field violates the invariants.
    #[error("membership field {field}: {problem}")]
    Invalid {
        /// JSON path of the offending field, e.g. `members[2].rank`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The key is shorter than [`MIN_KEY_LEN`].
    #[error("key file holds {0} bytes, need at least {MIN_KEY_LEN}")]
    KeyTooShort(usize),
}

impl Membership {
    /// Parses and validates membership JSON.
    ///
    /// # Errors
    /// [`ContractError::Json`] on bad JSON, [`ContractError::Invalid`] naming the field when an
    /// invariant fails.
    pub fn parse(json: &str) -> Result<Membership, ContractError> {
        let m: Membership = serde_json::from_str(json).map_err(ContractError::Json)?;
        m.validate()?;
        Ok(m)
    }

    /// Checks the invariants.
    ///
    /// # Errors
    /// [`ContractError::Invalid`] naming the offending field.
    pub fn validate(&self) -> Result<(), ContractError> {
        let bad = |field: String, problem: &str| {
            Err(ContractError::Invalid {
                field,
                problem: problem.to_string(),
            })
        };
        if self.members.is_empty() {
            return bad("members".into(), "must not be empty");
        }
        if self.job_uid.is_empty() || self.job_uid.len() > crate::frame::MAX_JOB_UID {
            return bad("jobUid".into(), "must be 1..=128 bytes");
        }
        let mut pods = std::collections::HashSet::new();
        for (i, m) in self.members.iter().enumerate() {
            if m.rank as usize != i {
                return bad(format!("members[{i}].rank"), "ranks must be 0..n in order");
            }
            if !pods.insert(m.pod.as_str()) {
                return bad(format!("members[{i}].pod"), "duplicate pod name");
            }
            if m.port == 0 {
                return bad(format!("members[{i}].port"), "must not be 0");
            }
        }
        Ok(())
    }

    /// The rank of pod `pod` in this generation, if it is a member.
    pub fn rank_of(&self, pod: &str) -> Option<usize> {
        self.members.iter().position(|m| m.pod == pod)
    }

    /// The members' socket addresses, indexed by rank.
    pub fn addresses(&self) -> Vec<std::net::SocketAddr> {
        self.members
            .iter()
            .map(|m| std::net::SocketAddr::new(m.address, m.port))
            .collect()
    }
}

/// Validates the bytes of a key file and returns them as the HMAC key.
///
/// # Errors
/// [`ContractError::KeyTooShort`] below [`MIN_KEY_LEN`] bytes.
pub fn parse_key(bytes: Vec<u8>) -> Result<Vec<u8>, ContractError> {
    if bytes.len() < MIN_KEY_LEN {
        return Err(ContractError::KeyTooShort(bytes.len()));
    }
    Ok(bytes)
}

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

/// Training progress, written by rank 0 every few seconds (one write per job, whatever the
/// number of workers): the operator copies it into the job's status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// When it was written (RFC 3339).
    pub time: String,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_roundtrip_and_validation() {
        let json = r#"{"generation":3,"jobUid":"u-1","members":[
            {"rank":0,"pod":"j-0","address":"127.0.0.2","port":29500},
            {"rank":1,"pod":"j-1","address":"127.0.0.3","port":29500}]}"#;
        let m = Membership::parse(json).unwrap();
        assert_eq!(m.rank_of("j-1"), Some(1));
        assert_eq!(m.addresses()[0].to_string(), "127.0.0.2:29500");
        assert_eq!(
            Membership::parse(&serde_json::to_string(&m).unwrap()).unwrap(),
            m
        );
        let swapped = json.replace(r#""rank":1"#, r#""rank":5"#);
        match Membership::parse(&swapped) {
            Err(ContractError::Invalid { field, .. }) => assert_eq!(field, "members[1].rank"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Membership::parse("{"),
            Err(ContractError::Json(_))
        ));
        assert!(matches!(
            parse_key(vec![0; 5]),
            Err(ContractError::KeyTooShort(5))
        ));
        assert_eq!(membership_configmap_name("demo"), "demo-ring");
    }
}
