//! The [`Communicator`] of one ring generation: its configuration and its collectives.
//!
//! Owns the API: [`Config`], [`Communicator::connect`] and the collectives, each of which picks a
//! `schedule.rs` plan by size and runs it step by step. Joining a generation (connecting,
//! accepting, the handshake) lives in `join.rs`; moving one step's bytes over non-blocking
//! sockets lives in `transport.rs`. It decides nothing about the schedules themselves.
//!
//! Transport design: blocking-free sockets driven by the calling thread. Each step's send and
//! receive progress alternately in one loop of non-blocking `writev`/`readv` calls; when neither
//! can progress, the loop spins for [`Config::spin`] (lowest latency for small messages) and then
//! sleeps in `poll(2)` until a socket is ready or the deadline passes. So there is no helper
//! thread, no lock, no allocation per operation (the plan and the scratch buffer are reused), and
//! no call can block past its deadline. Received data for a reduction lands in a cache-sized
//! scratch segment ([`Config::segment_bytes`]) and is reduced into the user's buffer as soon as
//! the segment is full, while the kernel keeps buffering the next segment.
//!
//! Data frames are protected per [`Config::protection`] (`seal.rs`: a keyed tag per frame by
//! default, AES-256-GCM as an option): each connection has a [`Seal`] per direction, and a frame
//! that fails its check ends the collective with [`CommError::IntegrityFailed`].
//!
//! Failure: any error shuts down every socket of the communicator, so each neighbour's pending
//! read ends at once and the failure cascades around the ring within one hop per rank, far inside
//! the timeout; the communicator is then poisoned and can only be dropped.
//!
//! Slow is not hung: with [`Config::liveness`], a collective's wait is not bounded by
//! `timeout`; each time it has waited a window on a silent peer it probes that peer's process
//! (`liveness.rs`), waits on while it answers and blames it only when it does not.

mod join;
mod transport;

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::auth::RefusalCounters;
use crate::error::CommError;
use crate::frame::{MAX_DATA_PAYLOAD, Protection};
use crate::liveness;
use crate::reduce::{self, Element, ReduceOp};
pub use crate::schedule::Algorithm;
use crate::schedule::{self, Step};
use crate::seal::Seal;
use transport::{Kernel, StepCtx, reduce_scratch};

/// Everything needed to join one ring generation.
#[derive(Clone)]
pub struct Config {
    /// This member's rank, `0..world`.
    pub rank: usize,
    /// Number of members.
    pub world: usize,
    /// Every member's ring address, indexed by rank (`addresses[rank]` is where this member
    /// listens when [`Communicator::bind_and_connect`] is used).
    pub addresses: Vec<SocketAddr>,
    /// The ring generation (from the membership).
    pub generation: u64,
    /// The job's UID, bound into each handshake (1..=128 bytes).
    pub job_uid: String,
    /// The per-job HMAC key (at least [`diphoma_contract::MIN_KEY_LEN`] bytes).
    pub key: Vec<u8>,
    /// How data frames are protected after the handshake; every member must use the same
    /// mode (a mismatch fails the handshake). Default: [`Protection::None`].
    pub protection: Protection,
    /// Bound on every call: connect, and each collective unless `liveness` is set.
    pub timeout: Duration,
    /// Tells a slow peer from a hung one (see [`crate::liveness`]). When set, a collective that
    /// has waited this long on a silent peer probes that peer's process for up to this long
    /// again: a peer that answers is waited for another window (and probed again after it), one
    /// that does not is blamed with [`CommError::Timeout`] naming its rank. So a step may take
    /// as long as it takes, a hung peer is blamed within twice this window, and a new
    /// generation still aborts the wait at once. Peers must run a
    /// [`liveness::Responder`] at their ring address (UDP). `None`
    /// (the default): each collective is bounded by `timeout`.
    pub liveness: Option<Duration>,
    /// How long a collective busy-polls its sockets before sleeping in `poll(2)`. Spinning cuts
    /// small-message latency roughly in half (no wake-up); default 50 µs when `world` ≤ available
    /// cores, 200 µs (yielding) when ranks outnumber cores and a wake-up costs a time slice.
    pub spin: Duration,
    /// While spinning, call `sched_yield` between polls of the sockets, so a peer (or any other
    /// process) that needs this core gets it: nearly free on an idle core, essential when ranks
    /// outnumber cores. Default: true.
    pub yield_spin: bool,
    /// `SO_SNDBUF`/`SO_RCVBUF` requested for data connections, in bytes (capped by the kernel's
    /// `wmem_max`/`rmem_max`); 0 keeps the kernel's autotuning.
    pub socket_buffer: usize,
    /// Allreduce buffers up to this many bytes use recursive doubling; larger ones use the ring.
    pub small_bytes: usize,
    /// Forces one allreduce algorithm for every size (benchmarks, tests); `None` chooses by
    /// size: recursive doubling up to `small_bytes`, then the halving-doubling algorithm when
    /// `world` is a power of two above 2, else the ring.
    pub algorithm: Option<Algorithm>,
    /// Size of the scratch segment received data is reduced from, in bytes (rounded down to a
    /// multiple of 8, at least 4096).
    pub segment_bytes: usize,
    /// Refusal counters (shared with metrics; counted even when `connect` fails).
    pub counters: Arc<RefusalCounters>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("addresses", &self.addresses)
            .field("generation", &self.generation)
            .field("job_uid", &self.job_uid)
            .field("key", &"<redacted>")
            .field("protection", &self.protection)
            .field("timeout", &self.timeout)
            .field("liveness", &self.liveness)
            .field("spin", &self.spin)
            .field("yield_spin", &self.yield_spin)
            .field("socket_buffer", &self.socket_buffer)
            .field("small_bytes", &self.small_bytes)
            .field("segment_bytes", &self.segment_bytes)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

/// Default bound on every call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default recursive-doubling threshold, in bytes.
pub const DEFAULT_SMALL_BYTES: usize = 64 << 10;
/// Default socket buffer request, in bytes.
pub const DEFAULT_SOCKET_BUFFER: usize = 4 << 20;
/// Default scratch segment, in bytes.
pub const DEFAULT_SEGMENT_BYTES: usize = 256 << 10;

impl Config {
    /// A configuration with the defaults for timeout, spinning, thresholds and fresh counters.
    pub fn new(
        rank: usize,
        world: usize,
        addresses: Vec<SocketAddr>,
        generation: u64,
        job_uid: impl Into<String>,
        key: impl Into<Vec<u8>>,
    ) -> Config {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Config {
            rank,
            world,
            addresses,
            generation,
            job_uid: job_uid.into(),
            key: key.into(),
            protection: Protection::default(),
            timeout: DEFAULT_TIMEOUT,
            liveness: None,
            spin: Duration::from_micros(if world <= cores { 50 } else { 200 }),
            yield_spin: true,
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            small_bytes: DEFAULT_SMALL_BYTES,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            algorithm: None,
            counters: Arc::default(),
        }
    }

    fn validate(&self) -> Result<(), CommError> {
        let bad = |m: String| Err(CommError::Config(m));
        if self.world == 0 || self.rank >= self.world {
            return bad(format!("rank {} not in 0..{}", self.rank, self.world));
        }
        if self.addresses.len() != self.world {
            return bad(format!(
                "{} addresses for world {}",
                self.addresses.len(),
                self.world
            ));
        }
        if self.job_uid.is_empty() || self.job_uid.len() > diphoma_contract::MAX_JOB_UID {
            return bad("job_uid must be 1..=128 bytes".into());
        }
        if self.key.len() < diphoma_contract::MIN_KEY_LEN {
            return bad(format!(
                "key must be at least {} bytes",
                diphoma_contract::MIN_KEY_LEN
            ));
        }
        if self.world > u32::MAX as usize {
            return bad("world too large".into());
        }
        Ok(())
    }
}

/// Aborts a communicator's collective in flight from another thread (e.g. when a new
/// generation is published): its sockets are shut down, the call in flight returns
/// [`CommError::Aborted`] promptly, and the peers see the connection end.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    streams: Arc<Vec<TcpStream>>,
    aborted: Arc<AtomicBool>,
}

impl AbortHandle {
    /// True once [`AbortHandle::abort`] was called (a newer generation was published).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Shuts down every connection of the communicator.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in self.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// A member of one ring generation: authenticated connections to the peers its collectives
/// need, and the collectives.
///
/// Not `Sync`: one collective at a time, called by every rank in the same order with buffers of
/// the same length (the usual collective contract; a mismatch is detected as a
/// [`ProtocolError::OutOfStep`](crate::ProtocolError::OutOfStep)).
pub struct Communicator {
    rank: usize,
    world: usize,
    generation: u64,
    timeout: Duration,
    spin: Duration,
    yield_spin: bool,
    small_bytes: usize,
    segment_bytes: usize,
    algorithm: Option<Algorithm>,
    links: Vec<Option<TcpStream>>,
    /// Per peer rank: the protection of the frames we send to it, and of those we receive.
    tx_seals: Vec<Seal>,
    rx_seals: Vec<Seal>,
    /// Two frames' worth of ciphertext (send, receive) under encryption; empty otherwise.
    stage: Vec<u8>,
    counters: Arc<RefusalCounters>,
    scratch: Vec<u64>,
    steps: Vec<Step>,
    seq: u64,
    poisoned: bool,
    abort: AbortHandle,
    liveness: Option<Liveness>,
}

/// What a collective needs to probe a silent peer (see [`Config::liveness`]).
pub(super) struct Liveness {
    /// The quiet wait before a probe, and the probe's own bound.
    window: Duration,
    key: Vec<u8>,
    addresses: Vec<SocketAddr>,
    rank: usize,
    aborted: Arc<AtomicBool>,
}

impl Liveness {
    /// True when `peer`'s process answered within the window (see [`liveness::probe`]).
    fn alive(&self, peer: usize) -> bool {
        let from = self.addresses[self.rank].ip();
        liveness::probe(
            from,
            self.addresses[peer],
            &self.key,
            self.window,
            &self.aborted,
        )
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("generation", &self.generation)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

/// The timeout of `op`, begun at `start`, blaming `peer` when one was awaited (used by `join.rs`
/// and `transport.rs`).
fn timeout_err(op: &'static str, start: Instant, peer: Option<usize>) -> CommError {
    CommError::Timeout {
        op,
        after: start.elapsed(),
        peer,
    }
}

impl Communicator {
    /// Binds `config.addresses[rank]` and joins the ring (see [`Communicator::connect`]).
    ///
    /// # Errors
    /// [`CommError::Io`] when the address cannot be bound, and everything `connect` returns.
    pub fn bind_and_connect(config: Config) -> Result<Communicator, CommError> {
        config.validate()?;
        let l = TcpListener::bind(config.addresses[config.rank])
            .map_err(|source| CommError::Io { op: "bind", source })?;
        Communicator::connect(config, l)
    }

    /// Joins the ring on an already bound `listener`: connects to the lower-ranked peers it
    /// needs, accepts the higher-ranked ones, and authenticates every connection. Connections
    /// that fail authentication are refused, counted in `config.counters`, and do not stop the
    /// join. World size 1 needs no connection.
    ///
    /// # Errors
    /// [`CommError::Config`] on an unusable config; [`CommError::Timeout`] when not every peer
    /// joined within `config.timeout`; [`CommError::AuthFailed`], [`CommError::WrongJob`],
    /// [`CommError::StaleGeneration`] (peer newer than us) or [`CommError::Protocol`] when a peer
    /// we connected to refused us or failed to prove the key; [`CommError::ProtectionMismatch`]
    /// when a peer runs another [`Config::protection`]. `StaleGeneration` with
    /// `theirs > ours` also comes back, without waiting for the timeout, when a peer that
    /// proved the key connected to us from a newer generation: ours will not form.
    pub fn connect(config: Config, listener: TcpListener) -> Result<Communicator, CommError> {
        config.validate()?;
        let joined = join::join(&config, listener)?;
        let seal =
            |k: Option<&[u8; 32]>| k.map_or_else(Seal::none, |k| Seal::new(config.protection, k));
        let tx_seals = joined
            .iter()
            .map(|j| seal(j.as_ref().map(|(_, k)| &k.send)))
            .collect();
        let rx_seals = joined
            .iter()
            .map(|j| seal(j.as_ref().map(|(_, k)| &k.recv)))
            .collect();
        let links: Vec<Option<TcpStream>> = joined.into_iter().map(|j| j.map(|(s, _)| s)).collect();
        let clones = links
            .iter()
            .flatten()
            .map(|s| s.try_clone())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| CommError::Io {
                op: "connect",
                source,
            })?;
        let segment_bytes = (config.segment_bytes / 8 * 8).max(4096);
        let scratch_bytes = segment_bytes.max(config.small_bytes);
        let aborted: Arc<AtomicBool> = Arc::default();
        let liveness = config.liveness.map(|window| Liveness {
            window,
            key: config.key.clone(),
            addresses: config.addresses.clone(),
            rank: config.rank,
            aborted: aborted.clone(),
        });
        Ok(Communicator {
            rank: config.rank,
            world: config.world,
            generation: config.generation,
            timeout: config.timeout,
            spin: config.spin,
            yield_spin: config.yield_spin,
            small_bytes: config.small_bytes,
            segment_bytes,
            algorithm: config.algorithm,
            links,
            tx_seals,
            rx_seals,
            stage: match config.protection {
                Protection::Encryption => vec![0; 2 * MAX_DATA_PAYLOAD],
                _ => Vec::new(),
            },
            counters: config.counters.clone(),
            scratch: vec![0u64; scratch_bytes.div_ceil(8)],
            steps: Vec::with_capacity(64),
            seq: 0,
            poisoned: false,
            abort: AbortHandle {
                streams: Arc::new(clones),
                aborted,
            },
            liveness,
        })
    }

    /// This member's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of members.
    pub fn world(&self) -> usize {
        self.world
    }
    /// The generation this communicator belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The refusal counters (shared with the config it was built from).
    pub fn counters(&self) -> &Arc<RefusalCounters> {
        &self.counters
    }
    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// In-place allreduce of `buf` (the same length on every rank): afterwards every rank holds
    /// the element-wise sum (average, maximum, minimum) of all ranks' buffers, bit-identical on
    /// all ranks. Half types travel as half and accumulate each reduction in f32. Buffers up to
    /// [`Config::small_bytes`] use recursive doubling, larger ones the pipelined ring. World
    /// size 1 and empty buffers return at once.
    ///
    /// # Errors
    /// [`CommError::Config`] for [`ReduceOp::Avg`] on a type that does not average
    /// ([`DType::averages`](crate::DType::averages)), before anything is sent;
    /// [`CommError::PeerLost`], [`CommError::Timeout`] (after [`Config::timeout`]),
    /// [`CommError::Protocol`], [`CommError::Aborted`], [`CommError::Poisoned`]. On error `buf`
    /// holds unspecified values and the communicator is poisoned.
    pub fn allreduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.check()?;
        check_op::<T>(op)?;
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::size_of_val(buf);
        let alg = match self.algorithm {
            Some(a) => a,
            None if bytes <= self.small_bytes || buf.len() < self.world => {
                Algorithm::RecursiveDoubling
            }
            None if self.world > 2 && self.world.is_power_of_two() => Algorithm::Halving,
            None => Algorithm::Ring,
        };
        self.steps.clear();
        schedule::allreduce(alg, self.world, self.rank, buf.len(), &mut self.steps);
        let scale = (op == ReduceOp::Avg).then(|| 1.0 / self.world as f32);
        self.run(
            "allreduce",
            reduce::as_bytes_mut(buf),
            Kernel::of::<T>(op),
            scale,
        )
    }

    /// In-place ring reduce-scatter of `buf` (the same length on every rank, split into
    /// `world` balanced chunks by [`schedule::chunk`]): afterwards
    /// `buf[chunk(buf.len(), world, rank)]` holds the reduction of that chunk over every rank,
    /// bit-identical to what every other rank would compute; the rest of `buf` holds partial
    /// results. World size 1 and empty buffers return at once.
    ///
    /// # Errors
    /// As [`Communicator::allreduce`].
    pub fn reduce_scatter<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check()?;
        check_op::<T>(op)?;
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        self.steps.clear();
        schedule::reduce_scatter(self.world, self.rank, buf.len(), &mut self.steps);
        let scale = (op == ReduceOp::Avg).then(|| 1.0 / self.world as f32);
        self.run(
            "reduce_scatter",
            reduce::as_bytes_mut(buf),
            Kernel::of::<T>(op),
            scale,
        )
    }

    /// In-place ring all-gather of raw bytes: `buf` is `world` chunks of `buf.len() / world`
    /// bytes; each rank fills chunk `rank` and afterwards holds every rank's chunk.
    ///
    /// # Errors
    /// [`CommError::Config`] when `buf.len()` is not a multiple of the world size; otherwise as
    /// [`Communicator::allreduce`].
    pub fn allgather_bytes(&mut self, buf: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        if !buf.len().is_multiple_of(self.world) {
            return Err(CommError::Config(format!(
                "all-gather of {} bytes does not split into {} equal chunks",
                buf.len(),
                self.world
            )));
        }
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        self.steps.clear();
        schedule::allgather(self.world, self.rank, buf.len(), &mut self.steps);
        self.run("allgather", buf, Kernel::bytes(), None)
    }

    /// Broadcast of `buf` from rank `root` to every rank (same length everywhere).
    ///
    /// # Errors
    /// As [`Communicator::allreduce`], and [`CommError::Config`] when `root` is out of range.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.broadcast_bytes(reduce::as_bytes_mut(buf), root)
    }

    /// Broadcast of raw bytes from rank `root` (parameters, optimizer state, …): binomial tree
    /// up to [`Config::small_bytes`], pipelined chain in segments above.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    pub fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.check()?;
        if root >= self.world {
            return Err(CommError::Config(format!(
                "root {root} not in 0..{}",
                self.world
            )));
        }
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        self.steps.clear();
        if buf.len() <= self.small_bytes {
            schedule::broadcast_tree(self.world, self.rank, root, buf.len(), &mut self.steps);
        } else {
            let seg = self.segment_bytes * 4;
            schedule::broadcast_chain(self.world, self.rank, root, buf.len(), seg, &mut self.steps);
        }
        self.run("broadcast", buf, Kernel::bytes(), None)
    }

    /// Returns once every rank has entered the barrier (recursive doubling of empty messages).
    ///
    /// # Errors
    /// As [`Communicator::allreduce`].
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.check()?;
        if self.world == 1 {
            return Ok(());
        }
        self.steps.clear();
        schedule::allreduce(
            Algorithm::RecursiveDoubling,
            self.world,
            self.rank,
            0,
            &mut self.steps,
        );
        self.run("barrier", &mut [], Kernel::bytes(), None)
    }

    fn check(&self) -> Result<(), CommError> {
        if self.poisoned {
            return Err(CommError::Poisoned);
        }
        Ok(())
    }

    fn run(
        &mut self,
        op: &'static str,
        buf: &mut [u8],
        kern: Kernel,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        self.seq += 1;
        let start = Instant::now();
        // With liveness, each wait past the window probes the silent peer (transport.rs).
        let mut deadline = start + self.liveness.as_ref().map_or(self.timeout, |l| l.window);
        let steps = std::mem::take(&mut self.steps);
        let mut result = Ok(());
        for step in &steps {
            let overlap_len = step
                .recv
                .as_ref()
                .map_or(0, |(r, _)| r.range.len() * kern.esize);
            if self.scratch.len() * 8 < overlap_len && overlaps(step) {
                self.scratch.resize(overlap_len.div_ceil(8), 0);
            }
            let ctx = StepCtx {
                links: &self.links,
                tx_seals: &mut self.tx_seals,
                rx_seals: &mut self.rx_seals,
                stage: &mut self.stage,
                scratch: reduce_scratch(&mut self.scratch),
                segment: self.segment_bytes,
                seq: self.seq,
                op,
                start,
                deadline: &mut deadline,
                liveness: self.liveness.as_ref(),
                spin: self.spin,
                yield_spin: self.yield_spin,
                kern,
                scale,
            };
            if let Err(e) = ctx.run(buf, step) {
                result = Err(e);
                break;
            }
        }
        self.steps = steps;
        if let Err(e) = result {
            self.poison();
            if self.abort.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted);
            }
            return Err(e);
        }
        Ok(())
    }

    /// The first peer whose connection to this member was closed or reset (its process gone,
    /// or it left this generation and shut its sockets: the failure cascade), seen without
    /// reading anything (`peek` on the non-blocking links). Meant for a ring at rest: another
    /// data plane's collective watches it while it waits ([`crate::foreign`]).
    pub fn closed_peer(&self) -> Option<usize> {
        let mut byte = [0u8; 1];
        self.links
            .iter()
            .enumerate()
            .find_map(|(rank, s)| match s.as_ref()?.peek(&mut byte) {
                Ok(0) => Some(rank),
                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => Some(rank),
                _ => None,
            })
    }

    fn poison(&mut self) {
        self.poisoned = true;
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Abort handles hold clones of the sockets: shut them down so peers see the end now.
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Refuses an average of a type that does not average.
fn check_op<T: Element>(op: ReduceOp) -> Result<(), CommError> {
    if op == ReduceOp::Avg && !T::DTYPE.averages() {
        return Err(CommError::Config(format!(
            "{op:?} is not defined for {:?} (sum, max or min are)",
            T::DTYPE
        )));
    }
    Ok(())
}

/// True when a step sends from and receives into overlapping ranges (exchange steps): the
/// received data must wait in scratch until the send completes.
fn overlaps(step: &Step) -> bool {
    match (&step.send, &step.recv) {
        (Some(s), Some((r, _))) => s.range.start < r.range.end && r.range.start < s.range.end,
        _ => false,
    }
}
