//! `diphoma._native`: the ring runtime of `diphoma-ring` as a Python extension module (pyo3,
//! abi3 for CPython ≥ 3.9). The Python package (`python/diphoma/`) builds the torch.distributed
//! backend and the launcher on top of it.
//!
//! # Layout
//!
//! | item | owns | must not |
//! |---|---|---|
//! | [`Ring`] | one ring generation's [`Communicator`] and its collectives on raw CPU buffers (address + length from `tensor.data_ptr()`), each run with the GIL released | know about torch, keep a buffer past a call |
//! | [`RingError`], [`ConfigError`] | the Python exceptions: a collective or join failed; a bad argument or environment variable (named in the message) | |
//!
//! The ring, the membership and the handshake are `diphoma-ring`'s: this crate only converts
//! arguments and errors. It must not re-implement any of them.

use std::sync::Mutex;

use diphoma_ring::source::standalone_config;
use diphoma_ring::{CommError, Communicator, Element, ReduceOp, bf16, f16};
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
    rank: usize,
    world: usize,
    generation: u64,
}

impl Ring {
    /// Runs `f` on the communicator with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Communicator) -> Result<R, CommError> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut c = self.comm.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut c)
        })
        .map_err(ring_err)
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
            .detach(|| Communicator::bind_and_connect(cfg))
            .map_err(ring_err)?;
        Ok(Ring {
            rank: comm.rank(),
            world: comm.world(),
            generation: comm.generation(),
            comm: Mutex::new(comm),
        })
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

    fn __repr__(&self) -> String {
        format!(
            "Ring(rank={}, world={}, generation={})",
            self.rank, self.world, self.generation
        )
    }
}

/// The module `diphoma._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Ring>()?;
    m.add("RingError", m.py().get_type::<RingError>())?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    Ok(())
}
