//! One pod worker per pod (as in the real kubelet's `pod_workers.go`): prepare the pod (IP, GPUs,
//! volumes, env, kubeconfig), run its containers as processes, report status, restart per
//! `restartPolicy`, probe readiness and liveness ([`super::probe`]), and carry out deletion
//! (SIGTERM → grace → SIGKILL → final status → delete with grace 0 and a UID precondition). On a
//! failed node it kills or freezes its processes and goes silent, as a dead node would.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::container::{self, ContainerRun, Mount};
use super::logs;
use super::node::GPU_RESOURCE;
use super::probe::{self, Kind};
use super::process::{self, Launch};
use super::spec::{self, PodFacts, Sources};
use super::status::{self, ContainerRecord, RunState};
use super::volumes;
use super::{FailMode, NodeState, Runtime, Shared, pod_key};
use crate::Error;

/// What the watch loop tells a pod worker.
#[derive(Debug)]
pub enum PodEvent {
    /// The pod object changed (or was seen again).
    Updated(Box<Pod>),
    /// The pod is gone from the API.
    Deleted,
}

/// Interval of the periodic pod sync.
const RESYNC: Duration = Duration::from_secs(5);

/// How long a pod waits for GPUs that a deleted pod still holds.
const GPU_WAIT: Duration = Duration::from_secs(30);

/// Restart back-off: 1 s, 2 s, 4 s, … capped at 10 s (the real kubelet starts at 10 s, capped at
/// 5 min; shorter here so that tests of crash loops finish).
fn backoff(restarts: i32) -> Duration {
    Duration::from_secs(1u64 << restarts.clamp(0, 3)).min(Duration::from_secs(10))
}

/// Container mode: `c`'s image must be in the local image store; nothing is pulled.
///
/// Errors: [`Error::ImageNotPresent`] naming the image (`never` under `imagePullPolicy: Never`).
async fn present_image(c: &Container) -> Result<(), Error> {
    let image = c.image.clone().unwrap_or_default();
    if container::image_present(&image).await? {
        return Ok(());
    }
    Err(Error::ImageNotPresent {
        never: c.image_pull_policy.as_deref() == Some("Never"),
        image,
    })
}

fn now() -> Time {
    Time(jiff::Timestamp::now())
}

/// GPUs a pod asks for: the sum of its containers' `nvidia.com/gpu` limits (or requests).
fn gpus_requested(pod: &Pod) -> u32 {
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
    containers
        .filter_map(|c| {
            let r = c.resources.as_ref()?;
            let q = r
                .limits
                .as_ref()
                .and_then(|l| l.get(GPU_RESOURCE))
                .or(r.requests.as_ref()?.get(GPU_RESOURCE))?;
            q.0.parse::<u32>().ok()
        })
        .sum()
}

struct Worker {
    sh: Arc<Shared>,
    node: Arc<NodeState>,
    pod: Pod,
    api: Api<Pod>,
    dir: PathBuf,
    pod_ip: Option<String>,
    gpus: Vec<u32>,
    records: Vec<ContainerRecord>,
    launches: Vec<Option<Launch>>,
    restart_at: Vec<Option<Instant>>,
    start_time: Time,
    last_patch: Option<serde_json::Value>,
    exits: mpsc::UnboundedSender<(usize, ExitStatus)>,
    /// Per container, the probe tasks of its running process.
    probes: Vec<Vec<tokio::task::AbortHandle>>,
    verdicts: mpsc::UnboundedSender<Verdict>,
    /// The start failed for want of an image: tried again at each periodic sync (the image may
    /// have been built since), as the real kubelet retries pulls.
    retry_start: bool,
}

type Exits = mpsc::UnboundedReceiver<(usize, ExitStatus)>;

/// A probe's new verdict: (container index, pid of the process probed, kind, passing).
type Verdict = (usize, u32, Kind, bool);
type Verdicts = mpsc::UnboundedReceiver<Verdict>;

/// Runs the pod until it is deleted, its node fails and it is deleted, or the kubelet shuts down.
pub(crate) async fn run(
    sh: Arc<Shared>,
    node: Arc<NodeState>,
    pod: Pod,
    mut rx: mpsc::UnboundedReceiver<PodEvent>,
) {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let (exits, mut exits_rx) = mpsc::unbounded_channel();
    let (verdicts, mut verdicts_rx) = mpsc::unbounded_channel();
    let mut w = Worker {
        exits,
        verdicts,
        probes: vec![],
        api: Api::namespaced(sh.client.clone(), &ns),
        dir: sh.cfg.root.join("pods").join(&uid),
        node,
        pod,
        sh,
        pod_ip: None,
        gpus: vec![],
        records: vec![],
        launches: vec![],
        restart_at: vec![],
        start_time: now(),
        last_patch: None,
        retry_start: false,
    };
    let terminal = matches!(w.phase_in_api(), "Succeeded" | "Failed");
    if !terminal && w.pod.metadata.deletion_timestamp.is_none() {
        w.start().await;
    }
    w.event_loop(&mut rx, &mut exits_rx, &mut verdicts_rx).await;
    w.cleanup();
}

impl Worker {
    fn phase_in_api(&self) -> &str {
        self.pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("Pending")
    }

    fn key(&self) -> String {
        pod_key(&self.pod)
    }

    /// Allocates, prepares and starts every container; a preparation error leaves the
    /// containers waiting with the reason and a message naming what is wrong.
    async fn start(&mut self) {
        let spec = self.pod.spec.clone().unwrap_or_default();
        self.records = spec
            .containers
            .iter()
            .map(|c| ContainerRecord::creating(&c.name, c.image.as_deref().unwrap_or("")))
            .collect();
        self.restart_at = vec![None; spec.containers.len()];
        self.probes = vec![vec![]; spec.containers.len()];
        match self.prepare().await {
            Ok(launches) => {
                self.launches = launches.into_iter().map(Some).collect();
                for i in 0..self.records.len() {
                    self.spawn(i).await;
                }
            }
            Err(e) => {
                let reason = match e {
                    Error::UnknownImage { .. } | Error::MissingBinary { .. } => "ErrImagePull",
                    Error::ImageNotPresent { never: true, .. } => "ErrImageNeverPull",
                    Error::ImageNotPresent { .. } => "ImagePullBackOff",
                    _ => "CreateContainerConfigError",
                };
                // Started again at the next resync, as the real kubelet retries: images are
                // checked before anything is allocated, and what a config error found allocated
                // is freed here (a ConfigMap or Secret the pod needs may appear later, such as
                // the namespace's kube-root-ca.crt, which the controller manager publishes a
                // moment after the namespace is created).
                if reason == "CreateContainerConfigError" {
                    self.release_gpus();
                    self.release_ip();
                }
                self.retry_start = true;
                tracing::warn!(pod = %self.key(), error = %e, "cannot start pod");
                for r in &mut self.records {
                    r.state = RunState::Waiting {
                        reason: reason.into(),
                        message: e.to_string(),
                    };
                }
            }
        }
        self.report().await;
    }

    async fn prepare(&mut self) -> Result<Vec<Launch>, Error> {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let podman = self.sh.cfg.runtime == Runtime::Podman;
        let mut binaries = vec![];
        for c in &spec.containers {
            let image = c.image.as_deref().unwrap_or("");
            binaries.push(if podman {
                present_image(c).await?;
                PathBuf::from("podman")
            } else {
                self.sh.cfg.images.resolve(image)?
            });
        }
        let want = gpus_requested(&self.pod);
        // The scheduler frees a deleted pod's GPUs as soon as its object is gone, which can be a
        // moment before this kubelet has reaped its processes: wait for them briefly, as the
        // device plugin's allocation would.
        let deadline = Instant::now() + GPU_WAIT;
        self.gpus = loop {
            if let Some(g) = self.node.gpus.lock().unwrap().allocate(want) {
                break g;
            }
            if Instant::now() > deadline {
                return Err(Error::Unsupported {
                    pod: self.key(),
                    what: format!("{want} {GPU_RESOURCE} requested but the node has fewer free"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let ip = self
            .node
            .ips
            .lock()
            .unwrap()
            .allocate()
            .ok_or_else(|| Error::Unsupported {
                pod: self.key(),
                what: "no free pod IP on the node".into(),
            })?;
        self.pod_ip = Some(ip.clone());
        let facts = PodFacts {
            pod_ip: ip,
            host_ip: self.node.ip.clone(),
        };
        let sources = self.sources().await?;
        let volume_dirs =
            volumes::materialize(&self.sh.client, &self.pod, &facts, &sources, &self.dir).await?;

        let mut extra = vec![];
        let mut kubeconfig = vec![]; // container mode: mounted read-only at KUBECONFIG_PATH
        if spec.automount_service_account_token != Some(false) {
            let token = volumes::pod_token(&self.sh.client, &self.pod, None).await?;
            let kc = self.dir.join("kubeconfig");
            volumes::write_kubeconfig(&kc, &self.sh.cfg.api_server, &self.sh.cfg.ca_file, &token)?;
            let seen_as = if podman {
                kubeconfig.push((kc, container::KUBECONFIG_PATH.to_owned(), true));
                container::KUBECONFIG_PATH.to_owned()
            } else {
                kc.display().to_string()
            };
            extra.push(("KUBECONFIG".to_owned(), seen_as));
        }
        if !self.gpus.is_empty() {
            let ids = self
                .gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            extra.push(("CUDA_VISIBLE_DEVICES".to_owned(), ids.clone()));
            extra.push(("NVIDIA_VISIBLE_DEVICES".to_owned(), ids));
        }
        let name = self.pod.metadata.name.clone().unwrap_or_default();
        spec.containers
            .iter()
            .zip(binaries)
            .map(|(c, binary)| {
                let mounts: Vec<Mount> = c
                    .volume_mounts
                    .iter()
                    .flatten()
                    .filter_map(|m| {
                        let dir = volume_dirs.get(&m.name)?;
                        let dir = m.sub_path.as_ref().map_or(dir.clone(), |s| dir.join(s));
                        Some((dir, m.mount_path.clone(), m.read_only == Some(true)))
                    })
                    .collect();
                let env = spec::container_env(&self.pod, c, &facts, &sources, &extra)?;
                let mut launch = Launch {
                    program: binary,
                    args: vec![],
                    env,
                    cwd: self.dir.clone(),
                    hostname: name.clone(),
                    container: None,
                };
                if podman {
                    let (entrypoint, args) = spec::command_args(c, &launch.env);
                    launch.args = args;
                    launch.container = Some(ContainerRun {
                        image: c.image.clone().unwrap_or_default(),
                        name: format!(
                            "dpk-{}-{}",
                            self.pod.metadata.uid.as_deref().unwrap_or(""),
                            c.name
                        ),
                        root: self.sh.cfg.root.clone(),
                        pidfile: self.dir.join(format!("{}.pid", c.name)),
                        mounts: mounts.into_iter().chain(kubeconfig.clone()).collect(),
                        entrypoint,
                        user: container::user(
                            spec.security_context.as_ref(),
                            c.security_context.as_ref(),
                        ),
                        security: container::security_flags(c),
                        nofile: container::nofile_limit(),
                    });
                } else {
                    let mounts: Vec<(String, PathBuf)> = mounts
                        .into_iter()
                        .map(|(dir, path, _)| (path, dir))
                        .collect();
                    for (_, v) in &mut launch.env {
                        *v = spec::rewrite_path(v, &mounts);
                    }
                    (launch.program, launch.args) =
                        spec::command_line(c, &launch.program, &launch.env, &mounts);
                }
                Ok(launch)
            })
            .collect()
    }

    /// Fetches the ConfigMaps and Secrets the pod references (missing ones are left out; the
    /// env and volume code decides whether that is an error).
    async fn sources(&self) -> Result<Sources, Error> {
        let (cms, secrets) = spec::references(&self.pod);
        let ns = self.pod.metadata.namespace.clone().unwrap_or_default();
        let client: &Client = &self.sh.client;
        let mut out = Sources::default();
        for name in cms {
            if let Some(cm) = Api::<ConfigMap>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await?
            {
                let mut m = cm.data.unwrap_or_default();
                for (k, v) in cm.binary_data.unwrap_or_default() {
                    m.insert(k, String::from_utf8_lossy(&v.0).into_owned());
                }
                out.config_maps.insert(name, m);
            }
        }
        for name in secrets {
            if let Some(s) = Api::<Secret>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await?
            {
                let mut m: BTreeMap<String, String> = s.string_data.unwrap_or_default();
                for (k, v) in s.data.unwrap_or_default() {
                    m.insert(k, String::from_utf8_lossy(&v.0).into_owned());
                }
                out.secrets.insert(name, m);
            }
        }
        Ok(out)
    }

    /// Starts container `i`'s process, its output captured into the run's log file
    /// ([`logs::run_file`] of its restart count), and a task that reports its exit.
    async fn spawn(&mut self, i: usize) {
        let Some(launch) = self.launches[i].clone() else {
            return;
        };
        let m = &self.pod.metadata;
        let s = |o: &Option<String>| o.clone().unwrap_or_default();
        let (ns, name, uid) = (s(&m.namespace), s(&m.name), s(&m.uid));
        let dir = logs::container_dir(&self.sh.cfg.root, &ns, &name, &uid, &self.records[i].name);
        let log = logs::run_file(&dir, self.records[i].restart_count);
        let started = logs::open_run(&log).and_then(|file| {
            let mut child = process::spawn(&launch, Stdio::piped(), Stdio::piped())?;
            logs::capture(&mut child, file, &log, &self.sh.live_logs);
            Ok(child)
        });
        let started = match started {
            Ok(mut child) => process::main_pid(&launch, &mut child)
                .await
                .map(|pid| (child, pid)),
            Err(e) => Err(e),
        };
        match started {
            Ok((mut child, pid)) => {
                self.records[i].state = RunState::Running {
                    started: now(),
                    pid,
                };
                self.sh.pids.lock().unwrap().insert(pid);
                self.start_probes(i, pid);
                let (exits, sh) = (self.exits.clone(), self.sh.clone());
                tokio::spawn(async move {
                    let st = child.wait().await;
                    sh.pids.lock().unwrap().remove(&pid);
                    if let Ok(st) = st {
                        let _ = exits.send((i, st));
                    }
                });
            }
            Err(e) => {
                self.records[i].state = RunState::Waiting {
                    reason: "RunContainerError".into(),
                    message: e.to_string(),
                };
            }
        }
    }

    /// Starts container `i`'s probes against process `pid`; without a readiness probe it is
    /// ready at once. A probe that cannot run (exec, an unknown port) leaves it unready.
    fn start_probes(&mut self, i: usize, pid: u32) {
        let container = &self
            .pod
            .spec
            .as_ref()
            .expect("started pods have a spec")
            .containers[i];
        self.records[i].ready = Kind::Readiness.of(container).is_none();
        let ip = self.pod_ip.as_deref().and_then(|ip| ip.parse().ok());
        for kind in Kind::ALL {
            let (Some(p), Some(ip)) = (kind.of(container), ip) else {
                continue;
            };
            match probe::action(p, container, ip) {
                Ok(a) => {
                    let tx = self.verdicts.clone();
                    let flip = move |ok| tx.send((i, pid, kind, ok)).is_ok();
                    let task = tokio::spawn(probe::run(a, p.clone(), kind, flip));
                    self.probes[i].push(task.abort_handle());
                }
                Err(e) => tracing::warn!(pod = %self.key(), error = %e, "probe not run"),
            }
        }
    }

    fn stop_probes(&mut self, i: usize) {
        self.probes[i].drain(..).for_each(|t| t.abort());
    }

    /// A probe's verdict about the process still running: readiness is reported; a failed
    /// liveness probe kills the process (the kubelet sends SIGTERM and SIGKILL after the grace
    /// period; SIGKILL here), which is then restarted per `restartPolicy`.
    async fn verdict(&mut self, (i, pid, kind, ok): Verdict) {
        if !matches!(self.records[i].state, RunState::Running { pid: p, .. } if p == pid) {
            return;
        }
        match kind {
            Kind::Readiness => {
                self.records[i].ready = ok;
                self.report().await;
            }
            Kind::Liveness if !ok => {
                tracing::info!(pod = %self.key(), container = %self.records[i].name, "liveness probe failed: killing");
                process::signal_group(pid, libc::SIGKILL);
            }
            Kind::Liveness => {}
        }
    }

    fn pids(&self) -> Vec<u32> {
        self.records
            .iter()
            .filter_map(|r| match r.state {
                RunState::Running { pid, .. } => Some(pid),
                _ => None,
            })
            .collect()
    }

    fn signal_all(&self, sig: libc::c_int) {
        for pid in self.pids() {
            process::signal_group(pid, sig);
        }
    }

    /// What container `i`, which exited with `st`, leaves as its termination message: under
    /// `terminationMessagePolicy: FallbackToLogsOnError` after a failed exit, the end of its
    /// run's log ([`logs::termination_message`]), read once the log's writer has taken the
    /// process's last lines (at most 2 s: a child may still hold the pipes).
    async fn fallback_message(&self, i: usize, st: ExitStatus) -> Option<String> {
        let spec = self.pod.spec.as_ref()?.containers.get(i)?;
        if spec.termination_message_policy.as_deref() != Some("FallbackToLogsOnError")
            || status::termination(st).0 == 0
        {
            return None;
        }
        let m = &self.pod.metadata;
        let s = |o: &Option<String>| o.clone().unwrap_or_default();
        let dir = logs::container_dir(
            &self.sh.cfg.root,
            &s(&m.namespace),
            &s(&m.name),
            &s(&m.uid),
            &spec.name,
        );
        let log = logs::run_file(&dir, self.records[i].restart_count);
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.sh.live_logs.get(&log).is_some() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let content = tokio::fs::read_to_string(&log).await.ok()?;
        Some(logs::termination_message(&content)).filter(|m| !m.is_empty())
    }

    /// Records a process exit (with its termination `message`); schedules a restart when the
    /// restart policy says so.
    fn exited(&mut self, i: usize, st: ExitStatus, deleting: bool, message: Option<String>) {
        let RunState::Running { started, .. } = self.records[i].state.clone() else {
            return;
        };
        self.stop_probes(i);
        self.records[i].ready = false;
        let (exit_code, reason) = status::termination(st);
        let term = RunState::Terminated {
            exit_code,
            reason: reason.into(),
            started,
            finished: now(),
            message,
        };
        let policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        if !deleting && status::should_restart(&policy, exit_code) {
            let r = &mut self.records[i];
            r.last = Some(term);
            r.state = RunState::Waiting {
                reason: "CrashLoopBackOff".into(),
                message: format!("back-off restarting failed container {}", r.name),
            };
            self.restart_at[i] = Some(Instant::now() + backoff(r.restart_count));
        } else {
            self.records[i].state = term;
        }
        if matches!(status::phase(&self.records), "Succeeded" | "Failed") {
            self.release_gpus(); // a finished pod's GPUs are free, as the device manager's
        }
    }

    /// Patches pod status when it differs from the last patch (no self-triggered churn).
    async fn report(&mut self) {
        if self.records.is_empty() {
            return;
        }
        let body = status::status_patch(
            &self.records,
            self.pod_ip.as_deref(),
            &self.node.ip,
            &self.start_time,
            status::gates_pass(&self.pod),
            &now(),
        );
        let mut comparable = body.clone();
        for c in comparable["status"]["conditions"]
            .as_array_mut()
            .into_iter()
            .flatten()
        {
            c.as_object_mut().map(|o| o.remove("lastTransitionTime"));
        }
        if self.last_patch.as_ref() == Some(&comparable) {
            return;
        }
        let name = self.pod.metadata.name.clone().unwrap_or_default();
        match self
            .api
            .patch_status(&name, &PatchParams::default(), &Patch::Strategic(&body))
            .await
        {
            Ok(p) => {
                self.pod = p;
                self.last_patch = Some(comparable);
            }
            Err(e) => tracing::warn!(pod = %self.key(), error = %e, "status patch failed"),
        }
    }

    async fn event_loop(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<PodEvent>,
        my_exits: &mut Exits,
        verdicts: &mut Verdicts,
    ) {
        // A node may have failed (or the kubelet stopped) while the pod was starting: look once.
        let mut failed = self.node.failed.subscribe();
        failed.mark_changed();
        let mut shutdown = self.sh.shutdown.subscribe();
        shutdown.mark_changed();
        // Periodic sync, as the real kubelet's: a watch event that never arrived (a deletion, a
        // readiness-gate change) is caught by reading the pod again.
        let mut resync = tokio::time::interval(RESYNC);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.pod.metadata.deletion_timestamp.is_some() {
                return self.terminate(my_exits).await;
            }
            let next_restart = self.restart_at.iter().flatten().min().copied();
            tokio::select! {
                _ = resync.tick() => {
                    if std::mem::take(&mut self.retry_start) {
                        self.start().await;
                    }
                    let name = self.pod.metadata.name.clone().unwrap_or_default();
                    match self.api.get_opt(&name).await {
                        Ok(Some(p)) if p.metadata.uid == self.pod.metadata.uid => self.pod = p,
                        Ok(_) => return self.kill_and_reap(my_exits).await,
                        Err(e) => tracing::debug!(pod = %self.key(), error = %e, "resync"),
                    }
                }
                ev = rx.recv() => match ev {
                    Some(PodEvent::Updated(p)) => {
                        self.pod = *p;
                        let ready = status::gates_pass(&self.pod) && status::containers_ready(&self.records);
                        if ready != status::is_ready(&self.pod) && !self.pids().is_empty() {
                            self.last_patch = None;
                            self.report().await;
                        }
                    }
                    Some(PodEvent::Deleted) | None => return self.kill_and_reap(my_exits).await,
                },
                Some((i, st)) = my_exits.recv() => {
                    let message = self.fallback_message(i, st).await;
                    self.exited(i, st, false, message);
                    self.report().await;
                }
                Some(v) = verdicts.recv() => self.verdict(v).await,
                _ = tokio::time::sleep_until(next_restart.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600))), if next_restart.is_some() => {
                    let now = Instant::now();
                    for i in 0..self.restart_at.len() {
                        if self.restart_at[i].is_some_and(|t| t <= now) {
                            self.restart_at[i] = None;
                            self.records[i].restart_count += 1;
                            self.spawn(i).await;
                        }
                    }
                    self.report().await;
                }
                _ = failed.changed() => {
                    let mode = *failed.borrow();
                    if let Some(mode) = mode {
                        (0..self.probes.len()).for_each(|i| self.stop_probes(i));
                        self.signal_all(match mode { FailMode::Kill => libc::SIGKILL, FailMode::Freeze => libc::SIGSTOP });
                        return self.silent(rx, my_exits).await;
                    }
                }
                _ = shutdown.changed() => if *shutdown.borrow() { return self.kill_and_reap(my_exits).await },
            }
        }
    }

    /// A dead node's pod: no more status, no deletion; only leaves (killing its processes) when
    /// the pod is removed from the API or the kubelet shuts down.
    async fn silent(&mut self, rx: &mut mpsc::UnboundedReceiver<PodEvent>, exits: &mut Exits) {
        let mut shutdown = self.sh.shutdown.subscribe();
        loop {
            tokio::select! {
                ev = rx.recv() => if matches!(ev, Some(PodEvent::Deleted) | None) { break },
                _ = shutdown.changed() => break,
            }
        }
        self.kill_and_reap(exits).await;
    }

    /// SIGKILL every process and wait for all of them (no API writes).
    async fn kill_and_reap(&mut self, exits: &mut Exits) {
        self.signal_all(libc::SIGKILL);
        while !self.pids().is_empty() {
            match exits.recv().await {
                Some((i, st)) => self.exited(i, st, true, None),
                None => break,
            }
        }
    }

    /// Graceful deletion: SIGTERM, wait `deletionGracePeriodSeconds`, SIGKILL, final status, then
    /// delete with grace 0 and the pod's UID as precondition.
    async fn terminate(&mut self, exits: &mut Exits) {
        let grace = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64;
        self.restart_at.iter_mut().for_each(|r| *r = None);
        self.signal_all(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(grace);
        while !self.pids().is_empty() {
            match tokio::time::timeout_at(deadline, exits.recv()).await {
                Ok(Some((i, st))) => self.exited(i, st, true, None),
                Ok(None) => break,
                Err(_) => {
                    self.kill_and_reap(exits).await;
                    break;
                }
            }
        }
        for r in &mut self.records {
            if let RunState::Waiting { .. } = r.state {
                let t = now();
                r.state = RunState::Terminated {
                    exit_code: 137,
                    reason: "Error".into(),
                    started: t.clone(),
                    finished: t,
                    message: None,
                };
            }
        }
        self.release_gpus(); // before the pod object goes: the scheduler frees them then
        self.report().await;
        let name = self.pod.metadata.name.clone().unwrap_or_default();
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: self.pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..Default::default()
        };
        if let Err(e) = self.api.delete(&name, &dp).await {
            tracing::debug!(pod = %self.key(), error = %e, "final delete");
        }
    }

    /// Frees the IP and GPUs and removes the pod's directory (logs stay).
    fn cleanup(&mut self) {
        (0..self.probes.len()).for_each(|i| self.stop_probes(i));
        self.release_gpus();
        self.release_ip();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Returns the pod's IP to the node.
    fn release_ip(&mut self) {
        if let Some(ip) = self.pod_ip.take() {
            self.node.ips.lock().unwrap().release(&ip);
        }
    }

    /// Returns the pod's GPUs to the node (once its processes are gone).
    fn release_gpus(&mut self) {
        self.node
            .gpus
            .lock()
            .unwrap()
            .release(&std::mem::take(&mut self.gpus));
    }
}
