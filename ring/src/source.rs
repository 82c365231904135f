//! Where a rank learns about ring generations: the [`RingSource`] a training loop asks after
//! each committed step and after each failure, what it answers ([`Control`], [`Generation`]),
//! and what the loop tells it ([`Progress`]). [`FixedRing`] and [`local_generation`] are the
//! standalone source (one generation on 127.0.0.1); [`crate::follow::Follower`] follows a
//! membership document (the ring ConfigMap: `k8s::KubeRing`, feature `kube`; a standalone launcher's
//! ring directory: [`crate::file::FileRing`]). [`standalone_config`] reads a standalone rank's
//! generation from the variables a launcher sets (`python -m diphoma.run`). [`sync_root`] is
//! whose state a new generation adopts.
//!
//! Owns the trait and its plain data; it must not train (no model, no optimizer) and does no
//! I/O beyond binding the listeners of [`local_generation`] and reading the key file of
//! [`standalone_config`].

use std::net::{SocketAddr, TcpListener};

use diphoma_contract::{ENV_JOB_UID, ENV_KEY_FILE, ENV_RING_PROTECTION, ProgressReport};

use crate::follow::PROGRESS_EVERY;
use crate::{AbortHandle, CommError, Config, Protection};

/// A missing or malformed contract variable; the message names it.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// Not set, or empty.
    #[error("environment variable {0} is not set")]
    Missing(&'static str),
    /// Set to something unusable.
    #[error("environment variable {var}: {problem}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// What is wrong with its value.
        problem: String,
    },
}

/// Parses `DIPHOMA_RING_PROTECTION`'s value: unset or empty gives [`Protection::default`]
/// (none); otherwise one of the names [`Protection`] parses.
///
/// # Errors
/// [`EnvError::Invalid`] naming the variable and the allowed names.
pub fn protection_var(value: Option<String>) -> Result<Protection, EnvError> {
    match value.as_deref().map(str::trim) {
        None | Some("") => Ok(Protection::default()),
        Some(v) => v.parse().map_err(|problem| EnvError::Invalid {
            var: ENV_RING_PROTECTION,
            problem,
        }),
    }
}

/// Standalone env: this process's rank, `0..DIPHOMA_WORLD_SIZE`.
pub const ENV_RANK: &str = "DIPHOMA_RANK";
/// Standalone env: the number of ranks.
pub const ENV_WORLD_SIZE: &str = "DIPHOMA_WORLD_SIZE";
/// Standalone env: every rank's ring address, comma-separated, indexed by rank
/// (`127.0.0.1:40001,127.0.0.1:40002`).
pub const ENV_RING_ADDRESSES: &str = "DIPHOMA_RING_ADDRESSES";

/// Generation 1 of a standalone ring, from the launcher's variables read through `get`:
/// [`ENV_RANK`], [`ENV_WORLD_SIZE`], [`ENV_RING_ADDRESSES`], and the contract's
/// `DIPHOMA_JOB_UID` and `DIPHOMA_KEY_FILE` (the per-job key, at least
/// [`diphoma_contract::MIN_KEY_LEN`] bytes), and `DIPHOMA_RING_PROTECTION` (`none`, `integrity`
/// — the default when unset — or `encryption`; `none` is allowed here, unlike in a pod, because
/// a standalone ring runs on 127.0.0.1 only). The other fields keep [`Config::new`]'s defaults.
///
/// # Errors
/// [`EnvError`] naming the first missing or malformed variable (an unreadable or short key
/// file is reported against `DIPHOMA_KEY_FILE`).
pub fn standalone_config(get: impl Fn(&str) -> Option<String>) -> Result<Config, EnvError> {
    let req = |v: &'static str| {
        get(v)
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .ok_or(EnvError::Missing(v))
    };
    let invalid = |var: &'static str, problem: String| EnvError::Invalid { var, problem };
    let number = |v: &'static str| {
        let s = req(v)?;
        s.parse::<usize>()
            .map_err(|_| invalid(v, format!("{s:?} is not a non-negative integer")))
    };
    let (rank, world) = (number(ENV_RANK)?, number(ENV_WORLD_SIZE)?);
    if rank >= world {
        return Err(invalid(ENV_RANK, format!("{rank} not in 0..{world}")));
    }
    let addresses = req(ENV_RING_ADDRESSES)?
        .split(',')
        .map(|a| {
            a.trim()
                .parse::<SocketAddr>()
                .map_err(|_| invalid(ENV_RING_ADDRESSES, format!("{a:?} is not an address")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if addresses.len() != world {
        return Err(invalid(
            ENV_RING_ADDRESSES,
            format!("{} addresses for world {world}", addresses.len()),
        ));
    }
    let job_uid = req(ENV_JOB_UID)?;
    let key_file = req(ENV_KEY_FILE)?;
    let key = std::fs::read(&key_file)
        .map_err(|e| e.to_string())
        .and_then(|b| diphoma_contract::parse_key(b).map_err(|e| e.to_string()))
        .map_err(|e| invalid(ENV_KEY_FILE, format!("{key_file}: {e}")))?;
    let protection = protection_var(get(ENV_RING_PROTECTION))?;
    Ok(Config {
        protection,
        ..Config::new(rank, world, addresses, 1, job_uid, key)
    })
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
    /// or `None` to give up. Sources that report failures report it first
    /// ([`RingSource::report_failure`]).
    fn after_failure(&mut self, err: &CommError) -> Option<Generation>;
    /// Reports that a collective failed with `err` to whoever re-forms the ring (the operator's
    /// heartbeat, the launcher's ring directory), without joining anything: for a process that
    /// is restarted rather than re-joining (a torchrun script under the in-pod launcher).
    fn report_failure(&mut self, _err: &CommError) {}
    /// Publishes `progress` for whoever shows it (rank 0's progress record, at most every
    /// [`PROGRESS_EVERY`] and at the last step: [`Progress::record`]) without deciding
    /// anything: for a training loop that reports between commits. [`RingSource::after_commit`]
    /// publishes too.
    fn publish_progress(&mut self, _progress: &Progress) {}
    /// Rank 0's last word: its last progress record again, with the trained model's accuracy
    /// on the test split (in [0, 1]), for the job's status. Other ranks publish nothing.
    fn report_test_accuracy(&mut self, _accuracy: f64) {}
}

/// The rank whose state a new generation adopts, from every rank's committed step (indexed by
/// rank): the highest step, the lowest rank among equals; 0 for an empty list. The rule of the
/// Rust worker and of `diphoma.torch.elastic` (through the Python module).
pub fn sync_root(steps: &[u64]) -> usize {
    let mut best = 0;
    for (r, &s) in steps.iter().enumerate() {
        if s > steps[best] {
            best = r;
        }
    }
    best
}

/// The failure report a member writes after its collective failed with `err` at generation
/// `current` (the reporter's ring), or `None` when it writes none: no report for an aborted
/// collective, for a peer of a newer generation (this rank only has to catch up), or when it
/// already reported at this generation (`reported`: the first failure names the suspect; the
/// failed re-connects that may follow do not overwrite it). The suspect is the peer whose link
/// broke or went silent, when the error names one.
pub fn failure_report(
    err: &CommError,
    current: Option<&diphoma_contract::Membership>,
    reported: Option<u64>,
    reporter: &str,
    job_uid: Option<String>,
) -> Option<diphoma_contract::FailureReport> {
    let cur = current.map(|m| m.generation);
    let behind = matches!(err, CommError::StaleGeneration { ours, theirs } if theirs > ours);
    if matches!(err, CommError::Aborted) || behind || reported == cur {
        return None;
    }
    let suspect = match err {
        CommError::PeerLost { rank, .. }
        | CommError::Timeout {
            peer: Some(rank), ..
        } => current
            .and_then(|m| m.members.get(*rank))
            .map(|m| m.pod.clone()),
        _ => None,
    };
    Some(diphoma_contract::FailureReport {
        generation: cur.unwrap_or(0),
        reporter: reporter.to_owned(),
        suspect,
        error: err.metric_label().to_string(),
        time: jiff::Timestamp::now().to_string(),
        job_uid,
    })
}

/// What a rank knows after a committed step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Progress {
    /// Steps committed.
    pub step: u64,
    /// Steps to train in total, when the trainer knows them.
    pub total_steps: Option<u64>,
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
    /// How the step's global batch was split: samples per rank, in rank order (empty when the
    /// trainer does not say).
    pub shares: Vec<usize>,
}

impl Progress {
    /// Rank 0's record of this progress for the operator, or `None` when it is not due: from
    /// rank 0 only, at the last step (`total_steps` reached) or once [`PROGRESS_EVERY`] has
    /// passed since `last_write` (`None`: never written). `time` is RFC 3339; a NaN loss is
    /// left out. The rule of [`crate::follow::Follower`].
    pub fn record(
        &self,
        last_write: Option<std::time::Instant>,
        time: String,
        job_uid: Option<String>,
    ) -> Option<ProgressReport> {
        let due = self.is_last() || last_write.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY);
        if self.rank != 0 || !due {
            return None;
        }
        let (min_share, max_share) = diphoma_contract::share_range(&self.shares);
        Some(ProgressReport {
            generation: self.generation,
            step: self.step,
            total_steps: self.total_steps,
            loss: Some(f64::from(self.loss)).filter(|l| !l.is_nan()),
            samples_per_second: Some(self.samples_per_second),
            last_checkpoint_step: self.last_checkpoint,
            test_accuracy: None,
            min_share,
            max_share,
            time,
            job_uid,
        })
    }

    /// Whether this is the run's last step.
    pub fn is_last(&self) -> bool {
        self.total_steps == Some(self.step)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |n| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn sync_root_takes_the_highest_step_lowest_rank() {
        assert_eq!(sync_root(&[3, 4, 4, 0]), 1);
        assert_eq!(sync_root(&[0, 0]), 0);
        assert_eq!(sync_root(&[7]), 0);
        assert_eq!(sync_root(&[]), 0);
    }

    #[test]
    fn standalone_config_reads_every_variable_and_names_the_bad_one() {
        let dir = std::env::temp_dir().join(format!("diphoma-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("ring.key");
        std::fs::write(&key, [7u8; 32]).unwrap();
        let short = dir.join("short.key");
        std::fs::write(&short, [7u8; 8]).unwrap();
        let (key, short) = (key.to_str().unwrap(), short.to_str().unwrap());
        let good = [
            (ENV_RANK, "1"),
            (ENV_WORLD_SIZE, "2"),
            (ENV_RING_ADDRESSES, "127.0.0.1:4000, 127.0.0.1:4001"),
            (ENV_JOB_UID, "job"),
            (ENV_KEY_FILE, key),
        ];
        let c = standalone_config(lookup(&good)).unwrap();
        assert_eq!((c.rank, c.world, c.generation), (1, 2, 1));
        assert_eq!(c.addresses[1], "127.0.0.1:4001".parse().unwrap());
        assert_eq!(c.key, vec![7u8; 32]);
        assert_eq!(c.protection, Protection::None, "the default");
        for (name, p) in [
            ("integrity", Protection::Integrity),
            ("encryption", Protection::Encryption),
        ] {
            let mut v = good.to_vec();
            v.push((ENV_RING_PROTECTION, name));
            assert_eq!(standalone_config(lookup(&v)).unwrap().protection, p);
        }
        let with = |var: &str, val: Option<&str>| {
            let mut v: Vec<(&str, &str)> =
                good.iter().copied().filter(|(k, _)| *k != var).collect();
            v.extend(val.map(|x| (var, x)));
            standalone_config(lookup(&v)).unwrap_err().to_string()
        };
        for var in [
            ENV_RANK,
            ENV_WORLD_SIZE,
            ENV_RING_ADDRESSES,
            ENV_JOB_UID,
            ENV_KEY_FILE,
        ] {
            assert!(with(var, None).contains(var), "{var}");
        }
        assert!(with(ENV_RANK, Some("2")).contains("DIPHOMA_RANK: 2 not in 0..2"));
        assert!(with(ENV_WORLD_SIZE, Some("x")).contains(ENV_WORLD_SIZE));
        assert!(with(ENV_RING_ADDRESSES, Some("127.0.0.1:1")).contains("1 addresses for world 2"));
        assert!(with(ENV_RING_ADDRESSES, Some("a,b")).contains(ENV_RING_ADDRESSES));
        assert!(with(ENV_KEY_FILE, Some(short)).contains(ENV_KEY_FILE));
        assert!(with(ENV_KEY_FILE, Some("/nonexistent/k")).contains(ENV_KEY_FILE));
        assert!(with(ENV_RING_PROTECTION, Some("mac")).contains(
            "DIPHOMA_RING_PROTECTION: \"mac\" is not one of none, integrity, encryption"
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
