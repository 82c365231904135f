//! The operator/worker contract: environment variable names, ports, labels, the ring-membership
//! format, the key file and the heartbeat formats. The operator, the ring, the worker and e2e
//! import this crate; nothing here is written down anywhere else.
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
//! 3. The worker answers liveness pings on UDP at the same address and port as its ring
//!    listener (the ring crate's `liveness` module), from the start of its process: a peer
//!    whose collective waits on it asks whether the process is alive before blaming it. Both
//!    windows follow [`ENV_DETECTION_SECONDS`].
//!
//! # Layout
//!
//! | module | owns | must not |
//! |---|---|---|
//! | crate root | env names, ports, labels, key-file constants, protocol bounds shared with the ring | do I/O |
//! | [`membership`] | the ring-membership document ([`Membership`]), its validation, the key-file check | do I/O |
//! | [`heartbeat`] | the heartbeat ConfigMap: rank 0's [`ProgressReport`], the workers' [`FailureReport`]s | do I/O |
//! | [`local`] | a pod of several training processes: its members' ranks and ports ([`Local`], [`Membership::per_process`], [`process_port`]) | do I/O |
//! | [`balance`] | speed-weighted shares that every worker of a job derives alike: the smoothed compute time per sample ([`balance::Speed`]), the split of the global batch by largest remainder ([`balance::split`]) | do I/O, time anything itself |
//!
//! This crate imports nothing of ours (only serde, serde_json and thiserror): the operator, the
//! ring, the worker and e2e all depend on it, and it on none of them.

pub mod balance;
pub mod heartbeat;
pub mod local;
pub mod membership;

pub use heartbeat::{
    FailureReport, PROGRESS_KEY, ProgressReport, REPORT_KEY_PREFIX, RESTART_MEMBER_JOINED,
    RESTART_MEMBER_LOST, RESTART_RING_FAULT, RESTARTS_KEY_PREFIX, RestartReport,
    heartbeat_configmap_name, share_range,
};
pub use local::{
    ENV_LOCAL_RANK, ENV_PROCESSES_PER_WORKER, Local, LocalError, MAX_PROCESSES_PER_WORKER,
    last_port, process_port,
};
pub use membership::{
    ContractError, MEMBERSHIP_KEY, Member, Membership, membership_configmap_name, parse_key,
};

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
/// Env: the job's `faultTolerance.detectionSeconds`, a positive whole number of seconds: a
/// silent worker must be blamed within it, a slow one never. The ring derives from it how long
/// a collective waits on a silent peer before probing its liveness, and how long the probe
/// waits for an answer.
pub const ENV_DETECTION_SECONDS: &str = "DIPHOMA_DETECTION_SECONDS";
/// Env: how ring data frames are protected (`spec.ring.protection`): `none` (the default when
/// unset), `integrity` (a keyed tag on every frame) or `encryption` (AES-256-GCM). Every worker of a
/// job gets the same value; peers that differ refuse each other's handshake.
pub const ENV_RING_PROTECTION: &str = "DIPHOMA_RING_PROTECTION";
/// Env: what carries a PyTorch job's collectives (`spec.ring.dataPlane`): `ring` (the default
/// when unset), `gloo` or `nccl` (a communicator of that library per ring generation;
/// `diphoma.torch._plane`).
pub const ENV_DATA_PLANE: &str = "DIPHOMA_DATA_PLANE";
/// Env: the wire dtype of a PyTorch job's float32 all-reduces (`spec.ring.compression`): `none`
/// (the default when unset) or `bf16` (`diphoma.torch._ops.compression`).
pub const ENV_COMPRESSION: &str = "DIPHOMA_COMPRESSION";
/// Env: directory of the checkpoints (the mount path of `spec.checkpoint.volume`); unset: none.
pub const ENV_CHECKPOINT_DIR: &str = "DIPHOMA_CHECKPOINT_DIR";
/// Env: steps between two checkpoints (`spec.checkpoint.everySteps`).
pub const ENV_CHECKPOINT_EVERY: &str = "DIPHOMA_CHECKPOINT_EVERY";
/// Env: name of a job of the same namespace whose newest checkpoint the job resumes when it has
/// none of its own (`spec.checkpoint.resumeFrom.name`); unset: only its own. A job's own
/// checkpoints are in `<DIPHOMA_CHECKPOINT_DIR>/<namespace>/<job>/<uid>/`.
pub const ENV_CHECKPOINT_RESUME_FROM: &str = "DIPHOMA_CHECKPOINT_RESUME_FROM";

/// Env: `true` (the default when unset) splits each step's global batch over the workers in
/// proportion to their measured speeds, `false` equally (`spec.balance.speedWeighted`).
pub const ENV_SPEED_WEIGHTED: &str = "DIPHOMA_SPEED_WEIGHTED";
/// Env: committed steps between two re-splits of the batch (`spec.balance.everySteps`).
pub const ENV_BALANCE_EVERY: &str = "DIPHOMA_BALANCE_EVERY";
/// Env: `0` (the default when unset) synchronises every step (one gradient allreduce); `H ≥ 1`
/// takes `H` local steps between two averages of the models (`spec.sync`, mode `Periodic`).
pub const ENV_SYNC_EVERY: &str = "DIPHOMA_SYNC_EVERY";

/// Default TCP port of the ring (`spec.ringPort`).
pub const DEFAULT_RING_PORT: u16 = 29500;
/// Name of the ring port on the worker container.
pub const RING_PORT_NAME: &str = "ring";
/// Name of the liveness port on the worker container: UDP, the ring port's number.
pub const LIVENESS_PORT_NAME: &str = "liveness";
/// Name of the rendezvous store's port on the worker container: TCP, the ring port's number
/// plus one ([`store_port`]), where rank 0's training process serves torch's `TCPStore`
/// (`MASTER_PORT`) when `python -m diphoma.run` runs a torchrun script in the pod.
pub const STORE_PORT_NAME: &str = "store";
/// Env: the rendezvous store's port ([`store_port`] of the ring port).
pub const ENV_STORE_PORT: &str = "DIPHOMA_STORE_PORT";

/// The most of a container's termination message Kubernetes keeps (the kubelet's bound, also
/// `status.lastFailure.message`'s).
pub const TERMINATION_MESSAGE_BYTES: usize = 2048;

/// The end of `text`, at most `max_bytes` long, cut at a character boundary (where a log or a
/// traceback says what happened last).
pub fn tail(text: &str, max_bytes: usize) -> &str {
    let mut start = text.len().saturating_sub(max_bytes);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

#[cfg(test)]
#[test]
fn a_tail_keeps_the_end_at_a_character_boundary() {
    assert_eq!(tail("abcdef", 3), "def");
    assert_eq!(tail("ab", 3), "ab");
    assert_eq!(tail("aéb", 2), "b", "the é's second byte is no boundary");
}

/// The rendezvous store's port of a job whose ring listens on `ring_port` (at most 65534, as
/// `spec.ringPort` allows): the next one.
pub fn store_port(ring_port: u16) -> u16 {
    ring_port.saturating_add(1)
}

/// Default TCP port of the worker's `/metrics` endpoint (on the pod IP).
pub const DEFAULT_METRICS_PORT: u16 = 9400;
/// Name of the metrics port on the worker container.
pub const METRICS_PORT_NAME: &str = "metrics";

/// Label on every worker pod: the owning job's name.
pub const LABEL_JOB_NAME: &str = "diphoma.io/job-name";
/// Label on every worker pod: its replica index (stable pod identity, not the ring rank, which
/// changes with each generation).
pub const LABEL_REPLICA_INDEX: &str = "diphoma.io/replica-index";
/// Label on a worker pod that is a ring member: its rank in the current generation (absent on a
/// worker outside the ring; a worker created before the job's first ring carries the rank that
/// ring will give it, so that forming it patches no pod). Kept up to date by the operator when
/// the ring re-forms (a member whose rank does not change is not patched), so that
/// `kubectl logs -l diphoma.io/job-name=J,diphoma.io/rank=0` finds rank 0.
pub const LABEL_RANK: &str = "diphoma.io/rank";
/// Label on a worker pod that is a ring member: the generation since which it holds its
/// [`LABEL_RANK`] (the generation that gave it that rank; it holds the same rank in every later
/// one up to the current). Not rewritten while the rank stays, so that a repair patches only the
/// members whose rank moved (issue 14); the current generation is the ring ConfigMap's and
/// `status.ring.generation`.
pub const LABEL_GENERATION: &str = "diphoma.io/generation";

/// Key inside the job's Secret, and file name inside its mount, of the per-job HMAC key.
pub const KEY_FILE_NAME: &str = "ring.key";
/// Directory where the operator mounts the key Secret in worker pods.
pub const KEY_MOUNT_DIR: &str = "/var/run/diphoma";
/// Shortest acceptable per-job key, in bytes.
pub const MIN_KEY_LEN: usize = 32;
/// Longest job UID, in bytes: a membership's `jobUid` and the ring handshake's `Hello` carry at
/// most this many (Kubernetes UIDs are 36).
pub const MAX_JOB_UID: usize = 128;
