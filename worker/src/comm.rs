//! The [`Communicator`] of one ring generation, and the transport that runs plans over TCP.
//!
//! Owns the sockets of one generation: connecting and authenticating them (with `auth.rs`),
//! and executing the steps of a `plan.rs` schedule with frames of `frame.rs` and the kernels of
//! `reduce.rs`. It decides nothing about the schedule itself.
//!
//! Transport design: blocking-free sockets driven by the calling thread. Each step's send and
//! receive progress alternately in one loop of non-blocking `writev`/`read` calls; when neither
//! can progress, the loop spins for [`Config::spin`] (lowest latency for small messages) and then
//! sleeps in `poll(2)` until a socket is ready or the deadline passes. So there is no helper
//! thread, no lock, no allocation per operation (the plan and the scratch buffer are reused), and
//! no call can block past its deadline. Received data for a reduction lands in a cache-sized
//! scratch segment ([`Config::segment_bytes`]) and is reduced into the user's buffer as soon as
//! the segment is full, while the kernel keeps buffering the next segment.
//!
//! Failure: any error shuts down every socket of the communicator, so each neighbour's pending
//! read ends at once and the failure cascades around the ring within one hop per rank, far inside
//! the timeout; the communicator is then poisoned and can only be dropped.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::auth::{self, AuthParams, RefusalCounters};
use crate::error::{CommError, ProtocolError};
use crate::frame::{HEADER_LEN, Header, Kind, MAX_DATA_PAYLOAD};
pub use crate::plan::Algorithm;
use crate::plan::{self, Action, Step};
use crate::reduce::{self, Element, ReduceOp};

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
    /// The per-job HMAC key (at least [`crate::contract::MIN_KEY_LEN`] bytes).
    pub key: Vec<u8>,
    /// Bound on every call: connect, each collective.
    pub timeout: Duration,
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
            .field("timeout", &self.timeout)
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
            timeout: DEFAULT_TIMEOUT,
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
        if self.job_uid.is_empty() || self.job_uid.len() > crate::frame::MAX_JOB_UID {
            return bad("job_uid must be 1..=128 bytes".into());
        }
        if self.key.len() < crate::contract::MIN_KEY_LEN {
            return bad(format!(
                "key must be at least {} bytes",
                crate::contract::MIN_KEY_LEN
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
/// [`ProtocolError::OutOfStep`]).
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
    counters: Arc<RefusalCounters>,
    scratch: Vec<u64>,
    steps: Vec<Step>,
    seq: u64,
    poisoned: bool,
    abort: AbortHandle,
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

const HANDSHAKE_MAX: Duration = Duration::from_secs(5);

fn clamp_timeout(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    Some(left.clamp(Duration::from_millis(1), HANDSHAKE_MAX))
}

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
    /// we connected to refused us or failed to prove the key. `StaleGeneration` with
    /// `theirs > ours` also comes back, without waiting for the timeout, when a peer that
    /// proved the key connected to us from a newer generation: ours will not form.
    pub fn connect(config: Config, listener: TcpListener) -> Result<Communicator, CommError> {
        config.validate()?;
        let start = Instant::now();
        let deadline = start + config.timeout;
        let (rank, world) = (config.rank, config.world);
        let peers = plan::peers(world, rank);
        let (lower, higher): (Vec<usize>, Vec<usize>) = peers.iter().partition(|&&p| p < rank);
        let params = AuthParams {
            key: &config.key,
            job_uid: &config.job_uid,
            generation: config.generation,
            world: world as u32,
        };
        let stop = AtomicBool::new(false);
        let counters = &config.counters;
        let (acc, con) = std::thread::scope(|sc| {
            let acc = sc.spawn(|| {
                let r = accept_peers(
                    &listener, &params, rank, &higher, start, deadline, &stop, counters,
                );
                if r.is_err() {
                    stop.store(true, Ordering::SeqCst);
                }
                r
            });
            let con = connect_peers(&config, &params, &lower, start, deadline, &stop, counters);
            if con.is_err() {
                stop.store(true, Ordering::SeqCst);
            }
            (
                acc.join()
                    .unwrap_or(Err(CommError::Config("accept thread panicked".into()))),
                con,
            )
        });
        // Whichever half failed first stopped the other (which then says `Aborted` or
        // `Timeout`): report the first failure.
        let con = match con {
            Err(CommError::Aborted) => return Err(acc.err().unwrap_or(CommError::Aborted)),
            c => c?,
        };
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (p, s) in con.into_iter().chain(acc?) {
            s.set_nodelay(true).map_err(|source| CommError::Io {
                op: "connect",
                source,
            })?;
            s.set_nonblocking(true).map_err(|source| CommError::Io {
                op: "connect",
                source,
            })?;
            if config.socket_buffer > 0 {
                set_buffers(&s, config.socket_buffer);
            }
            links[p] = Some(s);
        }
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
        Ok(Communicator {
            rank,
            world,
            generation: config.generation,
            timeout: config.timeout,
            spin: config.spin,
            yield_spin: config.yield_spin,
            small_bytes: config.small_bytes,
            segment_bytes,
            algorithm: config.algorithm,
            links,
            counters: config.counters.clone(),
            scratch: vec![0u64; scratch_bytes.div_ceil(8)],
            steps: Vec::with_capacity(64),
            seq: 0,
            poisoned: false,
            abort: AbortHandle {
                streams: Arc::new(clones),
                aborted: Arc::default(),
            },
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
    /// the element-wise sum (or average) of all ranks' buffers, bit-identical on all ranks.
    /// Half types travel as half and accumulate each reduction in f32. Buffers up to
    /// [`Config::small_bytes`] use recursive doubling, larger ones the pipelined ring. World
    /// size 1 and empty buffers return at once.
    ///
    /// # Errors
    /// [`CommError::PeerLost`], [`CommError::Timeout`] (after [`Config::timeout`]),
    /// [`CommError::Protocol`], [`CommError::Aborted`], [`CommError::Poisoned`]. On error `buf`
    /// holds unspecified values and the communicator is poisoned.
    pub fn allreduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.check()?;
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
        plan::allreduce(alg, self.world, self.rank, buf.len(), &mut self.steps);
        let scale = (op == ReduceOp::Avg).then(|| 1.0 / self.world as f32);
        let kern = Kernel::of::<T>();
        self.run("allreduce", reduce::as_bytes_mut(buf), kern, scale)
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
            plan::broadcast_tree(self.world, self.rank, root, buf.len(), &mut self.steps);
        } else {
            let seg = self.segment_bytes * 4;
            plan::broadcast_chain(self.world, self.rank, root, buf.len(), seg, &mut self.steps);
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
        plan::allreduce(
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
        let deadline = start + self.timeout;
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
                scratch: reduce_scratch(&mut self.scratch),
                segment: self.segment_bytes,
                seq: self.seq,
                op,
                start,
                deadline,
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

/// Best effort: a refused request leaves the kernel's default, which only costs speed.
fn set_buffers(s: &TcpStream, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: valid fd, option value is a c_int of the stated size.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

fn overlaps(step: &Step) -> bool {
    match (&step.send, &step.recv) {
        (Some(s), Some((r, _))) => s.range.start < r.range.end && r.range.start < s.range.end,
        _ => false,
    }
}

fn reduce_scratch(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 → u8 view of the same memory; any byte pattern is a valid u64.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

/// The reduction of one dtype, on byte slices whose offsets are multiples of the element size
/// (and whose base is element-aligned: user buffers and the u64-backed scratch).
#[derive(Clone, Copy)]
struct Kernel {
    esize: usize,
    reduce: fn(&mut [u8], &[u8], Option<f32>),
}

impl Kernel {
    fn of<T: Element>() -> Kernel {
        fn red<T: Element>(d: &mut [u8], s: &[u8], k: Option<f32>) {
            let n = d.len() / std::mem::size_of::<T>();
            debug_assert_eq!(d.as_ptr() as usize % std::mem::align_of::<T>(), 0);
            debug_assert_eq!(s.as_ptr() as usize % std::mem::align_of::<T>(), 0);
            // SAFETY: both slices are element-aligned (see `Kernel`), hold n whole elements,
            // do not overlap (scratch vs user buffer), and every bit pattern is a valid T.
            let (d, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(d.as_mut_ptr().cast::<T>(), n),
                    std::slice::from_raw_parts(s.as_ptr().cast::<T>(), n),
                )
            };
            T::reduce(d, s, k);
        }
        Kernel {
            esize: std::mem::size_of::<T>(),
            reduce: red::<T>,
        }
    }
    fn bytes() -> Kernel {
        fn never(_: &mut [u8], _: &[u8], _: Option<f32>) {
            unreachable!("byte plans only copy")
        }
        Kernel {
            esize: 1,
            reduce: never,
        }
    }
}

struct StepCtx<'a> {
    links: &'a [Option<TcpStream>],
    scratch: &'a mut [u8],
    segment: usize,
    seq: u64,
    op: &'static str,
    start: Instant,
    deadline: Instant,
    spin: Duration,
    yield_spin: bool,
    kern: Kernel,
    scale: Option<f32>,
}

fn link_err(e: std::io::Error, peer: usize, op: &'static str) -> CommError {
    use std::io::ErrorKind::*;
    match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof | NotConnected => {
            CommError::PeerLost { rank: peer, op }
        }
        _ => CommError::Io { op, source: e },
    }
}

/// Sending half of a step: `data` in frames of at most `MAX_DATA_PAYLOAD` bytes.
struct Tx<'a> {
    s: &'a TcpStream,
    peer: usize,
    data: *const u8,
    len: usize,
    pos: usize,
    frame_end: usize,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    started: bool,
    done: bool,
}

impl Tx<'_> {
    fn progress(&mut self, seq: u64, op: &'static str) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        if self.hdr_off == HEADER_LEN && self.pos == self.frame_end {
            let flen = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
            self.hdr = Header {
                kind: Kind::Data,
                len: flen as u32,
                seq,
            }
            .encode();
            self.hdr_off = 0;
            self.frame_end = self.pos + flen;
            self.started = true;
        }
        // SAFETY: data..data+len is the step's send range of the caller's buffer, alive and not
        // written during the step (writes go to disjoint ranges or to scratch).
        let data = unsafe {
            std::slice::from_raw_parts(self.data.add(self.pos), self.frame_end - self.pos)
        };
        let r = if self.hdr_off < HEADER_LEN {
            let bufs = [IoSlice::new(&self.hdr[self.hdr_off..]), IoSlice::new(data)];
            (&mut &*self.s).write_vectored(&bufs)
        } else {
            (&mut &*self.s).write(data)
        };
        match r {
            Ok(0) => Err(CommError::PeerLost {
                rank: self.peer,
                op,
            }),
            Ok(mut n) => {
                let h = n.min(HEADER_LEN - self.hdr_off);
                self.hdr_off += h;
                n -= h;
                self.pos += n;
                if self.hdr_off == HEADER_LEN && self.pos == self.len && self.started {
                    self.done = true;
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(link_err(e, self.peer, op)),
        }
    }
}

/// Where received payload goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// Straight into the user's buffer (copy, no overlap with the send).
    Direct,
    /// Through the scratch segment, reduced when each segment fills.
    Segmented,
    /// All into scratch, applied after the step's send completes (exchange steps).
    Deferred,
}

/// Receiving half of a step.
struct Rx<'a> {
    s: &'a TcpStream,
    peer: usize,
    dst: *mut u8,
    len: usize,
    pos: usize,
    frame_left: usize,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    sink: Sink,
    seg_start: usize,
    action: Action,
    done: bool,
}

impl Rx<'_> {
    fn progress(&mut self, c: &mut StepCtx<'_>) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        // While a header is incomplete, read it together with the payload that should follow
        // (one readv instead of two reads: the header's length is checked before any of those
        // payload bytes are accounted, and they land only where the expected frame may go).
        let in_header = self.hdr_off < HEADER_LEN;
        let want = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
        let frame_left = if in_header { want } else { self.frame_left };
        let room = match self.sink {
            Sink::Direct | Sink::Deferred => frame_left,
            Sink::Segmented => {
                let seg_len = c.segment.min(self.len - self.seg_start);
                (self.seg_start + seg_len - self.pos).min(frame_left)
            }
        };
        let dst: &mut [u8] = match self.sink {
            // SAFETY: dst..dst+len is the step's receive range of the caller's buffer, not
            // read by the send half (Direct is used only without overlap).
            Sink::Direct => unsafe { std::slice::from_raw_parts_mut(self.dst.add(self.pos), room) },
            Sink::Segmented => {
                let off = self.pos - self.seg_start;
                &mut c.scratch[off..off + room]
            }
            Sink::Deferred => &mut c.scratch[self.pos..self.pos + room],
        };
        let r = if in_header {
            let mut bufs = [
                IoSliceMut::new(&mut self.hdr[self.hdr_off..]),
                IoSliceMut::new(dst),
            ];
            (&mut &*self.s).read_vectored(&mut bufs)
        } else {
            (&mut &*self.s).read(dst)
        };
        let mut n = match r {
            Ok(0) => {
                return Err(CommError::PeerLost {
                    rank: self.peer,
                    op: c.op,
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(true),
            Err(e) => return Err(link_err(e, self.peer, c.op)),
        };
        if in_header {
            let h = n.min(HEADER_LEN - self.hdr_off);
            self.hdr_off += h;
            n -= h;
            if self.hdr_off < HEADER_LEN {
                return Ok(true);
            }
            let h = Header::decode(&self.hdr)?;
            if h.kind != Kind::Data {
                return Err(ProtocolError::Unexpected {
                    got: h.kind,
                    expected: Kind::Data,
                }
                .into());
            }
            if h.seq != c.seq || h.len as usize != want {
                return Err(ProtocolError::OutOfStep {
                    seq: h.seq,
                    len: h.len,
                    want_seq: c.seq,
                    want_len: want as u32,
                }
                .into());
            }
            self.frame_left = want;
            if want == 0 {
                self.done = true;
                return Ok(true);
            }
        }
        self.pos += n;
        self.frame_left -= n;
        if self.sink == Sink::Segmented {
            let seg_len = c.segment.min(self.len - self.seg_start);
            if self.pos == self.seg_start + seg_len {
                // SAFETY: as for Direct; the segment lies inside the receive range.
                let d = unsafe {
                    std::slice::from_raw_parts_mut(self.dst.add(self.seg_start), seg_len)
                };
                self.apply(c, d, 0, seg_len);
                self.seg_start = self.pos;
            }
        }
        if self.frame_left == 0 {
            if self.pos == self.len {
                self.done = true;
            } else {
                self.hdr_off = 0;
            }
        }
        Ok(true)
    }

    /// Applies the action to `d` from `scratch[from..from+len]`.
    fn apply(&self, c: &mut StepCtx<'_>, d: &mut [u8], from: usize, len: usize) {
        let src = &c.scratch[from..from + len];
        match self.action {
            Action::Copy => d.copy_from_slice(src),
            Action::Reduce { finalize } => {
                (c.kern.reduce)(d, src, if finalize { c.scale } else { None })
            }
        }
    }
}

fn link(links: &[Option<TcpStream>], peer: usize) -> Result<&TcpStream, CommError> {
    links[peer]
        .as_ref()
        .ok_or_else(|| CommError::Config(format!("no connection to rank {peer}")))
}

impl StepCtx<'_> {
    fn run(mut self, buf: &mut [u8], step: &Step) -> Result<(), CommError> {
        let e = self.kern.esize;
        let base = buf.as_mut_ptr();
        let deferred = overlaps(step);
        let links = self.links;
        let mut tx = match &step.send {
            Some(t) => Some(Tx {
                s: link(links, t.peer)?,
                peer: t.peer,
                // SAFETY: the range lies inside `buf` (plans only produce ranges within len).
                data: unsafe { base.add(t.range.start * e) },
                len: t.range.len() * e,
                pos: 0,
                frame_end: 0,
                hdr: [0; HEADER_LEN],
                hdr_off: HEADER_LEN,
                started: false,
                done: false,
            }),
            None => None,
        };
        let mut rx = match &step.recv {
            Some((t, action)) => Some(Rx {
                s: link(links, t.peer)?,
                peer: t.peer,
                // SAFETY: as above.
                dst: unsafe { base.add(t.range.start * e) },
                len: t.range.len() * e,
                pos: 0,
                frame_left: 0,
                hdr: [0; HEADER_LEN],
                hdr_off: 0,
                sink: match (deferred, action) {
                    (true, _) => Sink::Deferred,
                    (false, Action::Copy) => Sink::Direct,
                    (false, Action::Reduce { .. }) => Sink::Segmented,
                },
                seg_start: 0,
                action: *action,
                done: false,
            }),
            None => None,
        };
        debug_assert!(
            step.send
                .as_ref()
                .is_none_or(|t| t.range.end * e <= buf.len())
        );
        debug_assert!(
            step.recv
                .as_ref()
                .is_none_or(|(t, _)| t.range.end * e <= buf.len())
        );
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut progress = false;
            if let Some(tx) = tx.as_mut() {
                progress |= tx.progress(self.seq, self.op)?;
            }
            if let Some(rx) = rx.as_mut() {
                progress |= rx.progress(&mut self)?;
            }
            let tx_done = tx.as_ref().is_none_or(|t| t.done);
            let rx_done = rx.as_ref().is_none_or(|r| r.done);
            if tx_done && rx_done {
                break;
            }
            if progress {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now >= self.deadline {
                // Blame the peer we wait on: the one whose data is missing, else the one that
                // does not read what we send.
                let silent = rx
                    .as_ref()
                    .filter(|r| !r.done)
                    .map(|r| r.peer)
                    .or(tx.as_ref().filter(|t| !t.done).map(|t| t.peer));
                return Err(timeout_err(self.op, self.start, silent));
            }
            match idle_since {
                None => {
                    idle_since = Some(now);
                    continue;
                }
                Some(t) if now - t < self.spin => {
                    if self.yield_spin {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                _ => {}
            }
            let mut fds = [libc::pollfd {
                fd: -1,
                events: 0,
                revents: 0,
            }; 2];
            if let Some(t) = tx.as_ref().filter(|t| !t.done) {
                fds[0] = libc::pollfd {
                    fd: t.s.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
            }
            if let Some(r) = rx.as_ref().filter(|r| !r.done) {
                fds[1] = libc::pollfd {
                    fd: r.s.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
            }
            let left = self.deadline.saturating_duration_since(now);
            let ms = left.as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: fds is a valid array of 2 pollfds (fd −1 entries are ignored by poll).
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            if rc < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    return Err(CommError::Io {
                        op: self.op,
                        source: err,
                    });
                }
            }
        }
        if let Some(rx) = rx.as_ref().filter(|r| r.sink == Sink::Deferred) {
            // SAFETY: the send half is done; the receive range is ours to write.
            let d = unsafe { std::slice::from_raw_parts_mut(rx.dst, rx.len) };
            rx.apply(&mut self, d, 0, rx.len);
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn accept_peers(
    listener: &TcpListener,
    params: &AuthParams<'_>,
    rank: usize,
    higher: &[usize],
    start: Instant,
    deadline: Instant,
    stop: &AtomicBool,
    counters: &RefusalCounters,
) -> Result<Vec<(usize, TcpStream)>, CommError> {
    let mut got: Vec<(usize, TcpStream)> = Vec::new();
    if higher.is_empty() {
        return Ok(got);
    }
    listener
        .set_nonblocking(true)
        .map_err(|source| CommError::Io {
            op: "connect",
            source,
        })?;
    while got.len() < higher.len() {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            return Err(timeout_err("connect", start, None));
        }
        let (mut s, _) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fd = libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut fd, 1, 20) };
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(source) => {
                return Err(CommError::Io {
                    op: "connect",
                    source,
                });
            }
        };
        let prepared = s
            .set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(clamp_timeout(deadline)))
            .and_then(|_| s.set_write_timeout(clamp_timeout(deadline)));
        if prepared.is_err() {
            continue;
        }
        match auth::accept(&mut s, params, rank as u32, |f| {
            higher.contains(&(f as usize))
        }) {
            Ok(from) => {
                got.retain(|(p, _)| *p != from as usize);
                got.push((from as usize, s));
            }
            // An authenticated peer is at a newer generation: ours will never form.
            Err(e @ CommError::StaleGeneration { ours, theirs }) if theirs > ours => {
                counters.record(&e);
                return Err(e);
            }
            Err(e) => counters.record(&e),
        }
    }
    Ok(got)
}

fn connect_peers(
    config: &Config,
    params: &AuthParams<'_>,
    lower: &[usize],
    start: Instant,
    deadline: Instant,
    stop: &AtomicBool,
    counters: &RefusalCounters,
) -> Result<Vec<(usize, TcpStream)>, CommError> {
    let mut out = Vec::new();
    for &p in lower {
        loop {
            if stop.load(Ordering::SeqCst) {
                return Err(CommError::Aborted);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout_err("connect", start, None));
            }
            let retry = || std::thread::sleep(Duration::from_millis(10).min(left));
            let mut s =
                match TcpStream::connect_timeout(&config.addresses[p], left.min(HANDSHAKE_MAX)) {
                    Ok(s) => s,
                    Err(_) => {
                        retry();
                        continue;
                    }
                };
            let prepared = s
                .set_read_timeout(clamp_timeout(deadline))
                .and_then(|_| s.set_write_timeout(clamp_timeout(deadline)))
                .and_then(|_| s.set_nodelay(true));
            if prepared.is_err() {
                retry();
                continue;
            }
            match auth::initiate(&mut s, params, config.rank as u32, p as u32) {
                Ok(()) => {
                    out.push((p, s));
                    break;
                }
                // The peer has not reached our generation yet: it will.
                Err(CommError::StaleGeneration { ours, theirs }) if theirs < ours => retry(),
                Err(CommError::Io { .. } | CommError::Timeout { .. }) => retry(),
                Err(CommError::Protocol(ProtocolError::Truncated { .. })) => retry(),
                Err(e) => {
                    counters.record(&e);
                    return Err(e);
                }
            }
        }
    }
    Ok(out)
}
