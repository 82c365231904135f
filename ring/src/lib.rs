//! Diphoma's ring runtime: allreduce, reduce-scatter, all-gather, broadcast and barrier over
//! authenticated TCP (every data frame tagged, or encrypted on request), for one ring generation at a time, and the membership follower that tells
//! a worker pod which generation to join.
//!
//! ```no_run
//! use diphoma_ring::{Communicator, Config, ReduceOp};
//! # fn main() -> Result<(), diphoma_ring::CommError> {
//! let addrs = vec!["10.0.0.1:29500".parse().unwrap(), "10.0.0.2:29500".parse().unwrap()];
//! let cfg = Config::new(0, 2, addrs, 1, "job-uid", vec![7u8; 32]);
//! let mut comm = Communicator::bind_and_connect(cfg)?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.allreduce(&mut grads, ReduceOp::Avg)?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! | module | owns | must not |
//! |---|---|---|
//! | [`schedule`] | the collective schedules as pure step lists (ring, recursive doubling, trees, chains, ring reduce-scatter and all-gather) | touch sockets |
//! | [`reduce`] | element types (f32, f16, bf16, f64, i32, i64) and the reduction kernels (sum, max, min) | touch sockets |
//! | [`frame`] | the wire format: 16-byte headers, handshake messages, validating decoders, [`ProtocolError`] | touch sockets, allocate while decoding, import `error` |
//! | [`auth`] | the HMAC-SHA256 challenge-response on one stream, the HKDF-SHA256 frame keys, refusal counters | open sockets, see data |
//! | [`seal`] | per-frame protection of one direction: BLAKE3 keyed tags or AES-256-GCM, the frame counter | touch sockets, decide what a failure means |
//! | [`comm`] | the [`Communicator`] and its collectives (`comm/mod.rs`), the non-blocking transport (`comm/transport.rs`), joining a generation (`comm/join.rs`) | choose schedules by itself beyond size thresholds |
//! | [`foreign`] | which member a collective of another library (gloo: `spec.ring.dataPlane`) blames, from liveness answers (pure) | probe, keep state |
//! | [`liveness`] | liveness apart from progress: the UDP [`liveness::Responder`] a process runs at its ring address, the keyed ping/pong, [`liveness::probe`] | touch the TCP ring, judge what silence means |
//! | [`error`] | [`CommError`], the error of every communicator call | do I/O |
//! | [`source`] | the [`source::RingSource`] a training loop follows, the standalone [`source::FixedRing`] and [`source::standalone_config`] (a launcher's env) | train |
//! | [`follow`] | the membership follower, once: [`follow::Follower`] over a [`follow::Backend`] (newer generation aborts the collective in flight, one failure report per failure, the re-form wait, rank 0's progress cadence) | train, do I/O but through its backend |
//! | `k8s` (feature `kube`) | the pod's backend: contract env, the ring ConfigMap watched (`k8s::KubeRing`), heartbeat writes, the launcher's `k8s::RingWatch`; a worker pod's, so the standalone ring does not link kube, k8s-openapi or tokio | train, record metrics, decide what a membership means |
//! | [`file`](mod@file) | the standalone backend: a ring directory (`membership.json` in, heartbeat records out; [`file::FileRing`]) | train, decide what a membership means |
//!
//! This crate must not import candle, safetensors or anything of training, nor the operator:
//! its only Diphoma dependency is `diphoma-contract`.
//!
//! # Design decisions
//!
//! - **Transport: one thread, non-blocking sockets, `poll(2)`.** A step's send and receive
//!   are interleaved on the calling thread with non-blocking `writev`/`readv`, spinning briefly
//!   (yielding) before sleeping in `poll`. Full duplex without helper threads or hand-offs:
//!   nothing to wake, no deadlock when both sides send at once (neither blocks in `write`), and
//!   every wait is bounded by the collective's deadline. On a 2-core box running 4 ranks this
//!   matters: every extra thread competes for the same cores.
//! - **Algorithms by size** (see [`comm::Config`]): recursive doubling up to 64 KiB (direct
//!   exchange for 2 ranks), the Rabenseifner halving-doubling schedule for larger buffers when
//!   the world is a power of two above 2, and the ring otherwise; all three are pure schedules.
//! - **Half types stay half on the wire** and are reduced through f32 (AVX2/F16C kernels chosen
//!   at run time, portable ones otherwise).
//! - **Failure cascade:** on any error the communicator shuts all its sockets, so every
//!   neighbour's call fails at once with `PeerLost` rather than at its timeout.
//! - **Slow is not hung** ([`liveness`]): in Kubernetes mode a collective waits on a silent peer
//!   as long as the peer's process answers a keyed UDP ping (a responder thread, independent of
//!   the training step), and blames it only when it does not within the window derived from
//!   `faultTolerance.detectionSeconds`.
//! - **One follower, two backends** ([`follow`]): the ring ConfigMap watched on a private tokio
//!   runtime (`k8s`) or a polled ring directory ([`file`](mod@file)) only deliver memberships and write
//!   records; a newer generation aborts the collective in flight; after a failure a member
//!   writes one report per failure, waits [`follow::REJOIN_WAIT`] for a newer generation, else
//!   re-forms the newest it knows.

#[cfg(target_endian = "big")]
compile_error!("the wire format is little-endian and buffers travel as raw bytes");

pub mod auth;
pub mod comm;
pub mod error;
pub mod file;
pub mod follow;
pub mod foreign;
pub mod frame;
#[cfg(feature = "kube")]
pub mod k8s;
pub mod liveness;
pub mod reduce;
pub mod schedule;
pub mod seal;
pub mod source;

pub use auth::RefusalCounters;
pub use comm::{AbortHandle, Communicator, Config};
pub use error::CommError;
pub use frame::{Protection, ProtocolError};
pub use half::{bf16, f16};
pub use reduce::{DType, Element, ReduceOp};
