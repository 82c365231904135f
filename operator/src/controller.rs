//! The reconciler: observe → plan (pure, [`crate::plan`]) → apply → status. Only this module
//! talks to the API server.
//!
//! API calls per reconcile: reads — the job's pods (one list), the ring and heartbeat ConfigMaps,
//! the Leases and Nodes of the nodes its pods run on; writes — only what the plan changes (status when it
//! differs, pods created or deleted, a ring generation), plus the static children when the spec
//! generation changes. A steady job therefore writes nothing.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diphoma_contract::{
    self as contract, FailureReport, MEMBERSHIP_KEY, Membership, ProgressReport,
};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::{DiphomaJob, FIELD_MANAGER};
use crate::build::{self, ANNOT_DELETED_BY_OPERATOR, ANNOT_FAILURE_COUNTED, MANAGED_BY};
use crate::metrics::Metrics;
use crate::plan::{self, NodeLease, Observed, Plan};

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API request failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The published ring ConfigMap is not valid membership.
    #[error("ring ConfigMap {name}: {source}")]
    Ring {
        /// The ConfigMap.
        name: String,
        /// Why it was refused.
        #[source]
        source: contract::ContractError,
    },
}

impl Error {
    /// Every value of [`Error::metric_label`] (metric label values are initialized from it).
    pub const LABELS: [&'static str; 2] = ["kube", "ring"];

    /// Bounded label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Ring { .. } => "ring",
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Publishes Kubernetes Events for the jobs.
    pub recorder: Recorder,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Whether each job gets a NetworkPolicy ([`Options::network_policy`]).
    pub network_policy: bool,
}

impl Context {
    /// A context whose events are reported by `diphoma-operator` (instance: `$POD_NAME`).
    pub fn new(client: Client, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: MANAGED_BY.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            network_policy: false,
        }
    }
}

/// Leader election on a `coordination.k8s.io` Lease, so that several replicas are safe.
#[derive(Debug, Clone)]
pub struct LeaderElection {
    /// Namespace of the Lease (the operator's own).
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
}

/// How [`run`] serves and coordinates.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Where to serve `/metrics`, `/healthz` and `/readyz` (none: not served).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Reconcile only while holding this Lease (none: always).
    pub leader_election: Option<LeaderElection>,
    /// Give each job a NetworkPolicy that opens its ring port only to its own workers.
    pub network_policy: bool,
}

/// Why [`run`] stopped before its shutdown signal.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The metrics address could not be bound.
    #[error("metrics address {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The leader Lease could not be set up.
    #[error("leader election on lease {lease}: {source}")]
    Lease {
        /// `namespace/name` of the Lease.
        lease: String,
        /// The error.
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
    /// Leadership was lost; the process should exit and campaign again.
    #[error("lost the leader lease")]
    LostLeadership,
}

/// How long [`run`] waits for reconciles in flight after its shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Runs the controller until `shutdown` resolves: serves metrics and health, waits for the
/// leader Lease when asked to, then reconciles every `DiphomaJob`.
///
/// Errors: [`RunError`] when the metrics address cannot be bound, the Lease cannot be managed, or
/// leadership is lost.
pub async fn run(
    client: Client,
    opts: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let jobs: Api<DiphomaJob> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let managed = format!("app.kubernetes.io/managed-by={MANAGED_BY}");
    let metrics = Metrics::default();
    let ready = Arc::new(AtomicBool::new(false));
    let controller = Controller::new(jobs, watcher::Config::default().any_semantic())
        .owns(pods, watcher::Config::default().labels(&managed));
    if let Some(addr) = opts.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Bind { addr, source })?;
        tokio::spawn(crate::metrics::serve(
            listener,
            metrics.clone(),
            controller.store(),
            ready.clone(),
        ));
    }
    let mut shutdown = Box::pin(shutdown);
    // Ready once serving, leader or standby: a standby must count as available, or a Deployment
    // of two replicas never finishes rolling out (controller-runtime does the same).
    ready.store(true, Ordering::Relaxed);
    let mut leadership = None;
    if let Some(le) = &opts.leader_election {
        let lease = format!("{}/{}", le.namespace, le.lease_name);
        let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &le.lease_name)
            .with_namespace(&le.namespace)
            .with_identity(&le.identity)
            // Per identity: the Lease's server-side-apply conflicts are what keep two replicas
            // from both holding it.
            .with_field_manager(format!("{FIELD_MANAGER}-{}", le.identity))
            .build()
            .await
            .map_err(|source| RunError::Lease { lease, source })?;
        let (mut rx, _task) = manager.watch().await;
        tracing::info!(identity = %le.identity, "waiting for the leader lease");
        while !*rx.borrow_and_update() {
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return Err(RunError::LostLeadership) },
                _ = &mut shutdown => return Ok(()),
            }
        }
        leadership = Some(rx);
    }
    metrics.leader.set(1);
    let lost = Arc::new(AtomicBool::new(false));
    let lost_flag = lost.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        match leadership {
            Some(mut rx) => tokio::select! {
                _ = shutdown => {}
                _ = async { while rx.changed().await.is_ok() && *rx.borrow() {} } => lost_flag.store(true, Ordering::Relaxed),
            },
            None => shutdown.await,
        }
        let _ = stop_tx.send(());
        let _ = stopping_tx.send(true);
    });
    let stop = async move {
        let _ = stop_rx.await;
    };
    let ctx = Arc::new(Context {
        network_policy: opts.network_policy,
        ..Context::new(client, metrics.clone())
    });
    let drive = controller
        .graceful_shutdown_on(stop)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "reconcile");
            }
        });
    // A graceful shutdown waits for reconciles in flight; bound it, as the kubelet bounds ours.
    tokio::select! {
        _ = drive => {}
        _ = async {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!("the controller did not stop within {SHUTDOWN_GRACE:?} of the signal; dropping it"),
    }
    metrics.leader.set(0);
    if lost.load(Ordering::Relaxed) {
        Err(RunError::LostLeadership)
    } else {
        Ok(())
    }
}

fn error_policy(job: Arc<DiphomaJob>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .errors
        .with_label_values(&[err.metric_label()])
        .inc();
    tracing::warn!(job = %job.name_any(), error = %err, kind = err.metric_label(), "reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

/// One reconcile of one job.
pub async fn reconcile(job: Arc<DiphomaJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    if job.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // owner references clean up the children
    }
    ctx.metrics.reconciles.inc();
    let _timer = ctx.metrics.duration.start_timer();
    let obs = observe(&ctx.client, &job).await?; // reads
    let plan = plan::plan(&job, &obs); // pure
    apply(&ctx, &job, &plan).await?; // writes
    ctx.metrics.observe_plan(&plan);
    let running = plan.status.phase.is_some_and(|p| !p.is_terminal());
    let node_check =
        Duration::from_secs_f64(f64::from(job.spec.fault_tolerance.detection_seconds) / 3.0);
    let next = match plan.requeue_after {
        Some(d) if running => d.min(node_check),
        Some(d) => d,
        None if running => node_check,
        None => return Ok(Action::await_change()),
    };
    Ok(Action::requeue(next))
}

/// Reads the job's pods, its published ring and the health of the nodes its pods run on.
async fn observe(client: &Client, job: &DiphomaJob) -> Result<Observed, Error> {
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&build::selector(&name)))
        .await?
        .items;
    let ring_name = contract::membership_configmap_name(&name);
    let ring = match Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .get_opt(&ring_name)
        .await?
    {
        Some(cm) => match cm.data.as_ref().and_then(|d| d.get(MEMBERSHIP_KEY)) {
            Some(json) => Some(Membership::parse(json).map_err(|source| Error::Ring {
                name: ring_name.clone(),
                source,
            })?),
            None => None,
        },
        None => None,
    };
    let heartbeat = Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .get_opt(&contract::heartbeat_configmap_name(&name))
        .await?;
    let (progress, reports) = read_heartbeat(heartbeat.and_then(|cm| cm.data).unwrap_or_default());
    let now = jiff::Timestamp::now();
    let nodes: BTreeSet<String> = pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    let (mut lost_nodes, mut late_nodes) = (BTreeSet::new(), BTreeSet::new());
    for n in nodes {
        let spec = Api::<Lease>::namespaced(client.clone(), "kube-node-lease")
            .get_opt(&n)
            .await?
            .and_then(|l| l.spec);
        let lease = plan::node_lease(
            spec.as_ref()
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0),
            spec.as_ref().and_then(|s| s.lease_duration_seconds),
            now,
            job.spec.fault_tolerance.detection_seconds,
        );
        let ready = Api::<Node>::all(client.clone())
            .get_opt(&n)
            .await?
            .is_some_and(|node| {
                node.status
                    .and_then(|s| s.conditions)
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
        if lease != NodeLease::Fresh || !ready {
            late_nodes.insert(n.clone());
        }
        if lease == NodeLease::Lost || !ready {
            lost_nodes.insert(n);
        }
    }
    Ok(Observed {
        pods,
        ring,
        lost_nodes,
        late_nodes,
        progress,
        reports,
        now,
    })
}

/// Progress and failure reports from the heartbeat ConfigMap's data; entries that do not parse
/// are skipped with a warning (a worker's bad write must not stop the reconciler).
fn read_heartbeat(
    data: std::collections::BTreeMap<String, String>,
) -> (Option<ProgressReport>, Vec<FailureReport>) {
    let mut progress = None;
    let mut reports = vec![];
    for (k, v) in data {
        if k == contract::PROGRESS_KEY {
            match serde_json::from_str(&v) {
                Ok(p) => progress = Some(p),
                Err(e) => tracing::warn!(key = %k, error = %e, "unreadable progress record"),
            }
        } else if k.starts_with(contract::REPORT_KEY_PREFIX) {
            match serde_json::from_str(&v) {
                Ok(r) => reports.push(r),
                Err(e) => tracing::warn!(key = %k, error = %e, "unreadable failure report"),
            }
        }
    }
    (progress, reports)
}

async fn apply_one<K>(api: &Api<K>, obj: &K) -> Result<(), Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await?;
    Ok(())
}

/// Carries out the plan: static children (when the spec generation moved), status, failure
/// annotations and deletions, new pods, the ring generation, events, the TTL deletion.
async fn apply(ctx: &Context, job: &DiphomaJob, plan: &Plan) -> Result<(), Error> {
    let client = &ctx.client;
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let jobs: Api<DiphomaJob> = Api::namespaced(client.clone(), &ns);
    if plan.delete_job {
        jobs.delete(&name, &DeleteParams::background()).await?;
        return Ok(());
    }
    let prev = job.status.clone().unwrap_or_default();
    let finished = prev.phase.is_some_and(|p| p.is_terminal());
    if !finished && prev.observed_generation != job.metadata.generation {
        apply_one(
            &Api::<ServiceAccount>::namespaced(client.clone(), &ns),
            &build::service_account(job),
        )
        .await?;
        apply_one(
            &Api::<Role>::namespaced(client.clone(), &ns),
            &build::role(job),
        )
        .await?;
        apply_one(
            &Api::<RoleBinding>::namespaced(client.clone(), &ns),
            &build::role_binding(job),
        )
        .await?;
        apply_one(
            &Api::<Service>::namespaced(client.clone(), &ns),
            &build::service(job),
        )
        .await?;
        if ctx.network_policy {
            apply_one(
                &Api::<NetworkPolicy>::namespaced(client.clone(), &ns),
                &build::network_policy(job),
            )
            .await?;
        }
        let key: Vec<u8> = (0..contract::MIN_KEY_LEN)
            .map(|_| rand::random::<u8>())
            .collect();
        create_once(
            &Api::<Secret>::namespaced(client.clone(), &ns),
            &build::key_secret(job, key),
        )
        .await?;
        // The workers may patch the heartbeat object but not create it (create cannot be
        // limited by resourceNames), so the operator creates it, empty, once.
        create_once(
            &Api::<ConfigMap>::namespaced(client.clone(), &ns),
            &build::heartbeat_configmap(job),
        )
        .await?;
    }
    // Status first: a counted failure is never lost, even if what follows fails.
    if job.status.as_ref() != Some(&plan.status) {
        let body = serde_json::json!({"apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "status": plan.status});
        jobs.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for f in plan.failures.iter().filter(|f| f.exists) {
        let mark = serde_json::json!({"metadata": {"annotations": {ANNOT_FAILURE_COUNTED: f.cause.as_str()}}});
        ignore_missing(
            pods.patch(&f.pod, &PatchParams::default(), &Patch::Merge(&mark))
                .await,
        )?;
    }
    for d in &plan.delete {
        let mark =
            serde_json::json!({"metadata": {"annotations": {ANNOT_DELETED_BY_OPERATOR: d.reason}}});
        ignore_missing(
            pods.patch(&d.pod, &PatchParams::default(), &Patch::Merge(&mark))
                .await,
        )?;
        let dp = if d.force {
            DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            }
        } else {
            DeleteParams::default()
        };
        ignore_missing(pods.delete(&d.pod, &dp).await.map(|_| ()))?;
    }
    for p in &plan.create {
        apply_one(&pods, p).await?;
    }
    if let Some(m) = &plan.publish {
        apply_one(
            &Api::<ConfigMap>::namespaced(client.clone(), &ns),
            &build::ring_configmap(job, m),
        )
        .await?;
    }
    let reference = job.object_ref(&());
    for (warning, reason, note) in &plan.events {
        let ev = Event {
            type_: if *warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: (*reason).into(),
            note: Some(note.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&ev, &reference).await {
            tracing::debug!(error = %e, "event");
        }
    }
    Ok(())
}

/// Creates `obj` unless it exists (never overwritten: the key must not change under running
/// workers, and the heartbeat's data belongs to them).
async fn create_once<K>(api: &Api<K>, obj: &K) -> Result<(), Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(()),
        other => other.map(|_| ()).map_err(Error::from),
    }
}

fn ignore_missing<T: Default>(r: Result<T, kube::Error>) -> Result<T, Error> {
    match r {
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(T::default()),
        other => Ok(other?),
    }
}

#[cfg(test)]
mod tests;
