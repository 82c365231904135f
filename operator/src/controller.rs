//! The reconciler: observe → plan (pure, [`crate::plan`]) → apply. Only this module talks to
//! the API server, and it decides nothing: which nodes are lost, which pods go, when the static
//! children are re-applied and when to look again are the plan's.
//!
//! The children are the job's by owner UID, not by name: a pod, ConfigMap or RBAC object left
//! by a deleted job of the same name (still terminating) is never taken for its own.
//!
//! Reads come from caches, reactions from watches ([`caches`]): the controller watches its jobs,
//! their pods and ConfigMaps (whole), their ServiceAccounts, Roles, RoleBindings, Services, key
//! Secrets and NetworkPolicies (metadata), all by the label `app.kubernetes.io/managed-by`, and
//! the node Leases and Nodes; each event reconciles the jobs it concerns (a child's owner; for a
//! node, the jobs with a pod on it). A job where nothing happens costs no API request: it is
//! looked at again only when a timer of its plan falls due ([`Plan::look_again`]: deadline, TTL,
//! when a node would be lost without a renewal, young failure reports, reports falling silent),
//! or after [`Options::resync`], a long safety net.
//!
//! API calls per reconcile:
//! - reads: none (`observe` reads the caches, and Kueue's Workloads, WorkloadPriorityClasses
//!   and ResourceFlavors from the stores of their watches: [`crate::queue::Stores`]), but for a
//!   queued job while those watches have not listed yet, or when Kueue was not served at the
//!   operator's start ([`crate::queue::observe`]);
//! - writes, only what the plan asks for, in this order: for a gang-scheduled job, its gang
//!   Workload created, or deleted when its `minCount` is no longer the ring's minimum
//!   ([`crate::gang`], read from the store of their watch); then (`apply`) the static children
//!   ([`build::children`]: ServiceAccount, Role, RoleBinding, Service, NetworkPolicy by
//!   server-side apply; key Secret and heartbeat ConfigMap created once) when
//!   [`Plan::apply_children`], and the deletion of the children the job owns that the table no
//!   longer builds ([`Plan::prune`]: a NetworkPolicy after the option was turned off); the
//!   status when it differs; a failure annotation on each newly failed pod; an annotation, then
//!   a deletion, for each pod to delete; each new pod (server-side apply: a pod the API server
//!   refuses is remembered for the next plan, the others are still created, and the reconcile
//!   then fails so that it is retried with exponential back-off); the ring ConfigMap of a new
//!   generation; the events; then, for a queued job, its Kueue Workload (created, deleted,
//!   activated, its status: `PodsReady`, an eviction's requeue, `Finished`). The static children
//!   are applied again whenever one is missing. Once the TTL passed ([`Plan::delete_job`]), only
//!   the job's deletion. After its writes, a reconcile waits until the watches have delivered
//!   them ([`Caches::caught_up`]), so that the next one plans from what it wrote;
//! - a job that does not decode gets one list of the job as stored, then its status and event
//!   ([`plan::invalid`]).
//!
//! A steady job therefore reads and writes nothing.

pub mod applier;
pub mod caches;
pub mod memories;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diphoma_contract::{
    self as contract, FailureReport, MEMBERSHIP_KEY, Membership, ProgressReport, RestartReport,
};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::api::{DiphomaJob, DiphomaJobStatus, FIELD_MANAGER};
use crate::build::{self, ANNOT_DELETED_BY_OPERATOR, ANNOT_FAILURE_COUNTED, MANAGED_BY};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::plan::{self, Observed, Plan};
use caches::{Caches, Kind, Written, owned_by};
use memories::Memories;
use plan::memory::{Answered, Memory};

/// What every reconcile shares.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Who reports the jobs' Kubernetes Events.
    pub reporter: Reporter,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Whether each job gets a NetworkPolicy ([`Options::network_policy`]).
    pub network_policy: bool,
    /// What the reconciler remembers of each job between its reconciles (the plan's
    /// [`plan::memory::Memory`]), by job UID.
    pub memories: Arc<Memories>,
    /// The jobs as their watch keeps them (none: not watched): a job's memory is forgotten once
    /// the job is no longer there ([`Memories::repairing_other`]).
    pub jobs: Option<reflector::Store<DeserializeGuard<DiphomaJob>>>,
    /// What the watches keep: the children, node health, what they delivered.
    pub caches: Arc<Caches>,
    /// The safety net: the longest a job goes without a reconcile ([`Options::resync`]).
    pub resync: Duration,
    /// The gang objects this operator created, as their watches keep them: the
    /// `scheduling.k8s.io/v1alpha2` Workloads and PodGroups, the `scheduling.x-k8s.io/v1alpha1`
    /// PodGroups, each none when the API server does not serve them ([`crate::gang`]).
    pub gangs: crate::gang::Stores,
    /// The `schedulerName` of coscheduled workers ([`Options::coscheduling_scheduler_name`]).
    pub coscheduling_scheduler_name: String,
    /// Held while a gang-scheduled job's workers are created, so that the workers of two gangs
    /// are never created interleaved: the scheduler's queue takes pods of equal priority in the
    /// order they arrived, and two gangs placed turn about would each hold part of the room
    /// while waiting for the rest (until the gang plugin's timeout releases them both).
    pub gang_creation: tokio::sync::Mutex<()>,
}

/// How long a reconcile waits for the watches to deliver its own writes
/// ([`Caches::caught_up`]) before it gives up waiting (the next reconcile may then plan from an
/// older view; it is logged).
const CATCH_UP: Duration = Duration::from_secs(10);

pub use plan::memory::retry_delay;

impl Context {
    /// A context whose events are reported by `diphoma-operator` (instance: `$POD_NAME`), with
    /// caches fed by no watch ([`Caches::unwatched`]) and the default [`Options::resync`].
    pub fn new(client: Client, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: MANAGED_BY.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            reporter,
            client,
            metrics,
            network_policy: false,
            memories: Arc::default(),
            jobs: None,
            caches: Arc::new(Caches::unwatched()),
            resync: DEFAULT_RESYNC,
            gangs: Default::default(),
            coscheduling_scheduler_name: DEFAULT_COSCHEDULING_SCHEDULER_NAME.into(),
            gang_creation: tokio::sync::Mutex::new(()),
        }
    }
}

/// The default [`Options::resync`]: 5 minutes (as controller-rs).
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(300);

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

/// How [`run`] coordinates.
#[derive(Debug, Clone)]
pub struct Options {
    /// Reconcile only while holding this Lease (none: always).
    pub leader_election: Option<LeaderElection>,
    /// Give each job a NetworkPolicy that opens its ring port only to its own workers.
    pub network_policy: bool,
    /// The safety net: a job is reconciled at least this often, even when no watch event and no
    /// timer of its plan asks for it ([`DEFAULT_RESYNC`]).
    pub resync: Duration,
    /// The `schedulerName` of the workers of a job with `spec.gang.scheduler: Coscheduling`:
    /// the scheduler that runs the scheduler-plugins coscheduling plugin
    /// ([`DEFAULT_COSCHEDULING_SCHEDULER_NAME`]).
    pub coscheduling_scheduler_name: String,
}

/// The default [`Options::coscheduling_scheduler_name`]: the name the scheduler-plugins Helm
/// chart gives its second scheduler.
pub const DEFAULT_COSCHEDULING_SCHEDULER_NAME: &str = "scheduler-plugins-scheduler";

impl Default for Options {
    fn default() -> Self {
        Options {
            leader_election: None,
            network_policy: false,
            resync: DEFAULT_RESYNC,
            coscheduling_scheduler_name: DEFAULT_COSCHEDULING_SCHEDULER_NAME.into(),
        }
    }
}

/// Why [`run`] stopped before its shutdown signal.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
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

/// How long [`run`] waits, before it returns, for the release of the leader Lease.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a standby looks whether the leader released the Lease ([`released`]): one GET each
/// time, 0.5 requests/s per standby whatever the number of jobs, as client-go's leader election,
/// whose standby tries to acquire the Lease (a GET) every `RetryPeriod`, 2 s by default.
const STANDBY_POLL: Duration = Duration::from_secs(2);

/// The leader Lease's duration (s): a leader killed without releasing it is replaced by a standby
/// within this plus [`STANDBY_POLL`]. client-go's `LeaseDuration` default, as kube-controller-manager's
/// (kube-lease-manager's own default is 30 s); the holder renews it [`LEASE_GRACE_SECONDS`] before it
/// ends, every 10 s.
const LEASE_DURATION_SECONDS: u64 = 15;

/// How long before the Lease ends its holder renews it (s): kube-lease-manager's default, as
/// client-go's `LeaseDuration` − `RenewDeadline`.
const LEASE_GRACE_SECONDS: u64 = 5;

/// The task of a Lease manager: it keeps the Lease while the leadership watch is held, and
/// releases it when the watch is dropped.
type LeaseTask = tokio::task::JoinHandle<
    Result<kube_lease_manager::LeaseManager, kube_lease_manager::LeaseManagerError>,
>;

/// Campaigns for the leader Lease `le` until this replica holds it: returns its leadership watch
/// (true while leader) and the manager's task, or none when `shutdown` resolved first.
///
/// A standby's manager sleeps until the holder's Lease would expire; a leader that shuts down
/// releases it long before that. So the standby also looks at the Lease every
/// [`STANDBY_POLL`], and when it sees it released, starts a new manager, which takes it at once.
///
/// Errors: [`RunError::Lease`] when the manager cannot be set up, [`RunError::LostLeadership`]
/// when its task ends.
async fn campaign(
    client: &Client,
    le: &LeaderElection,
    shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<Option<(tokio::sync::watch::Receiver<bool>, LeaseTask)>, RunError> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), &le.namespace);
    loop {
        let lease = format!("{}/{}", le.namespace, le.lease_name);
        let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &le.lease_name)
            .with_namespace(&le.namespace)
            .with_identity(&le.identity)
            // Per identity: the Lease's server-side-apply conflicts are what keep two replicas
            // from both holding it.
            .with_field_manager(format!("{FIELD_MANAGER}-{}", le.identity))
            .with_duration(LEASE_DURATION_SECONDS)
            .with_grace(LEASE_GRACE_SECONDS)
            .build()
            .await
            .map_err(|source| RunError::Lease { lease, source })?;
        let (mut rx, task) = manager.watch().await;
        enum Next {
            Leader(bool),
            Released,
            Shutdown,
        }
        let next = tokio::select! {
            held = rx.wait_for(|leader| *leader) => Next::Leader(held.is_ok()),
            _ = released(&leases, &le.lease_name) => Next::Released,
            _ = &mut *shutdown => Next::Shutdown,
        };
        match next {
            Next::Leader(true) => return Ok(Some((rx, task))),
            Next::Leader(false) => return Err(RunError::LostLeadership),
            // Not the holder: dropping the watch releases nothing.
            Next::Shutdown => return Ok(None),
            Next::Released => task.abort(), // a standby, asleep: a new manager takes over
        }
    }
}

/// Resolves once the Lease `name` exists without a holder (released), looking every
/// [`STANDBY_POLL`]; a Lease that cannot be read, or does not exist yet (the managers create it),
/// counts as held. Not only a change from held to released: a leader that releases before this
/// standby's first look must not leave it asleep until the Lease would have expired.
async fn released(leases: &Api<Lease>, name: &str) {
    loop {
        tokio::time::sleep(STANDBY_POLL).await;
        if let Ok(Some(lease)) = leases.get_opt(name).await {
            let holder = lease.spec.and_then(|s| s.holder_identity);
            if holder.is_none_or(|h| h.is_empty()) {
                return;
            }
        }
    }
}

/// Runs the controller until `shutdown` resolves: serves `/metrics`, `/healthz` and `/readyz` on
/// `metrics` (a bound listener, none: not served), waits for the leader Lease when asked to,
/// then reconciles every `DiphomaJob`.
///
/// Errors: [`RunError`] when the Lease cannot be managed, or leadership is lost.
pub async fn run(
    client: Client,
    opts: Options,
    metrics_listener: Option<tokio::net::TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    // Guarded: a job that does not decode is reported on itself, and never stops the others.
    let jobs: Api<DeserializeGuard<DiphomaJob>> = Api::all(client.clone());
    let metrics = Metrics::default();
    let ready = Arc::new(AtomicBool::new(false));
    let (mut caches, writers) = Caches::new();
    // Kueue's Workloads, WorkloadPriorityClasses and ResourceFlavors, when the API server serves
    // them (a job labelled with a queue is held without them): kept in stores, so that a
    // reconcile reads its job's place in Kueue without a request.
    let kueue = caches::serves(&client, "kueue.x-k8s.io/v1beta2", "workloads")
        .await
        .then(|| caches.keep_kueue());
    let caches = Arc::new(caches);
    let streams = caches.watches(&client, writers);
    let (job_store, job_writer) = reflector::store();
    let memories = Arc::new(Memories::default());
    let forget = memories.clone();
    let job_events = caches::observed(
        watcher(jobs, watcher::Config::default().any_semantic()),
        job_writer,
        caches.seen.clone(),
        Kind::Job,
        |_| {},
    )
    .inspect(move |ev| {
        if let Ok(watcher::Event::Delete(job)) = ev {
            forget.clear(job); // a deleted job's memory goes with it
        }
    })
    .applied_objects();
    let mut controller = Controller::for_stream(job_events, job_store.clone())
        .owns_stream(streams.pods)
        .owns_stream(streams.configmaps)
        .reconcile_on(streams.nodes);
    for (resource, events) in streams.metas {
        controller = controller.owns_stream_with(events, resource);
    }
    if let Some(writers) = kueue {
        let events = caches.watch_kueue(&client, writers);
        controller = controller.owns_stream_with(events, crate::queue::workloads());
    }
    // Gang Workloads and PodGroups (`scheduling.k8s.io/v1alpha2`), when the API server serves
    // them (Kubernetes 1.36 with the feature gate `GenericWorkload` and the API enabled; a job
    // asking for a gang is held without them): kept in stores, so that a reconcile reads its
    // job's without a request.
    let gang_group = "scheduling.k8s.io/v1alpha2";
    let mut gangs = crate::gang::Stores::default();
    if caches::serves(&client, gang_group, "workloads").await
        && caches::serves(&client, gang_group, "podgroups").await
    {
        let (workloads, events) = caches::watch_owned(&client, &caches.seen, Kind::GangWorkload);
        controller = controller.owns_stream(events);
        let (pod_groups, events) = caches::watch_owned(&client, &caches.seen, Kind::GangPodGroup);
        controller = controller.owns_stream(events);
        gangs.native = Some(crate::gang::Native {
            workloads,
            pod_groups,
        });
    }
    // The scheduler-plugins coscheduling PodGroups (`scheduling.x-k8s.io/v1alpha1`), when their
    // CRD is installed (a job asking for Coscheduling is held without it).
    if caches::serves(&client, "scheduling.x-k8s.io/v1alpha1", "podgroups").await {
        let (groups, events) =
            caches::watch_owned(&client, &caches.seen, Kind::CoschedulingPodGroup);
        controller = controller.owns_stream(events);
        gangs.coscheduling = Some(groups);
    }
    if let Some(listener) = metrics_listener {
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
    let mut lease_task = None;
    if let Some(le) = &opts.leader_election {
        tracing::info!(identity = %le.identity, "waiting for the leader lease");
        match campaign(&client, le, &mut shutdown).await? {
            Some((rx, task)) => {
                leadership = Some(rx);
                lease_task = Some(task);
            }
            None => return Ok(()),
        }
    }
    metrics.leader.set(1);
    let lost = Arc::new(AtomicBool::new(false));
    let lost_flag = lost.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    let closing = caches.clone();
    tokio::spawn(async move {
        match leadership {
            Some(mut rx) => tokio::select! {
                _ = shutdown => {}
                _ = async { while rx.changed().await.is_ok() && *rx.borrow() {} } => lost_flag.store(true, Ordering::Relaxed),
            },
            None => shutdown.await,
        }
        // Here `rx` is dropped: the Lease manager releases the Lease at once (the first step of
        // the shutdown, as client-go's ReleaseOnCancel), while the controller drains.
        let _ = stop_tx.send(());
        let _ = stopping_tx.send(true);
        closing.close(); // the reconciles in flight no longer wait for the watches
    });
    let stop = async move {
        let _ = stop_rx.await;
    };
    let ctx = Arc::new(Context {
        network_policy: opts.network_policy,
        memories,
        jobs: Some(job_store),
        caches,
        resync: opts.resync,
        gangs,
        coscheduling_scheduler_name: opts.coscheduling_scheduler_name,
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
    if let Some(task) = lease_task {
        // The release was sent at the signal; the process must not exit before it is written.
        if tokio::time::timeout(RELEASE_TIMEOUT, task).await.is_err() {
            tracing::warn!("the leader lease was not released within {RELEASE_TIMEOUT:?}");
        }
    }
    if lost.load(Ordering::Relaxed) {
        Err(RunError::LostLeadership)
    } else {
        Ok(())
    }
}

fn error_policy(job: Arc<DeserializeGuard<DiphomaJob>>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .errors
        .with_label_values(&[err.metric_label()])
        .inc();
    let delay = retry_delay(ctx.memories.failed(job.as_ref()));
    tracing::warn!(job = %job.name_any(), error = %err, kind = err.metric_label(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// One reconcile of one job; a job that does not decode is reported on itself
/// ([`plan::invalid`]).
pub async fn reconcile(
    job: Arc<DeserializeGuard<DiphomaJob>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let done = match &job.0 {
        Ok(decoded) => reconcile_job(decoded, &ctx).await,
        Err(_) => report_invalid(&job, &ctx).await,
    };
    if done.is_ok() {
        ctx.memories.succeeded(job.as_ref());
    }
    done
}

/// Reads the job as stored (one list by name: the operator's role has no `get` on jobs), and
/// writes the status and event [`plan::invalid`] plans.
async fn report_invalid(
    job: &DeserializeGuard<DiphomaJob>,
    ctx: &Context,
) -> Result<Action, Error> {
    let (ns, name) = (job.namespace().unwrap_or_default(), job.name_any());
    let raw = Api::<DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &ns,
        &ApiResource::erase::<DiphomaJob>(&()),
    )
    .list(&ListParams::default().fields(&format!("metadata.name={name}")))
    .await
    .map_err(|source| Error::Observe {
        what: "invalid job",
        source,
    })?
    .items
    .into_iter()
    .next();
    let Some(raw) = raw else {
        return Ok(Action::await_change()); // deleted meanwhile
    };
    let object = serde_json::to_value(&raw).unwrap_or_default();
    let Some(plan) = plan::invalid(&object, jiff::Timestamp::now()) else {
        return Ok(Action::requeue(Duration::from_secs(1))); // it decodes now: look again
    };
    let prev: Option<DiphomaJobStatus> = object
        .get("status")
        .and_then(|s| serde_json::from_value(s.clone()).ok());
    // Guarded: the API server answers with the job, which does not decode.
    let jobs: Api<DeserializeGuard<DiphomaJob>> = Api::namespaced(ctx.client.clone(), &ns);
    write_status(&jobs, &name, None, prev.as_ref(), &plan.status).await?;
    publish(ctx, &job.object_ref(&()), &plan.events).await;
    Ok(Action::await_change())
}

/// One reconcile of a job that decodes: observe → plan → apply → remember → requeue.
async fn reconcile_job(job: &DiphomaJob, ctx: &Context) -> Result<Action, Error> {
    if job.metadata.deletion_timestamp.is_some() {
        ctx.memories.clear(job);
        return Ok(Action::await_change()); // owner references clean up the children
    }
    // A job managed by another controller (spec.managedBy) is left alone: nothing created, no
    // status written.
    if !job.spec.managed_here() {
        return Ok(Action::await_change());
    }
    tracing::debug!(job = %job.name_any(), "reconcile");
    // The first lists: before them, a missing object may only be unlisted yet.
    if !ctx.caches.ready().await {
        return Ok(Action::await_change()); // stopping
    }
    ctx.metrics.reconciles.inc();
    let _timer = ctx.metrics.duration.start_timer();
    let memory = ctx.memories.get(job);
    // The static children, built once: compared with the caches, applied when the plan says.
    let key = (0..contract::MIN_KEY_LEN)
        .map(|_| rand::random::<u8>())
        .collect();
    let children = build::children(job, ctx.network_policy, key);
    let obs = observe_job(ctx, job, &children, &memory).await?;
    let (plan, next) = plan::plan(job, &obs, &memory); // pure
    let mut answered = Answered::default();
    let applied = apply(ctx, job, &plan, &children, &mut answered).await; // writes
    let next = plan::memory::remember(&memory, next, &answered, obs.now);
    let held = next.held_for(jiff::Timestamp::now());
    ctx.memories.put(job, next);
    match applied {
        // The job changed since it was observed (its watch was behind): plan again from the
        // job as it is, at once; nothing failed.
        Err(Error::PatchStatus {
            source: kube::Error::Api(s),
        }) if s.code == 409 => {
            tracing::debug!(job = %job.name_any(), "stale job: planning again");
            Ok(Action::requeue(Duration::from_millis(100)))
        }
        other => other.map(|()| Action::requeue(requeue(&plan, held, ctx.resync))),
    }
}

/// When to reconcile again: the plan's timer ([`Plan::look_again`]), the end of the refused
/// creations' back-off (`held`), or the safety net `resync`, whichever comes first.
fn requeue(plan: &Plan, held: Option<Duration>, resync: Duration) -> Duration {
    [plan.look_again, held, Some(resync)]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(resync)
}

/// Everything the plan reads of `job`: the caches ([`observe`]), the answers of members it
/// would count as hung to a liveness probe, its place in Kueue and its gang Workload (from the
/// stores of their watches), another gang being repaired, and what its `memory` recalls
/// ([`plan::memory::recall`]).
async fn observe_job(
    ctx: &Context,
    job: &DiphomaJob,
    children: &[build::Child],
    memory: &Memory,
) -> Result<Observed, Error> {
    let mut obs = observe(&ctx.caches, job, children)?;
    // Members the plan would count as hung are asked first whether their process runs; the
    // plan then reads the caches as they are after the asking.
    let suspects = plan::failures::suspects(job, &obs);
    if !suspects.is_empty() {
        let probed = probe_suspects(job, &suspects).await;
        obs = observe(&ctx.caches, job, children)?;
        (obs.answering, obs.exited) = probed;
    }
    obs.queue = crate::queue::observe(&ctx.client, ctx.caches.kueue_listed(), job).await?;
    obs.gang = crate::gang::observe(&ctx.gangs, job);
    obs.scheduler_name = (job.spec.gang_scheduler() == crate::api::GangScheduler::Coscheduling)
        .then(|| ctx.coscheduling_scheduler_name.clone());
    obs.gang_repairing = ctx.memories.repairing_other(job, |ns, name, uid| {
        ctx.jobs.as_ref().is_none_or(|jobs| {
            jobs.get(&ObjectRef::new(name).within(ns))
                .is_some_and(|j| j.uid().as_deref() == Some(uid))
        })
    });
    plan::memory::recall(memory, &mut obs);
    Ok(obs)
}

/// The job's pods, its published ring, the workers' reports, the health of the nodes its pods
/// run on, which of its `children` are missing and the heartbeat ConfigMap's `resourceVersion`,
/// from the caches (no API request). Only what the job owns (owner UID) is its own: pods, ring
/// and heartbeat left by a deleted job of the same name are not; such pods' names are
/// [`Observed::foreign`], and a missing or foreign heartbeat ConfigMap is in
/// [`Observed::missing`].
///
/// Errors: [`Error::Ring`] when the ring ConfigMap holds no readable membership.
fn observe(
    caches: &Caches,
    job: &DiphomaJob,
    children: &[build::Child],
) -> Result<Observed, Error> {
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let uid = job.uid().unwrap_or_default();
    let labelled = caches.pods.state_filter(|p| {
        p.metadata.namespace.as_deref() == Some(ns.as_str())
            && p.labels().get(contract::LABEL_JOB_NAME) == Some(&name)
    });
    let (pods, foreign): (Vec<Pod>, Vec<Pod>) = labelled
        .iter()
        .map(|p| Pod::clone(p))
        .partition(|p| owned_by(&p.metadata, &uid));
    let configmap = |cm: &str| {
        caches
            .configmaps
            .get(&ObjectRef::new(cm).within(&ns))
            .filter(|cm| owned_by(&cm.metadata, &uid))
    };
    let ring_name = contract::membership_configmap_name(&name);
    let ring =
        match configmap(&ring_name).and_then(|cm| cm.data.as_ref()?.get(MEMBERSHIP_KEY).cloned()) {
            Some(json) => Some(Membership::parse(&json).map_err(|source| Error::Ring {
                name: ring_name.clone(),
                source,
            })?),
            None => None,
        };
    let heartbeat = configmap(&contract::heartbeat_configmap_name(&name));
    let version = heartbeat
        .as_ref()
        .and_then(|cm| cm.metadata.resource_version.clone());
    let (progress, reports, restarts) = read_heartbeat(
        heartbeat.and_then(|cm| cm.data.clone()).unwrap_or_default(),
        &uid,
    );
    let at = std::time::Instant::now();
    let nodes = pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect::<BTreeSet<String>>()
        .into_iter()
        .map(|n| {
            let health = caches.node_health(&n, at);
            (n, health)
        })
        .collect();
    let observed = Observed {
        pods,
        foreign: foreign.iter().map(|p| p.name_any()).collect(),
        missing: caches.missing(job, children),
        orphans: caches.orphans(job, children),
        heartbeat_version: version,
        heartbeat_changed: None,
        ring,
        nodes,
        progress,
        reports,
        restarts,
        now: jiff::Timestamp::now(),
        refused: BTreeMap::new(),
        queue: Default::default(),
        gang: Default::default(),
        scheduler_name: None,
        workload_refused: None,
        gang_repairing: None,
        answering: Default::default(),
        exited: Default::default(),
    };
    Ok(observed)
}

/// Progress, failure and in-place restart reports of job `uid` from the heartbeat ConfigMap's
/// data; entries that do not parse are skipped with a warning (a worker's bad write must not
/// stop the reconciler), and so are records of another job (`jobUid`: an orphaned worker of a
/// deleted job of the same name still writing).
fn read_heartbeat(
    data: std::collections::BTreeMap<String, String>,
    uid: &str,
) -> (
    Option<ProgressReport>,
    Vec<FailureReport>,
    Vec<RestartReport>,
) {
    let ours = |job_uid: &Option<String>| job_uid.as_deref().is_none_or(|u| u == uid);
    let mut progress = None;
    let mut reports = vec![];
    let mut restarts = vec![];
    for (k, v) in data {
        if k == contract::PROGRESS_KEY {
            match serde_json::from_str::<ProgressReport>(&v) {
                Ok(p) if ours(&p.job_uid) => progress = Some(p),
                Ok(_) => tracing::debug!(key = %k, "a progress record of another job"),
                Err(e) => tracing::warn!(key = %k, error = %e, "unreadable progress record"),
            }
        } else if k.starts_with(contract::REPORT_KEY_PREFIX) {
            match serde_json::from_str::<FailureReport>(&v) {
                Ok(r) if ours(&r.job_uid) => reports.push(r),
                Ok(_) => tracing::debug!(key = %k, "a failure report of another job"),
                Err(e) => tracing::warn!(key = %k, error = %e, "unreadable failure report"),
            }
        } else if k.starts_with(contract::RESTARTS_KEY_PREFIX) {
            match serde_json::from_str::<RestartReport>(&v) {
                Ok(r) if ours(&r.job_uid) => restarts.push(r),
                Ok(_) => tracing::debug!(key = %k, "a restart report of another job"),
                Err(e) => tracing::warn!(key = %k, error = %e, "unreadable restart report"),
            }
        }
    }
    (progress, reports, restarts)
}

/// The longest the operator waits for a suspect's pong (a live process answers in one round
/// trip): a reconcile with a frozen member is delayed by at most this.
const PROBE_WINDOW_MAX: Duration = Duration::from_secs(2);

/// What the `suspects` answer to a liveness ping from this operator on their ring address
/// (`ring/src/liveness.rs`) within the workers' own window (a quarter of `detectionSeconds`, at
/// most [`PROBE_WINDOW_MAX`]), all probed at once: (those alive, those whose port refuses:
/// exited). The operator never reads the
/// key Secret, so it cannot check a pong's tag ([`diphoma_ring::liveness::probe_unkeyed`]): a
/// forged answer could only delay the verdict to the cut-off bound
/// ([`plan::failures::CUT_OFF_FACTOR`]).
async fn probe_suspects(
    job: &DiphomaJob,
    suspects: &[diphoma_contract::Member],
) -> (BTreeSet<String>, BTreeSet<String>) {
    use diphoma_ring::liveness::{Answer, probe_unkeyed};
    let detection = Duration::from_secs(job.spec.fault_tolerance.detection_seconds.max(1) as u64);
    let window = diphoma_ring::liveness::liveness_window(detection).min(PROBE_WINDOW_MAX);
    let probes = suspects.iter().map(|m| {
        let pod = m.pod.clone();
        let addr = std::net::SocketAddr::new(m.address, m.port);
        tokio::task::spawn_blocking(move || {
            let never = std::sync::atomic::AtomicBool::new(false);
            let from = match addr {
                std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
                std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            };
            (pod, probe_unkeyed(from, addr, window, &never))
        })
    });
    let answers: Vec<(String, Answer)> = futures::future::join_all(probes)
        .await
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let with = |a: Answer| -> BTreeSet<String> {
        answers
            .iter()
            .filter(|(_, x)| *x == a)
            .map(|(p, _)| p.clone())
            .collect()
    };
    let (alive, exited) = (with(Answer::Alive), with(Answer::Gone));
    if !alive.is_empty() || !exited.is_empty() {
        tracing::info!(job = %job.name_any(), ?alive, ?exited, "blamed members answer their liveness ping or have exited: not hung");
    }
    (alive, exited)
}

/// Carries out the plan, in the order the module doc lists: the gang Workload, the job's own
/// writes ([`write`]), the Kueue Workload, then a wait until the watches delivered them all
/// (read-your-writes: the next reconcile plans from what this one wrote). What the API server
/// refused is noted in `answered`, for the memory.
async fn apply(
    ctx: &Context,
    job: &DiphomaJob,
    plan: &Plan,
    children: &[build::Child],
    answered: &mut Answered,
) -> Result<(), Error> {
    let mut written = Written::default();
    // The gang first: the workers wait for the Workload they point at.
    let wrote = match crate::gang::apply(&ctx.client, job, &plan.gang, &mut written).await {
        Ok(()) => write(ctx, job, plan, children, answered, &mut written).await,
        Err(e) => Err(e),
    };
    // Kueue's Workload last (none after a failed write): its status says what the job's says.
    let queued = match &wrote {
        Ok(()) => Some(crate::queue::apply(&ctx.client, job, &plan.queue, &mut written).await),
        Err(_) => None,
    };
    tracing::debug!(job = %job.name_any(), ?written, ok = wrote.is_ok(), "applied");
    let late = ctx.caches.caught_up(&written, CATCH_UP).await;
    if !late.is_empty() {
        tracing::warn!(job = %job.name_any(), ?late, "the watches did not deliver this reconcile's writes within {CATCH_UP:?}");
    }
    // A refused Workload shows in the job's status at the next reconcile (the retry).
    answered.workload = match &queued {
        Some(Err(Error::Workload {
            action: "create",
            source: kube::Error::Api(s),
            ..
        })) => Some(Err(crate::queue::refusal(s))),
        Some(_) if plan.queue.create.is_some() => Some(Ok(())),
        _ => None,
    };
    wrote.and(queued.unwrap_or(Ok(())))
}

/// The job's own writes, in the order the module doc lists; the creations the API server
/// refused are noted in `answered`. Each write that returned an object is noted in `written`.
async fn write(
    ctx: &Context,
    job: &DiphomaJob,
    plan: &Plan,
    children: &[build::Child],
    answered: &mut Answered,
    written: &mut Written,
) -> Result<(), Error> {
    let client = &ctx.client;
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let jobs: Api<DiphomaJob> = Api::namespaced(client.clone(), &ns);
    if plan.delete_job {
        jobs.delete(&name, &DeleteParams::background())
            .await
            .map_err(|source| Error::DeleteJob { source })?;
        return Ok(());
    }
    if plan.apply_children {
        apply_children(ctx, job, children, written).await?;
    }
    // A child the table no longer builds is deleted; a refusal (RBAC without delete on its
    // kind) stops nothing else: it is counted and logged, and tried again at the next plan
    // (the owner reference deletes it with the job in any case).
    for (kind, child) in &plan.prune {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &kind.resource());
        match applier::delete(&api, child, &DeleteParams::background()).await {
            Ok(_) => {
                tracing::info!(job = %name, kind = kind.name(), %child, "pruned: no longer built")
            }
            Err(source) => {
                let kind = kind.name();
                let err = Error::PruneChild {
                    kind,
                    name: child.clone(),
                    source,
                };
                ctx.metrics
                    .errors
                    .with_label_values(&[err.metric_label()])
                    .inc();
                tracing::warn!(job = %name, error = %err, "prune");
            }
        }
    }
    // Status first: a counted failure is never lost, even if what follows fails.
    // Conditional on the job as observed: a plan made from a stale job (its watch behind this
    // operator's last write) is refused (409) and made again, so a failure is counted once.
    let base = job.resource_version();
    if let Some(j) = write_status(&jobs, &name, base, job.status.as_ref(), &plan.status).await? {
        written.note(Kind::Job, j.meta());
        ctx.metrics
            .observe_failures(job.status.as_ref(), &plan.status);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for c in &plan.mark {
        let p = annotate(&pods, &c.pod, ANNOT_FAILURE_COUNTED, &c.cause).await?;
        written.note(Kind::Pod, &p.metadata);
    }
    for d in &plan.delete {
        let p = annotate(&pods, &d.pod, ANNOT_DELETED_BY_OPERATOR, d.reason).await?;
        written.note(Kind::Pod, &p.metadata);
        let dp = if d.force {
            DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            }
        } else {
            DeleteParams::default()
        };
        let gone = applier::delete(&pods, &d.pod, &dp)
            .await
            .map_err(|source| Error::DeletePod {
                pod: d.pod.clone(),
                source,
            })?;
        if let Some(p) = gone {
            written.note(Kind::Pod, &p.metadata);
        }
    }
    // A pod the API server refuses (a quota, a pod it finds invalid) stops neither the other
    // creations nor the ring: it is remembered for the next plan, and retried with back-off
    // (those still held are not in the plan).
    answered.created = true;
    let refused = &mut answered.refused;
    let gang =
        !plan.create.is_empty() && job.spec.gang_scheduler() != crate::api::GangScheduler::None;
    let _gang_creation = match gang {
        true => Some(ctx.gang_creation.lock().await),
        false => None,
    };
    for p in &plan.create {
        let pod = p.name_any();
        match applier::apply(&pods, p).await {
            Ok(created) => written.note(Kind::Pod, &created.metadata),
            Err(kube::Error::Api(s)) => {
                refused.insert(pod.clone(), s.message.clone());
                let err = Error::CreatePod {
                    pod,
                    source: kube::Error::Api(s),
                };
                ctx.metrics
                    .errors
                    .with_label_values(&[err.metric_label()])
                    .inc();
                tracing::warn!(job = %name, error = %err, "worker refused");
            }
            Err(source) => return Err(Error::CreatePod { pod, source }),
        }
    }
    // A refused creation is no WorkerCreated fact: its WorkerBlocked says what happened.
    let events = plan::fold_created(
        plan.events
            .iter()
            .filter(|e| {
                !(e.reason == "WorkerCreated"
                    && e.pod.as_ref().is_some_and(|p| refused.contains_key(p)))
            })
            .cloned()
            .collect(),
    );
    if let Some(m) = &plan.publish {
        let cm = applier::apply(
            &Api::<ConfigMap>::namespaced(client.clone(), &ns),
            &build::ring_configmap(job, m),
        )
        .await
        .map_err(|source| Error::PublishRing {
            generation: m.generation,
            source,
        })?;
        written.note(Kind::ConfigMap, &cm.metadata);
        ctx.metrics.observe_publish(plan);
    }
    for r in &plan.relabel {
        let p = relabel(&pods, r).await?;
        written.note(Kind::Pod, &p.metadata);
    }
    publish(ctx, &job.object_ref(&()), &events).await;
    Ok(())
}

/// Writes `status` on job `name` (server-side apply) unless it equals `prev`, conditional on
/// the job's `resourceVersion` being `base` when given (else the API server answers 409
/// Conflict: [`Error::PatchStatus`]); `K` is the job type the reply decodes into. The job as
/// stored after the write (none: nothing written).
async fn write_status<K>(
    jobs: &Api<K>,
    name: &str,
    base: Option<String>,
    prev: Option<&DiphomaJobStatus>,
    status: &DiphomaJobStatus,
) -> Result<Option<K>, Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    if prev == Some(status) {
        return Ok(None);
    }
    let mut body = serde_json::json!({"apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "status": status});
    if let Some(rv) = base {
        body["metadata"] = serde_json::json!({"resourceVersion": rv});
    }
    jobs.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map(Some)
    .map_err(|source| Error::PatchStatus { source })
}

/// Publishes `events` on the object `reference` (a failed publish is logged, not an error).
async fn publish(ctx: &Context, reference: &ObjectReference, events: &[plan::EventNote]) {
    for e in events {
        let ev = Event {
            type_: if e.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: e.reason.into(),
            note: Some(e.note.clone()),
            action: e.action.into(),
            secondary: e.pod.as_ref().map(|pod| ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.clone()),
                namespace: reference.namespace.clone(),
                ..Default::default()
            }),
        };
        // A Recorder of its own per event: kube's Recorder folds events with the same reason,
        // action and objects into one series that keeps the first note, and each of these is a
        // distinct fact (the plan states a fact once), e.g. each generation's RingReformed.
        let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
        if let Err(e) = recorder.publish(&ev, reference).await {
            tracing::debug!(error = %e, "event");
        }
    }
}

/// Sets annotation `key` to `value` on `pod` (a pod already gone is fine); the pod as stored.
async fn annotate(pods: &Api<Pod>, pod: &str, key: &str, value: &str) -> Result<Pod, Error> {
    mark(
        pods,
        pod,
        serde_json::json!({"metadata": {"annotations": {key: value}}}),
    )
    .await
}

/// Sets (or, for a pod outside the ring, removes) the rank labels of `r.pod`; the pod as stored.
async fn relabel(pods: &Api<Pod>, r: &plan::Relabel) -> Result<Pod, Error> {
    let (rank, generation) = r
        .rank
        .map(|(rank, g)| (rank.to_string(), g.to_string()))
        .unzip();
    let labels = serde_json::json!({
        contract::LABEL_RANK: rank,
        contract::LABEL_GENERATION: generation,
    });
    mark(
        pods,
        &r.pod,
        serde_json::json!({"metadata": {"labels": labels}}),
    )
    .await
}

/// Merge-patches `body` into `pod`; the pod as stored (a pod already gone is fine: an empty
/// pod).
async fn mark(pods: &Api<Pod>, pod: &str, body: serde_json::Value) -> Result<Pod, Error> {
    applier::merge(pods, pod, &PatchParams::default(), &body)
        .await
        .map(Option::unwrap_or_default)
        .map_err(|source| Error::MarkPod {
            pod: pod.to_owned(),
            source,
        })
}

/// The static children ([`build::children`]), in the table's order: server-side applied, or
/// created once as [`caches::adoption`] says (an object the job owns, or another owner's, is
/// never overwritten; an orphan of a job of the same name is replaced, conditional on the
/// `resourceVersion` seen; one written meanwhile stays missing for this job, so the next
/// reconcile tries again). Each write is noted in `written`.
async fn apply_children(
    ctx: &Context,
    job: &DiphomaJob,
    children: &[build::Child],
    written: &mut Written,
) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    for child in children {
        let api = Api::namespaced_with(ctx.client.clone(), &ns, &child.kind.resource());
        let name = child.name();
        let wrote = match child.once {
            false => applier::apply(&api, &child.object).await.map(Some),
            true => {
                let existing = ctx.caches.child_meta(child.kind, &ns, &name);
                let in_use = child.pinned_by_workers && ctx.caches.has_workers(job);
                match caches::adoption(existing.as_ref(), job, in_use) {
                    caches::Adoption::Keep | caches::Adoption::Foreign => Ok(None),
                    caches::Adoption::TakeOver(rv) => {
                        tracing::info!(%name, "taking over an orphaned child of a job of the same name");
                        let mut obj = child.object.clone();
                        obj.metadata.resource_version = Some(rv);
                        applier::replace(&api, &obj).await
                    }
                    caches::Adoption::Create => applier::create(&api, &child.object).await,
                }
            }
        };
        let wrote = wrote.map_err(|source| Error::ApplyChild {
            kind: child.kind.name(),
            name,
            source,
        })?;
        if let Some(o) = wrote {
            written.note(child.kind, &o.metadata);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
