//! The one error type of the ring runtime, [`CommError`].
//!
//! Every fallible call of the communicator returns it; each variant names what failed so the
//! worker can decide between "re-form the ring" (`PeerLost`, `Timeout`, `IntegrityFailed`) and
//! "this peer is not one of us" (`AuthFailed`, `WrongJob`, `StaleGeneration`,
//! `ProtectionMismatch`). This module owns no I/O.
//!
//! It wraps the wire format's [`ProtocolError`] (owned by `frame.rs`); the dependency is one-way:
//! `frame` never imports `error`.

use std::time::Duration;

use crate::frame::{Protection, ProtocolError};

/// A failure of a communicator call (connect, allreduce, broadcast, barrier).
///
/// After any error other than a refusal during connect, the communicator is poisoned: its sockets
/// are shut down (so the failure cascades to the other ranks promptly) and every later call returns
/// [`CommError::Poisoned`]. Drop it and form a new generation.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The connection to `rank` ended (EOF, reset, broken pipe) before the operation completed.
    #[error("peer rank {rank} lost during {op}")]
    PeerLost {
        /// Rank of the peer whose connection broke.
        rank: usize,
        /// The operation in flight (`connect`, `allreduce`, `broadcast`, `barrier`).
        op: &'static str,
    },
    /// The operation did not complete within the communicator's timeout.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// The operation in flight.
        op: &'static str,
        /// How long it ran before giving up.
        after: Duration,
        /// The rank whose data (or reading) was awaited, when one was: the silent peer.
        peer: Option<usize>,
    },
    /// The peer belongs to another ring generation.
    #[error("generation mismatch: ours {ours}, peer's {theirs}")]
    StaleGeneration {
        /// Our generation.
        ours: u64,
        /// The peer's generation.
        theirs: u64,
    },
    /// The peer could not prove knowledge of the per-job key (or refused our proof).
    #[error("authentication failed with {peer}: {reason}")]
    AuthFailed {
        /// Who the peer claimed to be, or its socket address.
        peer: String,
        /// What did not verify.
        reason: &'static str,
    },
    /// A data frame from `rank` failed its integrity check (a wrong tag: the frame was
    /// tampered with, replayed, reordered or dropped on the way). The connection is closed and
    /// the communicator poisoned, like any ring fault.
    #[error(
        "integrity check failed on a frame from rank {rank} during {op} \
         (tampered, replayed or reordered data); connection closed"
    )]
    IntegrityFailed {
        /// Rank of the peer whose frame failed.
        rank: usize,
        /// The operation in flight.
        op: &'static str,
    },
    /// The peer protects data frames another way (`spec.ring.protection` differs): the
    /// handshake is refused and the ring cannot form.
    #[error("data-frame protection mismatch with {peer}: ours {ours}, peer's {theirs}")]
    ProtectionMismatch {
        /// Who the peer claimed to be.
        peer: String,
        /// Our mode.
        ours: Protection,
        /// The peer's mode.
        theirs: Protection,
    },
    /// The peer belongs to another job (different job UID).
    #[error("peer belongs to another job (job UID {theirs:?})")]
    WrongJob {
        /// The job UID the peer announced.
        theirs: String,
    },
    /// A frame was malformed, oversized, out of sequence or of an unexpected kind.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The configuration is unusable (rank out of range, wrong number of addresses, …).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The collective was aborted through an [`crate::AbortHandle`].
    #[error("aborted")]
    Aborted,
    /// A previous call failed; this communicator can no longer be used.
    #[error("communicator poisoned by an earlier failure")]
    Poisoned,
    /// Any other socket error.
    #[error("I/O error during {op}")]
    Io {
        /// The operation in flight.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl CommError {
    /// A bounded label for metrics (`peer_lost`, `timeout`, …).
    pub fn metric_label(&self) -> &'static str {
        match self {
            CommError::PeerLost { .. } => "peer_lost",
            CommError::Timeout { .. } => "timeout",
            CommError::StaleGeneration { .. } => "stale_generation",
            CommError::AuthFailed { .. } => "auth_failed",
            CommError::IntegrityFailed { .. } => "integrity_failed",
            CommError::ProtectionMismatch { .. } => "protection_mismatch",
            CommError::WrongJob { .. } => "wrong_job",
            CommError::Protocol(_) => "protocol",
            CommError::Config(_) => "config",
            CommError::Poisoned => "poisoned",
            CommError::Aborted => "aborted",
            CommError::Io { .. } => "io",
        }
    }
}
