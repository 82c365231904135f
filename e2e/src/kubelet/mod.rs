//! The process kubelet: registers simulated GPU nodes, keeps them Ready with Leases, and runs the
//! pods bound to them as local processes (one [`pod`] worker per pod).
//!
//! Pure parts: [`node`] (Node and Lease objects), [`spec`] (env, expansion, mount paths),
//! [`status`] (pod status), [`alloc`] (pod IPs, GPUs), [`images`] (image → binary), the log
//! format and selection in [`logs`].
//! I/O: this module (watch loop, heartbeats, node failure), [`pod`], [`volumes`], [`process`]
//! and [`container`] (container mode: podman),
//! [`probe`] (readiness and liveness probes), [`logs`] (capture, follow) and [`server`] (the
//! kubelet API over TLS: `GET /containerLogs`, what `kubectl logs` reaches through the API server).

pub mod alloc;
pub mod container;
pub mod images;
pub mod logs;
pub mod node;
pub mod pod;
pub mod probe;
pub mod process;
pub mod server;
pub mod spec;
pub mod status;
pub mod volumes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::config::Kubeconfig;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use self::alloc::{GpuPool, IpPool};
use self::images::ImageTable;
use self::node::{LEASE_NAMESPACE, NodeConfig};
use self::pod::PodEvent;
use crate::Error;

/// How a failed node treats its processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailMode {
    /// SIGKILL every process (a node that lost power).
    Kill,
    /// SIGSTOP every process (a hung or partitioned node: sockets stay open, nothing answers).
    Freeze,
}

impl std::str::FromStr for FailMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "kill" => Ok(FailMode::Kill),
            "freeze" => Ok(FailMode::Freeze),
            _ => Err(Error::Config {
                field: "mode".into(),
                message: format!("{s:?} is not kill or freeze"),
            }),
        }
    }
}

/// How a kubelet runs pods' containers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Runtime {
    /// As processes of the binaries the image table maps images to: fast, no isolation.
    #[default]
    Process,
    /// As podman containers of images in the local image store ([`container`]).
    Podman,
}

impl std::str::FromStr for Runtime {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "process" => Ok(Runtime::Process),
            "podman" => Ok(Runtime::Podman),
            _ => Err(Error::Config {
                field: "--runtime".into(),
                message: format!("{s:?} is not process or podman"),
            }),
        }
    }
}

/// Configuration of a process kubelet.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// The nodes to register and run.
    pub nodes: Vec<NodeConfig>,
    /// Which binary each image runs (process mode).
    pub images: ImageTable,
    /// Processes or containers.
    pub runtime: Runtime,
    /// Directory for pod directories (`pods/<uid>`) and logs (`logs/…`).
    pub root: PathBuf,
    /// API server URL written into pods' kubeconfigs (`https://127.0.0.1:<port>`).
    pub api_server: String,
    /// CA certificate file of the API server, for pods' kubeconfigs.
    pub ca_file: PathBuf,
    /// Second octet of every node and pod IP (`127.<cluster>.<node>.<n>`); distinct clusters on
    /// one machine should differ.
    pub cluster_octet: u8,
    /// Interval between Lease renewals.
    pub heartbeat: Duration,
}

impl KubeletConfig {
    /// A configuration whose API server and CA come from the kubeconfig the kubelet itself uses
    /// (its current context's cluster), with `nodes`, the default image table for `bin_dir`,
    /// a 2 s heartbeat and a cluster octet derived from the API server's port.
    ///
    /// Errors: [`Error::Kubeconfig`] naming the file when it lacks a server or a CA file.
    pub fn from_kubeconfig(
        kubeconfig: &Path,
        nodes: Vec<NodeConfig>,
        bin_dir: &Path,
        root: PathBuf,
    ) -> Result<Self, Error> {
        let bad = |m: &str| Error::Kubeconfig {
            path: kubeconfig.to_owned(),
            source: m.to_owned().into(),
        };
        let kc = Kubeconfig::read_from(kubeconfig).map_err(|e| Error::Kubeconfig {
            path: kubeconfig.to_owned(),
            source: e.into(),
        })?;
        let cluster = kc
            .clusters
            .first()
            .and_then(|c| c.cluster.clone())
            .ok_or_else(|| bad("no cluster"))?;
        let api_server = cluster.server.ok_or_else(|| bad("cluster has no server"))?;
        let ca_file = PathBuf::from(
            cluster
                .certificate_authority
                .ok_or_else(|| bad("cluster has no certificate-authority file"))?,
        );
        let port: u16 = api_server
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .unwrap_or(0);
        Ok(KubeletConfig {
            nodes,
            images: ImageTable::with_defaults(bin_dir),
            runtime: Runtime::Process,
            root,
            api_server,
            ca_file,
            cluster_octet: 20 + (port % 200) as u8,
            heartbeat: Duration::from_secs(2),
        })
    }
}

/// Per-node state shared by the heartbeat task and the pod workers.
pub(crate) struct NodeState {
    ip: String,
    ips: Mutex<IpPool>,
    gpus: Mutex<GpuPool>,
    failed: watch::Sender<Option<FailMode>>,
    /// The node's clock offset ([`NodeConfig::clock_offset_seconds`]).
    clock_offset: jiff::SignedDuration,
}

impl NodeState {
    /// Now, by the node's clock.
    fn now(&self) -> jiff::Timestamp {
        jiff::Timestamp::now() + self.clock_offset
    }
}

/// State shared by every task of one kubelet.
pub(crate) struct Shared {
    client: Client,
    cfg: KubeletConfig,
    nodes: BTreeMap<String, Arc<NodeState>>,
    workers: Mutex<HashMap<String, mpsc::UnboundedSender<PodEvent>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    shutdown: watch::Sender<bool>,
    /// Process-group ids of every running container, killed when the kubelet is dropped.
    pids: Mutex<HashSet<u32>>,
    /// Container runs whose output is still being written.
    live_logs: Arc<logs::LiveLogs>,
}

/// `namespace/name` of a pod, for messages.
pub(crate) fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// A running process kubelet. [`Kubelet::shutdown`] kills its processes and waits for them;
/// dropping it (a panicking test) SIGKILLs them at once.
pub struct Kubelet {
    shared: Arc<Shared>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        for pid in self.shared.pids.lock().unwrap().drain() {
            process::signal_group(pid, libc::SIGKILL);
        }
    }
}

impl Kubelet {
    /// Starts the kubelet API on every node's IP (a serving certificate issued by the CA of
    /// `cfg.ca_file`, whose key is `ca.key` next to it), registers the nodes (with their Leases
    /// and their kubelet port), starts heartbeats and the pod watch, and returns once every node
    /// exists in the API.
    ///
    /// Errors: API errors while registering; [`Error::Config`] for duplicate node names or more
    /// than 254 nodes; [`Error::Script`], [`Error::Tls`] or [`Error::Io`] when the serving
    /// certificate cannot be issued or a node's address bound.
    pub async fn start(client: Client, cfg: KubeletConfig) -> Result<Self, Error> {
        if cfg.nodes.len() > 254 {
            return Err(Error::Config {
                field: "nodes".into(),
                message: "at most 254 nodes".into(),
            });
        }
        let mut nodes = BTreeMap::new();
        for (i, n) in cfg.nodes.iter().enumerate() {
            let ips = IpPool::new(cfg.cluster_octet, i as u8);
            let state = NodeState {
                ip: ips.node_ip(),
                ips: Mutex::new(ips),
                gpus: Mutex::new(GpuPool::new(n.gpus)),
                failed: watch::channel(None).0,
                clock_offset: jiff::SignedDuration::from_secs(n.clock_offset_seconds),
            };
            if nodes.insert(n.name.clone(), Arc::new(state)).is_some() {
                return Err(Error::Config {
                    field: "nodes".into(),
                    message: format!("duplicate node {:?}", n.name),
                });
            }
        }
        let shared = Arc::new(Shared {
            client,
            cfg,
            nodes,
            workers: Mutex::default(),
            tasks: Mutex::default(),
            shutdown: watch::channel(false).0,
            pids: Mutex::default(),
            live_logs: Arc::default(),
        });
        // From here on, an early return drops it: its shutdown stops the servers started so far.
        let kubelet = Kubelet {
            shared: shared.clone(),
        };
        let mut tasks = vec![];
        let ips: Vec<String> = shared.nodes.values().map(|n| n.ip.clone()).collect();
        let cfg = &shared.cfg;
        let (crt, key) =
            server::issue_serving_cert(&cfg.ca_file, &cfg.root.join("pki"), &ips).await?;
        let tls = server::tls_config(&crt, &key, &cfg.ca_file)?;
        let app = server::router(server::LogSource {
            client: shared.client.clone(),
            root: cfg.root.clone(),
            live: shared.live_logs.clone(),
        });
        for n in &cfg.nodes {
            let ips = shared.nodes[&n.name].ips.lock().unwrap().clone();
            let listener = server::bind(&ips.node_ip()).await?;
            let port = listener.local_addr().map_or(0, |a| a.port());
            let stop = shared.shutdown.subscribe();
            tasks.push(tokio::spawn(server::serve(
                listener,
                tls.clone(),
                app.clone(),
                stop,
            )));
            let renewed = shared.nodes[&n.name].now();
            register(&shared.client, n, &ips, port, cfg.heartbeat, renewed).await?;
        }
        for name in shared.nodes.keys() {
            tasks.push(tokio::spawn(heartbeat(shared.clone(), name.clone())));
        }
        tasks.push(tokio::spawn(watch_pods(shared.clone())));
        shared.tasks.lock().unwrap().extend(tasks);
        Ok(kubelet)
    }

    /// Fails a node: its Lease is no longer renewed (so the node-lifecycle controller marks it
    /// NotReady), its processes are killed or frozen, and its pods stay as they are in the API.
    ///
    /// Errors: [`Error::UnknownNode`] naming the node.
    pub fn fail_node(&self, name: &str, mode: FailMode) -> Result<(), Error> {
        self.node(name)?.failed.send_replace(Some(mode));
        Ok(())
    }

    /// The state of node `name`. Errors: [`Error::UnknownNode`] naming it.
    fn node(&self, name: &str) -> Result<&NodeState, Error> {
        self.shared
            .nodes
            .get(name)
            .map(|n| n.as_ref())
            .ok_or_else(|| Error::UnknownNode {
                name: name.to_owned(),
                known: self
                    .shared
                    .nodes
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// What a container printed (stdout and stderr), every run in order; the kubelet keeps it
    /// after the pod is deleted. Errors: [`Error::Io`] naming a run that cannot be read.
    pub fn log_text(&self, pod: &Pod, container: &str) -> Result<String, Error> {
        let m = &pod.metadata;
        let s = |o: &Option<String>| o.clone().unwrap_or_default();
        logs::read_text(&logs::container_dir(
            &self.shared.cfg.root,
            &s(&m.namespace),
            &s(&m.name),
            &s(&m.uid),
            container,
        ))
    }

    /// Stops heartbeats and the watch, kills every pod process and waits until all are reaped.
    /// Pods are left in the API as they are.
    pub async fn shutdown(self) {
        self.shared.shutdown.send_replace(true);
        loop {
            let tasks: Vec<_> = std::mem::take(&mut *self.shared.tasks.lock().unwrap());
            if tasks.is_empty() {
                break;
            }
            for t in tasks {
                let _ = t.await;
            }
        }
    }
}

/// Creates the Node (status included) and its Lease, renewed every `renew` and last at
/// `renewed` (the node's clock); an existing one is taken over.
async fn register(
    client: &Client,
    cfg: &NodeConfig,
    ips: &IpPool,
    kubelet_port: u16,
    renew: Duration,
    renewed: jiff::Timestamp,
) -> Result<(), Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let obj = node::node_object(cfg, &ips.node_ip(), &ips.cidr(), kubelet_port);
    let node = match nodes.create(&PostParams::default(), &obj).await {
        Ok(n) => n,
        Err(kube::Error::Api(s)) if s.is_already_exists() => {
            let body = serde_json::json!({"status": obj.status});
            nodes
                .patch_status(&cfg.name, &PatchParams::default(), &Patch::Merge(&body))
                .await?
        }
        Err(e) => return Err(e.into()),
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let uid = node.metadata.uid.as_deref().unwrap_or_default();
    let lease = node::lease_object(&cfg.name, uid, renew, renewed);
    match leases.create(&PostParams::default(), &lease).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() => {
            let body = serde_json::json!({"spec": lease.spec});
            leases
                .patch(&cfg.name, &PatchParams::default(), &Patch::Merge(&body))
                .await?;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Renews the node's Lease every heartbeat, on a fixed schedule (a slow renewal does not push
/// the next one back), by the node's clock, until the node fails or the kubelet stops.
async fn heartbeat(sh: Arc<Shared>, name: String) {
    let leases: Api<Lease> = Api::namespaced(sh.client.clone(), LEASE_NAMESPACE);
    let mut shutdown = sh.shutdown.subscribe();
    let failed = sh.nodes[&name].failed.subscribe();
    let mut tick = tokio::time::interval(sh.cfg.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tick.tick().await; // the first tick is immediate; the Lease was just created
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        if failed.borrow().is_some() {
            continue;
        }
        if let Err(e) = leases
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&node::lease_renewal(sh.nodes[&name].now())),
            )
            .await
        {
            tracing::warn!(node = %name, error = %e, "lease renewal failed");
        }
    }
}

/// Watches pods bound to any node and hands each to its pod worker, starting one for a new pod.
async fn watch_pods(sh: Arc<Shared>) {
    let api: Api<Pod> = Api::all(sh.client.clone());
    let cfg = watcher::Config::default().fields("spec.nodeName!=");
    let mut stream = std::pin::pin!(watcher::watcher(api, cfg).default_backoff());
    let mut shutdown = sh.shutdown.subscribe();
    let mut relisted: Option<HashSet<String>> = None;
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = shutdown.changed() => break,
        };
        match ev {
            Some(Ok(Event::Apply(p))) => dispatch(&sh, p),
            Some(Ok(Event::InitApply(p))) => {
                if let Some(seen) = relisted.as_mut() {
                    seen.insert(p.metadata.uid.clone().unwrap_or_default());
                }
                dispatch(&sh, p)
            }
            Some(Ok(Event::Delete(p))) => {
                deleted(&sh, p.metadata.uid.as_deref().unwrap_or_default())
            }
            Some(Ok(Event::Init)) => relisted = Some(HashSet::new()),
            Some(Ok(Event::InitDone)) => {
                // Pods that vanished while the watch was down.
                let seen = relisted.take().unwrap_or_default();
                let gone: Vec<String> = sh
                    .workers
                    .lock()
                    .unwrap()
                    .keys()
                    .filter(|u| !seen.contains(*u))
                    .cloned()
                    .collect();
                gone.iter().for_each(|u| deleted(&sh, u));
            }
            Some(Err(e)) => tracing::warn!(error = %e, "pod watch"),
            None => break,
        }
    }
    // Tell every worker to stop; their handles are awaited by `shutdown`.
    sh.workers.lock().unwrap().clear();
}

fn deleted(sh: &Shared, uid: &str) {
    if let Some(tx) = sh.workers.lock().unwrap().remove(uid) {
        let _ = tx.send(PodEvent::Deleted);
    }
}

fn dispatch(sh: &Arc<Shared>, pod: Pod) {
    let node_name = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let Some(node) = sh.nodes.get(&node_name) else {
        return;
    };
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let mut workers = sh.workers.lock().unwrap();
    if let Some(tx) = workers.get(&uid) {
        if tx.send(PodEvent::Updated(Box::new(pod))).is_ok() {
            return;
        }
        workers.remove(&uid);
        return;
    }
    if node.failed.borrow().is_some() || *sh.shutdown.borrow() {
        return; // a dead node starts nothing
    }
    let (tx, rx) = mpsc::unbounded_channel();
    workers.insert(uid.clone(), tx);
    let (sh2, node) = (sh.clone(), node.clone());
    let handle = tokio::spawn(async move {
        pod::run(sh2.clone(), node, pod, rx).await;
        sh2.workers.lock().unwrap().remove(&uid);
    });
    sh.tasks.lock().unwrap().push(handle);
}
