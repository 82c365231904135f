//! Elastic data-parallel training of one rank: the step loop, commit and roll-back, and the
//! change of ring generation.
//!
//! Step `s` trains on samples `[s·B, (s+1)·B)` of the seeded per-epoch permutation
//! ([`crate::data::step_indices`]), split over the ranks of the current generation in
//! contiguous shares ([`crate::balance::range`]). Each rank computes the gradient of its
//! **summed** loss, all gradients and the loss travel in one fused `f32` buffer through one
//! `allreduce(Sum)`, and every rank divides by `B`: the mean gradient of the global batch,
//! whatever the world size and whatever the split.
//!
//! Speed-weighted shares ([`TrainConfig::speed_weighted`]): each rank times the compute of its
//! share (gather, forward, backward; everything before the collective) and keeps a smoothed time
//! per sample ([`crate::balance::Speed`]). Its rate rides in the step's fused buffer, one `f32`
//! slot per rank (zero in the others', so the sum is exact), and every
//! [`TrainConfig::balance_every`] committed steps every rank derives the same new split with
//! [`crate::balance::split`] from the same summed vector. A new generation starts with the
//! rates gathered by its state sync. No extra collective: the rates travel with the gradients
//! (with the averages in periodic mode, and with the steps in the state sync). Switched off, the
//! split is equal ([`crate::data::shard`]'s).
//!
//! Periodic averaging ([`SyncMode::Periodic`], local SGD): each rank takes `H` local steps on its
//! own share of each step's batch (its gradient is the mean over its share, applied by its own
//! optimizer) with no collective, then the ranks average their parameters and the optimizer's
//! state (AdamW's first and second moments; its step count is the same everywhere; SGD has
//! none) in one `allreduce(Sum)` of the values weighted by each rank's share of the period's
//! samples, `nᵢ / (h·B)`. With that weighting and plain SGD, `H = 1` is exactly every-step
//! training (up to f32 rounding): `Σ nᵢ/B·(θ − lr·gᵢ/nᵢ) = θ − lr·Σgᵢ/B`. Only the averages
//! commit: the committed state is the last average, a failed average rolls back to it (the
//! local steps since are redone), checkpoints and progress are written at averages only. The
//! result depends on `H`, on the split and on the world size (local models drift apart between
//! averages); what it buys is `H` times fewer collectives.
//!
//! Commit and roll-back: a step commits (its parameters become the in-memory committed state)
//! only after its allreduce succeeded; on a [`CommError`] the rank restores the committed
//! parameters, asks its [`RingSource`] for the next generation and connects it. A new generation
//! starts with a state sync: the member with the highest committed step (the lowest rank among
//! equals: [`sync_root`], the ring's rule) broadcasts its step and parameters with `broadcast_bytes`, so a joiner receives the
//! model, and a survivor whose last allreduce succeeded locally while a peer's failed (ranks can
//! differ by one step) agrees with the others again. The state is the step, the parameters and
//! the optimizer's state ([`crate::optim::OptState`]: nothing for SGD, AdamW's moments and step
//! count), and all of it travels in that broadcast and in checkpoints.
//!
//! The model and the data are the run's choice ([`TrainConfig::widths`], the [`Dataset`] given):
//! the digits MLP on the digits set, or the synthetic bandwidth model on
//! [`crate::data::synthetic`] data; the loop is the same.

use std::path::PathBuf;

use diphoma_ring::source::{
    Control, FixedRing, Generation, Progress, RingSource, local_generation, sync_root,
};
use diphoma_ring::{CommError, Communicator, ReduceOp};

use crate::balance::{self, Speed};
use crate::checkpoint;
use crate::data::{self, Dataset};
use crate::model::{Mlp, digits_widths, fuse};
use crate::optim::{OptState, Optim, OptimizerKind};

/// Hyper-parameters and schedule of a training run (identical on every rank).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Steps to train in total.
    pub steps: u64,
    /// Global batch size `B` (samples per step over all ranks).
    pub batch: usize,
    /// Seed of the data order and of the initial weights.
    pub seed: u64,
    /// Learning rate of the optimizer.
    pub lr: f64,
    /// Layer widths of the MLP `[input, hidden…, classes]`
    /// ([`crate::model::digits_widths`], [`crate::model::synthetic_widths`]); the input width
    /// must be the data's `features`.
    pub widths: Vec<usize>,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Rank 0 writes a checkpoint every this many steps (0: never).
    pub checkpoint_every: u64,
    /// Where checkpoints are written and resumed from: with an owner, the root of every job's
    /// checkpoints (this run's are in [`checkpoint::Owner::dir`]); without, this run's own.
    pub checkpoint_dir: Option<PathBuf>,
    /// The job the checkpoints belong to (none: a standalone run): only its own are resumed
    /// and pruned ([`checkpoint::load_own`]).
    pub checkpoint_owner: Option<checkpoint::Owner>,
    /// A job of the owner's namespace whose newest checkpoint is resumed when the owner has none
    /// of its own (`spec.checkpoint.resumeFrom`; [`checkpoint::load_other`]).
    pub resume_from: Option<String>,
    /// Rank 0 hands its progress to [`TrainConfig::on_log`] every this many steps (0: never).
    pub log_every: u64,
    /// Receives rank 0's progress every [`TrainConfig::log_every`] steps (the CLI prints it);
    /// `None`: nobody.
    pub on_log: Option<fn(&StepLog)>,
    /// For tests of failure detection: `(rank, delay)`, the member at this rank of every
    /// generation sleeps `delay` before each step's allreduce, as a slow GPU or a data-loading
    /// stall would (the sleep counts as its compute time). `None`: no delay.
    pub slow_rank: Option<(usize, std::time::Duration)>,
    /// Split each step's batch over the ranks in proportion to their measured speeds (see the
    /// module docs); `false`: equal shares.
    pub speed_weighted: bool,
    /// Committed steps between two re-splits of the batch (at least 1).
    pub balance_every: u64,
    /// When the ranks synchronise.
    pub sync: SyncMode,
}

/// When the ranks synchronise their models (`spec.sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// One gradient allreduce per step: the result does not depend on the world or the split.
    #[default]
    EveryStep,
    /// Local SGD: `H` local steps, then one average of parameters and optimizer state.
    Periodic(u64),
}

impl SyncMode {
    /// Steps per synchronisation: 1 for every step, `H` for periodic.
    pub fn period(self) -> u64 {
        match self {
            SyncMode::EveryStep => 1,
            SyncMode::Periodic(h) => h,
        }
    }
}

/// Default of [`TrainConfig::balance_every`].
pub const DEFAULT_BALANCE_EVERY: u64 = balance::DEFAULT_EVERY;

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 400,
            batch: 64,
            seed: 1,
            lr: 0.5,
            widths: digits_widths(64),
            optimizer: OptimizerKind::Sgd,
            checkpoint_every: 0,
            checkpoint_dir: None,
            checkpoint_owner: None,
            resume_from: None,
            log_every: 0,
            on_log: None,
            slow_rank: None,
            speed_weighted: true,
            balance_every: DEFAULT_BALANCE_EVERY,
            sync: SyncMode::EveryStep,
        }
    }
}

impl TrainConfig {
    /// This run's own checkpoint directory: [`TrainConfig::checkpoint_dir`], under it the
    /// owner's ([`checkpoint::Owner::dir`]) when there is one.
    pub fn own_checkpoint_dir(&self) -> Option<PathBuf> {
        let root = self.checkpoint_dir.as_ref()?;
        Some(match &self.checkpoint_owner {
            Some(owner) => owner.dir(root),
            None => root.clone(),
        })
    }
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
    /// The checkpoint directory could not be read.
    #[error("checkpoint dir {}: {source}", dir.display())]
    CheckpointDir {
        /// The directory.
        dir: std::path::PathBuf,
        /// Why.
        #[source]
        source: crate::checkpoint::CheckpointError,
    },
}

/// What one rank ends with.
#[derive(Debug)]
pub struct Outcome {
    /// The model after the last committed step.
    pub model: Mlp,
    /// The optimizer after the last committed step (its state: [`Optim::state`]).
    pub optimizer: Optim,
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
    /// Time spent in this rank's committed steps.
    pub stats: Stats,
    /// The split of the global batch in use at the end (samples per rank, in rank order).
    pub shares: Vec<usize>,
    /// Every rank's smoothed compute rate (samples per second, in rank order) as last
    /// exchanged; empty when not speed-weighted. Their sum is the throughput the ring would
    /// reach if no rank waited for another and communication were free.
    pub rates: Vec<f64>,
}

/// Time spent by one rank in its committed steps (not in connects, state syncs or failed
/// steps).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Steps committed by this rank.
    pub steps: u64,
    /// Wall time of those steps (gradient, allreduce, update, checkpoint), in seconds.
    pub seconds: f64,
    /// Time in their allreduces, in seconds.
    pub allreduce_seconds: f64,
    /// Size of one step's fused allreduce buffer (gradients and loss, f32), in bytes.
    pub allreduce_bytes: u64,
    /// Collectives of the committed steps: one per step, or one per average in periodic mode
    /// (the state syncs of new generations not counted).
    pub allreduces: u64,
}

impl Stats {
    /// Samples per second over the ring (`batch` samples per step).
    pub fn samples_per_second(&self, batch: usize) -> f64 {
        (self.steps * batch as u64) as f64 / self.seconds.max(1e-9)
    }

    /// Mean allreduce time per step, in seconds.
    pub fn allreduce_per_step(&self) -> f64 {
        self.allreduce_seconds / self.steps.max(1) as f64
    }
}

/// The whole training state: what a joiner receives and a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
struct State {
    step: u64,
    params: Vec<f32>,
    opt: OptState,
}

/// The state of the live model and optimizer after `step` committed steps.
fn snapshot(step: u64, model: &Mlp, opt: &Optim) -> candle_core::Result<State> {
    Ok(State {
        step,
        params: model.flat_params()?,
        opt: opt.state()?,
    })
}

/// Sets the live model and optimizer to `s`; returns its step.
fn restore(s: &State, model: &Mlp, opt: &mut Optim) -> candle_core::Result<u64> {
    model.set_flat_params(&s.params)?;
    opt.set_state(&s.opt)?;
    Ok(s.step)
}

/// Bytes of the encoded state of a model of `params` parameters with `kind`: the step (u64),
/// the parameters (f32), then for AdamW its step count (u64) and both moments (f32).
fn state_len(params: usize, kind: OptimizerKind) -> usize {
    let opt = match kind {
        OptimizerKind::Sgd => 0,
        OptimizerKind::AdamW => 8,
    };
    8 + 4 * params + opt + 4 * kind.state_floats(params)
}

fn put_f32s(out: &mut [u8], xs: &[f32]) -> usize {
    for (o, p) in out.chunks_exact_mut(4).zip(xs) {
        o.copy_from_slice(&p.to_le_bytes());
    }
    4 * xs.len()
}

fn get_f32s(buf: &[u8], n: usize) -> Vec<f32> {
    buf[..4 * n]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

/// The state as little-endian bytes (see [`state_len`]); `out` has exactly that length.
fn encode_state(s: &State, out: &mut [u8]) {
    out[..8].copy_from_slice(&s.step.to_le_bytes());
    let mut at = 8 + put_f32s(&mut out[8..], &s.params);
    if let OptState::AdamW { step, m, v } = &s.opt {
        out[at..at + 8].copy_from_slice(&step.to_le_bytes());
        at += 8;
        at += put_f32s(&mut out[at..], m);
        put_f32s(&mut out[at..], v);
    }
}

/// Decodes [`encode_state`]'s bytes of a model of `params` parameters with `kind`.
fn decode_state(buf: &[u8], params: usize, kind: OptimizerKind) -> State {
    let u64_at = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
    let step = u64_at(0);
    let p = get_f32s(&buf[8..], params);
    let at = 8 + 4 * params;
    let opt = match kind {
        OptimizerKind::Sgd => OptState::Sgd,
        OptimizerKind::AdamW => OptState::AdamW {
            step: u64_at(at),
            m: get_f32s(&buf[at + 8..], params),
            v: get_f32s(&buf[at + 8 + 4 * params..], params),
        },
    };
    State {
        step,
        params: p,
        opt,
    }
}

/// Agrees on the state at the start of a generation (see the module docs): gathers every rank's
/// committed step (as two exact 24-bit halves in f32, one-hot by rank) and its rate (samples
/// per second, one-hot) through one allreduce, then broadcasts the chosen rank's step,
/// parameters and optimizer state into the live model and optimizer of every other rank.
/// Returns the agreed step and every rank's rate. Nothing changes on a failure.
fn sync_state(
    comm: &mut Communicator,
    step: u64,
    rate: f64,
    model: &Mlp,
    opt: &mut Optim,
) -> Result<(u64, Vec<f64>), StepError> {
    let (w, r) = (comm.world(), comm.rank());
    if w == 1 {
        return Ok((step, vec![rate]));
    }
    let mut v = vec![0f32; 3 * w];
    v[2 * r] = (step >> 24) as f32;
    v[2 * r + 1] = (step & 0xFF_FFFF) as f32;
    v[2 * w + r] = rate as f32;
    comm.allreduce(&mut v, ReduceOp::Sum)
        .map_err(StepError::Comm)?;
    let steps: Vec<u64> = (0..w)
        .map(|q| ((v[2 * q] as u64) << 24) | v[2 * q + 1] as u64)
        .collect();
    let rates = v[2 * w..].iter().map(|&x| f64::from(x)).collect();
    let root = sync_root(&steps);
    let (n, kind) = (model.param_count(), opt.kind());
    let mut buf = vec![0u8; state_len(n, kind)];
    if r == root {
        encode_state(&snapshot(step, model, opt)?, &mut buf);
    }
    comm.broadcast_bytes(&mut buf, root)
        .map_err(StepError::Comm)?;
    if r == root {
        return Ok((step, rates));
    }
    Ok((restore(&decode_state(&buf, n, kind), model, opt)?, rates))
}

/// Writes the checkpoint of the live state after `step`, committed after `prev`, when a due
/// step (a multiple of `checkpoint_every`, or the last one) lies in `prev+1..=step`; returns its
/// step. A failed write is reported and training goes on (the previous checkpoint stays valid).
fn maybe_checkpoint(
    cfg: &TrainConfig,
    prev: u64,
    step: u64,
    model: &Mlp,
    opt: &Optim,
) -> candle_core::Result<Option<u64>> {
    let Some(dir) = cfg.own_checkpoint_dir() else {
        return Ok(None);
    };
    let every = cfg.checkpoint_every;
    if every == 0 || !(crosses(every, prev, step) || step == cfg.steps) {
        return Ok(None);
    }
    let s = snapshot(step, model, opt)?;
    let ck = checkpoint::Checkpoint {
        step,
        seed: cfg.seed,
        widths: cfg.widths.clone(),
        params: s.params,
        optimizer: s.opt,
        owner: cfg.checkpoint_owner.clone(),
    };
    Ok(match checkpoint::write_atomic(&dir, &ck) {
        Ok(_) => Some(step),
        Err(e) => {
            tracing::warn!(
                "checkpoint of step {step} into {} failed: {e}",
                dir.display()
            );
            None
        }
    })
}

/// What a committed step or average leaves behind.
struct Committed {
    /// Global mean training loss (periodic: over the period's steps).
    loss: f32,
    /// Duration of the collective, in seconds.
    secs: f64,
    /// Size of its buffer, in bytes.
    bytes: u64,
    /// Every rank's rate as carried in the buffer (empty when not speed-weighted).
    rates: Vec<f64>,
}

/// This rank's share of step `step`: the samples and the seconds it took to compute their
/// summed-loss gradient (gather, forward, backward, and [`TrainConfig::slow_rank`]'s delay).
fn local_gradient(
    cfg: &TrainConfig,
    train: &Dataset,
    model: &Mlp,
    (rank, shares): (usize, &[usize]),
    step: u64,
) -> candle_core::Result<(Vec<Vec<f32>>, f32, usize, f64)> {
    let t0 = std::time::Instant::now();
    let idx = data::step_indices(train.len(), cfg.batch, cfg.seed, step);
    let mine = balance::range(shares, rank);
    let n = mine.len();
    let (grads, loss) = model.grad_sum(&train.gather(&idx[mine]))?;
    if let Some((r, delay)) = cfg.slow_rank
        && r == rank
    {
        std::thread::sleep(delay);
    }
    Ok((grads, loss, n, t0.elapsed().as_secs_f64()))
}

/// The rates' slots of a fused buffer: `world` zeros but this rank's rate (speed-weighted
/// runs only; none otherwise).
fn rate_slots(cfg: &TrainConfig, world: usize, rank: usize, speed: &Speed) -> Vec<f32> {
    if !cfg.speed_weighted {
        return Vec::new();
    }
    let mut v = vec![0f32; world];
    v[rank] = speed.rate() as f32;
    v
}

/// One step on this rank: local gradient of its share, the fused allreduce (gradients, loss,
/// rates), the optimizer's update. On a [`CommError`] the model and the optimizer are
/// untouched: they still hold the committed state, so roll-back needs no copy.
fn step_once(
    cfg: &TrainConfig,
    train: &Dataset,
    (model, opt): (&Mlp, &mut Optim),
    comm: &mut Communicator,
    (shares, speed): (&[usize], &mut Speed),
    step: u64,
) -> Result<Committed, StepError> {
    let (w, r) = (comm.world(), comm.rank());
    let (grads, loss, n, secs) = local_gradient(cfg, train, model, (r, shares), step)?;
    speed.record(secs, n);
    let mut buf = fuse(&grads, &[loss]);
    drop(grads);
    let np = buf.len() - 1;
    buf.extend(rate_slots(cfg, w, r, speed));
    let t0 = std::time::Instant::now();
    comm.allreduce(&mut buf, ReduceOp::Sum)
        .map_err(StepError::Comm)?;
    let (secs, bytes) = (t0.elapsed().as_secs_f64(), 4 * buf.len() as u64);
    let rates = buf[np + 1..].iter().map(|&x| f64::from(x)).collect();
    buf.truncate(np + 1);
    let inv = 1.0 / cfg.batch as f32;
    buf.iter_mut().for_each(|x| *x *= inv);
    let mean_loss = buf[np];
    model.apply(opt, &buf[..np])?;
    Ok(Committed {
        loss: mean_loss,
        secs,
        bytes,
        rates,
    })
}

/// One period of local SGD on this rank: the local steps `from..to` on its shares (each the
/// mean gradient of its share, applied by its own optimizer), then the weighted average of
/// parameters and optimizer moments with the loss and the rates in one `allreduce(Sum)` (see
/// the module docs). On a [`CommError`] the live model and optimizer hold local, uncommitted
/// values: the caller restores the last average.
fn period_once(
    cfg: &TrainConfig,
    train: &Dataset,
    (model, opt): (&Mlp, &mut Optim),
    comm: &mut Communicator,
    (shares, speed): (&[usize], &mut Speed),
    (from, to): (u64, u64),
) -> Result<Committed, StepError> {
    let (w, r) = (comm.world(), comm.rank());
    let (mut samples, mut loss_sum) = (0usize, 0f64);
    for s in from..to {
        let (grads, loss, n, secs) = local_gradient(cfg, train, model, (r, shares), s)?;
        speed.record(secs, n);
        let mut g = fuse(&grads, &[]);
        drop(grads);
        let inv = 1.0 / n.max(1) as f32;
        g.iter_mut().for_each(|x| *x *= inv);
        if n > 0 {
            model.apply(opt, &g)?;
        }
        samples += n;
        loss_sum += f64::from(loss);
    }
    let total = ((to - from) * cfg.batch as u64) as f64;
    let weight = (samples as f64 / total) as f32;
    let np = model.param_count();
    let mut buf = model.flat_params()?;
    let opt_state = opt.state()?;
    if let OptState::AdamW { m, v, .. } = &opt_state {
        buf.extend_from_slice(m);
        buf.extend_from_slice(v);
    }
    buf.iter_mut().for_each(|x| *x *= weight);
    buf.push((loss_sum / total) as f32);
    let nv = buf.len();
    buf.extend(rate_slots(cfg, w, r, speed));
    let t0 = std::time::Instant::now();
    comm.allreduce(&mut buf, ReduceOp::Sum)
        .map_err(StepError::Comm)?;
    let (secs, bytes) = (t0.elapsed().as_secs_f64(), 4 * buf.len() as u64);
    let rates = buf[nv..].iter().map(|&x| f64::from(x)).collect();
    model.set_flat_params(&buf[..np])?;
    if let OptState::AdamW { step, .. } = opt_state {
        opt.set_state(&OptState::AdamW {
            step,
            m: buf[np..2 * np].to_vec(),
            v: buf[2 * np..3 * np].to_vec(),
        })?;
    }
    Ok(Committed {
        loss: buf[nv - 1],
        secs,
        bytes,
        rates,
    })
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

impl StepError {
    /// The failed connect's or collective's error; a tensor error ends the run
    /// ([`TrainError::Model`]).
    fn into_comm(self) -> Result<CommError, TrainError> {
        match self {
            StepError::Comm(e) => Ok(e),
            StepError::Model(e) => Err(e.into()),
        }
    }
}

/// Rank 0's progress after a commit, handed to [`TrainConfig::on_log`] every
/// [`TrainConfig::log_every`] steps.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLog {
    /// Steps committed.
    pub step: u64,
    /// The generation it committed in.
    pub generation: u64,
    /// Global mean training loss of the step (periodic mode: of the period).
    pub loss: f32,
    /// Samples per second over this rank's committed steps ([`Stats::samples_per_second`]).
    pub samples_per_second: f64,
    /// Duration of the step's collective, in seconds.
    pub allreduce_seconds: f64,
    /// Every rank's smoothed compute rate (samples per second, in rank order) as last
    /// exchanged.
    pub rates: Vec<f64>,
    /// The split of the global batch in use (samples per rank, in rank order).
    pub shares: Vec<usize>,
}

/// Whether committing the steps `prev+1..=step` crosses a multiple of `every` (a schedule of
/// "every `every` steps"); never when `every` is 0.
fn crosses(every: u64, prev: u64, step: u64) -> bool {
    every > 0 && step / every > prev / every
}

/// Trains this rank from `first` until `cfg.steps` steps are committed, following the
/// generations `source` offers (see the module docs): one generation after the other
/// (`train_generation`), the next one asked of `source` after a failure.
///
/// # Errors
/// [`TrainError::Ring`] when a collective failed and `source` offered no new generation;
/// [`TrainError::Model`] on a tensor error; [`TrainError::Config`] on a zero batch, an empty
/// training set, widths that do not fit the data, or a checkpoint directory that cannot be
/// listed.
pub fn train_rank(
    cfg: &TrainConfig,
    train: &Dataset,
    first: Generation,
    source: &mut dyn RingSource,
) -> Result<Outcome, TrainError> {
    check_config(cfg, train)?;
    let model = Mlp::new(&cfg.widths, cfg.seed)?;
    let mut opt = Optim::new(cfg.optimizer, model.vars.clone(), cfg.lr)?;
    let mut rec = Record {
        step: resume(cfg, &model, &mut opt)?,
        ..Record::default()
    };
    let mut next = Some(first);
    while let Some(g) = next.take() {
        next = match train_generation(cfg, train, (&model, &mut opt), g, source, &mut rec)? {
            GenerationEnd::Finished => None,
            GenerationEnd::Failed(e) => Some(source.after_failure(&e).ok_or(TrainError::Ring(e))?),
            GenerationEnd::Switch(g) => Some(g),
            GenerationEnd::Leave => {
                rec.left = true;
                None
            }
        };
    }
    Ok(rec.outcome(cfg, model, opt))
}

/// Checks that `cfg` can train on `train`.
///
/// # Errors
/// [`TrainError::Config`] on a zero batch, an empty training set, or widths whose input is not
/// the data's `features`.
fn check_config(cfg: &TrainConfig, train: &Dataset) -> Result<(), TrainError> {
    if cfg.batch == 0 || train.is_empty() {
        return Err(TrainError::Config(
            "batch and training set must not be empty".into(),
        ));
    }
    if cfg.widths.first() != Some(&train.features) {
        return Err(TrainError::Config(format!(
            "widths {:?} for samples of {} inputs",
            cfg.widths, train.features
        )));
    }
    Ok(())
}

/// Restores the live model and optimizer from the checkpoint this run resumes, if any: with an
/// owner its own newest, else the newest of [`TrainConfig::resume_from`]'s job; without, the
/// newest in [`TrainConfig::checkpoint_dir`]. Only checkpoints of the same seed, widths and
/// optimizer are taken. Returns the committed step (0 without a checkpoint).
///
/// # Errors
/// [`TrainError::CheckpointDir`] when the directory cannot be read; [`TrainError::Model`] when
/// the checkpoint does not fit the model.
fn resume(cfg: &TrainConfig, model: &Mlp, opt: &mut Optim) -> Result<u64, TrainError> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok(0);
    };
    let accept = |c: &checkpoint::Checkpoint| {
        let kind = c.optimizer.kind();
        if c.seed != cfg.seed || c.widths != cfg.widths || kind != cfg.optimizer {
            return Err(format!(
                "seed {} widths {:?} optimizer {}, this run has seed {} widths {:?} optimizer {}",
                c.seed,
                c.widths,
                kind.name(),
                cfg.seed,
                cfg.widths,
                cfg.optimizer.name()
            ));
        }
        Ok(())
    };
    let resumed = match &cfg.checkpoint_owner {
        None => checkpoint::load_newest(dir, accept),
        Some(owner) => match checkpoint::load_own(dir, owner, accept) {
            Ok(None) => match &cfg.resume_from {
                Some(name) => checkpoint::load_other(dir, &owner.namespace, name, accept),
                None => Ok(None),
            },
            found => found,
        },
    }
    .map_err(|source| TrainError::CheckpointDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let Some((path, c)) = resumed else {
        return Ok(0);
    };
    tracing::info!("resuming from {} at step {}", path.display(), c.step);
    let s = State {
        step: c.step,
        params: c.params,
        opt: c.optimizer,
    };
    Ok(restore(&s, model, opt)?)
}

/// What a rank carries from one generation to the next besides the model and the optimizer:
/// its [`Outcome`] in the making, and its speed.
#[derive(Default)]
struct Record {
    /// The committed step; the live model and optimizer always hold its state (see
    /// [`step_once`]).
    step: u64,
    losses: Vec<f32>,
    generations: Vec<u64>,
    last_checkpoint: Option<u64>,
    left: bool,
    stats: Stats,
    speed: Speed,
    shares: Vec<usize>,
    rates: Vec<f64>,
}

/// How training in one generation ended.
enum GenerationEnd {
    /// All [`TrainConfig::steps`] are committed.
    Finished,
    /// Its connect, state sync or a collective failed; the live state is the committed one.
    Failed(CommError),
    /// `source` offered the next generation after a commit.
    Switch(Generation),
    /// `source` asked this rank to leave the ring.
    Leave,
}

/// Trains in generation `g`: joins it ([`join_generation`]), then trains one step (periodic
/// mode: one period) at a time ([`train_span`]), commits it ([`Record::commit`],
/// [`Record::account`]) and reports it (to [`TrainConfig::on_log`] and `source`), until the
/// run is done, a collective fails (the live state rolled back to the committed one) or
/// `source` switches or stops this rank.
///
/// # Errors
/// [`TrainError::Model`] on a tensor error.
fn train_generation(
    cfg: &TrainConfig,
    train: &Dataset,
    (model, opt): (&Mlp, &mut Optim),
    g: Generation,
    source: &mut dyn RingSource,
    rec: &mut Record,
) -> Result<GenerationEnd, TrainError> {
    let generation = g.config.generation;
    let mut comm = match join_generation(cfg, g, (model, opt), rec) {
        Ok(c) => c,
        Err(e) => return Ok(GenerationEnd::Failed(e.into_comm()?)),
    };
    let rank = comm.rank();
    source.connected(generation, rank, comm.abort_handle());
    let since = (std::time::Instant::now(), rec.step);
    // Periodic mode: the last average, restored when the next one fails.
    let mut last = match cfg.sync {
        SyncMode::EveryStep => None,
        SyncMode::Periodic(_) => Some(snapshot(rec.step, model, opt)?),
    };
    let period = cfg.sync.period().max(1);
    while rec.step < cfg.steps {
        let span = (rec.step, (rec.step + period).min(cfg.steps));
        let t0 = std::time::Instant::now();
        let c = match train_span(cfg, train, (model, opt), &mut comm, rec, span) {
            Ok(c) => c,
            Err(e) => {
                let e = e.into_comm()?;
                if let Some(last) = &last {
                    restore(last, model, opt)?;
                }
                return Ok(GenerationEnd::Failed(e));
            }
        };
        rec.commit(cfg, (model, opt), &mut last, rank, span, c.loss)?;
        rec.account(cfg, span, &c, t0.elapsed().as_secs_f64());
        if let Some(log) = cfg.on_log
            && rank == 0
            && crosses(cfg.log_every, span.0, span.1)
        {
            log(&rec.step_log(cfg, generation, &c));
        }
        match source.after_commit(&rec.progress(cfg, (generation, rank), since, &c)) {
            Control::Continue => {}
            Control::Switch(g) => return Ok(GenerationEnd::Switch(g)),
            Control::Leave => return Ok(GenerationEnd::Leave),
        }
    }
    Ok(GenerationEnd::Finished)
}

/// Joins generation `g`: connects its ring, agrees on the state ([`sync_state`]), then takes
/// the agreed step, the split for the gathered rates, and records the generation. On a failure
/// `rec` is untouched.
fn join_generation(
    cfg: &TrainConfig,
    g: Generation,
    (model, opt): (&Mlp, &mut Optim),
    rec: &mut Record,
) -> Result<Communicator, StepError> {
    let generation = g.config.generation;
    let mut comm = Communicator::connect(g.config, g.listener).map_err(StepError::Comm)?;
    let (step, rates) = sync_state(&mut comm, rec.step, rec.speed.rate(), model, opt)?;
    rec.step = step;
    rec.shares = split_for(cfg, &rates);
    rec.rates = rates;
    rec.losses.resize(step as usize, f32::NAN);
    rec.generations.push(generation);
    Ok(comm)
}

/// Trains the steps `from..to` of `span` and synchronises, as [`TrainConfig::sync`] says: one
/// step ([`step_once`]) or one period of local SGD ([`period_once`]).
fn train_span(
    cfg: &TrainConfig,
    train: &Dataset,
    (model, opt): (&Mlp, &mut Optim),
    comm: &mut Communicator,
    rec: &mut Record,
    span: (u64, u64),
) -> Result<Committed, StepError> {
    let balance = (&rec.shares[..], &mut rec.speed);
    match cfg.sync {
        SyncMode::EveryStep => step_once(cfg, train, (model, opt), comm, balance, span.0),
        SyncMode::Periodic(_) => period_once(cfg, train, (model, opt), comm, balance, span),
    }
}

impl Record {
    /// Commits the steps `from+1..=to` of `span` with their global mean `loss`: the step, the
    /// losses, periodic mode's `last` average, and on rank 0 the checkpoint when one is due
    /// ([`maybe_checkpoint`]).
    fn commit(
        &mut self,
        cfg: &TrainConfig,
        (model, opt): (&Mlp, &Optim),
        last: &mut Option<State>,
        rank: usize,
        (from, to): (u64, u64),
        loss: f32,
    ) -> candle_core::Result<()> {
        self.step = to;
        self.losses.resize(to as usize, loss);
        if let Some(last) = last {
            *last = snapshot(to, model, opt)?;
        }
        if rank == 0 {
            self.last_checkpoint =
                maybe_checkpoint(cfg, from, to, model, opt)?.or(self.last_checkpoint);
        }
        Ok(())
    }

    /// Accounts the committed steps of `span`, which took `seconds` (wall time, checkpoint
    /// included) with their collective `c`: the [`Stats`], and when speed-weighted the rates
    /// `c` carried and, every [`TrainConfig::balance_every`] steps, the split they give.
    fn account(&mut self, cfg: &TrainConfig, (from, to): (u64, u64), c: &Committed, seconds: f64) {
        let st = &mut self.stats;
        st.steps += to - from;
        st.seconds += seconds;
        st.allreduce_seconds += c.secs;
        st.allreduce_bytes = c.bytes;
        st.allreduces += 1;
        if cfg.speed_weighted {
            if crosses(cfg.balance_every.max(1), from, to) {
                self.shares = split_for(cfg, &c.rates);
            }
            self.rates = c.rates.clone();
        }
    }

    /// The [`StepLog`] of the last commit, made in `generation` with `c`.
    fn step_log(&self, cfg: &TrainConfig, generation: u64, c: &Committed) -> StepLog {
        StepLog {
            step: self.step,
            generation,
            loss: c.loss,
            samples_per_second: self.stats.samples_per_second(cfg.batch),
            allreduce_seconds: c.secs,
            rates: self.rates.clone(),
            shares: self.shares.clone(),
        }
    }

    /// The [`Progress`] of the last commit, made by `rank` of `generation` with `c`, for
    /// [`RingSource::after_commit`]; `since` is when the generation started and its first step.
    fn progress(
        &self,
        cfg: &TrainConfig,
        (generation, rank): (u64, usize),
        (start, first): (std::time::Instant, u64),
        c: &Committed,
    ) -> Progress {
        Progress {
            step: self.step,
            total_steps: Some(cfg.steps),
            generation,
            rank,
            loss: c.loss,
            samples_per_second: ((self.step - first) * cfg.batch as u64) as f64
                / start.elapsed().as_secs_f64().max(1e-9),
            last_checkpoint: self.last_checkpoint,
            allreduce_seconds: c.secs,
            allreduce_bytes: c.bytes,
            shares: self.shares.clone(),
        }
    }

    /// The rank's [`Outcome`], with its `model` and `optimizer`.
    fn outcome(self, cfg: &TrainConfig, model: Mlp, optimizer: Optim) -> Outcome {
        Outcome {
            model,
            optimizer,
            step: self.step,
            losses: self.losses,
            generations: self.generations,
            last_checkpoint: self.last_checkpoint,
            left: self.left,
            stats: self.stats,
            shares: self.shares,
            rates: if cfg.speed_weighted {
                self.rates
            } else {
                Vec::new()
            },
        }
    }
}

/// The split of the batch for `rates` (one per rank): [`balance::split`] when speed-weighted,
/// equal otherwise (the ranks' count is the length of `rates`).
fn split_for(cfg: &TrainConfig, rates: &[f64]) -> Vec<usize> {
    if cfg.speed_weighted {
        balance::split(cfg.batch, rates)
    } else {
        balance::split(cfg.batch, &vec![1.0; rates.len()])
    }
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
    fn crosses_a_multiple_once() {
        assert!(crosses(10, 9, 10));
        assert!(crosses(10, 5, 25));
        assert!(!crosses(10, 10, 19));
        assert!(!crosses(0, 0, 100));
        assert!(crosses(1, 0, 1));
    }

    #[test]
    fn state_bytes_roundtrip() {
        for opt in [
            OptState::Sgd,
            OptState::AdamW {
                step: 5,
                m: vec![0.25, -1.0, 3.0],
                v: vec![1e-9, 2.0, 0.0],
            },
        ] {
            let s = State {
                step: (1 << 40) + 3,
                params: vec![1.5, -2.0, f32::MIN_POSITIVE],
                opt,
            };
            let kind = s.opt.kind();
            let mut b = vec![0; state_len(3, kind)];
            encode_state(&s, &mut b);
            assert_eq!(decode_state(&b, 3, kind), s);
        }
    }
}
