//! The membership backend of a worker pod: the contract's env, the ring ConfigMap watched for a
//! [`Follower`] ([`KubeRing`]), and the heartbeat ConfigMap writes (docs/design/heartbeat.md).
//!
//! Pure part (unit-tested): [`WorkerEnv::from_lookup`]. The rules are the [`Follower`]'s. I/O
//! parts: [`RingConfigMap`] runs a single-object watch of `<job>-ring` ([`watch_ring`]) on a
//! small tokio runtime of its own; each membership it sees is handed to the training thread,
//! and a newer generation aborts the collective in flight (so a ring stuck on a hung peer moves
//! on as soon as the operator has re-formed it). Rank 0 patches its
//! [`diphoma_contract::ProgressReport`] into `<job>-heartbeat` every
//! [`crate::follow::PROGRESS_EVERY`]; a member whose collective fails patches one
//! [`diphoma_contract::FailureReport`] under `report.<pod>`. [`RingWatch`] is the in-pod
//! launcher's view of the same ConfigMap. Nothing is written per worker per step. From its start, the process answers
//! liveness pings ([`crate::liveness::Responder`]) on UDP at its ring address, and every
//! generation it joins probes silent peers ([`Config::liveness`]) with [`liveness_window`](crate::liveness::liveness_window) of
//! the job's `detectionSeconds`: a slow or catching-up peer is waited for, a silent one blamed.
//!
//! It must not train or record metrics: the worker wraps it (its `metrics::Metered`) and serves
//! `/metrics` on [`KubeRing::handle`].

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};

use diphoma_contract::{
    self as contract, ENV_DETECTION_SECONDS, ENV_JOB_NAME, ENV_JOB_UID, ENV_KEY_FILE,
    ENV_MEMBERSHIP, ENV_NAMESPACE, ENV_POD_IP, ENV_POD_NAME, ENV_RING_PORT, ENV_RING_PROTECTION,
    MEMBERSHIP_KEY, Membership,
};

use crate::follow::{Backend, Feed, Follower, Memberships};
use crate::liveness::Responder;
pub use crate::source::EnvError;
use crate::source::protection_var;
use crate::{Config, Protection};

/// Default bound on each connect in Kubernetes mode (a connect that times out blames nobody: the
/// member re-joins). Collectives are not bounded by it: see [`liveness_window`](crate::liveness::liveness_window).
pub const OP_TIMEOUT: Duration = Duration::from_secs(4);

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
    /// `DIPHOMA_RING_PORT` (1–65535): the pod's; its local rank `l` listens at
    /// [`contract::process_port`] of it (see [`WorkerEnv::process_port`]).
    pub ring_port: u16,
    /// `DIPHOMA_LOCAL_RANK` of `DIPHOMA_PROCESSES_PER_WORKER` (unset: local rank 0 of 1).
    pub local: contract::Local,
    /// `DIPHOMA_KEY_FILE`.
    pub key_file: PathBuf,
    /// `DIPHOMA_MEMBERSHIP`: name of the ring ConfigMap.
    pub membership: String,
    /// `DIPHOMA_DETECTION_SECONDS` (whole seconds, at least 1).
    pub detection: Duration,
    /// `DIPHOMA_RING_PROTECTION`: `none` (default when unset), `integrity` or `encryption`.
    pub protection: Protection,
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
            protection: protection_var(get(ENV_RING_PROTECTION))?,
            local: contract::Local::from_lookup(&get).map_err(|e| invalid(e.var, e.problem))?,
        })
    }

    /// The port this process listens on (TCP ring, UDP liveness): the pod's ring port for local
    /// rank 0, [`contract::process_port`] for the others.
    pub fn process_port(&self) -> u16 {
        contract::process_port(self.ring_port, self.local.rank)
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

/// Watches ConfigMap `name` through `api` on `rt`: a single-object watch whose every valid
/// membership goes to `feed` (a malformed one is logged and skipped), until the feed's
/// receiver is gone.
pub fn watch_ring(rt: &tokio::runtime::Handle, api: Api<ConfigMap>, name: &str, feed: Feed) {
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
            match Membership::parse(json) {
                Ok(m) => {
                    if feed.send(m).is_err() {
                        break;
                    }
                }
                Err(e) => tracing::warn!("ignoring ring membership: {e}"),
            }
        }
    });
}

/// A small multi-threaded tokio runtime of one worker thread (the watch, the heartbeat writes).
fn runtime() -> Result<tokio::runtime::Runtime, KubeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(KubeError::Runtime)
}

/// The ring ConfigMap's generations as the in-pod launcher sees them (`python -m diphoma.run`
/// in a pod, which starts and restarts the member): a watch on a runtime of its own that binds
/// nothing, answers no ping and aborts nothing, and writes into the heartbeat on request.
pub struct RingWatch {
    memberships: Memberships,
    rt: tokio::runtime::Runtime,
    /// The heartbeat ConfigMap and its name.
    heartbeat: (Api<ConfigMap>, String),
}

impl RingWatch {
    /// Watches the ring ConfigMap `env` names.
    ///
    /// # Errors
    /// [`KubeError::Runtime`] or [`KubeError::Client`] when no runtime or client can be built.
    pub fn start(env: &WorkerEnv) -> Result<RingWatch, KubeError> {
        let rt = runtime()?;
        let client = rt
            .block_on(kube::Client::try_default())
            .map_err(KubeError::Client)?;
        let api = Api::namespaced(client, &env.namespace);
        let (feed, memberships) = Memberships::channel(None);
        watch_ring(rt.handle(), api.clone(), &env.membership, feed);
        let name = contract::heartbeat_configmap_name(&env.job_name);
        Ok(RingWatch {
            memberships,
            rt,
            heartbeat: (api, name),
        })
    }

    /// [`Memberships::wait_newer`]: waits up to `wait` for a generation newer than `than` (any,
    /// when `None`), and returns the newest seen.
    pub fn wait_newer(&mut self, than: Option<u64>, wait: Duration) -> Option<&Membership> {
        self.memberships.wait_newer(than, wait)
    }

    /// Patches `key: value` into the job's heartbeat ConfigMap, waiting up to 10 s; a failed
    /// write is logged. The in-pod launcher's restart reports.
    pub fn write_heartbeat(&self, key: String, value: String) {
        let (api, name) = &self.heartbeat;
        let write = patch_heartbeat(api.clone(), name.clone(), key, value);
        // In the runtime: the timer needs its reactor.
        let _ = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), write).await });
    }
}

/// Follows the ring ConfigMap as a worker pod (see the module docs).
pub type KubeRing = Follower<RingConfigMap>;

/// The ring ConfigMap and the heartbeat as a [`Backend`]: the watch, the heartbeat writes, the
/// SIGTERM flag and the liveness responder, on a private tokio runtime.
pub struct RingConfigMap {
    env: WorkerEnv,
    rt: tokio::runtime::Runtime,
    heartbeat: Api<ConfigMap>,
    /// The progress write still in flight (the next one waits for it: writes land in order).
    pending_progress: Option<tokio::task::JoinHandle<()>>,
    terminating: Arc<AtomicBool>,
    /// Answers liveness pings for the life of the follower.
    _responder: Responder,
}

impl std::fmt::Debug for RingConfigMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingConfigMap")
            .field("env", &self.env)
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

impl RingConfigMap {
    /// Starts the liveness responder at the ring address, connects to the API server
    /// (`KUBECONFIG` or in-cluster config) and starts watching the ring ConfigMap into `feed`,
    /// on a private tokio runtime.
    ///
    /// # Errors
    /// As [`KubeRing::start`].
    fn start(env: WorkerEnv, key: &[u8], feed: Feed) -> Result<RingConfigMap, KubeError> {
        // Alive from the start, so that peers never take this process for a hung one.
        let addr = SocketAddr::new(env.pod_ip, env.process_port());
        let responder = Responder::bind(addr, key.to_vec())
            .map_err(|source| KubeError::Liveness { addr, source })?;
        let rt = runtime()?;
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
        watch_ring(rt.handle(), ring, &env.membership, feed);
        Ok(RingConfigMap::new(env, rt, client, terminating, responder))
    }

    /// The backend over `client` on `rt`, watching nothing (the caller feeds it).
    pub(crate) fn new(
        env: WorkerEnv,
        rt: tokio::runtime::Runtime,
        client: kube::Client,
        terminating: Arc<AtomicBool>,
        responder: Responder,
    ) -> RingConfigMap {
        let heartbeat = Api::namespaced(client, &env.namespace);
        RingConfigMap {
            env,
            rt,
            heartbeat,
            pending_progress: None,
            terminating,
            _responder: responder,
        }
    }

    fn patch_heartbeat(&self, key: String, value: String) -> impl Future<Output = ()> + use<> {
        let name = contract::heartbeat_configmap_name(&self.env.job_name);
        patch_heartbeat(self.heartbeat.clone(), name, key, value)
    }
}

impl Backend for RingConfigMap {
    type Error = KubeError;

    /// Binds the ring port on the pod IP; collectives probe silent peers within the job's
    /// [`liveness_window`](crate::liveness::liveness_window), under the job's protection.
    fn listen(
        &mut self,
        _m: &Membership,
        _rank: usize,
        config: &mut Config,
    ) -> Result<TcpListener, KubeError> {
        let addr = SocketAddr::new(self.env.pod_ip, self.env.process_port());
        let listener =
            TcpListener::bind(addr).map_err(|source| KubeError::Bind { addr, source })?;
        config.liveness = Some(crate::liveness::liveness_window(self.env.detection));
        config.protection = self.env.protection;
        Ok(listener)
    }

    /// Patches the record into the heartbeat after the write still in flight: in the
    /// background, or waiting for both (at most 10 s) when it is the last one before the
    /// process exits.
    fn write_progress(&mut self, json: String, last: bool) {
        let write = self.patch_heartbeat(contract::PROGRESS_KEY.to_string(), json);
        let previous = self.pending_progress.take();
        let in_order = async move {
            if let Some(p) = previous {
                let _ = p.await;
            }
            write.await
        };
        if last {
            self.rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(10), in_order).await;
            });
        } else {
            self.pending_progress = Some(self.rt.spawn(in_order));
        }
    }

    /// Patches the report into the heartbeat, waiting up to 5 s.
    fn write_report(&mut self, key: String, json: String) {
        let write = self.patch_heartbeat(key, json);
        self.rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(5), write).await;
        });
    }

    fn terminating(&self) -> bool {
        self.terminating.load(Ordering::SeqCst)
    }
}

impl Follower<RingConfigMap> {
    /// Starts the liveness responder at the ring address, connects to the API server
    /// (`KUBECONFIG` or in-cluster config) and starts following the ring ConfigMap as pod
    /// `env.pod_name`, on a private tokio runtime (see [`KubeRing::handle`]); connects are
    /// bounded by [`OP_TIMEOUT`] until [`Follower::set_op_timeout`]. SIGTERM from then on
    /// means "leave the ring" ([`Follower::done`]).
    ///
    /// # Errors
    /// [`KubeError::Liveness`] when the ring address cannot be bound for UDP;
    /// [`KubeError::Runtime`] or [`KubeError::Client`] when no runtime or client can be built.
    pub fn start(env: WorkerEnv, key: Vec<u8>) -> Result<KubeRing, KubeError> {
        let (name, uid, local) = (env.pod_name.clone(), env.job_uid.clone(), env.local);
        let cm_key = key.clone();
        let mut f = Follower::with_backend(name, Some(uid), key, OP_TIMEOUT, move |feed| {
            RingConfigMap::start(env, &cm_key, feed)
        })?;
        f.set_local(local);
        Ok(f)
    }

    /// The private tokio runtime the watch and the heartbeat writes run on (the worker serves
    /// `/metrics` on it too).
    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.backend().rt.handle()
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
        assert_eq!(w.protection, Protection::None, "none when unset");
        let mut enc = env.clone();
        enc.insert(ENV_RING_PROTECTION, "encryption".into());
        let w = WorkerEnv::from_lookup(|n| enc.get(n).cloned()).unwrap();
        assert_eq!(w.protection, Protection::Encryption);
        let mut two = env.clone();
        two.insert(contract::ENV_PROCESSES_PER_WORKER, "2".into());
        two.insert(contract::ENV_LOCAL_RANK, "1".into());
        let w = WorkerEnv::from_lookup(|n| two.get(n).cloned()).unwrap();
        assert_eq!(w.process_port(), 29502, "local rank 1 at the ring port + 2");
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
            (ENV_RING_PROTECTION, "mac"),
            (ENV_RING_PROTECTION, "aes"),
            (contract::ENV_LOCAL_RANK, "x"),
        ] {
            let mut e = env.clone();
            e.insert(var, bad.to_string());
            let err = WorkerEnv::from_lookup(|n| e.get(n).cloned())
                .unwrap_err()
                .to_string();
            assert!(err.contains(var) && err.contains(bad), "{err}");
        }
    }
}
