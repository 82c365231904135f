//! Elastic data-parallel training of one rank: the step loop, commit and roll-back, and the
//! change of ring generation.
//!
//! Step `s` trains on samples `[s·B, (s+1)·B)` of the seeded per-epoch permutation
//! ([`crate::data::step_indices`]), split over the ranks of the current generation
//! ([`crate::data::shard`]). Each rank computes the gradient of its **summed** loss, all
//! gradients and the loss travel in one fused `f32` buffer through one `allreduce(Sum)`, and every
//! rank divides by `B`: the mean gradient of the global batch, whatever the world size.
//!
//! Commit and roll-back: a step commits (its parameters become the in-memory committed state)
//! only after its allreduce succeeded; on a [`CommError`] the rank restores the committed
//! parameters, asks its [`RingSource`] for the next generation and connects it. A new generation
//! starts with a state sync: the member with the highest committed step (the lowest rank among
//! equals) broadcasts its step and parameters with `broadcast_bytes`, so a joiner receives the
//! model, and a survivor whose last allreduce succeeded locally while a peer's failed (ranks can
//! differ by one step) agrees with the others again. Plain SGD keeps no optimizer state, so the
//! parameters and the step are the whole state.

use std::net::TcpListener;
use std::path::PathBuf;

use candle_nn::Optimizer;

use crate::checkpoint;
use crate::data::{self, Dataset};
use crate::model::{Mlp, fuse, unfuse};
use crate::{AbortHandle, CommError, Communicator, Config, ReduceOp};

/// Hyper-parameters and schedule of a training run (identical on every rank).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Steps to train in total.
    pub steps: u64,
    /// Global batch size `B` (samples per step over all ranks).
    pub batch: usize,
    /// Seed of the data order and of the initial weights.
    pub seed: u64,
    /// SGD learning rate.
    pub lr: f64,
    /// Hidden units of the MLP.
    pub hidden: usize,
    /// Rank 0 writes a checkpoint every this many steps (0: never).
    pub checkpoint_every: u64,
    /// Where checkpoints are written and resumed from.
    pub checkpoint_dir: Option<PathBuf>,
    /// Rank 0 prints the loss every this many steps (0: never).
    pub log_every: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 400,
            batch: 64,
            seed: 1,
            lr: 0.5,
            hidden: 64,
            checkpoint_every: 0,
            checkpoint_dir: None,
            log_every: 0,
        }
    }
}

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

/// Why training stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The ring failed and no further generation was offered.
    #[error("ring failed and no new generation: {0}")]
    Ring(#[source] CommError),
    /// A tensor operation failed.
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    /// The configuration is unusable.
    #[error("invalid training configuration: {0}")]
    Config(String),
}

/// What one rank ends with.
#[derive(Debug)]
pub struct Outcome {
    /// The model after the last committed step.
    pub model: Mlp,
    /// Last committed step count (`steps` unless the rank left).
    pub step: u64,
    /// Global mean training loss of each committed step, indexed by step (NaN for the steps
    /// before this rank joined).
    pub losses: Vec<f32>,
    /// The generations this rank trained in, in order.
    pub generations: Vec<u64>,
    /// Step of the last checkpoint this rank wrote (rank 0 only).
    pub last_checkpoint: Option<u64>,
    /// True when the rank left through [`Control::Leave`].
    pub left: bool,
}

/// The committed state kept in memory for roll-back.
struct Committed {
    step: u64,
    params: Vec<f32>,
}

/// The state as bytes: the step (u64 LE), then the parameters (f32 LE).
fn encode_state(c: &Committed, out: &mut [u8]) {
    out[..8].copy_from_slice(&c.step.to_le_bytes());
    for (o, p) in out[8..].chunks_exact_mut(4).zip(&c.params) {
        o.copy_from_slice(&p.to_le_bytes());
    }
}

fn decode_state(buf: &[u8]) -> Committed {
    let step = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    let params = buf[8..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    Committed { step, params }
}

/// The rank whose state a new generation adopts, from every rank's committed step: the highest
/// step, the lowest rank among equals.
pub fn sync_root(steps: &[u64]) -> usize {
    let mut best = 0;
    for (r, &s) in steps.iter().enumerate() {
        if s > steps[best] {
            best = r;
        }
    }
    best
}

/// Agrees on the state at the start of a generation (see the module docs): gathers every rank's
/// committed step (as two exact 24-bit halves in f32, one-hot by rank, through one allreduce),
/// then broadcasts the chosen rank's step and parameters.
fn sync_state(comm: &mut Communicator, c: &mut Committed) -> Result<(), CommError> {
    let (w, r) = (comm.world(), comm.rank());
    if w == 1 {
        return Ok(());
    }
    let mut v = vec![0f32; 2 * w];
    v[2 * r] = (c.step >> 24) as f32;
    v[2 * r + 1] = (c.step & 0xFF_FFFF) as f32;
    comm.allreduce(&mut v, ReduceOp::Sum)?;
    let steps: Vec<u64> = (0..w)
        .map(|q| ((v[2 * q] as u64) << 24) | v[2 * q + 1] as u64)
        .collect();
    let root = sync_root(&steps);
    let mut buf = vec![0u8; 8 + 4 * c.params.len()];
    if r == root {
        encode_state(c, &mut buf);
    }
    comm.broadcast_bytes(&mut buf, root)?;
    *c = decode_state(&buf);
    Ok(())
}

/// Writes the checkpoint of `c` when its step is due (or the last one); returns its step. A
/// failed write is reported and training goes on (the previous checkpoint stays valid).
fn maybe_checkpoint(cfg: &TrainConfig, c: &Committed) -> Option<u64> {
    let dir = cfg.checkpoint_dir.as_ref()?;
    let every = cfg.checkpoint_every;
    if every == 0 || !(c.step.is_multiple_of(every) || c.step == cfg.steps) {
        return None;
    }
    let ck = checkpoint::Checkpoint {
        step: c.step,
        seed: cfg.seed,
        hidden: cfg.hidden,
        params: c.params.clone(),
    };
    match checkpoint::write_atomic(dir, &ck) {
        Ok(_) => Some(c.step),
        Err(e) => {
            eprintln!(
                "diphoma-worker: warning: checkpoint of step {} into {} failed: {e}",
                c.step,
                dir.display()
            );
            None
        }
    }
}

/// One step on this rank: local gradient of its shard, the fused allreduce, the SGD update.
/// Returns the global mean loss, the allreduce's duration (s) and its size (bytes). On a
/// [`CommError`] the parameters are untouched.
fn step_once(
    cfg: &TrainConfig,
    train: &Dataset,
    model: &Mlp,
    opt: &mut candle_nn::SGD,
    comm: &mut Communicator,
    step: u64,
) -> Result<(f32, f64, u64), StepError> {
    let idx = data::step_indices(train.len(), cfg.batch, cfg.seed, step);
    let mine = data::shard(idx.len(), comm.world(), comm.rank());
    let (grads, loss) = model.grad_sum(&train.gather(&idx[mine]))?;
    let mut buf = fuse(&grads, &[loss]);
    let t0 = std::time::Instant::now();
    comm.allreduce(&mut buf, ReduceOp::Sum)
        .map_err(StepError::Comm)?;
    let (secs, bytes) = (t0.elapsed().as_secs_f64(), 4 * buf.len() as u64);
    let inv = 1.0 / cfg.batch as f32;
    buf.iter_mut().for_each(|x| *x *= inv);
    let parts = unfuse(&buf, &model.lens());
    let mean_loss = parts.last().expect("extra")[0];
    model.apply(opt, &buf[..buf.len() - 1])?;
    Ok((mean_loss, secs, bytes))
}

enum StepError {
    Comm(CommError),
    Model(candle_core::Error),
}

impl From<candle_core::Error> for StepError {
    fn from(e: candle_core::Error) -> Self {
        StepError::Model(e)
    }
}

/// Trains this rank from `first` until `cfg.steps` steps are committed, following the
/// generations `source` offers (see the module docs).
///
/// # Errors
/// [`TrainError::Ring`] when a collective failed and `source` offered no new generation;
/// [`TrainError::Model`] on a tensor error; [`TrainError::Config`] on a zero batch.
pub fn train_rank(
    cfg: &TrainConfig,
    train: &Dataset,
    first: Generation,
    source: &mut dyn RingSource,
) -> Result<Outcome, TrainError> {
    if cfg.batch == 0 || train.is_empty() {
        return Err(TrainError::Config(
            "batch and training set must not be empty".into(),
        ));
    }
    let model = Mlp::new(cfg.hidden, cfg.seed)?;
    let mut opt = candle_nn::SGD::new(model.vars.clone(), cfg.lr)?;
    let mut committed = Committed {
        step: 0,
        params: model.flat_params()?,
    };
    if let Some(dir) = &cfg.checkpoint_dir {
        let resumed = checkpoint::load_newest(dir, |c| {
            if c.seed != cfg.seed || c.hidden != cfg.hidden {
                return Err(format!(
                    "seed {} hidden {}, this run has seed {} hidden {}",
                    c.seed, c.hidden, cfg.seed, cfg.hidden
                ));
            }
            Ok(())
        })
        .map_err(|e| TrainError::Config(format!("checkpoint dir {}: {e}", dir.display())))?;
        if let Some((path, c)) = resumed {
            eprintln!(
                "diphoma-worker: resuming from {} at step {}",
                path.display(),
                c.step
            );
            committed = Committed {
                step: c.step,
                params: c.params,
            };
        }
    }
    let mut last_checkpoint = None;
    let mut losses: Vec<f32> = Vec::new();
    let mut generations = Vec::new();
    let mut next = Some(first);
    'generations: while let Some(g) = next.take() {
        let gen_no = g.config.generation;
        let mut comm = match Communicator::connect(g.config, g.listener)
            .and_then(|mut c| sync_state(&mut c, &mut committed).map(|_| c))
        {
            Ok(c) => c,
            Err(e) => {
                next = Some(source.after_failure(&e).ok_or(TrainError::Ring(e))?);
                continue;
            }
        };
        model.set_flat_params(&committed.params)?;
        losses.resize(committed.step as usize, f32::NAN);
        generations.push(gen_no);
        source.connected(gen_no, comm.rank(), comm.abort_handle());
        let (gen_start, gen_first_step) = (std::time::Instant::now(), committed.step);
        while committed.step < cfg.steps {
            let s = committed.step;
            let (ar_secs, ar_bytes) = match step_once(cfg, train, &model, &mut opt, &mut comm, s) {
                Ok((loss, secs, bytes)) => {
                    committed = Committed {
                        step: s + 1,
                        params: model.flat_params()?,
                    };
                    losses.push(loss);
                    if comm.rank() == 0 {
                        last_checkpoint = maybe_checkpoint(cfg, &committed).or(last_checkpoint);
                    }
                    if comm.rank() == 0
                        && cfg.log_every > 0
                        && (s + 1).is_multiple_of(cfg.log_every)
                    {
                        println!("step {} generation {gen_no} loss {loss:.5}", s + 1);
                    }
                    (secs, bytes)
                }
                Err(StepError::Model(e)) => return Err(e.into()),
                Err(StepError::Comm(e)) => {
                    model.set_flat_params(&committed.params)?;
                    next = Some(source.after_failure(&e).ok_or(TrainError::Ring(e))?);
                    continue 'generations;
                }
            };
            let progress = Progress {
                step: committed.step,
                total_steps: cfg.steps,
                generation: gen_no,
                rank: comm.rank(),
                loss: losses.last().copied().unwrap_or(f32::NAN),
                samples_per_second: ((committed.step - gen_first_step) * cfg.batch as u64) as f64
                    / gen_start.elapsed().as_secs_f64().max(1e-9),
                last_checkpoint,
                allreduce_seconds: ar_secs,
                allreduce_bytes: ar_bytes,
            };
            match source.after_commit(&progress) {
                Control::Continue => {}
                Control::Switch(g) => {
                    next = Some(g);
                    continue 'generations;
                }
                Control::Leave => {
                    return Ok(Outcome {
                        model,
                        step: committed.step,
                        losses,
                        generations,
                        last_checkpoint,
                        left: true,
                    });
                }
            }
        }
    }
    Ok(Outcome {
        model,
        step: committed.step,
        losses,
        generations,
        last_checkpoint,
        left: false,
    })
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

/// Runs `world` ranks as threads on 127.0.0.1 with a [`FixedRing`]; outcomes by rank.
///
/// # Errors
/// The first rank's error, or an I/O error binding the listeners.
pub fn train_standalone(
    cfg: &TrainConfig,
    train: &Dataset,
    world: usize,
) -> Result<Vec<Outcome>, TrainError> {
    if world == 0 {
        return Err(TrainError::Config("world must be at least 1".into()));
    }
    let mut key = vec![0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut key);
    let gens = local_generation(world, 1, &key).map_err(|e| {
        TrainError::Ring(CommError::Io {
            op: "bind",
            source: e,
        })
    })?;
    std::thread::scope(|s| {
        let hs: Vec<_> = gens
            .into_iter()
            .map(|g| s.spawn(move || train_rank(cfg, train, g, &mut FixedRing)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(TrainError::Config("rank panicked".into())))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_root_takes_the_highest_step_lowest_rank() {
        assert_eq!(sync_root(&[3, 4, 4, 0]), 1);
        assert_eq!(sync_root(&[0, 0]), 0);
        assert_eq!(sync_root(&[7]), 0);
    }

    #[test]
    fn state_bytes_roundtrip() {
        let c = Committed {
            step: (1 << 40) + 3,
            params: vec![1.5, -2.0, f32::MIN_POSITIVE],
        };
        let mut b = vec![0; 8 + 12];
        encode_state(&c, &mut b);
        let d = decode_state(&b);
        assert_eq!((d.step, d.params), (c.step, c.params));
    }
}
