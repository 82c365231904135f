//! `diphoma._native`: the ring runtime of `diphoma-ring` as a Python extension module (pyo3,
//! abi3 for CPython ≥ 3.9). The Python package (`python/diphoma/`) builds the torch.distributed
//! backend and the launcher on top of it.
//!
//! # Layout
//!
//! | item | owns | must not |
//! |---|---|---|
//! | [`Ring`] | one ring generation's [`Communicator`] and its collectives on raw CPU buffers (address + length from `tensor.data_ptr()`), each run with the GIL released; the error of its failed collective | know about torch, keep a buffer past a call |
//! | [`Follower`] | where the generations come from (`diphoma-ring`'s [`FixedRing`], [`FileRing`] or [`KubeRing`], chosen by the environment, then used as one [`RingSource`]): joining the next one, the decision after a commit or a failure, the progress records | decide anything the ring's sources do not |
//! | [`sync_root`] | whose state a new generation adopts (`diphoma-ring`'s rule, the Rust worker's) for `diphoma.torch.elastic` | |
//! | [`membership_json`] | the contract's membership document for the standalone launcher | |
//! | [`split`], [`Speed`] | the contract's speed-weighted shares (`diphoma_contract::balance`) for `diphoma.torch.ElasticSampler`: the same split and the same smoothing as the Rust worker | time anything (the sampler measures) |
//! | [`RingError`], [`RingChanged`], [`ConfigError`] | the Python exceptions: the join failed; a collective of an established ring failed (the ring must re-form); a bad argument or environment variable (named in the message) | |
//!
//! The ring, the membership and the handshake are `diphoma-ring`'s: this crate only converts
//! arguments and errors. It must not re-implement any of them.

use std::net::TcpListener;
use std::sync::Mutex;
use std::time::Duration;

use diphoma_contract::{Member, Membership, balance};
use diphoma_ring::file::{DirWatch, ENV_RING_DIR, FileRing};
use diphoma_ring::k8s::{KubeRing, OP_TIMEOUT, RingWatch as Watch, WorkerEnv};
use diphoma_ring::liveness::{self, Responder};
use diphoma_ring::source::{
    Control, FixedRing, Generation, Progress, RingSource, standalone_config,
};
use diphoma_ring::{
    AbortHandle, CommError, Communicator, Config, Element, ProtocolError, ReduceOp, bf16, f16,
    foreign,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    RingError,
    PyRuntimeError,
    "A ring collective or the ring join failed (peer lost, timeout, authentication, aborted); \
     the ring is unusable afterwards."
);
pyo3::create_exception!(
    _native,
    RingChanged,
    RingError,
    "A collective of an established ring failed (a member was lost, hung, or a newer generation \
     was published): the ring must re-form at the next generation. \
     `diphoma.torch.elastic.run` catches it, rolls the state back and re-forms the ring."
);
pyo3::create_exception!(
    _native,
    CollectiveMismatch,
    RingError,
    "The ranks called different collectives, or the same one with different sizes or dtypes: \
     a mistake in the training script, not a ring fault, so the ring is not re-formed for it \
     (it is unusable afterwards). The message names what this rank received and expected."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    PyValueError,
    "A bad argument or environment variable; the message names it. Nothing was sent."
);

fn ring_err(e: CommError) -> PyErr {
    match e {
        CommError::Config(m) => ConfigError::new_err(m),
        e => RingError::new_err(e.to_string()),
    }
}

/// A reduction by its Python name.
fn parse_op(op: &str) -> PyResult<ReduceOp> {
    match op {
        "sum" => Ok(ReduceOp::Sum),
        "avg" => Ok(ReduceOp::Avg),
        "max" => Ok(ReduceOp::Max),
        "min" => Ok(ReduceOp::Min),
        _ => Err(ConfigError::new_err(format!(
            "unsupported reduce op {op:?} (sum, avg, max, min)"
        ))),
    }
}

/// Which reduction collective to run on a typed buffer.
#[derive(Clone, Copy)]
enum Reduction {
    All,
    Scatter,
}

/// Views `count` elements at address `ptr` as a `T` slice, after checking the alignment.
///
/// # Safety
/// `ptr` must point to `count` initialised `T`s that nothing else reads or writes for the
/// lifetime of the slice (the Python caller keeps the tensor alive and untouched until the
/// collective returns).
unsafe fn typed<'a, T: Copy>(ptr: usize, count: usize) -> Result<&'a mut [T], CommError> {
    if count == 0 {
        return Ok(&mut []);
    }
    if ptr == 0 || !ptr.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(CommError::Config(format!(
            "buffer address {ptr:#x} is null or not aligned for {}",
            std::any::type_name::<T>()
        )));
    }
    // SAFETY: non-null and aligned (checked), valid and exclusive (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, count) })
}

/// Runs `what` on the `count` elements of type `T` at `ptr`.
///
/// # Safety
/// As [`typed`].
unsafe fn reduce<T: Element>(
    comm: &mut Communicator,
    what: Reduction,
    ptr: usize,
    count: usize,
    op: ReduceOp,
) -> Result<(), CommError> {
    // SAFETY: forwarded from the caller.
    let buf = unsafe { typed::<T>(ptr, count)? };
    match what {
        Reduction::All => comm.allreduce(buf, op),
        Reduction::Scatter => comm.reduce_scatter(buf, op),
    }
}

/// One member of one ring generation (`diphoma-ring`'s `Communicator`).
///
/// Collectives take a buffer as an address and a length (a contiguous CPU tensor's
/// `data_ptr()` and `numel()`), work in place, and release the GIL while they run. Every rank
/// must call the same collectives in the same order with the same lengths. After a
/// [`RingError`] the ring is poisoned: every later call raises again.
#[pyclass(module = "diphoma._native", frozen)]
pub struct Ring {
    comm: Mutex<Communicator>,
    /// The error of the first collective that failed (handed to [`Follower::failed`]).
    failure: Mutex<Option<CommError>>,
    rank: usize,
    world: usize,
    generation: u64,
    /// The config this ring was joined with (key, protection, timeout, job UID): what
    /// [`Ring::subring`] derives a sub-group's ring from.
    config: Config,
    /// Aborts the communicator; set by the follower when a newer generation is published.
    abort: AbortHandle,
}

/// The liveness responders [`Ring::answer_liveness`] started, by ring address: one per address
/// for the life of the process (the generations a process joins keep their address).
static RESPONDERS: Mutex<Vec<Responder>> = Mutex::new(Vec::new());

impl Ring {
    /// Every other member's answer to a liveness probe of `window` (probed at once), in rank
    /// order.
    fn probe_others(&self, window: Duration) -> Vec<(usize, bool)> {
        let cfg = &self.config;
        let from = cfg.addresses[self.rank].ip();
        let never = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let probes: Vec<_> = (0..self.world)
                .filter(|&r| r != self.rank)
                .map(|r| {
                    let never = &never;
                    s.spawn(move || {
                        let alive =
                            liveness::probe(from, cfg.addresses[r], &cfg.key, window, never);
                        (r, alive)
                    })
                })
                .collect();
            probes
                .into_iter()
                .map(|p| p.join().unwrap_or((usize::MAX, false)))
                .collect()
        })
    }

    fn new(comm: Communicator, config: Config) -> Ring {
        Ring {
            rank: comm.rank(),
            world: comm.world(),
            generation: comm.generation(),
            abort: comm.abort_handle(),
            comm: Mutex::new(comm),
            failure: Mutex::default(),
            config,
        }
    }

    /// Keeps `e` as this ring's failure (the first one stays) and returns the message
    /// [`RingChanged`] carries.
    fn keep_failure(&self, e: CommError) -> String {
        let msg = format!(
            "diphoma: ring generation {} (rank {} of {}) failed: {e}; the ring must re-form",
            self.generation, self.rank, self.world
        );
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
        msg
    }

    /// Runs `f` on the communicator with the GIL released; a failure other than a bad argument
    /// is kept and raised as [`RingChanged`].
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Communicator) -> Result<R, CommError> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut c = self.comm.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut c)
        })
        .map_err(|e| match e {
            CommError::Config(m) => ConfigError::new_err(m),
            CommError::Protocol(ProtocolError::OutOfStep { len, want_len, .. }) => {
                CollectiveMismatch::new_err(format!(
                    "diphoma: ring generation {} (rank {} of {}): the ranks called different \
                     collectives or sizes: this rank expected a frame of {want_len} bytes from \
                     its peer and received one of {len} (check that every rank calls the same \
                     collectives, in the same order, with tensors of the same size and dtype, \
                     and has the same DIPHOMA_COMPRESSION, DIPHOMA_DATA_PLANE and \
                     DIPHOMA_STAGING_SEGMENT_BYTES)",
                    self.generation, self.rank, self.world
                ))
            }
            e => RingChanged::new_err(self.keep_failure(e)),
        })
    }

    fn reduction(
        &self,
        py: Python<'_>,
        what: Reduction,
        ptr: usize,
        count: usize,
        dtype: &str,
        op: &str,
    ) -> PyResult<()> {
        let op = parse_op(op)?;
        let run = match dtype {
            "float32" => reduce::<f32>,
            "float64" => reduce::<f64>,
            "float16" => reduce::<f16>,
            "bfloat16" => reduce::<bf16>,
            "int32" => reduce::<i32>,
            "int64" => reduce::<i64>,
            _ => {
                return Err(ConfigError::new_err(format!(
                    "unsupported dtype {dtype:?} (float32, float64, float16, bfloat16, int32, int64)"
                )));
            }
        };
        // SAFETY: the Python caller passes a live, contiguous buffer it does not touch until
        // this call returns (see `Ring`).
        self.with(py, |c| unsafe { run(c, what, ptr, count, op) })
    }
}

#[pymethods]
impl Ring {
    /// Joins generation 1 of a standalone ring described by the launcher's environment
    /// (`DIPHOMA_RANK`, `DIPHOMA_WORLD_SIZE`, `DIPHOMA_RING_ADDRESSES`, `DIPHOMA_JOB_UID`,
    /// `DIPHOMA_KEY_FILE`): binds this rank's address and connects to every peer.
    /// `timeout` (seconds, > 0) bounds the join and every later collective; default 30.
    ///
    /// Raises `ConfigError` naming a missing or malformed variable, `RingError` when the ring
    /// does not form.
    #[staticmethod]
    #[pyo3(signature = (timeout = None))]
    fn from_env(py: Python<'_>, timeout: Option<f64>) -> PyResult<Ring> {
        let mut cfg = standalone_config(|n| std::env::var(n).ok())
            .map_err(|e| ConfigError::new_err(e.to_string()))?;
        if let Some(t) = timeout {
            cfg.timeout = std::time::Duration::try_from_secs_f64(t)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| ConfigError::new_err(format!("timeout {t} s is not positive")))?;
        }
        let comm = py
            .detach(|| Communicator::bind_and_connect(cfg.clone()))
            .map_err(ring_err)?;
        Ok(Ring::new(comm, cfg))
    }

    /// Joins the ring of a sub-group (`torch.distributed.new_group`) of this ring's members:
    /// this member is `rank` of `addresses` ("IP:port", indexed by the sub-group's rank; this
    /// member's entry is bound here). The sub-group's ring has this ring's key, protection,
    /// timeout and generation, and the job UID `<job UID>/<tag>` (`tag`: unique per sub-group,
    /// the same on every member), so its handshakes never match another group's. Its
    /// collectives are bounded by the timeout (no liveness probes).
    ///
    /// Raises `ConfigError` naming a malformed address or rank, `RingError` when the ring
    /// does not form.
    fn subring(
        &self,
        py: Python<'_>,
        rank: usize,
        addresses: Vec<String>,
        tag: &str,
    ) -> PyResult<Ring> {
        let addresses = addresses
            .iter()
            .enumerate()
            .map(|(i, a)| {
                a.parse()
                    .map_err(|_| config_err(format!("addresses[{i}]: {a:?} is not IP:port")))
            })
            .collect::<PyResult<Vec<std::net::SocketAddr>>>()?;
        let cfg = Config {
            rank,
            world: addresses.len(),
            addresses,
            job_uid: format!("{}/{tag}", self.config.job_uid),
            liveness: None,
            ..self.config.clone()
        };
        let comm = py
            .detach(|| Communicator::bind_and_connect(cfg.clone()))
            .map_err(ring_err)?;
        Ok(Ring::new(comm, cfg))
    }

    /// The IP address this member's ring listens on ("127.0.0.1", a pod IP): where a
    /// sub-group's ring binds too.
    #[getter]
    fn host(&self) -> String {
        self.config.addresses[self.config.rank].ip().to_string()
    }

    /// True once a collective of this ring failed (it raised [`RingChanged`]).
    #[getter]
    fn failed(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// What the kept failure was (the ring's metric label: `peer_lost`, `timeout`, …); none
    /// before a collective failed.
    #[getter]
    fn failure_kind(&self) -> Option<&'static str> {
        let failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        failure.as_ref().map(CommError::metric_label)
    }

    /// This member's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of members.
    #[getter]
    fn world(&self) -> usize {
        self.world
    }

    /// The ring generation.
    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    /// In-place allreduce of `count` elements of `dtype` ("float32", "float64", "float16",
    /// "bfloat16", "int32", "int64") at address `ptr` with `op` ("sum", "avg" for the float32
    /// and half types, "max", "min").
    fn allreduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: &str,
        op: &str,
    ) -> PyResult<()> {
        self.reduction(py, Reduction::All, ptr, count, dtype, op)
    }

    /// In-place reduce-scatter of `count` elements (as `allreduce`): afterwards this rank's
    /// chunk, elements `[rank·count/world, (rank+1)·count/world)` when `world` divides
    /// `count`, holds the reduction over every rank.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: &str,
        op: &str,
    ) -> PyResult<()> {
        self.reduction(py, Reduction::Scatter, ptr, count, dtype, op)
    }

    /// Broadcast of `nbytes` bytes at `ptr` from rank `root`.
    fn broadcast(&self, py: Python<'_>, ptr: usize, nbytes: usize, root: usize) -> PyResult<()> {
        self.with(py, |c| {
            // SAFETY: as `reduction`; bytes have no alignment.
            let buf = unsafe { typed::<u8>(ptr, nbytes)? };
            c.broadcast_bytes(buf, root)
        })
    }

    /// In-place all-gather of `nbytes` bytes at `ptr`: `world` equal chunks, this rank's filled
    /// at chunk `rank`; afterwards every chunk is filled.
    fn allgather(&self, py: Python<'_>, ptr: usize, nbytes: usize) -> PyResult<()> {
        self.with(py, |c| {
            // SAFETY: as `broadcast`.
            let buf = unsafe { typed::<u8>(ptr, nbytes)? };
            c.allgather_bytes(buf)
        })
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, Communicator::barrier)
    }

    /// Shuts every connection of this ring from any thread: a collective in flight on another
    /// thread fails at once (`RingChanged`), later ones too, and the peers see this member
    /// leave. For a sub-group's ring that another data plane watches (the hierarchical
    /// all-reduce's in-pod and cross-pod rings), which has no liveness probes of its own.
    fn abort(&self) {
        self.abort.abort();
    }

    /// True once a newer generation was published (the follower aborted this ring), or
    /// `abort` was called.
    #[getter]
    fn aborted(&self) -> bool {
        self.abort.is_aborted()
    }

    /// The rank of the first member whose ring connection to this one was closed (it left
    /// this generation, or its process is gone); None while every connection is open. Reads
    /// nothing: for a ring at rest (another data plane's collective in flight).
    #[getter]
    fn closed_peer(&self) -> Option<usize> {
        self.comm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .closed_peer()
    }

    /// The bound on joining this ring, in seconds (`DIPHOMA_TIMEOUT`, the join's `timeout`).
    #[getter]
    fn timeout(&self) -> f64 {
        self.config.timeout.as_secs_f64()
    }

    /// The liveness window of this ring's collectives in seconds (a pod:
    /// `detectionSeconds / 4`); None where they are bounded by the timeout instead (standalone).
    #[getter]
    fn liveness_window(&self) -> Option<f64> {
        self.config.liveness.map(|w| w.as_secs_f64())
    }

    /// Answers liveness probes at this member's ring address (UDP) from now on, for the life
    /// of the process, where nothing does yet (standalone: in a pod the follower's responder
    /// answers), so that [`Ring::blame`]'s probes of the other members, which do the same, tell
    /// a slow member from a hung one.
    ///
    /// Raises `RingError` when the address cannot be bound.
    fn answer_liveness(&self) -> PyResult<()> {
        let addr = self.config.addresses[self.rank];
        let mut responders = RESPONDERS.lock().unwrap_or_else(|p| p.into_inner());
        if self.config.liveness.is_some() || responders.iter().any(|r| r.local_addr() == addr) {
            return Ok(());
        }
        responders.push(Responder::bind(addr, self.config.key.clone()).map_err(|e| {
            RingError::new_err(format!(
                "diphoma: the liveness responder at {addr} (UDP): {e}"
            ))
        })?);
        Ok(())
    }

    /// For collective `op` of another library ("allreduce", "broadcast", …: the
    /// `DIPHOMA_DATA_PLANE` communicator of this generation) that failed (`failed`: it raised)
    /// or has waited `waited` seconds: a newer generation aborts it; a member whose ring
    /// connection was closed (it left this generation: the failure cascade) is lost; else, when
    /// `probe`, every other member is probed for `window` seconds at once and the verdict is
    /// `diphoma-ring`'s `foreign::verdict` (a silent member is blamed, lost or hung; every
    /// member answering, a wait goes on). A verdict is kept as this ring's failure, as a failed
    /// ring collective's ([`Follower::failed`] reports it and joins the next generation), this
    /// ring's connections are shut (so the other members see it leave), and its message is
    /// returned; None: wait on. Needs every member to answer probes ([`Ring::answer_liveness`]).
    #[pyo3(signature = (op, waited, failed, window, probe = true))]
    fn blame(
        &self,
        py: Python<'_>,
        op: &str,
        waited: f64,
        failed: bool,
        window: f64,
        probe: bool,
    ) -> PyResult<Option<String>> {
        let op = foreign::op_name(op);
        let waited = Duration::try_from_secs_f64(waited).unwrap_or_default();
        let window = Duration::try_from_secs_f64(window)
            .ok()
            .filter(|w| !w.is_zero())
            .ok_or_else(|| config_err(format!("window {window} s is not positive")))?;
        let closed = || {
            self.comm
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .closed_peer()
        };
        let verdict = if self.abort.is_aborted() {
            Some(CommError::Aborted)
        } else if let Some(rank) = closed() {
            Some(CommError::PeerLost { rank, op })
        } else if probe || failed {
            let answers = py.detach(|| self.probe_others(window));
            foreign::verdict(op, waited, failed, &answers)
        } else {
            None
        };
        let silent = match &verdict {
            Some(CommError::Timeout { peer: Some(r), .. }) => {
                format!(" (rank {r} did not answer its liveness probe within {window:?})")
            }
            _ => String::new(),
        };
        Ok(verdict.map(|e| {
            self.abort.abort();
            self.keep_failure(e) + &silent
        }))
    }

    fn __repr__(&self) -> String {
        format!(
            "Ring(rank={}, world={}, generation={})",
            self.rank, self.world, self.generation
        )
    }
}

/// What the follower knows besides its source.
struct Following {
    /// Where the generations come from: the fixed standalone ring (`python -m diphoma.run`),
    /// the ring directory (`--elastic`), or the ring ConfigMap (a worker pod).
    source: Box<dyn RingSource + Send>,
    /// The generation to join next.
    pending: Option<Generation>,
    /// (generation, rank) of the ring joined last.
    current: (u64, usize),
    /// Every rank's share of the global batch, in rank order (`set_shares`), published with the
    /// progress as the Rust worker's (`status.progress.min/maxBatchShare`); empty: not known.
    shares: Vec<usize>,
}

fn config_err(e: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(e.to_string())
}

/// Reads `DIPHOMA_KEY_FILE` through the contract's check.
fn read_key() -> PyResult<Vec<u8>> {
    let var = diphoma_contract::ENV_KEY_FILE;
    let path = std::env::var(var)
        .map_err(|_| config_err(format!("environment variable {var} is not set")))?;
    std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|b| diphoma_contract::parse_key(b).map_err(|e| e.to_string()))
        .map_err(|e| config_err(format!("environment variable {var}: {path}: {e}")))
}

fn required(var: &str) -> PyResult<String> {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| config_err(format!("environment variable {var} is not set")))
}

/// The ring's generations as this process sees them: joins each one and asks `diphoma-ring`'s
/// membership source what to do after a commit or a failure (the same decisions as the Rust
/// worker). The source is chosen by the environment: `DIPHOMA_RING_DIR` (standalone elastic,
/// with `DIPHOMA_POD_NAME` naming this member; `DIPHOMA_LOCAL_RANK` of
/// `DIPHOMA_PROCESSES_PER_WORKER` this process's place in it, as in a worker pod), `DIPHOMA_MEMBERSHIP` (a worker pod: the
/// contract's variables), else the fixed standalone ring of `Ring.from_env`.
#[pyclass(module = "diphoma._native", frozen)]
pub struct Follower {
    state: Mutex<Following>,
}

impl Follower {
    fn lock(&self) -> std::sync::MutexGuard<'_, Following> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Following {
    /// The progress of a committed step of the ring joined last (as `commit` takes it: steps,
    /// total steps, loss, samples/s, last checkpoint), with the shares set last.
    fn progress(
        &self,
        step: u64,
        total: Option<u64>,
        loss: f32,
        rate: f64,
        ck: Option<u64>,
    ) -> Progress {
        Progress {
            step,
            total_steps: total,
            generation: self.current.0,
            rank: self.current.1,
            loss,
            samples_per_second: rate,
            last_checkpoint: ck,
            allreduce_seconds: 0.0,
            allreduce_bytes: 0,
            shares: self.shares.clone(),
        }
    }
}

#[pymethods]
impl Follower {
    /// Starts following the generations described by the environment (see the class) and
    /// waits for the first one that lists this process. `timeout` (seconds, > 0) bounds each
    /// join and collective and the wait for a first generation; default 30 (4 in a pod, below
    /// the job's failure detection).
    ///
    /// Raises `ConfigError` naming a missing or malformed variable, `RingError` when no
    /// generation lists this process in time (or SIGTERM arrives first in a pod).
    #[staticmethod]
    #[pyo3(signature = (timeout = None))]
    fn from_env(py: Python<'_>, timeout: Option<f64>) -> PyResult<Follower> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| config_err(format!("timeout {t} s is not positive")))
            })
            .transpose()?;
        let (source, pending): (Box<dyn RingSource + Send>, _) = if let Ok(dir) =
            std::env::var(ENV_RING_DIR)
        {
            let name = required(diphoma_contract::ENV_POD_NAME)?;
            let t = timeout.unwrap_or(diphoma_ring::comm::DEFAULT_TIMEOUT);
            let protection = diphoma_ring::source::protection_var(
                std::env::var(diphoma_contract::ENV_RING_PROTECTION).ok(),
            )
            .map_err(config_err)?;
            let mut f =
                FileRing::start(dir.clone().into(), name.clone(), read_key()?, protection, t);
            f.set_local(
                diphoma_contract::Local::from_lookup(|n| std::env::var(n).ok())
                    .map_err(config_err)?,
            );
            let g = py
                .detach(|| f.first_generation(Some(t)))
                .map_err(|e| RingError::new_err(e.to_string()))?
                .ok_or_else(|| {
                    RingError::new_err(format!(
                        "no generation in {dir}/membership.json listed member {name} within {t:?}"
                    ))
                })?;
            (Box::new(f), g)
        } else if std::env::var(diphoma_contract::ENV_MEMBERSHIP).is_ok() {
            let env = WorkerEnv::from_env().map_err(config_err)?;
            let key = env.read_key().map_err(config_err)?;
            let mut k = KubeRing::start(env, key).map_err(config_err)?;
            k.set_op_timeout(timeout.unwrap_or(OP_TIMEOUT));
            let g = py
                .detach(|| k.first_generation(None))
                .map_err(config_err)?
                .ok_or_else(|| RingError::new_err("SIGTERM before the first generation"))?;
            (Box::new(k), g)
        } else {
            let mut config = standalone_config(|n| std::env::var(n).ok()).map_err(config_err)?;
            if let Some(t) = timeout {
                config.timeout = t;
            }
            let addr = config.addresses[config.rank];
            let listener = TcpListener::bind(addr)
                .map_err(|e| RingError::new_err(format!("binding {addr}: {e}")))?;
            (Box::new(FixedRing), Generation { config, listener })
        };
        Ok(Follower {
            state: Mutex::new(Following {
                source,
                pending: Some(pending),
                current: (0, 0),
                shares: Vec::new(),
            }),
        })
    }

    /// Joins the next generation (the first, or the one `commit`/`failed` chose); when the
    /// join fails, asks the source for the one after, as the Rust worker does.
    ///
    /// Raises `RingError` when there is none to join (the ring could not re-form, or this
    /// process is no longer a member).
    fn connect(&self, py: Python<'_>) -> PyResult<Ring> {
        py.detach(|| {
            let mut st = self.lock();
            loop {
                let Some(g) = st.pending.take() else {
                    return Err(RingError::new_err("diphoma: no ring generation to join"));
                };
                let generation = g.config.generation;
                let config = g.config.clone();
                match Communicator::connect(g.config, g.listener) {
                    Ok(comm) => {
                        st.current = (generation, comm.rank());
                        st.source
                            .connected(generation, comm.rank(), comm.abort_handle());
                        return Ok(Ring::new(comm, config));
                    }
                    Err(e) => match st.source.after_failure(&e) {
                        Some(next) => st.pending = Some(next),
                        None => {
                            return Err(RingError::new_err(format!(
                                "diphoma: joining ring generation {generation} failed: {e}"
                            )));
                        }
                    },
                }
            }
        })
    }

    /// The generation `connect` joins next (`None`: none is known).
    #[getter]
    fn pending_generation(&self) -> Option<u64> {
        self.lock().pending.as_ref().map(|g| g.config.generation)
    }

    /// After a committed step: publishes the progress (rank 0, every few seconds and at the
    /// last step, the total left out when `total_steps` is None) and returns the source's decision:
    /// "continue", "switch" (a newer generation lists this process: `connect` joins it) or
    /// "leave" (scale-down, SIGTERM in a pod).
    #[pyo3(signature = (step, total_steps = None, loss = f32::NAN, samples_per_second = 0.0, last_checkpoint = None))]
    fn commit(
        &self,
        step: u64,
        total_steps: Option<u64>,
        loss: f32,
        samples_per_second: f64,
        last_checkpoint: Option<u64>,
    ) -> &'static str {
        let mut st = self.lock();
        let p = st.progress(step, total_steps, loss, samples_per_second, last_checkpoint);
        match st.source.after_commit(&p) {
            Control::Continue => "continue",
            Control::Switch(g) => {
                st.pending = Some(g);
                "switch"
            }
            Control::Leave => "leave",
        }
    }

    /// After `ring` raised `RingChanged`: reports the failure and chooses the generation to
    /// join next. Returns False when there is none (give up).
    fn failed(&self, py: Python<'_>, ring: &Ring) -> bool {
        let err = ring
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or(CommError::Aborted);
        py.detach(|| {
            let mut st = self.lock();
            st.pending = st.source.after_failure(&err);
            st.pending.is_some()
        })
    }

    /// After a collective of `ring` raised `RingChanged`: reports the failure (naming the peer
    /// whose link broke or went silent) to whoever re-forms the ring, as `failed` does, but
    /// joins nothing: the process of a torchrun script is restarted at the next generation by
    /// its launcher. At most once per generation; nothing when the ring has not failed.
    fn report_failure(&self, py: Python<'_>, ring: &Ring) {
        let failure = ring.failure.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(err) = failure.as_ref() {
            py.detach(|| self.lock().source.report_failure(err));
        }
    }

    /// Publishes a progress record between commits (rank 0 only; at most every few seconds
    /// except at the last step), as `commit` does, without asking for a decision.
    #[pyo3(signature = (step, total_steps = None, loss = f32::NAN, samples_per_second = 0.0, last_checkpoint = None))]
    fn publish(
        &self,
        step: u64,
        total_steps: Option<u64>,
        loss: f32,
        samples_per_second: f64,
        last_checkpoint: Option<u64>,
    ) {
        let mut st = self.lock();
        let p = st.progress(step, total_steps, loss, samples_per_second, last_checkpoint);
        st.source.publish_progress(&p);
    }

    /// Every rank's share of the global batch (samples, in rank order) from now on: the next
    /// progress records (`commit`, `publish`) carry it, so the operator shows the smallest and
    /// largest share in `status.progress.min/maxBatchShare` as for the Rust worker.
    fn set_shares(&self, shares: Vec<usize>) {
        self.lock().shares = shares;
    }

    /// Rank 0's last record: its last progress record again with the test accuracy (in
    /// [0, 1]), which the operator copies into the job's status.
    fn report_test_accuracy(&self, accuracy: f64) {
        self.lock().source.report_test_accuracy(accuracy);
    }
}

/// The contract's membership JSON for generation `generation` of job `job_uid`; `members`
/// lists (name, IP address, port) by rank. Raises `ConfigError` naming the invalid field.
#[pyfunction]
fn membership_json(
    generation: u64,
    job_uid: String,
    members: Vec<(String, String, u16)>,
) -> PyResult<String> {
    let members = members
        .into_iter()
        .enumerate()
        .map(|(i, (pod, address, port))| {
            let address = address.parse().map_err(|_| {
                config_err(format!(
                    "members[{i}].address: {address:?} is not an IP address"
                ))
            })?;
            Ok(Member {
                rank: i as u32,
                pod,
                address,
                port,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let m = Membership {
        generation,
        job_uid,
        members,
    };
    m.validate().map_err(config_err)?;
    serde_json::to_string(&m).map_err(config_err)
}

/// The rank whose state a new generation adopts, from every rank's committed step (indexed by
/// rank): the highest step, the lowest rank among equals (`diphoma_ring::source::sync_root`,
/// the Rust worker's rule); 0 for an empty list.
#[pyfunction]
fn sync_root(steps: Vec<u64>) -> usize {
    diphoma_ring::source::sync_root(&steps)
}

/// Shares of a global batch of `batch` samples for ranks computing at `rates` (samples per
/// second, one per rank, in rank order): `diphoma_contract::balance::split`, the Rust
/// worker's own function. Proportional to the rates by largest remainder, each share at least
/// one sample when `batch ≥ len(rates)`, adding up to `batch`; a rate that is not a positive
/// finite number (unknown: a joiner) counts as the mean of the known ones, equal shares when
/// none is known. Deterministic: the same rates give the same shares on every rank.
#[pyfunction]
fn split(batch: usize, rates: Vec<f64>) -> Vec<usize> {
    balance::split(batch, &rates)
}

/// A rank's smoothed compute time per sample (`diphoma_contract::balance::Speed`, the Rust
/// worker's estimator): an exponential moving average with weight `SMOOTHING` (0.3) of
/// `seconds / samples` of each recorded step.
#[pyclass(module = "diphoma._native")]
#[derive(Default)]
pub struct Speed(balance::Speed);

#[pymethods]
impl Speed {
    #[new]
    fn new() -> Speed {
        Speed::default()
    }

    /// Records one step: `seconds` of compute for `samples` samples (ignored for 0 samples or
    /// a negative or non-finite time).
    fn record(&mut self, seconds: f64, samples: usize) {
        self.0.record(seconds, samples);
    }

    /// Samples per second; 0.0 before the first record ("unknown" to `split`).
    #[getter]
    fn rate(&self) -> f64 {
        self.0.rate()
    }

    fn __repr__(&self) -> String {
        format!("Speed(rate={:.1})", self.0.rate())
    }
}

/// A generation as [`RingWatch::newest`] returns it: (generation, this pod's rank, (pod,
/// "IP:port") by rank).
type Seen = (u64, Option<usize>, Vec<(String, String)>);

/// Where a [`RingWatch`] reads the generations: the ring ConfigMap (a worker pod) or a ring
/// directory (a local stand-in for a pod).
enum Watched {
    Kube(Box<Watch>),
    Dir(DirWatch),
}

impl Watched {
    fn wait_newer(&mut self, than: Option<u64>, wait: Duration) -> Option<&Membership> {
        match self {
            Watched::Kube(w) => w.wait_newer(than, wait),
            Watched::Dir(w) => w.wait_newer(than, wait),
        }
    }

    fn write(&self, key: String, value: String) {
        match self {
            Watched::Kube(w) => w.write_heartbeat(key, value),
            Watched::Dir(w) => w.write_record(&key, &value),
        }
    }
}

/// The ring ConfigMap's generations as a worker pod's launcher sees them (`python -m
/// diphoma.run` in a pod, which restarts its training processes at each new generation): a
/// watch of the contract's ring ConfigMap that binds no port and answers no ping (the training
/// processes it starts do both). `pod` is this pod's name (`DIPHOMA_POD_NAME`). With
/// `DIPHOMA_RING_DIR` set it watches that ring directory instead (a local stand-in for a pod,
/// its records files there).
#[pyclass(module = "diphoma._native", frozen)]
pub struct RingWatch {
    watch: Mutex<Watched>,
    #[pyo3(get)]
    pod: String,
    job_uid: Option<String>,
}

#[pymethods]
impl RingWatch {
    /// Starts watching the ring ConfigMap of the contract's variables (`DIPHOMA_MEMBERSHIP`,
    /// `DIPHOMA_NAMESPACE`, … as in a worker pod), or the ring directory `DIPHOMA_RING_DIR` as
    /// member `DIPHOMA_POD_NAME` (job UID `DIPHOMA_JOB_UID` when set). Raises `ConfigError`
    /// naming a missing or malformed variable or the Kubernetes client that could not be built.
    #[staticmethod]
    fn from_env() -> PyResult<RingWatch> {
        if let Ok(dir) = std::env::var(ENV_RING_DIR) {
            return Ok(RingWatch {
                watch: Mutex::new(Watched::Dir(DirWatch::start(dir.into()))),
                pod: required(diphoma_contract::ENV_POD_NAME)?,
                job_uid: std::env::var(diphoma_contract::ENV_JOB_UID).ok(),
            });
        }
        let env = WorkerEnv::from_env().map_err(config_err)?;
        let watch = Watch::start(&env).map_err(config_err)?;
        Ok(RingWatch {
            watch: Mutex::new(Watched::Kube(Box::new(watch))),
            pod: env.pod_name,
            job_uid: Some(env.job_uid),
        })
    }

    /// Waits up to `timeout` seconds for a generation newer than `than` (any, when `None`) and
    /// returns the newest one seen: `(generation, rank, members)`, `rank` this pod's rank in it
    /// (`None`: not a member), `members` by rank as `(pod, "IP:port")`; `None` when none came.
    #[pyo3(signature = (than = None, timeout = 0.0))]
    fn newest(&self, py: Python<'_>, than: Option<u64>, timeout: f64) -> PyResult<Option<Seen>> {
        let wait = Duration::try_from_secs_f64(timeout)
            .map_err(|_| config_err(format!("timeout {timeout} s is not a duration")))?;
        let latest = py.detach(|| {
            let mut watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
            watch.wait_newer(than, wait).cloned()
        });
        Ok(latest
            .filter(|m| than.is_none_or(|t| m.generation > t))
            .map(|m| {
                let members = m
                    .members
                    .iter()
                    .map(|x| {
                        (
                            x.pod.clone(),
                            std::net::SocketAddr::new(x.address, x.port).to_string(),
                        )
                    })
                    .collect();
                (m.generation, m.rank_of(&self.pod), members)
            }))
    }

    /// Writes this pod's in-place restarts (`by_cause`: cause → count so far, the contract's
    /// `MemberLost`, `MemberJoined`, `RingFault`; `generation`: the latest restart's) into the
    /// job's heartbeat as `restarts.<pod>`, which the operator sums into
    /// `status.inPlaceRestarts`; waits up to 10 s, a failed write is logged.
    fn report_restarts(
        &self,
        py: Python<'_>,
        by_cause: std::collections::BTreeMap<String, i32>,
        generation: u64,
    ) {
        let report = diphoma_contract::RestartReport {
            by_cause,
            generation,
            time: jiff::Timestamp::now().to_string(),
            job_uid: self.job_uid.clone(),
        };
        let key = format!("{}{}", diphoma_contract::RESTARTS_KEY_PREFIX, self.pod);
        let value = serde_json::to_string(&report).expect("serializable");
        py.detach(|| {
            let watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
            watch.write(key, value);
        });
    }
}

/// The module `diphoma._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Ring>()?;
    m.add_class::<Follower>()?;
    m.add_class::<RingWatch>()?;
    m.add_function(wrap_pyfunction!(membership_json, m)?)?;
    m.add_function(wrap_pyfunction!(split, m)?)?;
    m.add_function(wrap_pyfunction!(sync_root, m)?)?;
    m.add_class::<Speed>()?;
    m.add("SMOOTHING", balance::SMOOTHING)?;
    m.add("DEFAULT_BALANCE_EVERY", balance::DEFAULT_EVERY)?;
    m.add("ENV_SPEED_WEIGHTED", diphoma_contract::ENV_SPEED_WEIGHTED)?;
    m.add("ENV_LOCAL_RANK", diphoma_contract::ENV_LOCAL_RANK)?;
    m.add(
        "ENV_PROCESSES_PER_WORKER",
        diphoma_contract::ENV_PROCESSES_PER_WORKER,
    )?;
    m.add("ENV_BALANCE_EVERY", diphoma_contract::ENV_BALANCE_EVERY)?;
    m.add("RESTART_MEMBER_LOST", diphoma_contract::RESTART_MEMBER_LOST)?;
    m.add(
        "RESTART_MEMBER_JOINED",
        diphoma_contract::RESTART_MEMBER_JOINED,
    )?;
    m.add("RESTART_RING_FAULT", diphoma_contract::RESTART_RING_FAULT)?;
    m.add("RingError", m.py().get_type::<RingError>())?;
    m.add("RingChanged", m.py().get_type::<RingChanged>())?;
    m.add(
        "CollectiveMismatch",
        m.py().get_type::<CollectiveMismatch>(),
    )?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    Ok(())
}
