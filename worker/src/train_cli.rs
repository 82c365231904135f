//! The `train` subcommand: builds the run from its arguments, trains standalone (N ranks as
//! threads) or as one rank of a Kubernetes job (following the ring ConfigMap, serving
//! `/metrics`), and prints rank 0's progress ([`train::StepLog`]) and the result. It must not
//! hold training logic (that is the library's `train`).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use diphoma_ring::k8s;
use diphoma_ring::source::RingSource;
use diphoma_worker::metrics::{Metered, WorkerMetrics};
use diphoma_worker::optim::OptimizerKind;
use diphoma_worker::{data, model, train};

use crate::AnyErr;

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum ModelArg {
    /// `64 → --hidden → 10` on the digits set.
    Digits,
    /// A deep MLP of about `--params` parameters (`--layers` hidden layers of one width,
    /// 256 inputs, 16 classes) on seeded synthetic data.
    Synthetic,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum OptimizerArg {
    /// candle-nn's SGD (no state).
    Sgd,
    /// AdamW (candle-nn's update and defaults; its moments travel in checkpoints and syncs).
    Adamw,
}

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Run N ranks as threads on 127.0.0.1. Without it: one rank of a Kubernetes job, configured
    /// by the operator's env (DIPHOMA_*), following the ring ConfigMap.
    #[arg(long)]
    standalone: bool,
    /// Number of ranks (standalone).
    #[arg(long, default_value_t = 1)]
    world: usize,
    /// Steps to train.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Global batch size (samples per step over all ranks; independent of --world).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Seed of the data order and of the initial weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The model and its data.
    #[arg(long, value_enum, default_value = "digits")]
    model: ModelArg,
    /// Synthetic model: its parameter count (the hidden width is chosen to come closest).
    #[arg(long, default_value_t = 20_000_000)]
    params: usize,
    /// Synthetic model: number of hidden layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// The optimizer.
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: OptimizerArg,
    /// Learning rate (default: 0.5 for sgd, 0.001 for adamw; these suit digits: the deep
    /// synthetic model is unstable with sgd at 0.5 and descends steadily at 0.05).
    #[arg(long)]
    lr: Option<f64>,
    /// Hidden units of the digits MLP.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// A digits CSV (gzip: 64 pixel columns in 0..=16, then the label); default: the digits set
    /// compiled into the binary.
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Print the loss every this many steps (0: never).
    #[arg(long, default_value_t = 50)]
    log_every: u64,
    /// Rank 0 writes a checkpoint every this many steps (0: never).
    #[arg(long, env = diphoma_contract::ENV_CHECKPOINT_EVERY, default_value_t = 0)]
    checkpoint_every: u64,
    /// Directory of the checkpoints; training resumes from the newest valid one of its own in
    /// it. In Kubernetes mode the root of every job's: this job's are in
    /// `<dir>/<namespace>/<job>/<uid>/` and name the job in their metadata.
    #[arg(long, env = diphoma_contract::ENV_CHECKPOINT_DIR)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Kubernetes mode: a job of this namespace whose newest checkpoint (of any of its uids) is
    /// resumed when this job has none of its own (`spec.checkpoint.resumeFrom.name`).
    #[arg(long, env = diphoma_contract::ENV_CHECKPOINT_RESUME_FROM)]
    resume_from: Option<String>,
    /// Kubernetes mode: bound on each connect, in seconds. A collective is not bounded: it
    /// waits on a silent peer while the peer's process answers liveness pings, within windows
    /// of a quarter of the job's faultTolerance.detectionSeconds (DIPHOMA_DETECTION_SECONDS).
    #[arg(long, default_value_t = k8s::OP_TIMEOUT.as_secs_f64())]
    op_timeout_s: f64,
    /// Testing failure detection: the member at --step-delay-rank of every generation sleeps
    /// this many milliseconds before each step's allreduce (a slow GPU, a data-loading stall).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// The rank that --step-delay-ms slows down.
    #[arg(long, default_value_t = 0)]
    step_delay_rank: usize,
    /// Split each step's global batch over the ranks in proportion to their measured speeds
    /// (`spec.balance.speedWeighted`); `false`: equal shares.
    #[arg(long, env = diphoma_contract::ENV_SPEED_WEIGHTED, default_value_t = true, action = clap::ArgAction::Set)]
    speed_weighted: bool,
    /// Committed steps between two re-splits of the batch (`spec.balance.everySteps`).
    #[arg(long, env = diphoma_contract::ENV_BALANCE_EVERY, default_value_t = train::DEFAULT_BALANCE_EVERY)]
    balance_every: u64,
    /// 0: synchronise every step (one gradient allreduce); H ≥ 1: periodic averaging (local
    /// SGD), H local steps between two averages of the models (`spec.sync`).
    #[arg(long, env = diphoma_contract::ENV_SYNC_EVERY, default_value_t = 0)]
    sync_every: u64,
    /// One rank of a standalone ring started by a launcher: rank, world and addresses from
    /// DIPHOMA_RANK, DIPHOMA_WORLD_SIZE, DIPHOMA_RING_ADDRESSES, the key from DIPHOMA_KEY_FILE,
    /// DIPHOMA_JOB_UID (one process per rank, e.g. each pinned to its own CPU).
    #[arg(long, conflicts_with = "standalone")]
    launched: bool,
    /// Kubernetes mode: port of `/metrics` on the pod IP (0: none).
    #[arg(long, default_value_t = diphoma_contract::DEFAULT_METRICS_PORT)]
    metrics_port: u16,
}

/// Samples of the synthetic set (a fifth held out for testing, as for digits).
const SYNTHETIC_SAMPLES: usize = 5120;

/// Runs `train`; the exit code is 0 also when the rank left the ring (scale-down, SIGTERM).
pub(crate) fn train(a: TrainArgs) -> Result<ExitCode, AnyErr> {
    // Kubernetes mode checks its environment before anything else.
    if a.balance_every == 0 {
        return Err("--balance-every (DIPHOMA_BALANCE_EVERY) must be at least 1".into());
    }
    let kube_env = if a.standalone || a.launched {
        None
    } else {
        let env = k8s::WorkerEnv::from_env()?;
        let key = env.read_key()?;
        Some((env, key))
    };
    let (widths, (train_set, test_set)) = match a.model {
        ModelArg::Digits => (
            model::digits_widths(a.hidden),
            match &a.data {
                Some(path) => data::load_digits(path)?,
                None => data::embedded_digits()?,
            }
            .split(),
        ),
        ModelArg::Synthetic => {
            if a.layers == 0 || a.params == 0 {
                return Err("--params and --layers must be positive".into());
            }
            let set = data::synthetic(
                SYNTHETIC_SAMPLES,
                model::SYNTHETIC_FEATURES,
                model::SYNTHETIC_CLASSES,
                a.seed,
            );
            (model::synthetic_widths(a.params, a.layers), set.split())
        }
    };
    let optimizer = match a.optimizer {
        OptimizerArg::Sgd => OptimizerKind::Sgd,
        OptimizerArg::Adamw => OptimizerKind::AdamW,
    };
    let lr = a.lr.unwrap_or(optimizer.default_lr());
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(format!("--lr {lr} must be positive").into());
    }
    let checkpoint_owner = match &kube_env {
        Some((env, _)) => Some(diphoma_worker::checkpoint::Owner::new(
            &env.namespace,
            &env.job_name,
            &env.job_uid,
        )?),
        None if a.resume_from.is_some() => {
            return Err("--resume-from names a job: it needs Kubernetes mode".into());
        }
        None => None,
    };
    println!(
        "model {:?}: {} parameters, optimizer {} (lr {lr})",
        widths,
        model::count_params(&widths),
        optimizer.name()
    );
    let cfg = train::TrainConfig {
        steps: a.steps,
        batch: a.batch,
        seed: a.seed,
        lr,
        widths,
        optimizer,
        checkpoint_every: a.checkpoint_every,
        checkpoint_dir: a.checkpoint_dir,
        checkpoint_owner,
        resume_from: a.resume_from,
        log_every: a.log_every,
        on_log: Some(print_progress),
        slow_rank: (a.step_delay_ms > 0)
            .then(|| (a.step_delay_rank, Duration::from_millis(a.step_delay_ms))),
        speed_weighted: a.speed_weighted,
        balance_every: a.balance_every,
        sync: match a.sync_every {
            0 => train::SyncMode::EveryStep,
            h => train::SyncMode::Periodic(h),
        },
    };
    let (out, world, mut ring) = match kube_env {
        None if a.launched => {
            let config = diphoma_ring::source::standalone_config(|n| std::env::var(n).ok())?;
            let world = config.world;
            let listener = std::net::TcpListener::bind(config.addresses[config.rank])?;
            let first = diphoma_ring::source::Generation { config, listener };
            let out = train::train_rank(
                &cfg,
                &train_set,
                first,
                &mut diphoma_ring::source::FixedRing,
            )?;
            (out, world, None)
        }
        None => {
            let mut outs = train::train_standalone(&cfg, &train_set, a.world)?;
            (outs.swap_remove(0), a.world, None)
        }
        Some((env, key)) => {
            if !(a.op_timeout_s > 0.0 && a.op_timeout_s.is_finite()) {
                return Err(format!("--op-timeout-s {} must be positive", a.op_timeout_s).into());
            }
            let metrics_addr = std::net::SocketAddr::new(env.pod_ip, a.metrics_port);
            let mut kube = k8s::KubeRing::start(env, key)?;
            kube.set_op_timeout(Duration::from_secs_f64(a.op_timeout_s));
            let metrics = WorkerMetrics::new();
            if a.metrics_port != 0 {
                metrics.spawn_server(kube.handle(), metrics_addr)?;
            }
            let mut ring = Metered {
                inner: kube,
                metrics,
            };
            let Some(first) = ring.inner.first_generation(None)? else {
                println!("terminated before joining a ring");
                return Ok(ExitCode::SUCCESS);
            };
            let world = first.config.world;
            let out = match train::train_rank(&cfg, &train_set, first, &mut ring) {
                Err(e) if ring.inner.done() => {
                    println!("left the ring: {e}");
                    return Ok(ExitCode::SUCCESS);
                }
                r => r?,
            };
            if out.left {
                println!("left the ring after step {}", out.step);
                return Ok(ExitCode::SUCCESS);
            }
            (out, world, Some(ring))
        }
    };
    let st = &out.stats;
    let per_step = st.allreduce_per_step();
    let rate = if world > 1 && per_step > 0.0 {
        format!("{:.3} GB/s", st.allreduce_bytes as f64 / per_step / 1e9)
    } else {
        "no peers".to_string()
    };
    println!(
        "throughput {:.1} samples/s, allreduce {:.2} ms per step of {:.2} MB ({rate}), {} steps on rank 0",
        st.samples_per_second(cfg.batch),
        per_step * 1e3,
        st.allreduce_bytes as f64 / 1e6,
        st.steps,
    );
    println!(
        "allreduces {} for {} steps, shares {}, rates {} samples/s (sum {:.1})",
        st.allreduces,
        st.steps,
        join(&out.shares, ToString::to_string),
        join(&out.rates, |r| format!("{r:.1}")),
        out.rates.iter().sum::<f64>(),
    );
    let acc = out.model.accuracy(&test_set)?;
    println!(
        "test accuracy {acc:.4} ({} of {} held-out samples) after {} steps, world {world}",
        (acc * test_set.len() as f64).round(),
        test_set.len(),
        out.step,
    );
    if let Some(ring) = &mut ring {
        ring.report_test_accuracy(acc);
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints rank 0's progress line on stdout (`step N generation G loss L …`; e2e reads it).
fn print_progress(p: &train::StepLog) {
    println!(
        "step {} generation {} loss {:.5} samples/s {:.1} allreduce {:.2} ms rates {} shares {}",
        p.step,
        p.generation,
        p.loss,
        p.samples_per_second,
        p.allreduce_seconds * 1e3,
        join(&p.rates, |r| format!("{r:.0}")),
        join(&p.shares, ToString::to_string),
    );
}

/// `xs` shown with `f`, separated by `/` (rates and shares).
fn join<T>(xs: &[T], f: impl Fn(&T) -> String) -> String {
    xs.iter().map(f).collect::<Vec<_>>().join("/")
}
