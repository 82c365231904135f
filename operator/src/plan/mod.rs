//! The reconcile plan, a pure function of the job and what the controller observed (pods, the
//! published ring, the health of their nodes, the workers' reports, now): which failures to
//! count, which pods to create and delete, whether to publish a new ring generation, when the
//! static children are re-applied, the status that results and when to look again. Everything
//! the operator decides is decided here; nothing here does I/O.
//!
//! [`plan`] reads as a table of contents, one named step per module:
//! 0. [`admission`]: Kueue's admitted count and flavors ([`queue::admitted_view`]), and the hold
//!    on the job (suspended, queued, a gang yielding), computed once;
//! 1. [`failures`]: judge the nodes ([`nodes`]), find lost pods and silent or vanished members,
//!    count them;
//! 2. [`lifecycle`]: a finished job's clean-up and TTL; fail, complete or suspend the job;
//! 3. [`workers`]: create missing workers, scale away the surplus;
//! 4. [`ring`]: publish the next ring generation when its membership changes;
//! 5. [`status`]: readiness, waiting, phase and conditions;
//! 6. [`queue`]: the job's Kueue Workload;
//! 7. [`gang`]: the job's gang Workload and PodGroup;
//! 8. [`memory`]: the refused creations still held, and what the reconciler remembers.
//!
//! Every step depends only on earlier ones and on this module's vocabulary (failures,
//! deletions, events, holds): no step calls back into a later one.
//!
//! A job whose spec does not decode gets [`invalid`] instead: a status and an event that name
//! the field, and nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use diphoma_contract::{FailureReport, Membership, ProgressReport, RestartReport};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::api::{DiphomaJob, DiphomaJobStatus, Phase};
use crate::build::{ANNOT_DELETED_BY_OPERATOR, ANNOT_FAILURE_COUNTED};

pub mod admission;
pub mod failures;
pub mod gang;
pub mod lifecycle;
pub mod memory;
pub mod nodes;
pub mod queue;
pub mod ring;
pub mod status;
pub mod workers;

pub use failures::{classify, silent_members};
pub use nodes::{NodeLease, node_lease};
pub use status::conditions;

/// What the reconciler observed for one job.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The job's worker pods: labelled with its name and owned by it (owner UID).
    pub pods: Vec<Pod>,
    /// Names held by pods labelled with the job's name but owned by another object (a deleted
    /// job of the same name whose pods still terminate): never the job's workers, and their
    /// names are not reused.
    pub foreign: BTreeSet<String>,
    /// The children the job needs that are missing or not its own (`Kind/name`): the static
    /// children are then applied again.
    pub missing: Vec<String>,
    /// The children the job owns that its table of static children no longer builds (kind,
    /// name): a NetworkPolicy from when the operator made them, a kind an older operator made.
    pub orphans: Vec<(crate::build::Kind, String)>,
    /// The heartbeat ConfigMap's `resourceVersion` (none: missing, or not the job's).
    pub heartbeat_version: Option<String>,
    /// When (this operator's clock) the heartbeat ConfigMap was last seen to change; none:
    /// never seen. Recalled from the job's [`memory::Memory`] ([`memory::recall`]).
    pub heartbeat_changed: Option<Timestamp>,
    /// The published ring generation, if any.
    pub ring: Option<Membership>,
    /// The health of the nodes the pods run on, by node name; a node not listed counts as
    /// healthy.
    pub nodes: BTreeMap<String, NodeHealth>,
    /// Rank 0's latest progress record.
    pub progress: Option<ProgressReport>,
    /// The workers' failure reports (any generation).
    pub reports: Vec<FailureReport>,
    /// The in-pod launchers' in-place restart reports, one per pod that restarted its process.
    pub restarts: Vec<RestartReport>,
    /// Silent members ([`failures::suspects`]) that answered this operator's liveness probe at
    /// this observation: their process runs (a generation behind, joining, waiting on a dead
    /// peer, or its own report late or lost), so they are not hung, unless cut off
    /// ([`failures::CUT_OFF_FACTOR`]).
    pub answering: BTreeSet<String>,
    /// Silent members whose ring port refused this operator's ping (nothing bound there: their
    /// process exited): not hung; the kubelet is about to report how they ended, and they are
    /// counted `Hung` only if it has not within `detectionSeconds` of the first blame.
    pub exited: BTreeSet<String>,
    /// Now.
    pub now: Timestamp,
    /// Worker pods whose creation the API server refused at the previous apply, with its
    /// message (a quota exceeded, a pod it finds invalid): they are retried and reported, and
    /// never count as starting. Recalled from the job's [`memory::Memory`].
    pub refused: BTreeMap<String, String>,
    /// The job's place in Kueue (its Workload), for a job labelled with a LocalQueue.
    pub queue: queue::Queue,
    /// The job's gang object, for a job with `spec.gang`.
    pub gang: gang::Gang,
    /// The `schedulerName` the job's new workers get (the coscheduling scheduler's, for a job
    /// with `spec.gang.scheduler: Coscheduling`; none: the pod template's).
    pub scheduler_name: Option<String>,
    /// The API server's message when it refused to create the job's Kueue Workload at the
    /// last attempt (a ResourceQuota on Workloads, Kueue's validating webhook): the job's
    /// `Suspended` condition says so (reason `WorkloadRefused`) while it is retried. Recalled
    /// from the job's [`memory::Memory`].
    pub workload_refused: Option<String>,
    /// Another gang-scheduled job of this operator (`namespace/name`) whose placed gang is below
    /// its minimum with a worker waiting for room ([`gang::repairing`], as that job's
    /// [`memory::Memory::repairing`] remembers it): a gang of which no worker is bound yields
    /// to it ([`gang::hold`]).
    pub gang_repairing: Option<String>,
}

/// What the controller read about one node: its Lease in `kube-node-lease`, as this operator saw
/// it change ([`nodes::observe_lease`]), and its `Ready` condition. The default is a node with no
/// Lease that is not Ready (neither object found).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHealth {
    /// How long ago this operator saw the Lease's `renewTime` change, or first saw the Lease, by
    /// its own monotonic clock (none: no Lease, or never renewed).
    pub lease_age: Option<Duration>,
    /// The Lease's `leaseDurationSeconds` (none: the kubelet's default,
    /// [`nodes::DEFAULT_NODE_LEASE_SECONDS`]).
    pub lease_duration_seconds: Option<i32>,
    /// The Node's `Ready` condition is `True`.
    pub ready: bool,
    /// A skew between the node's clock and this operator's (positive: the node is ahead)
    /// beyond [`nodes::skew_threshold`], measured at this observation and not reported for
    /// this node before: the plan reports it once ([`nodes::skew_events`]).
    pub clock_skew: Option<jiff::SignedDuration>,
}

/// Why a worker was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// Its process exited non-zero.
    ProcessExit,
    /// Its pod was deleted by someone else.
    PodDeleted,
    /// Evicted through the Eviction API (or by kubelet pressure).
    Evicted,
    /// Preempted by the scheduler.
    Preempted,
    /// Its node stopped heartbeating.
    NodeLost,
    /// It stopped answering its ring neighbours.
    Hung,
}

impl Cause {
    /// Whether the lost pod is deleted with grace 0: nobody on a lost node, and no frozen
    /// process, would ever finish a graceful deletion.
    pub fn force_delete(self) -> bool {
        matches!(self, Cause::NodeLost | Cause::Hung)
    }

    /// Whether the loss is a disruption, not the job's fault (an eviction, a preemption, a lost
    /// node): counted against `faultTolerance.disruptionLimit`, never `backoffLimit`, as batch
    /// Job's `podFailurePolicy` treats `DisruptionTarget` pods.
    pub fn is_disruption(self) -> bool {
        matches!(self, Cause::Evicted | Cause::Preempted | Cause::NodeLost)
    }

    /// Every cause, in declaration order (metric label values are initialized from it).
    pub const ALL: [Cause; 6] = [
        Cause::ProcessExit,
        Cause::PodDeleted,
        Cause::Evicted,
        Cause::Preempted,
        Cause::NodeLost,
        Cause::Hung,
    ];

    /// The PascalCase name used in status, events and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::ProcessExit => "ProcessExit",
            Cause::PodDeleted => "PodDeleted",
            Cause::Evicted => "Evicted",
            Cause::Preempted => "Preempted",
            Cause::NodeLost => "NodeLost",
            Cause::Hung => "Hung",
        }
    }
}

/// A newly observed worker failure.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// Pod name.
    pub pod: String,
    /// Its rank in the current generation, if it was a member.
    pub rank: Option<i32>,
    /// Cause.
    pub cause: Cause,
    /// Kubernetes reason (`Error`, `OOMKilled`, `EvictionByEvictionAPI`, …).
    pub reason: String,
    /// Exit code, for process exits.
    pub exit_code: Option<i32>,
    /// Its container's termination message ([`failures::termination_message`]).
    pub message: Option<String>,
    /// Whether the worker is replaced (false: the job fails).
    pub retryable: bool,
    /// Whether the pod still exists (its failure is then recorded on it).
    pub exists: bool,
    /// When the loss happened: its container's finish time, else its deletion's request, else
    /// when it was observed; never after the observation.
    pub at: Timestamp,
}

/// A deletion the operator makes itself (never counted as a failure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deletion {
    /// Pod name.
    pub pod: String,
    /// Grace period 0: the pod's node is lost, nobody would finish the deletion.
    pub force: bool,
    /// Why (for the event).
    pub reason: &'static str,
}

/// A Kubernetes Event to publish on the job. The event recorder merges events with the same
/// type, reason, action and related object into one series (keeping the first note), so each
/// fact about a pod names the pod as its related object: two failures are two events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventNote {
    /// `Warning` (a loss, a failed job) rather than `Normal`.
    pub warning: bool,
    /// PascalCase reason (`WorkerFailed`, `RingReformed`, ...).
    pub reason: &'static str,
    /// What the operator did, a short verb (`Create`, `Replace`, `Publish`, …).
    pub action: &'static str,
    /// Human-readable note.
    pub note: String,
    /// The pod the event is about (the event's related object), if any.
    pub pod: Option<String>,
}

impl EventNote {
    /// A `Normal` event.
    pub fn normal(reason: &'static str, action: &'static str, note: String) -> Self {
        EventNote {
            warning: false,
            reason,
            action,
            note,
            pod: None,
        }
    }

    /// A `Warning` event.
    pub fn warning(reason: &'static str, action: &'static str, note: String) -> Self {
        EventNote {
            warning: true,
            ..EventNote::normal(reason, action, note)
        }
    }

    /// The same event about pod `pod`.
    pub fn about(self, pod: &str) -> Self {
        EventNote {
            pod: Some(pod.to_owned()),
            ..self
        }
    }
}

/// `notes` with its `WorkerCreated` notes, when there are several, folded into one at the first
/// one's place: "created workers a, b, c", about no single pod. A reconcile that creates a
/// job's workers records one event, not one per worker (issue 14: 3 event writes fewer per job
/// of 4).
pub fn fold_created(notes: Vec<EventNote>) -> Vec<EventNote> {
    let is_created = |e: &EventNote| e.reason == "WorkerCreated";
    let created: Vec<&str> = notes
        .iter()
        .filter(|e| is_created(e))
        .filter_map(|e| e.pod.as_deref())
        .collect();
    if created.len() < 2 {
        return notes;
    }
    let folded = EventNote::normal(
        "WorkerCreated",
        "Create",
        format!("created workers {}", created.join(", ")),
    );
    let first = notes.iter().position(is_created);
    let mut out: Vec<EventNote> = notes.iter().filter(|e| !is_created(e)).cloned().collect();
    out.insert(first.unwrap_or_default().min(out.len()), folded);
    out
}

/// Everything one reconcile does, in order: apply the static children (and prune those no
/// longer built), patch the status,
/// record failures on pods, delete pods, create pods, publish the ring, publish events.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// (Re-)apply the static children (Service, RBAC, NetworkPolicy, key Secret, heartbeat
    /// ConfigMap): the job has not finished, and the spec generation moved since the status
    /// last observed it or a child is missing ([`Observed::missing`]).
    pub apply_children: bool,
    /// The job's children to delete ([`Observed::orphans`]), after the others are applied.
    pub prune: Vec<(crate::build::Kind, String)>,
    /// Failures to count (in the status, and in its `countedPods` until they are marked).
    pub failures: Vec<Failure>,
    /// Pods to mark as counted (the `diphoma.io/failure-counted` annotation, the cause as its
    /// value) once the status is written: this plan's failures that exist, and those the status
    /// counted before without the mark ever written.
    pub mark: Vec<crate::api::CountedPod>,
    /// Pods to create.
    pub create: Vec<Pod>,
    /// Pods to delete.
    pub delete: Vec<Deletion>,
    /// A new ring generation to publish.
    pub publish: Option<Membership>,
    /// The status to write.
    pub status: DiphomaJobStatus,
    /// The earliest timer of the job's own (deadline, TTL, completion grace, young failure
    /// reports, the workers' reports falling silent); set with [`Plan::due_in`].
    pub requeue_after: Option<Duration>,
    /// When to reconcile again without an event: [`Plan::requeue_after`] or, while the job runs,
    /// when one of its nodes would be judged lost if its Lease is not renewed
    /// ([`nodes::next_check`]), whichever comes first; none: only on a change (the controller
    /// still looks again after its long safety-net interval).
    pub look_again: Option<Duration>,
    /// Delete the job itself (`ttlSecondsAfterFinished` passed).
    pub delete_job: bool,
    /// Events to publish.
    pub events: Vec<EventNote>,
    /// Worker pods whose rank labels are to be set (or removed) to match the ring.
    pub relabel: Vec<Relabel>,
    /// What to do with the job's Kueue Workload.
    pub queue: queue::QueuePlan,
    /// What to do with the job's gang Workload and PodGroup (`scheduling.k8s.io`).
    pub gang: gang::GangPlan,
}

impl Plan {
    /// Sets a timer `d` from now: [`Plan::requeue_after`] keeps the earliest.
    pub fn due_in(&mut self, d: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(d, |r| r.min(d)));
    }
}

/// Why the job's workers must not run now, for the `Suspended` condition: the user's
/// `runPolicy.suspend`, the job's queue (Kueue has not admitted it, or evicted it), or its gang
/// ([`admission::hold`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The `Suspended` condition's reason (`Suspended`, or Kueue's, e.g. `Pending`,
    /// `Preempted`; `GangYields`, …).
    pub reason: String,
    /// Its message.
    pub message: String,
}

/// New rank labels for one worker pod ([`diphoma_contract::LABEL_RANK`],
/// [`diphoma_contract::LABEL_GENERATION`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relabel {
    /// The pod.
    pub pod: String,
    /// Its rank and generation; none: remove both labels (not a ring member).
    pub rank: Option<(u32, u64)>,
}

/// Computes the plan, and the memory it leaves ([`memory::decide`]; `obs` holds what `memory`
/// recalls, [`memory::recall`]). Pure: same inputs, same plan. Infallible: what cannot be done
/// (a worker the template cannot build) is reported in the plan's status and events.
pub fn plan(job: &DiphomaJob, obs: &Observed, memory: &memory::Memory) -> (Plan, memory::Memory) {
    let mut plan = Plan {
        apply_children: children_due(job, obs),
        prune: obs.orphans.clone(),
        status: status::carried(job),
        ..Plan::default()
    };
    // 0. Admission: admitted by Kueue, the workers run with the admitted count and flavors;
    // the hold on the job, once, judged on the job itself (the admitted view's replicas are
    // the admitted count, not its Workload's: it would read as a job whose size changed).
    let admitted = queue::admitted_view(job, &obs.queue);
    let admitted = admitted.as_ref().unwrap_or(job);
    // The ring keeps the frame protection its live workers run (a job stored before the
    // default changed), so that replacements join it.
    let kept = workers::kept_protection(admitted, &obs.pods);
    let admitted = kept.as_ref().unwrap_or(admitted);
    let hold = admission::hold(job, obs);
    // 1-5. The job's failures, lifecycle, workers, ring and status.
    decide(admitted, obs, hold.as_ref(), &mut plan);
    // 6. Kueue: the job's Workload. A job held for a priority class not found looks again for
    // the class (created after the job: no event of the job's says so).
    let (phase, ready) = (plan.status.phase, plan.status.ready_replicas);
    plan.queue = queue::queue_plan(job, &obs.queue, &obs.pods, phase, ready, obs.now);
    // Fewer workers than asked because of Kueue: a scale-up that waits for its workload slice
    // (the workers run at the old size), or a partial admission.
    if plan.status.waiting.is_none() && phase.is_some_and(|p| !p.is_terminal()) {
        plan.status.waiting = queue::queue_waiting(job, &obs.queue);
    }
    let running = plan.status.phase.is_some_and(|p| !p.is_terminal());
    if running
        && hold
            .as_ref()
            .is_some_and(|h| h.reason == queue::NO_PRIORITY_CLASS)
    {
        plan.due_in(queue::PRIORITY_CLASS_LOOK_AGAIN);
    }
    // 7. Gang: the job's gang Workload and PodGroup. A gang waiting, or yielding, looks again for another
    // gang's repair starting or ending (the other job's pods are not this job's: no event of
    // its own says so).
    plan.gang = gang::gang_plan(job, &obs.gang, plan.status.phase);
    if gang::waiting(job, &obs.pods, &[]).is_some()
        || hold.is_some_and(|h| h.reason == gang::YIELDS)
    {
        plan.due_in(gang::YIELD_LOOK_AGAIN);
    }
    plan.events.extend(nodes::skew_events(&obs.nodes));
    plan.status.replicas = status::observed_replicas(obs, &plan);
    // 8. Memory: the refused creations still held; what the reconciler remembers.
    let next = memory::decide(job, obs, memory, &mut plan);
    plan.look_again = look_again(job, obs, &plan);
    (plan, next)
}

/// The plan for a job the operator cannot decode (`object`: the job as the API server stores
/// it): its status says why, with the field named, and a Warning event `InvalidSpec` says it
/// once per reconcile; nothing is created, deleted or published, and the job's workers are left
/// as they are until the spec is fixed. None when `object` decodes after all (it changed since
/// the watch saw it).
pub fn invalid(object: &serde_json::Value, now: Timestamp) -> Option<Plan> {
    let error = crate::api::decode(object.clone()).err()?;
    let prev = object
        .get("status")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .unwrap_or_default();
    let generation = object
        .pointer("/metadata/generation")
        .and_then(|g| g.as_i64());
    let message = format!("the operator cannot read this job: {error}");
    Some(Plan {
        status: status::invalid(prev, generation, &message, now),
        events: vec![EventNote::warning("InvalidSpec", "Decode", message)],
        ..Plan::default()
    })
}

/// Steps 1-5, in order; each later step sees what the earlier ones planned. `hold`: step 0's.
fn decide(job: &DiphomaJob, obs: &Observed, hold: Option<&Hold>, plan: &mut Plan) {
    let prev_phase = job.status.as_ref().and_then(|s| s.phase);
    if prev_phase.is_some_and(Phase::is_terminal) {
        lifecycle::finished(job, obs, plan); // finished jobs stay finished
        return;
    }
    status::progress(&mut plan.status, obs);
    status::in_place_restarts(&mut plan.status, &obs.restarts);
    // 1. Failures: which nodes are lost or late, then which pods and members are lost.
    let detection = job.spec.fault_tolerance.detection_seconds;
    let nodes = nodes::judge_nodes(&obs.nodes, detection);
    let found = failures::detect(job, obs, &nodes, plan);
    // 2. Lifecycle: fail, complete or suspend the job.
    if lifecycle::lifecycle(job, obs, hold, &found, plan) == lifecycle::Next::Done {
        return;
    }
    failures::count_repairs(plan); // the job runs on: its lost members will be replaced
    if plan.status.start_time.is_none() {
        // Started (first run, or resumed): the deadline counts from now, as batch Job's.
        plan.status.start_time = Some(ts(obs.now));
        if let Some(d) = job.spec.run_policy.active_deadline_seconds {
            let due = Duration::from_secs(d.max(0) as u64) + Duration::from_millis(100);
            plan.due_in(due);
        }
    }
    // 3. Workers: create the missing ones, scale away the surplus.
    let workers = workers::workers(job, obs, &found, plan);
    // 4. Ring: the next generation, when the membership changed.
    let ring = ring::next_generation(job, obs, &workers, found, plan);
    // 5. Status: readiness, waiting, phase, conditions.
    status::running(job, obs, &workers, &ring, plan);
}

/// Whether the static children are due: the job has not finished, and the spec generation
/// moved since the last status or a child is missing.
fn children_due(job: &DiphomaJob, obs: &Observed) -> bool {
    let prev = job.status.clone().unwrap_or_default();
    !prev.phase.is_some_and(Phase::is_terminal)
        && (prev.observed_generation != job.metadata.generation || !obs.missing.is_empty())
}

/// See [`Plan::look_again`].
fn look_again(job: &DiphomaJob, obs: &Observed, plan: &Plan) -> Option<Duration> {
    let running = plan.status.phase.is_some_and(|p| !p.is_terminal());
    let nodes = running
        .then(|| nodes::next_check(&obs.nodes, job.spec.fault_tolerance.detection_seconds))
        .flatten();
    [plan.requeue_after, nodes].into_iter().flatten().min()
}

fn ts(t: Timestamp) -> String {
    t.to_string()
}

fn parse_ts(s: &str) -> Option<Timestamp> {
    s.parse().ok()
}

fn pod_phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn condition<'a>(p: &'a Pod, t: &str) -> Option<&'a k8s_openapi::api::core::v1::PodCondition> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == t)
}

fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref()?.node_name.as_deref()
}

fn by_operator(p: &Pod) -> bool {
    p.annotations().contains_key(ANNOT_DELETED_BY_OPERATOR)
}

fn counted(p: &Pod) -> bool {
    p.annotations().contains_key(ANNOT_FAILURE_COUNTED)
}

/// Whether any container of the pod has ever run.
fn started(p: &Pod) -> bool {
    let statuses = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| {
        c.state
            .as_ref()
            .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
            || c.last_state
                .as_ref()
                .is_some_and(|s| s.terminated.is_some())
    })
}

fn present_pod(obs: &Observed, name: &str) -> bool {
    obs.pods.iter().any(|p| p.name_any() == name)
}

#[cfg(test)]
mod tests;
