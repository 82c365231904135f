//! Where a rank learns about ring generations: the [`RingSource`] a training loop asks after
//! each committed step and after each failure, what it answers ([`Control`], [`Generation`]),
//! and what the loop tells it ([`Progress`]). [`FixedRing`] and [`local_generation`] are the
//! standalone source (one generation on 127.0.0.1); [`crate::k8s::KubeRing`] follows the ring
//! ConfigMap.
//!
//! Owns the trait and its plain data; it must not train (no model, no optimizer) and does no
//! I/O beyond binding the listeners of [`local_generation`].

use std::net::TcpListener;

use crate::{AbortHandle, CommError, Config};

/// One ring generation to join: the communicator config and the listener bound at this
/// member's address.
#[derive(Debug)]
pub struct Generation {
    /// Rank, world, addresses, generation number, key.
    pub config: Config,
    /// Bound at `config.addresses[config.rank]`.
    pub listener: TcpListener,
}

/// What a rank does after a committed step.
#[derive(Debug)]
pub enum Control {
    /// Go on in the current generation.
    Continue,
    /// Leave the current generation and join this one.
    Switch(Generation),
    /// Leave the ring and stop training (scale-down, SIGTERM).
    Leave,
}

/// Where a rank learns about ring generations (the ring ConfigMap in Kubernetes, a fixed list
/// in standalone runs and tests).
pub trait RingSource {
    /// Called once a generation is connected, with the handle that aborts its collective in
    /// flight (e.g. when a newer generation is published while a peer hangs).
    fn connected(&mut self, _generation: u64, _rank: usize, _abort: AbortHandle) {}
    /// Called after a step committed.
    fn after_commit(&mut self, progress: &Progress) -> Control;
    /// Called after a collective or a connect failed with `err`: the generation to join next,
    /// or `None` to give up.
    fn after_failure(&mut self, err: &CommError) -> Option<Generation>;
}

/// What a rank knows after a committed step.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Steps committed.
    pub step: u64,
    /// Steps to train in total.
    pub total_steps: u64,
    /// The generation it committed in.
    pub generation: u64,
    /// This member's rank in that generation.
    pub rank: usize,
    /// Global mean training loss of the step.
    pub loss: f32,
    /// Samples per second over the ring since the generation started.
    pub samples_per_second: f64,
    /// Step of the last checkpoint written by this rank, if any.
    pub last_checkpoint: Option<u64>,
    /// Duration of the step's allreduce, in seconds.
    pub allreduce_seconds: f64,
    /// Size of the step's fused allreduce buffer, in bytes.
    pub allreduce_bytes: u64,
}

/// A ring that never changes: one generation, no replacement after a failure.
#[derive(Debug, Default)]
pub struct FixedRing;

impl RingSource for FixedRing {
    fn after_commit(&mut self, _progress: &Progress) -> Control {
        Control::Continue
    }
    fn after_failure(&mut self, _err: &CommError) -> Option<Generation> {
        None
    }
}

/// Generation 1 of a ring of `world` ranks on 127.0.0.1 (ephemeral ports, one random key),
/// one [`Generation`] per rank.
///
/// # Errors
/// An I/O error binding a listener.
pub fn local_generation(
    world: usize,
    generation: u64,
    key: &[u8],
) -> std::io::Result<Vec<Generation>> {
    let ls = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let addrs = ls
        .iter()
        .map(TcpListener::local_addr)
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(ls
        .into_iter()
        .enumerate()
        .map(|(r, listener)| Generation {
            config: Config::new(
                r,
                world,
                addrs.clone(),
                generation,
                "standalone",
                key.to_vec(),
            ),
            listener,
        })
        .collect())
}
