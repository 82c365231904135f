//! The membership follower of a worker pod: the contract's env, the ring ConfigMap watched as a
//! [`RingSource`], and the heartbeat ConfigMap writes (docs/design/heartbeat.md).
//!
//! Pure parts (unit-tested): [`WorkerEnv::from_lookup`] and [`decide`]. I/O parts: [`KubeRing`]
//! runs a single-object watch of `<job>-ring` on a small tokio runtime of its own; each
//! membership it sees is handed to the training thread, and a newer generation aborts the
//! collective in flight (so a ring stuck on a hung peer moves on as soon as the operator has
//! re-formed it). Rank 0 patches its [`ProgressReport`] into `<job>-heartbeat` every
//! [`PROGRESS_EVERY`]; a member whose collective fails patches one [`diphoma_contract::FailureReport`] under
//! `report.<pod>`. Nothing is written per worker per step. From its start, the process answers
//! liveness pings ([`crate::liveness::Responder`]) on UDP at its ring address, and every
//! generation it joins probes silent peers ([`Config::liveness`]) with [`liveness_window`] of
//! the job's `detectionSeconds`: a slow or catching-up peer is waited for, a silent one blamed.
//!
//! It must not train or record metrics: the worker wraps it (its `metrics::Metered`) and serves
//! `/metrics` on [`KubeRing::handle`].

use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};

use diphoma_contract::{
    self as contract, ENV_DETECTION_SECONDS, ENV_JOB_NAME, ENV_JOB_UID, ENV_KEY_FILE,
    ENV_MEMBERSHIP, ENV_NAMESPACE, ENV_POD_IP, ENV_POD_NAME, ENV_RING_PORT, ENV_RING_PROTECTION,
    MEMBERSHIP_KEY, Membership, ProgressReport,
};

use crate::liveness::Responder;
use crate::source::{Control, Generation, Progress, RingSource, failure_report};
use crate::{AbortHandle, CommError, Config, Protection};

/// How often rank 0 writes its progress record.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// Default bound on each connect in Kubernetes mode (a connect that times out blames nobody: the
/// member re-joins). Collectives are not bounded by it: see [`liveness_window`].
pub const OP_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a member whose collective failed waits for a newer generation before it re-joins
/// the newest one it knows (which may be the same generation, re-formed).
pub const REJOIN_WAIT: Duration = Duration::from_secs(1);

/// The liveness window of a job whose `faultTolerance.detectionSeconds` is `detection`: a
/// collective probes a peer it has waited on this long, and blames it when the probe gets no
/// answer within this long again ([`Config::liveness`]). A quarter, so that a hung peer is
/// reported within half of `detection`, and the operator's wait of another half for the other
/// reports (its `silent_members`) still ends within `detection`.
pub fn liveness_window(detection: Duration) -> Duration {
    detection / 4
}

/// The contract's environment, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    /// `DIPHOMA_JOB_NAME`.
    pub job_name: String,
    /// `DIPHOMA_JOB_UID`.
    pub job_uid: String,
    /// `DIPHOMA_NAMESPACE`.
    pub namespace: String,
    /// `DIPHOMA_POD_NAME`.
    pub pod_name: String,
    /// `DIPHOMA_POD_IP`.
    pub pod_ip: IpAddr,
    /// `DIPHOMA_RING_PORT` (1–65535).
    pub ring_port: u16,
    /// `DIPHOMA_KEY_FILE`.
    pub key_file: PathBuf,
    /// `DIPHOMA_MEMBERSHIP`: name of the ring ConfigMap.
    pub membership: String,
    /// `DIPHOMA_DETECTION_SECONDS` (whole seconds, at least 1).
    pub detection: Duration,
    /// `DIPHOMA_RING_PROTECTION`: `integrity` (default when unset) or `encryption`.
    pub protection: Protection,
}

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
/// (integrity); otherwise one of `allowed`, by the names [`Protection`] parses.
///
/// # Errors
/// [`EnvError::Invalid`] naming the variable and the allowed names.
pub(crate) fn protection_var(
    value: Option<String>,
    allowed: &[Protection],
) -> Result<Protection, EnvError> {
    match value.as_deref().map(str::trim) {
        None | Some("") => Ok(Protection::default()),
        Some(v) => v
            .parse()
            .ok()
            .filter(|p| allowed.contains(p))
            .ok_or_else(|| {
                let names: Vec<_> = allowed.iter().map(|p| p.as_str()).collect();
                EnvError::Invalid {
                    var: ENV_RING_PROTECTION,
                    problem: format!("{v:?} is not one of {}", names.join(", ")),
                }
            }),
    }
}

impl WorkerEnv {
    /// Parses the contract variables through `get` (a variable's value, `None` when unset).
    ///
    /// # Errors
    /// [`EnvError`] naming the first missing or malformed variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<WorkerEnv, EnvError> {
        let req = |v: &'static str| {
            get(v)
                .filter(|s| !s.trim().is_empty())
                .ok_or(EnvError::Missing(v))
        };
        let invalid = |var: &'static str, problem: String| EnvError::Invalid { var, problem };
        let ip = req(ENV_POD_IP)?;
        let port = req(ENV_RING_PORT)?;
        let detection = req(ENV_DETECTION_SECONDS)?;
        Ok(WorkerEnv {
            job_name: req(ENV_JOB_NAME)?,
            job_uid: req(ENV_JOB_UID)?,
            namespace: req(ENV_NAMESPACE)?,
            pod_name: req(ENV_POD_NAME)?,
            pod_ip: ip
                .trim()
                .parse()
                .map_err(|_| invalid(ENV_POD_IP, format!("{ip:?} is not an IP address")))?,
            ring_port: port
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| invalid(ENV_RING_PORT, format!("{port:?} is not a port 1-65535")))?,
            key_file: req(ENV_KEY_FILE)?.into(),
            membership: req(ENV_MEMBERSHIP)?,
            detection: detection
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|&s| s > 0)
                .map(Duration::from_secs)
                .ok_or_else(|| {
                    invalid(
                        ENV_DETECTION_SECONDS,
                        format!("{detection:?} is not a positive number of seconds"),
                    )
                })?,
            protection: protection_var(
                get(ENV_RING_PROTECTION),
                &[Protection::Integrity, Protection::Encryption],
            )?,
        })
    }

    /// [`WorkerEnv::from_lookup`] on the process environment.
    ///
    /// # Errors
    /// As [`WorkerEnv::from_lookup`].
    pub fn from_env() -> Result<WorkerEnv, EnvError> {
        WorkerEnv::from_lookup(|n| std::env::var(n).ok())
    }

    /// Reads and validates the key file.
    ///
    /// # Errors
    /// [`KubeError::KeyRead`] or [`KubeError::KeyInvalid`], naming the file.
    pub fn read_key(&self) -> Result<Vec<u8>, KubeError> {
        let path = self.key_file.clone();
        match std::fs::read(&path) {
            Err(source) => Err(KubeError::KeyRead { path, source }),
            Ok(bytes) => {
                contract::parse_key(bytes).map_err(|source| KubeError::KeyInvalid { path, source })
            }
        }
    }
}

/// What a member does on seeing membership `m` while in generation `current` (`None`: not yet
/// in any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing new: stay where it is.
    Stay,
    /// Join generation `m.generation` as this rank.
    Join(usize),
    /// The newer generation does not include this pod: leave.
    NotMember,
}

/// See [`Decision`]: a generation not newer than `current` changes nothing.
pub fn decide(current: Option<u64>, m: &Membership, pod: &str) -> Decision {
    if current.is_some_and(|c| m.generation <= c) {
        return Decision::Stay;
    }
    match m.rank_of(pod) {
        Some(r) => Decision::Join(r),
        None => Decision::NotMember,
    }
}

/// The collective in flight: its generation and the handle that aborts it (see [`Memberships`]).
pub type InFlight = Arc<Mutex<Option<(u64, AbortHandle)>>>;

/// The ring ConfigMap's memberships as a watch delivers them: a single-object watch of the
/// ConfigMap, run on a tokio runtime, hands each valid membership to this side (a malformed one
/// is logged and skipped). With an abort slot, a membership newer than the slot's generation
/// aborts the collective in flight there ([`KubeRing`]); without one it only reads
/// ([`Memberships::start`], the in-pod launcher's view, which binds nothing).
pub struct Memberships {
    rx: mpsc::Receiver<Membership>,
    /// The newest membership taken so far.
    pub latest: Option<Membership>,
    /// The runtime of [`Memberships::start`] (none when watching on another's).
    _rt: Option<tokio::runtime::Runtime>,
    /// [`Memberships::start`]'s heartbeat ConfigMap, for [`Memberships::write_heartbeat`].
    heartbeat: Option<(Api<ConfigMap>, String)>,
}

impl Memberships {
    /// Watches ConfigMap `name` through `api` on `rt` (see the type).
    pub fn watch(
        rt: &tokio::runtime::Handle,
        api: Api<ConfigMap>,
        name: &str,
        abort: Option<InFlight>,
    ) -> Memberships {
        let (tx, rx) = mpsc::channel();
        let fields = format!("metadata.name={name}");
        rt.spawn(async move {
            let mut events = watcher(api, watcher::Config::default().fields(&fields))
                .default_backoff()
                .boxed();
            while let Some(ev) = events.next().await {
                let cm = match ev {
                    Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => cm,
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!("ring watch: {e}");
                        continue;
                    }
                };
                let Some(json) = cm.data.as_ref().and_then(|d| d.get(MEMBERSHIP_KEY)) else {
                    continue;
                };
                let m = match Membership::parse(json) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!("ignoring ring membership: {e}");
                        continue;
                    }
                };
                if let Some(slot) = &abort
                    && let Some((g, h)) = slot.lock().expect("slot").as_ref()
                    && m.generation > *g
                {
                    h.abort();
                }
                if tx.send(m).is_err() {
                    break;
                }
            }
        });
        Memberships {
            rx,
            latest: None,
            _rt: None,
            heartbeat: None,
        }
    }

    /// Watches the ring ConfigMap `env` names on a runtime of its own, without binding anything
    /// or answering pings: for a process that starts and restarts the member (the in-pod
    /// launcher, `python -m diphoma.run`).
    ///
    /// # Errors
    /// [`KubeError::Runtime`] or [`KubeError::Client`] when no runtime or client can be built.
    pub fn start(env: &WorkerEnv) -> Result<Memberships, KubeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(KubeError::Runtime)?;
        let client = rt
            .block_on(kube::Client::try_default())
            .map_err(KubeError::Client)?;
        let api = Api::namespaced(client, &env.namespace);
        let mut m = Memberships::watch(rt.handle(), api.clone(), &env.membership, None);
        m._rt = Some(rt);
        m.heartbeat = Some((api, contract::heartbeat_configmap_name(&env.job_name)));
        Ok(m)
    }

    /// Patches `key: value` into the job's heartbeat ConfigMap (a watch of
    /// [`Memberships::start`] only; otherwise nothing), waiting up to 10 s; a failed write is
    /// logged. The in-pod launcher's restart reports.
    pub fn write_heartbeat(&self, key: String, value: String) {
        if let (Some(rt), Some((api, name))) = (&self._rt, &self.heartbeat) {
            let write = patch_heartbeat(api.clone(), name.clone(), key, value);
            // In the runtime: the timer needs its reactor.
            let _ =
                rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), write).await });
        }
    }

    /// Takes every membership seen so far; keeps the newest.
    pub fn drain(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            self.take(m);
        }
    }

    fn take(&mut self, m: Membership) {
        if self
            .latest
            .as_ref()
            .is_none_or(|l| m.generation >= l.generation)
        {
            self.latest = Some(m);
        }
    }

    /// Waits up to `wait` for a membership newer than `than` (or any, when `None`); the newest
    /// is then in [`Memberships::latest`].
    pub fn wait_newer(&mut self, than: Option<u64>, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            self.drain();
            if self
                .latest
                .as_ref()
                .is_some_and(|l| than.is_none_or(|t| l.generation > t))
            {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(m) => self.take(m),
                Err(_) => return,
            }
        }
    }
}

/// A [`RingSource`] fed by the ring ConfigMap (see the module docs).
pub struct KubeRing {
    env: WorkerEnv,
    key: Vec<u8>,
    rt: tokio::runtime::Runtime,
    heartbeat: Api<ConfigMap>,
    watch: Memberships,
    current: Option<Membership>,
    in_flight: InFlight,
    last_progress: Option<Instant>,
    last_report: Option<ProgressReport>,
    /// The progress write still in flight (the next one waits for it: writes land in order).
    pending_progress: Option<tokio::task::JoinHandle<()>>,
    terminating: Arc<AtomicBool>,
    removed: bool,
    /// The generation whose failure this worker reported since its last committed step (one
    /// report per failure: the failed re-connects that follow do not overwrite it).
    reported: Option<u64>,
    op_timeout: Duration,
    /// Answers liveness pings for the life of the follower.
    _responder: Responder,
}

impl std::fmt::Debug for KubeRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeRing")
            .field("env", &self.env)
            .field("current", &self.current.as_ref().map(|m| m.generation))
            .finish_non_exhaustive()
    }
}

/// Why the Kubernetes side could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The private tokio runtime or its SIGTERM handler could not be set up.
    #[error("the follower's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// No client configuration (kubeconfig / in-cluster).
    #[error("kubernetes client (in-cluster or $KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    /// The key file ([`ENV_KEY_FILE`]) could not be read.
    #[error("key file {} ({ENV_KEY_FILE}): {source}", path.display())]
    KeyRead {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The key file ([`ENV_KEY_FILE`]) does not hold a valid key.
    #[error("key file {} ({ENV_KEY_FILE}): {source}", path.display())]
    KeyInvalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        #[source]
        source: contract::ContractError,
    },
    /// The liveness responder could not be started at the ring address (UDP).
    #[error("the liveness responder at {addr} (UDP): {source}")]
    Liveness {
        /// The ring address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A port (the ring's, or the worker's metrics port) could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl KubeRing {
    /// Starts the liveness responder at the ring address, connects to the API server
    /// (`KUBECONFIG` or in-cluster config) and starts watching the ring ConfigMap, on a private
    /// tokio runtime (see [`KubeRing::handle`]).
    ///
    /// # Errors
    /// [`KubeError::Liveness`] when the ring address cannot be bound for UDP;
    /// [`KubeError::Runtime`] or [`KubeError::Client`] when no runtime or client can be built.
    pub fn start(env: WorkerEnv, key: Vec<u8>) -> Result<KubeRing, KubeError> {
        // Alive from the start, so that peers never take this process for a hung one.
        let addr = SocketAddr::new(env.pod_ip, env.ring_port);
        let responder = UdpSocket::bind(addr)
            .and_then(|s| Responder::spawn(s, key.clone()))
            .map_err(|source| KubeError::Liveness { addr, source })?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(KubeError::Runtime)?;
        // SIGTERM first: from here on it means "leave the ring and exit 0".
        let terminating = Arc::new(AtomicBool::new(false));
        let term = terminating.clone();
        rt.block_on(async {
            let mut sig = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(KubeError::Runtime)?;
            tokio::spawn(async move {
                sig.recv().await;
                tracing::info!("SIGTERM: leaving the ring after the current step");
                term.store(true, Ordering::SeqCst);
            });
            Ok::<_, KubeError>(())
        })?;
        let client = rt
            .block_on(kube::Client::try_default())
            .map_err(KubeError::Client)?;
        let ring: Api<ConfigMap> = Api::namespaced(client.clone(), &env.namespace);
        let heartbeat = Api::namespaced(client, &env.namespace);
        let in_flight: InFlight = Arc::default();
        let watch = Memberships::watch(rt.handle(), ring, &env.membership, Some(in_flight.clone()));
        Ok(KubeRing {
            env,
            key,
            rt,
            heartbeat,
            watch,
            current: None,
            in_flight,
            last_progress: None,
            last_report: None,
            pending_progress: None,
            terminating,
            removed: false,
            reported: None,
            op_timeout: OP_TIMEOUT,
            _responder: responder,
        })
    }

    /// Binds the ring port and builds generation `m` for rank `rank`.
    fn join(&mut self, m: Membership, rank: usize) -> Result<Generation, KubeError> {
        let addr = SocketAddr::new(self.env.pod_ip, self.env.ring_port);
        let listener =
            TcpListener::bind(addr).map_err(|source| KubeError::Bind { addr, source })?;
        let mut config = Config::new(
            rank,
            m.members.len(),
            m.addresses(),
            m.generation,
            m.job_uid.clone(),
            self.key.clone(),
        );
        config.timeout = self.op_timeout;
        config.liveness = Some(liveness_window(self.env.detection));
        config.protection = self.env.protection;
        self.current = Some(m);
        Ok(Generation { config, listener })
    }

    /// The private tokio runtime the watch and the heartbeat writes run on (the worker serves
    /// `/metrics` on it too).
    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.handle()
    }

    /// Sets the bound on each connect (default [`OP_TIMEOUT`]). Collectives follow the job's
    /// `detectionSeconds` instead (see [`liveness_window`]).
    pub fn set_op_timeout(&mut self, t: Duration) {
        self.op_timeout = t;
    }

    /// True once SIGTERM arrived: the rank leaves at the next step boundary, or gives up
    /// re-forming after a failure, and the process exits 0.
    pub fn terminating(&self) -> bool {
        self.terminating.load(Ordering::SeqCst)
    }

    /// True when this rank should stop and exit 0: SIGTERM arrived, or the newest generation
    /// no longer lists this pod (scale-down).
    pub fn done(&self) -> bool {
        self.terminating() || self.removed
    }

    /// Blocks until a generation lists this pod, and returns it; `None` when SIGTERM arrives
    /// first.
    ///
    /// # Errors
    /// [`KubeError::Bind`] when the ring port cannot be bound.
    pub fn first_generation(&mut self) -> Result<Option<Generation>, KubeError> {
        let mut seen = None;
        while !self.terminating() {
            self.watch.wait_newer(seen, Duration::from_millis(500));
            let Some(m) = self.watch.latest.clone() else {
                continue;
            };
            if let Some(r) = m.rank_of(&self.env.pod_name) {
                return self.join(m, r).map(Some);
            }
            // Not (yet) a member: wait for the next generation.
            seen = Some(m.generation);
        }
        Ok(None)
    }

    fn patch_heartbeat(&self, key: String, value: String) -> impl Future<Output = ()> + use<> {
        let name = contract::heartbeat_configmap_name(&self.env.job_name);
        patch_heartbeat(self.heartbeat.clone(), name, key, value)
    }

    fn decision(&mut self) -> Control {
        self.watch.drain();
        let cur = self.current.as_ref().map(|m| m.generation);
        let Some(m) = self.watch.latest.clone() else {
            return Control::Continue;
        };
        match decide(cur, &m, &self.env.pod_name) {
            Decision::Stay => Control::Continue,
            Decision::NotMember => {
                self.removed = true;
                Control::Leave
            }
            Decision::Join(r) => match self.join(m, r) {
                Ok(g) => Control::Switch(g),
                Err(e) => {
                    tracing::error!("{e}");
                    Control::Leave
                }
            },
        }
    }
}

impl KubeRing {
    /// Rank 0 patches `p` into the heartbeat as its progress record when it is the last step or
    /// [`PROGRESS_EVERY`] has passed since its previous write (in the background; the last one
    /// waits). Other ranks write nothing. [`RingSource::after_commit`] calls it; a training loop
    /// that reports between commits (`diphoma.report` in Python) may too.
    pub fn publish_progress(&mut self, p: &Progress) {
        if let Some(report) = p.record(self.last_progress, now(), Some(self.env.job_uid.clone())) {
            self.last_progress = Some(Instant::now());
            self.write_progress(&report, p.is_last());
            self.last_report = Some(report);
        }
    }

    /// Rank 0's last word: its final progress report again, with the trained model's accuracy
    /// on the test split (in [0, 1]), for the job's status. Other ranks write nothing.
    pub fn report_test_accuracy(&mut self, accuracy: f64) {
        if let Some(mut report) = self.last_report.take() {
            report.test_accuracy = Some(accuracy);
            report.time = now();
            self.write_progress(&report, true);
        }
    }

    /// Patches `report` into the heartbeat after the write still in flight: in the background,
    /// or waiting for both (at most 10 s) when it is the last one before the process exits.
    fn write_progress(&mut self, report: &ProgressReport, wait: bool) {
        let write = self.patch_heartbeat(
            contract::PROGRESS_KEY.to_string(),
            serde_json::to_string(report).expect("serializable"),
        );
        let previous = self.pending_progress.take();
        let in_order = async move {
            if let Some(p) = previous {
                let _ = p.await;
            }
            write.await
        };
        if wait {
            self.rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(10), in_order).await;
            });
        } else {
            self.pending_progress = Some(self.rt.spawn(in_order));
        }
    }
}

/// Merge-patches `key: value` into ConfigMap `name` (the heartbeat); a failure is logged.
async fn patch_heartbeat(api: Api<ConfigMap>, name: String, key: String, value: String) {
    let body = serde_json::json!({"data": {key.clone(): value}});
    if let Err(e) = api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        tracing::warn!("writing {key} into {name}: {e}");
    }
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

impl RingSource for KubeRing {
    fn connected(&mut self, generation: u64, _rank: usize, abort: AbortHandle) {
        *self.in_flight.lock().expect("slot") = Some((generation, abort));
    }

    fn after_commit(&mut self, p: &Progress) -> Control {
        if self.terminating() {
            return Control::Leave;
        }
        self.publish_progress(p);
        // The ring recovered: a later failure at this generation is a new one, reported again.
        self.reported = None;
        self.decision()
    }

    fn after_failure(&mut self, err: &CommError) -> Option<Generation> {
        tracing::warn!("collective failed: {err}");
        if self.terminating() {
            return None;
        }
        let cur = self.current.as_ref().map(|m| m.generation);
        self.report_failure(err);
        // Prefer a newer generation; else re-form the newest known one (possibly the same).
        // Not a member of it: give up (the operator has removed this pod).
        self.watch.wait_newer(cur, REJOIN_WAIT);
        let m = self.watch.latest.clone()?;
        let Some(r) = m.rank_of(&self.env.pod_name) else {
            self.removed = true;
            return None;
        };
        match self.join(m, r) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::error!("{e}");
                None
            }
        }
    }

    fn report_failure(&mut self, err: &CommError) {
        let current = self.current.as_ref();
        let uid = Some(self.env.job_uid.clone());
        if let Some(report) = failure_report(err, current, self.reported, &self.env.pod_name, uid) {
            self.reported = current.map(|m| m.generation);
            let write = self.patch_heartbeat(
                format!("{}{}", contract::REPORT_KEY_PREFIX, self.env.pod_name),
                serde_json::to_string(&report).expect("serializable"),
            );
            self.rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), write).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> std::collections::HashMap<&'static str, String> {
        [
            (ENV_JOB_NAME, "demo"),
            (ENV_JOB_UID, "u-1"),
            (ENV_NAMESPACE, "ns"),
            (ENV_POD_NAME, "demo-worker-0"),
            (ENV_POD_IP, "127.0.0.5"),
            (ENV_RING_PORT, "29500"),
            (ENV_KEY_FILE, "/var/run/diphoma/ring.key"),
            (ENV_MEMBERSHIP, "demo-ring"),
            (ENV_DETECTION_SECONDS, "10"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect()
    }

    #[test]
    fn env_is_parsed_and_errors_name_the_variable() {
        let env = full();
        let w = WorkerEnv::from_lookup(|n| env.get(n).cloned()).unwrap();
        assert_eq!(w.ring_port, 29500);
        assert_eq!(w.pod_ip.to_string(), "127.0.0.5");
        assert_eq!(w.detection, Duration::from_secs(10));
        assert_eq!(w.protection, Protection::Integrity, "integrity when unset");
        let mut enc = env.clone();
        enc.insert(ENV_RING_PROTECTION, "encryption".into());
        let w = WorkerEnv::from_lookup(|n| enc.get(n).cloned()).unwrap();
        assert_eq!(w.protection, Protection::Encryption);
        for var in env.keys() {
            let mut e = env.clone();
            e.remove(var);
            let err = WorkerEnv::from_lookup(|n| e.get(n).cloned())
                .unwrap_err()
                .to_string();
            assert!(err.contains(var), "{err}");
        }
        for (var, bad) in [
            (ENV_RING_PORT, "0"),
            (ENV_RING_PORT, "http"),
            (ENV_POD_IP, "pod"),
            (ENV_DETECTION_SECONDS, "0"),
            (ENV_DETECTION_SECONDS, "2.5s"),
            (ENV_RING_PROTECTION, "none"),
            (ENV_RING_PROTECTION, "aes"),
        ] {
            let mut e = env.clone();
            e.insert(var, bad.to_string());
            let err = WorkerEnv::from_lookup(|n| e.get(n).cloned())
                .unwrap_err()
                .to_string();
            assert!(err.contains(var) && err.contains(bad), "{err}");
        }
    }

    #[test]
    fn decisions() {
        let m = |g: u64, pods: &[&str]| Membership {
            generation: g,
            job_uid: "u".into(),
            members: pods
                .iter()
                .enumerate()
                .map(|(i, p)| contract::Member {
                    rank: i as u32,
                    pod: p.to_string(),
                    address: "127.0.0.1".parse().unwrap(),
                    port: 1,
                })
                .collect(),
        };
        assert_eq!(decide(None, &m(1, &["a", "b"]), "b"), Decision::Join(1));
        assert_eq!(decide(Some(1), &m(1, &["a", "b"]), "b"), Decision::Stay);
        assert_eq!(decide(Some(2), &m(1, &["a"]), "b"), Decision::Stay);
        assert_eq!(decide(Some(1), &m(2, &["b", "c"]), "b"), Decision::Join(0));
        assert_eq!(
            decide(Some(1), &m(2, &["a", "c"]), "b"),
            Decision::NotMember
        );
    }
}
