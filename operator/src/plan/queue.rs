//! Kueue admission, decided: what the job's Kueue `Workload` (`kueue.x-k8s.io/v1beta2`, the
//! version Kueue v0.17 stores) says about the job, and what the operator does about it. Pure;
//! the controller reads the Workload and the admitted ResourceFlavors and writes what this
//! module decides (`crate::queue`).
//!
//! DiphomaJob is a Kueue *external framework* (Kueue's `integrations.externalFrameworks`, the
//! route Kueue documents for AppWrapper and other custom jobs): Kueue queues, admits and
//! preempts the Workload, and this operator plays the part Kueue's own job reconciler plays for
//! a batch Job (`pkg/controller/jobframework/reconciler.go` in Kueue v0.17.0):
//! - a job labelled [`QUEUE_LABEL`] gets one Workload, owned by it, with one podSet of
//!   `replicas` workers (`minCount` = `elastic.minReplicas`: Kueue may admit fewer, partial
//!   admission) and the worker pod template; its workers run only while the Workload is
//!   admitted (the job is held, status `Suspended` with Kueue's reason, before);
//! - when admitted, the workers run with the admitted count and the admitted flavors' node
//!   labels and tolerations (as Kueue's `podSetInfo` merges them into a batch Job's template);
//! - when evicted (preempted, deactivated), the workers are deleted (the checkpoint and the
//!   counters stay), and once none runs the Workload's quota reservation is cleared (`admission`
//!   removed, `QuotaReserved` False `Pending`, `Requeued`), as the jobframework does, so Kueue
//!   queues it again;
//! - while admitted, the Workload's `PodsReady` condition says whether the admitted count of
//!   workers run as members of the ring ([`pods_ready`]), as Kueue's reconciler writes it for its
//!   own integrations: Kueue's `waitForPodsReady` (all-or-nothing admission) evicts a job whose
//!   ring does not form, or does not re-form, within its timeouts;
//! - a Workload that no longer matches the job (`replicas` or `minReplicas` changed: scaling
//!   goes through Kueue) is deleted while the workers stop, and a new one is created; unless the
//!   job asks for Kueue's *workload slices* ([`ELASTIC_JOB_ANNOTATION`], Kueue's
//!   `ElasticJobsViaWorkloadSlices`): then its running workers are kept, as Kueue's jobframework
//!   keeps a batch Job's (`pkg/workloadslicing`, [`scaling`]): a scale-down or a Workload not
//!   admitted yet is resized in place, a scale-up of an admitted one asks for a new *slice* that
//!   Kueue admits in place of the old one (the old one `Finished`, `WorkloadSliceReplaced`),
//!   and until then the workers run at the old size;
//! - a finished job marks its Workload `Finished`, which releases the quota.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Pod, PodSpec, PodTemplateSpec, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use super::Hold;
use crate::api::{DiphomaJob, Phase};
use crate::build;

/// The label that puts a job in a Kueue LocalQueue (its value: the LocalQueue's name).
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label naming a Kueue `WorkloadPriorityClass` for the job's Workload.
pub const PRIORITY_CLASS_LABEL: &str = "kueue.x-k8s.io/priority-class";
/// Kueue's API group and the version the operator reads and writes Workloads in.
pub const KUEUE_API_VERSION: &str = "kueue.x-k8s.io/v1beta2";
/// The hold's reason while the job has no Workload of its own yet (created, not yet seen).
pub const NO_WORKLOAD_YET: &str = "WorkloadCreated";
/// Name of the Workload's only podSet.
pub const PODSET: &str = "workers";
/// The job annotation (value `"true"`) that asks for Kueue's workload slices: scaling an
/// admitted job keeps its running workers. Kueue needs its feature gate
/// `ElasticJobsViaWorkloadSlices` (alpha in v0.17) to admit a slice in place of the old one.
pub const ELASTIC_JOB_ANNOTATION: &str = "kueue.x-k8s.io/elastic-job";
/// The annotation of a new slice naming the slice it replaces (`<namespace>/<name>`).
pub const REPLACEMENT_FOR: &str = "kueue.x-k8s.io/workload-slice-replacement-for";
/// The annotation naming the first slice of the chain (Kueue's `WorkloadSliceNameAnnotation`).
pub const SLICE_NAME: &str = "kueue.x-k8s.io/workload-slice-name";

/// The job's Workload as the controller read it, with the flavors of its admission resolved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkloadView {
    /// `metadata.name`.
    pub name: String,
    /// Owned by this job (owner UID): a Workload of a deleted job of the same name is not.
    pub owned: bool,
    /// Being deleted.
    pub deleting: bool,
    /// `spec.podSets[0].count` and `minCount`.
    pub count: i32,
    /// `spec.podSets[0].minCount`.
    pub min_count: Option<i32>,
    /// `spec.queueName`.
    pub queue: String,
    /// `status.conditions`.
    pub conditions: Vec<Condition>,
    /// The admission, when `status.admission` is set and the `Admitted` condition is True.
    pub admitted: Option<Admission>,
    /// `status.admission` is set (quota reserved, maybe not admitted yet, or evicted).
    pub quota_reserved: bool,
    /// `spec.active` is false: deactivated (Kueue evicts it, `InactiveWorkload`, and keeps it
    /// out of the queue).
    pub inactive: bool,
    /// `metadata.resourceVersion` as observed: the status patch is conditional on it, so that a
    /// plan made from a store behind Kueue's own writes is refused (409) and made again.
    pub resource_version: Option<String>,
    /// `Finished` is True (the job finished, or a newer slice replaced this one).
    pub finished: bool,
    /// `metadata.creationTimestamp` (RFC 3339): slices are ordered by it.
    pub created: String,
    /// The [`REPLACEMENT_FOR`] annotation: the slice (`<namespace>/<name>`) this one replaces.
    pub replacement_for: Option<String>,
    /// The job's newer slice, not finished, that asks Kueue for the job's new size in place of
    /// this one ([`slices`]; boxed: most Workloads have none).
    pub replacement: Option<Box<WorkloadView>>,
}

impl WorkloadView {
    /// Whether this slice replaces the Workload named `name` (its [`REPLACEMENT_FOR`]
    /// annotation, `<namespace>/<name>`; the namespace is the job's).
    pub fn replaces(&self, name: &str) -> bool {
        (self.replacement_for.as_deref()).is_some_and(|r| r.rsplit('/').next() == Some(name))
    }
}

/// What Kueue admitted the job's workers with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Admission {
    /// The ClusterQueue.
    pub cluster_queue: String,
    /// Workers admitted (`podSetAssignments[0].count`, at least `minCount`).
    pub count: i32,
    /// Node labels of the assigned ResourceFlavors (their `spec.nodeLabels`), then the
    /// admission checks' `podSetUpdates` node selectors.
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the assigned ResourceFlavors (their `spec.tolerations`) and of the
    /// admission checks' `podSetUpdates`.
    pub tolerations: Vec<Toleration>,
    /// Labels the admission checks' `podSetUpdates` give the workers (a ProvisioningRequest's,
    /// a custom check's).
    pub labels: BTreeMap<String, String>,
    /// Annotations the admission checks' `podSetUpdates` give the workers.
    pub annotations: BTreeMap<String, String>,
    /// The assigned flavors by resource, for the status message.
    pub flavors: BTreeMap<String, String>,
}

/// The job's place in Kueue, as observed.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Queue {
    /// Not queued (no [`QUEUE_LABEL`]): the job runs unless suspended.
    #[default]
    NotQueued,
    /// Labelled with a LocalQueue; its Workload, if one exists.
    Queued {
        /// The LocalQueue's name.
        queue: String,
        /// The Workload named after the job ([`workload_name`]), if any (boxed: it is large,
        /// and most jobs are not queued).
        workload: Option<Box<WorkloadView>>,
        /// The `value` of the WorkloadPriorityClass named by [`PRIORITY_CLASS_LABEL`] (none:
        /// no label, or no such class).
        priority: Option<i32>,
    },
}

/// What the controller does with the job's Workload this reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueuePlan {
    /// Create this Workload (a JSON object, `kueue.x-k8s.io/v1beta2`).
    pub create: Option<Value>,
    /// Delete the Workload of this name (it no longer matches the job).
    pub delete: Option<String>,
    /// Patch the Workload's status (a JSON merge patch of `status`), e.g. clear the admission
    /// of an evicted Workload or mark it Finished.
    pub patch_status: Option<(String, Value)>,
    /// The Workload's `resourceVersion` [`QueuePlan::patch_status`] was planned from: the patch
    /// is conditional on it (a 409 when Kueue wrote meanwhile, and the plan is made again).
    pub status_version: Option<String>,
    /// Resize the Workload of this name in place: its podSet's `count`, and `minCount` when
    /// given (a Workload without quota reserved only: Kueue's webhook lets an admitted one
    /// only shrink its count). A JSON patch that tests the podSet's name first.
    pub resize: Option<(String, i32, Option<i32>)>,
    /// Set the Workload's `spec.active` (Kueue's way for a user to stop an admitted
    /// workload): false while the job is suspended (`runPolicy.suspend`), so that its quota
    /// is released, true again when it is resumed.
    pub set_active: Option<(String, bool)>,
}

/// The Workload's name: `diphomajob-<job>` (at most 51 + 11 characters, a DNS subdomain).
pub fn workload_name(job: &str) -> String {
    format!("diphomajob-{job}")
}

/// The name of the job's workload slice created at the job's `generation` (a slice replacing
/// the first Workload, [`workload_name`]).
pub fn slice_name(job: &str, generation: i64) -> String {
    format!("{}-{generation}", workload_name(job))
}

/// Whether the job asks for Kueue's workload slices ([`ELASTIC_JOB_ANNOTATION`] `"true"`).
pub fn sliced(job: &DiphomaJob) -> bool {
    job.annotations()
        .get(ELASTIC_JOB_ANNOTATION)
        .is_some_and(|v| v == "true")
}

/// The job's Workload from all of its Workloads read (`views`, any order): one not owned
/// first (a deleted job's of the same name: the plan waits for it to go); else the oldest
/// slice not finished, with the newest other one as its [`WorkloadView::replacement`] (slices
/// being deleted are passed over: a dropped slice); else one being deleted (a replaced
/// Workload: the plan waits for it to go); else the newest finished one (a finished job's).
/// Slices are ordered by creation, a slice before the one that replaces it, as Kueue's
/// `FindNotFinishedWorkloads` orders them. Between Kueue's two writes of a replacement (the
/// old slice finished, the new one not admitted yet and never admitted or evicted before),
/// the finished old slice is returned with the new one as its replacement.
pub fn slices(mut views: Vec<WorkloadView>) -> Option<WorkloadView> {
    if let Some(i) = views.iter().position(|w| !w.owned) {
        return Some(views.swap_remove(i));
    }
    // Being deleted: a dropped slice is passed over; a replaced Workload blocks until gone.
    let (mut deleting, mut views): (Vec<_>, Vec<_>) = views.into_iter().partition(|w| w.deleting);
    if views.iter().all(|w| w.finished) && !deleting.is_empty() {
        return deleting.pop();
    }
    views.sort_by(|a, b| {
        a.created.cmp(&b.created).then_with(|| {
            if b.replaces(&a.name) {
                std::cmp::Ordering::Less
            } else if a.replaces(&b.name) {
                std::cmp::Ordering::Greater
            } else {
                a.name.cmp(&b.name)
            }
        })
    });
    let (mut active, mut finished): (Vec<_>, Vec<_>) = views.into_iter().partition(|w| !w.finished);
    if active.is_empty() {
        return finished.pop();
    }
    let mut current = active.remove(0);
    current.replacement = active.pop().map(Box::new);
    // Kueue finishes the replaced slice before it admits its replacement: in between, the
    // replaced slice's admission still runs the workers (Kueue's jobframework does not suspend
    // a job with slices whose Workload is not admitted).
    // Not a replacement evicted since (its admission cleared): that one holds the job.
    let between = current.admitted.is_none()
        && current.replacement.is_none()
        && find(&current.conditions, "Admitted").is_none()
        && find(&current.conditions, "Evicted").is_none();
    let replaced = (finished.iter())
        .position(|f| between && current.replaces(&f.name) && f.admitted.is_some());
    if let Some(i) = replaced {
        let mut old = finished.swap_remove(i);
        old.replacement = Some(Box::new(current));
        return Some(old);
    }
    Some(current)
}

/// How the job's size reaches its Workload `w` in LocalQueue `queue`: Kueue's
/// `EnsureWorkloadSlices` (v0.17) for a job that asks for slices ([`sliced`]), a new Workload
/// otherwise.
#[derive(Debug, Clone, PartialEq)]
pub enum Scaling {
    /// The Workload matches the job's size and queue.
    InStep,
    /// A new Workload, once no worker runs: a job without slices, a move to another queue, or
    /// `minReplicas` changed on a Workload with quota reserved (immutable there).
    Replace,
    /// Resize `w` in place ([`QueuePlan::resize`]): not admitted yet, or a scale-down.
    Resize {
        /// The podSet's new `count`.
        count: i32,
        /// Its new `minCount` (only while no quota is reserved).
        min_count: Option<i32>,
    },
    /// A scale-up of a Workload with quota reserved: a new slice replacing `w`; the workers run
    /// at `w`'s size until Kueue admits it.
    NewSlice,
    /// `w` has a newer slice and is finished (`OutOfSync`): it lost its reservation, was
    /// evicted, or the newer one was admitted as its replacement.
    FinishOld,
    /// `w`'s newer slice, not admitted yet, is no longer needed (the job was scaled back to
    /// `w`'s count or below): it is deleted.
    DropPending,
    /// `w`'s newer slice waits for Kueue, resized in place to the job's count when given (it
    /// has no quota reserved); `w` may be finished already (replaced, its replacement not yet
    /// admitted: Kueue writes the two in turn).
    Pending(Option<i32>),
}

/// See [`Scaling`]. Pure.
pub fn scaling(job: &DiphomaJob, queue: &str, w: &WorkloadView) -> Scaling {
    let want = job.spec.replicas;
    let min = job.spec.bounds().0.min(want);
    if let Some(next) = &w.replacement {
        let resize = (!next.quota_reserved && next.count != want).then_some(want);
        if !next.quota_reserved && !w.finished && want <= w.count {
            return Scaling::DropPending; // scaled back: the old slice covers it
        }
        if w.finished {
            return Scaling::Pending(resize); // replaced: its replacement is being admitted
        }
        let evicted = is_true(&w.conditions, "Evicted");
        if !w.quota_reserved || evicted || (next.quota_reserved && next.replaces(&w.name)) {
            return Scaling::FinishOld;
        }
        return Scaling::Pending(resize);
    }
    let w_min = w.min_count.unwrap_or(w.count);
    if w.count == want && w_min == min && w.queue == queue {
        return Scaling::InStep;
    }
    if !sliced(job) || w.queue != queue {
        return Scaling::Replace;
    }
    if !w.quota_reserved {
        let min_count = (w_min != min).then_some(min);
        return Scaling::Resize {
            count: want,
            min_count,
        };
    }
    if w_min != min {
        return Scaling::Replace;
    }
    if want < w.count {
        return Scaling::Resize {
            count: want,
            min_count: None,
        };
    }
    Scaling::NewSlice
}

/// What `status.waiting` says of an admitted job that runs fewer workers than `replicas`
/// because of Kueue: its newer slice waits for Kueue (a scale-up, [`Scaling::Pending`]), with
/// Kueue's reason; or Kueue admitted fewer (partial admission, down to `minReplicas`), which
/// Kueue never grows by itself. None otherwise.
pub fn queue_waiting(job: &DiphomaJob, q: &Queue) -> Option<String> {
    let Queue::Queued {
        queue,
        workload: Some(w),
        ..
    } = q
    else {
        return None;
    };
    if let Some(next) = &w.replacement
        && matches!(scaling(job, queue, w), Scaling::Pending(_))
    {
        let why = find(&next.conditions, "QuotaReserved")
            .map(|c| format!(": {}", c.message))
            .unwrap_or_default();
        return Some(format!(
            "scaling to {} workers waits for Kueue to admit workload slice {}{why}",
            next.count, next.name
        ));
    }
    let admitted = admitted_view(job, q)?.spec.replicas;
    let name = match w.replacement.as_ref().filter(|n| n.admitted.is_some()) {
        Some(n) => &n.name,
        None => &w.name,
    };
    let again = if sliced(job) {
        "scale the job down to it and up again to ask for more"
    } else {
        "Kueue does not grow an admitted Workload"
    };
    (admitted < job.spec.replicas).then(|| {
        format!(
            "running {admitted} of {} workers: Kueue admitted Workload {name} partially \
             (down to minReplicas); {again}",
            job.spec.replicas
        )
    })
}

/// The LocalQueue the job is labelled with, if any.
pub fn queue_of(job: &DiphomaJob) -> Option<String> {
    job.labels()
        .get(QUEUE_LABEL)
        .filter(|q| !q.is_empty())
        .cloned()
}

fn find<'a>(conds: &'a [Condition], t: &str) -> Option<&'a Condition> {
    conds.iter().find(|c| c.type_ == t)
}

fn is_true(conds: &[Condition], t: &str) -> bool {
    find(conds, t).is_some_and(|c| c.status == "True")
}

/// [`Hold::reason`] of a job whose WorkloadPriorityClass (its label) is not found: it is read
/// from the store of their watch, and no event of the job's says when one is created.
pub const NO_PRIORITY_CLASS: &str = "PriorityClassNotFound";

/// How often a job held for [`NO_PRIORITY_CLASS`] looks whether the class was created
/// (a look reads the caches: no API request).
pub const PRIORITY_CLASS_LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The hold the queue puts on the job, if any: not admitted yet (Kueue's `QuotaReserved`
/// reason and message, e.g. `Pending: couldn't assign flavors …`), evicted (`Evicted`'s:
/// `Preempted`, `InactiveWorkload`, …), or a Workload that is being replaced.
pub fn hold(job: &DiphomaJob, q: &Queue) -> Option<Hold> {
    let Queue::Queued {
        queue,
        workload,
        priority,
    } = q
    else {
        return None;
    };
    let h = |reason: &str, message: String| {
        Some(Hold {
            reason: reason_of(reason),
            message,
        })
    };
    if let Some(class) = job.labels().get(PRIORITY_CLASS_LABEL)
        && priority.is_none()
        && workload.is_none()
    {
        return h(
            NO_PRIORITY_CLASS,
            format!("WorkloadPriorityClass {class} (label {PRIORITY_CLASS_LABEL}) not found"),
        );
    }
    if mismatched(job, q) {
        return h(
            "WorkloadReplaced",
            "the job's size changed: its Kueue Workload is replaced and admitted again".into(),
        );
    }
    // Every slice finished while the job runs on (the last one replaced): as none at all.
    let Some(w) = workload
        .as_ref()
        .filter(|w| w.owned && !w.deleting)
        .filter(|w| !w.finished || w.replacement.is_some())
    else {
        return h(
            NO_WORKLOAD_YET,
            format!("waiting for Kueue to admit the job's Workload in LocalQueue {queue}"),
        );
    };
    if let Some(e) = find(&w.conditions, "Evicted").filter(|c| c.status == "True") {
        return h(&e.reason, format!("evicted by Kueue: {}", e.message));
    }
    if w.admitted.is_some() || w.replacement.as_ref().is_some_and(|n| n.admitted.is_some()) {
        return None;
    }
    match find(&w.conditions, "QuotaReserved") {
        Some(c) if c.status == "False" => h(&c.reason, format!("queued in Kueue: {}", c.message)),
        Some(c) if c.status == "True" => h(
            "QuotaReserved",
            format!(
                "quota reserved, waiting for admission checks: {}",
                c.message
            ),
        ),
        _ => h(
            "Pending",
            format!("queued in Kueue (LocalQueue {queue}): not admitted yet"),
        ),
    }
}

/// A condition reason (`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`) from Kueue's, which always
/// is one; `Queued` when empty.
fn reason_of(r: &str) -> String {
    let ok = r.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && r.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_,:".contains(c));
    if ok { r.to_owned() } else { "Queued".into() }
}

/// The job as its workers run it: with the admitted count (partial admission: between
/// `minReplicas` and `replicas`) and the admitted flavors' node labels and tolerations merged
/// into its placement. The job itself when not queued or not admitted.
pub fn admitted_view(job: &DiphomaJob, queue: &Queue) -> Option<DiphomaJob> {
    let Queue::Queued {
        workload: Some(w), ..
    } = queue
    else {
        return None;
    };
    // A newer slice admitted runs the workers, while Kueue finishes the old one.
    let a = (w.replacement.as_ref())
        .and_then(|n| n.admitted.as_ref())
        .or(w.admitted.as_ref())?;
    let mut job = job.clone();
    let (min, _) = job.spec.bounds();
    job.spec.replicas = a.count.clamp(min.min(job.spec.replicas), job.spec.replicas);
    let placement = job.spec.placement.get_or_insert_default();
    placement.node_selector.extend(a.node_selector.clone());
    placement.tolerations.extend(a.tolerations.clone());
    let meta = job.spec.template.metadata.get_or_insert_default();
    meta.labels.get_or_insert_default().extend(a.labels.clone());
    meta.annotations
        .get_or_insert_default()
        .extend(a.annotations.clone());
    Some(job)
}

/// What to do with the Workload: create it when missing, replace it when it no longer matches
/// the job (`workers`: the job's pods; a replacement waits until none runs), clear the quota
/// reservation of an evicted one once no worker runs, say whether the admitted workers are
/// ready ([`pods_ready`]; `ready`: the workers running as members of the ring), mark it
/// Finished when the job finished (`phase`).
pub fn queue_plan(
    job: &DiphomaJob,
    queue: &Queue,
    workers: &[Pod],
    phase: Option<Phase>,
    ready: i32,
    now: Timestamp,
) -> QueuePlan {
    let mut plan = QueuePlan::default();
    let Queue::Queued {
        queue,
        workload: current,
        priority,
    } = queue
    else {
        return plan;
    };
    // Kueue's `IsActive`: a worker that has not finished (terminating ones included) still
    // holds what the admission gave it.
    let running = workers
        .iter()
        .any(|p| !matches!(super::pod_phase(p), "Succeeded" | "Failed"));
    // No Workload is created while the job's priority class is not found.
    let classless = job.labels().contains_key(PRIORITY_CLASS_LABEL) && priority.is_none();
    let w = match current {
        None => {
            if !phase.is_some_and(Phase::is_terminal) && !classless {
                plan.create = Some(workload(job, queue, *priority));
            }
            return plan;
        }
        Some(w) if !w.owned || w.deleting => return plan, // wait for it to go
        Some(w) => w,
    };
    let terminal = phase.is_some_and(Phase::is_terminal);
    if w.finished && w.replacement.is_none() && !terminal {
        // Every slice of a job that runs on finished (its last one replaced, and deleted): a
        // new Workload, named as a slice (the first's name is still taken).
        if !classless {
            let mut fresh = workload(job, queue, *priority);
            let generation = job.metadata.generation.unwrap_or_default();
            fresh["metadata"]["name"] = json!(slice_name(&job.name_any(), generation));
            plan.create = Some(fresh);
        }
        return plan;
    }
    if terminal {
        if !is_true(&w.conditions, "Finished") {
            let (reason, message) = match phase {
                Some(Phase::Succeeded) => ("Succeeded", "the DiphomaJob succeeded"),
                _ => ("Failed", "the DiphomaJob failed"),
            };
            let conds = set_condition(&w.conditions, "Finished", "True", reason, message, now);
            plan.patch_status = Some((w.name.clone(), json!({"conditions": conds})));
            plan.status_version = w.resource_version.clone();
        }
        return plan;
    }
    match scaling(job, queue, w) {
        Scaling::InStep => {}
        // Scaling (or a move to another queue) goes through Kueue: a new Workload, once the
        // workers admitted under the old one are gone.
        Scaling::Replace => {
            if !running {
                plan.delete = Some(w.name.clone());
            }
            return plan;
        }
        Scaling::Resize { count, min_count } => {
            plan.resize = Some((w.name.clone(), count, min_count));
        }
        Scaling::NewSlice => plan.create = Some(new_slice(job, queue, *priority, w)),
        Scaling::FinishOld => {
            let conds = set_condition(
                &w.conditions,
                "Finished",
                "True",
                "OutOfSync",
                "The workload slice is out of sync with its parent job",
                now,
            );
            plan.patch_status = Some((w.name.clone(), json!({"conditions": conds})));
            plan.status_version = w.resource_version.clone();
            return plan;
        }
        Scaling::DropPending => {
            plan.delete = w.replacement.as_ref().map(|n| n.name.clone());
        }
        Scaling::Pending(resize) => {
            let next = w.replacement.as_ref().expect("a pending slice");
            plan.resize = resize.map(|count| (next.name.clone(), count, None));
            if w.finished {
                return plan; // nothing more is written on a finished slice
            }
        }
    }
    // A user's suspension deactivates the Workload (Kueue evicts it and releases its quota);
    // resuming activates it again.
    let suspended = job.spec.run_policy.suspend;
    if suspended != w.inactive {
        plan.set_active = Some((w.name.clone(), !suspended));
    }
    let evicted = find(&w.conditions, "Evicted").filter(|c| c.status == "True");
    if let Some(e) = evicted {
        if !w.quota_reserved || running {
            return plan; // the workers stop first; then the reservation is released
        }
        let requeued = matches!(e.reason.as_str(), "Preempted" | "NodeFailures");
        let mut conds = set_condition(
            &w.conditions,
            "Requeued",
            if requeued { "True" } else { "False" },
            &e.reason,
            &e.message,
            now,
        );
        conds = set_condition(&conds, "QuotaReserved", "False", "Pending", &e.message, now);
        if find(&conds, "Admitted").is_some() {
            conds = set_condition(
                &conds,
                "Admitted",
                "False",
                "NoReservation",
                "The workload has no reservation",
                now,
            );
        }
        if find(&conds, PODS_READY).is_some() {
            let (status, reason, message) = WAIT_FOR_START;
            conds = set_condition(&conds, PODS_READY, status, reason, message, now);
        }
        plan.patch_status = Some((
            w.name.clone(),
            json!({"admission": null, "conditions": conds}),
        ));
        plan.status_version = w.resource_version.clone();
        return plan;
    }
    if let Some((status, reason, message)) = pods_ready(w, ready) {
        let conds = set_condition(&w.conditions, PODS_READY, status, reason, message, now);
        plan.patch_status = Some((w.name.clone(), json!({"conditions": conds})));
        plan.status_version = w.resource_version.clone();
    }
    plan
}

/// Kueue's Workload condition that its `waitForPodsReady` waits for (all-or-nothing admission:
/// a Workload admitted and not `PodsReady` within its timeout is evicted and requeued, and with
/// `blockAdmission` no other is admitted meanwhile). Kueue's own job integrations write it; for
/// an external framework, the framework's controller must.
pub const PODS_READY: &str = "PodsReady";

/// `PodsReady` before the admitted workers have all been ready once (`WaitForStart`).
const WAIT_FOR_START: (&str, &str, &str) = (
    "False",
    "WaitForStart",
    "Not all pods are ready or succeeded",
);

/// The `PodsReady` condition to write on the admitted Workload `w` (status, reason, message),
/// as Kueue's job reconciler computes it for its own integrations (`generatePodsReadyCondition`,
/// Kueue v0.17): True (`Started`, or `Recovered` after a recovery) once `ready` workers, those
/// running as members of the ring, reach the admitted count; False `WaitForStart` until then,
/// `WaitForRecovery` after it was True. None: not admitted, or the condition already says so.
pub fn pods_ready(
    w: &WorkloadView,
    ready: i32,
) -> Option<(&'static str, &'static str, &'static str)> {
    let admitted = w.admitted.as_ref()?;
    let current = find(&w.conditions, PODS_READY);
    let recovering = current.is_some_and(|c| c.status == "True" || c.reason == "WaitForRecovery");
    let next = if ready >= admitted.count {
        let recovered =
            current.is_some_and(|c| matches!(c.reason.as_str(), "WaitForRecovery" | "Recovered"));
        let reason = if recovered { "Recovered" } else { "Started" };
        (
            "True",
            reason,
            "All pods reached readiness and the workload is running",
        )
    } else if recovering {
        (
            "False",
            "WaitForRecovery",
            "At least one pod has failed, waiting for recovery",
        )
    } else {
        WAIT_FOR_START
    };
    let same = current.is_some_and(|c| c.status == next.0 && c.reason == next.1);
    (!same).then_some(next)
}

/// Whether the job's Workload is replaced ([`Scaling::Replace`]): the job is held until the
/// new one is admitted.
pub fn mismatched(job: &DiphomaJob, queue: &Queue) -> bool {
    let Queue::Queued {
        queue,
        workload: Some(w),
        ..
    } = queue
    else {
        return false;
    };
    w.owned && !w.deleting && scaling(job, queue, w) == Scaling::Replace
}

/// `conds` with condition `t` set (its `lastTransitionTime` moves only when its status does).
fn set_condition(
    conds: &[Condition],
    t: &str,
    status: &str,
    reason: &str,
    message: &str,
    now: Timestamp,
) -> Vec<Condition> {
    let mut out: Vec<Condition> = conds.iter().filter(|c| c.type_ != t).cloned().collect();
    let since = find(conds, t)
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone());
    out.push(Condition {
        type_: t.into(),
        status: status.into(),
        reason: reason_of(reason),
        message: message.chars().take(32 * 1024).collect(),
        last_transition_time: since.unwrap_or(Time(now)),
        observed_generation: None,
    });
    out
}

/// The job's Workload: one podSet of `replicas` workers, `minCount` = `minReplicas` (when
/// below `replicas`), the worker pod template (containers' names, images and resources, GPU
/// requests included, node selector, tolerations, affinity: what Kueue's flavor assignment
/// reads), the job's LocalQueue and, from [`PRIORITY_CLASS_LABEL`], its
/// WorkloadPriorityClass with its `priority` value (Kueue's validation requires both, as its
/// jobframework sets them). Owned by the job (controller), so it goes with it.
pub fn workload(job: &DiphomaJob, queue: &str, priority: Option<i32>) -> Value {
    let name = job.name_any();
    let (min, _) = job.spec.bounds();
    let replicas = job.spec.replicas;
    let template = podset_template(job);
    let mut podset = json!({"name": PODSET, "count": replicas, "template": template});
    if min < replicas {
        podset["minCount"] = json!(min);
    }
    let mut spec = json!({"queueName": queue, "podSets": [podset]});
    if let (Some(pc), Some(value)) = (job.labels().get(PRIORITY_CLASS_LABEL), priority) {
        spec["priorityClassRef"] = json!({
            "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": pc
        });
        spec["priority"] = json!(value);
    }
    let mut labels = BTreeMap::new();
    labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        build::MANAGED_BY.to_owned(),
    );
    labels.insert(diphoma_contract::LABEL_JOB_NAME.to_owned(), name.clone());
    let annotations = sliced(job).then(|| {
        BTreeMap::from([
            (ELASTIC_JOB_ANNOTATION.to_owned(), "true".to_owned()),
            (SLICE_NAME.to_owned(), workload_name(&name)),
        ])
    });
    let meta = ObjectMeta {
        name: Some(workload_name(&name)),
        namespace: job.namespace(),
        labels: Some(labels),
        annotations,
        owner_references: job.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    };
    json!({
        "apiVersion": KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": meta,
        "spec": spec,
    })
}

/// A new workload slice of the job ([`workload`], named [`slice_name`] after the job's
/// generation) that asks Kueue for the job's size in place of `old`: annotated
/// [`REPLACEMENT_FOR`] `<namespace>/<old>` and with the chain's [`SLICE_NAME`], as Kueue's
/// jobframework annotates a batch Job's (`prepareWorkloadSlice`).
pub fn new_slice(
    job: &DiphomaJob,
    queue: &str,
    priority: Option<i32>,
    old: &WorkloadView,
) -> Value {
    let mut w = workload(job, queue, priority);
    let name = job.name_any();
    let ns = job.namespace().unwrap_or_default();
    w["metadata"]["name"] = json!(slice_name(
        &name,
        job.metadata.generation.unwrap_or_default()
    ));
    w["metadata"]["annotations"] = json!({
        ELASTIC_JOB_ANNOTATION: "true",
        REPLACEMENT_FOR: format!("{ns}/{}", old.name),
        SLICE_NAME: workload_name(&name),
    });
    w
}

/// The worker pod template as Kueue needs it: the first worker's spec, reduced to what
/// admission reads, with every limit also a request (Kueue counts requests).
fn podset_template(job: &DiphomaJob) -> PodTemplateSpec {
    let pod = build::worker_pod(job, 0, 0).ok();
    let full = pod.and_then(|p| p.spec).unwrap_or_default();
    let containers = full
        .containers
        .into_iter()
        .map(|c| {
            let mut resources = c.resources.unwrap_or_default();
            let mut requests = resources.requests.take().unwrap_or_default();
            for (k, v) in resources.limits.iter().flatten() {
                requests.entry(k.clone()).or_insert_with(|| v.clone());
            }
            resources.requests = (!requests.is_empty()).then_some(requests);
            k8s_openapi::api::core::v1::Container {
                name: c.name,
                image: c.image,
                resources: Some(resources),
                ..Default::default()
            }
        })
        .collect();
    PodTemplateSpec {
        metadata: None,
        spec: Some(PodSpec {
            containers,
            node_selector: full.node_selector,
            tolerations: full.tolerations,
            affinity: full.affinity,
            restart_policy: Some("Never".into()),
            ..Default::default()
        }),
    }
}

/// A JSON object of strings as a map (empty: none, or not such an object).
fn strings(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// Reads a Workload object (`kueue.x-k8s.io/v1beta2`) into a [`WorkloadView`]; `job_uid`
/// decides ownership and `flavors` gives each ResourceFlavor's `spec` (node labels,
/// tolerations) by name; the admission checks' `podSetUpdates` of its podSet add to the
/// admission. Fields missing from the object read as empty.
pub fn view(object: &Value, job_uid: &str, flavors: &BTreeMap<String, Value>) -> WorkloadView {
    let s = |p: &str| {
        object
            .pointer(p)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let owned = object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|o| o.get("uid").and_then(Value::as_str) == Some(job_uid));
    let podset = object.pointer("/spec/podSets/0");
    let int = |v: Option<&Value>| v.and_then(Value::as_i64).map(|n| n as i32);
    let conditions: Vec<Condition> = object
        .pointer("/status/conditions")
        .and_then(|c| serde_json::from_value(c.clone()).ok())
        .unwrap_or_default();
    let admission = object.pointer("/status/admission").filter(|a| !a.is_null());
    let count = int(podset.and_then(|p| p.get("count"))).unwrap_or_default();
    let admitted = admission
        .filter(|_| is_true(&conditions, "Admitted"))
        .map(|a| {
            let assignment = a.pointer("/podSetAssignments/0");
            let assigned: BTreeMap<String, String> = assignment
                .and_then(|p| p.get("flavors"))
                .and_then(|f| serde_json::from_value(f.clone()).ok())
                .unwrap_or_default();
            let mut node_selector = BTreeMap::new();
            let mut tolerations: Vec<Toleration> = vec![];
            let mut merge = |selector: Option<&Value>, tols: Option<&Value>| {
                node_selector.extend(strings(selector));
                for t in tols
                    .and_then(|t| serde_json::from_value::<Vec<Toleration>>(t.clone()).ok())
                    .unwrap_or_default()
                {
                    if !tolerations.contains(&t) {
                        tolerations.push(t);
                    }
                }
            };
            for flavor in assigned.values().collect::<std::collections::BTreeSet<_>>() {
                if let Some(spec) = flavors.get(flavor) {
                    merge(spec.get("nodeLabels"), spec.get("tolerations"));
                }
            }
            // The admission checks' updates of this podSet, as Kueue's jobframework applies
            // them to a batch Job's template once every check is Ready.
            let name = podset.and_then(|p| p.get("name")).and_then(Value::as_str);
            let updates: Vec<&Value> = object
                .pointer("/status/admissionChecks")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|c| c.get("podSetUpdates")?.as_array())
                .flatten()
                .filter(|u| u.get("name").and_then(Value::as_str) == name)
                .collect();
            let (mut labels, mut annotations) = (BTreeMap::new(), BTreeMap::new());
            for u in updates {
                merge(u.get("nodeSelector"), u.get("tolerations"));
                labels.extend(strings(u.get("labels")));
                annotations.extend(strings(u.get("annotations")));
            }
            Admission {
                cluster_queue: a
                    .get("clusterQueue")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                // A slice shrunk in place keeps its admission's count.
                count: int(assignment.and_then(|p| p.get("count")))
                    .unwrap_or(count)
                    .min(count),
                node_selector,
                tolerations,
                labels,
                annotations,
                flavors: assigned,
            }
        });
    let finished = is_true(&conditions, "Finished");
    WorkloadView {
        name: s("/metadata/name").to_owned(),
        owned,
        deleting: object
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|d| !d.is_null()),
        count,
        min_count: int(podset.and_then(|p| p.get("minCount"))),
        queue: s("/spec/queueName").to_owned(),
        conditions,
        admitted,
        quota_reserved: admission.is_some(),
        inactive: object.pointer("/spec/active") == Some(&Value::Bool(false)),
        resource_version: object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned),
        finished,
        created: s("/metadata/creationTimestamp").to_owned(),
        replacement_for: object
            .pointer("/metadata/annotations")
            .and_then(|a| a.get(REPLACEMENT_FOR))
            .and_then(Value::as_str)
            .map(str::to_owned),
        replacement: None,
    }
}

/// The names of the ResourceFlavors a Workload object's admission assigns (to be read).
pub fn assigned_flavors(object: &Value) -> Vec<String> {
    let mut names: Vec<String> = object
        .pointer("/status/admission/podSetAssignments")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("flavors")?.as_object().cloned())
        .flat_map(|m| {
            m.into_iter()
                .filter_map(|(_, v)| v.as_str().map(str::to_owned))
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::tests::job;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn queued(mut j: DiphomaJob) -> DiphomaJob {
        j.metadata
            .labels
            .get_or_insert_default()
            .insert(QUEUE_LABEL.into(), "team".into());
        j.metadata.uid = Some("uid-1".into());
        j
    }

    fn elastic() -> DiphomaJob {
        queued(job(
            json!({"replicas": 4, "elastic": {"minReplicas": 2, "maxReplicas": 4},
            "gpusPerWorker": 1,
            "template": {"spec": {"containers": [{"name": "w", "image": "x"}]}}}),
        ))
    }

    fn wl(j: &DiphomaJob, status: Value) -> Value {
        let mut w = workload(j, "team", None);
        w["metadata"]["ownerReferences"] = json!([{"uid": "uid-1", "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "name": "train"}]);
        w["status"] = status;
        w
    }

    #[test]
    fn the_workload_has_one_podset_with_min_count_and_gpu_requests() {
        let j = elastic();
        let w = workload(&j, "team", None);
        assert_eq!(w["spec"]["queueName"], "team");
        let ps = &w["spec"]["podSets"][0];
        assert_eq!(
            (ps["count"].as_i64(), ps["minCount"].as_i64()),
            (Some(4), Some(2))
        );
        let c = &ps["template"]["spec"]["containers"][0];
        assert_eq!(c["resources"]["requests"]["nvidia.com/gpu"], "1");
        assert_eq!(w["metadata"]["name"], "diphomajob-train");
    }

    /// A priority class created after the job: the job looks again for it (its creation
    /// reconciles no job), and runs on its Workload once found.
    #[test]
    fn a_job_whose_priority_class_is_not_found_looks_again_for_it() {
        let mut j = elastic();
        j.metadata
            .labels
            .get_or_insert_default()
            .insert(PRIORITY_CLASS_LABEL.into(), "high".into());
        let obs = |priority| crate::plan::Observed {
            queue: Queue::Queued {
                queue: "team".into(),
                workload: None,
                priority,
            },
            now: t(0),
            ..Default::default()
        };
        let plan = |o| crate::plan::plan(&j, &o, &Default::default()).0;
        let missing = plan(obs(None));
        assert_eq!(
            missing
                .status
                .conditions
                .iter()
                .find(|c| c.type_ == "Suspended")
                .map(|c| c.reason.as_str()),
            Some(NO_PRIORITY_CLASS)
        );
        assert!(
            missing
                .requeue_after
                .is_some_and(|d| d <= PRIORITY_CLASS_LOOK_AGAIN),
            "{:?}",
            missing.requeue_after
        );
        let found = plan(obs(Some(1000)));
        assert!(found.queue.create.is_some());
        assert!(
            found
                .requeue_after
                .is_none_or(|d| d > PRIORITY_CLASS_LOOK_AGAIN),
            "{:?}",
            found.requeue_after
        );
    }

    #[test]
    fn a_queued_job_is_held_until_admitted_then_runs_with_the_admitted_flavor() {
        let j = elastic();
        let none = Queue::Queued {
            queue: "team".into(),
            workload: None,
            priority: None,
        };
        assert!(hold(&j, &none).is_some());
        assert!(queue_plan(&j, &none, &[], None, 0, t(0)).create.is_some());
        // A user's suspension deactivates a matching Workload, a resumption activates it.
        let mut suspended = j.clone();
        suspended.spec.run_policy.suspend = true;
        let mine = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(
                &wl(&j, json!({})),
                "uid-1",
                &BTreeMap::new(),
            ))),
            priority: None,
        };
        assert_eq!(
            queue_plan(&suspended, &mine, &[], None, 0, t(0)).set_active,
            Some(("diphomajob-train".into(), false))
        );
        assert_eq!(queue_plan(&j, &mine, &[], None, 0, t(0)).set_active, None);
        let mut off = wl(&j, json!({}));
        off["spec"]["active"] = json!(false);
        let inactive = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&off, "uid-1", &BTreeMap::new()))),
            priority: None,
        };
        assert_eq!(
            queue_plan(&j, &inactive, &[], None, 0, t(0)).set_active,
            Some(("diphomajob-train".into(), true))
        );
        // Its creation refused: the hold says so, with the API server's message.
        let refused = crate::plan::Observed {
            queue: none.clone(),
            workload_refused: Some(
                "exceeded quota: q, requested: count/workloads.kueue.x-k8s.io=1".into(),
            ),
            ..Default::default()
        };
        let h = crate::plan::admission::hold(&j, &refused).expect("held");
        assert_eq!(h.reason, "WorkloadRefused");
        assert!(
            h.message
                .ends_with("exceeded quota: q, requested: count/workloads.kueue.x-k8s.io=1")
        );

        let pending = wl(
            &j,
            json!({"conditions": [{"type": "QuotaReserved", "status": "False",
            "reason": "Pending", "message": "couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu in flavor gpu, 4 more needed",
            "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        let q = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&pending, "uid-1", &BTreeMap::new()))),
            priority: None,
        };
        let h = hold(&j, &q).unwrap();
        assert_eq!(h.reason, "Pending");
        assert!(
            h.message.contains("insufficient unused quota"),
            "{}",
            h.message
        );
        assert!(admitted_view(&j, &q).is_none());

        let admitted = wl(
            &j,
            json!({
            "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 3, "flavors": {"nvidia.com/gpu": "gpu"}}]},
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        let flavors = BTreeMap::from([(
            "gpu".to_owned(),
            json!({"nodeLabels": {"pool": "gpu"},
            "tolerations": [{"key": "pool", "operator": "Exists", "effect": "NoSchedule"}]}),
        )]);
        assert_eq!(assigned_flavors(&admitted), ["gpu"]);
        let q = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&admitted, "uid-1", &flavors))),
            priority: None,
        };
        assert!(hold(&j, &q).is_none());
        let run = admitted_view(&j, &q).unwrap();
        assert_eq!(run.spec.replicas, 3, "partial admission");
        let p = run.spec.placement.unwrap();
        assert_eq!(p.node_selector.get("pool").map(String::as_str), Some("gpu"));
        assert_eq!(p.tolerations.len(), 1);
        // Admitted, no worker ready yet: Kueue's waitForPodsReady is told so.
        let waiting = queue_plan(&j, &q, &[], None, 0, t(0));
        assert_eq!(waiting.set_active, None);
        let conds: Vec<Condition> =
            serde_json::from_value(waiting.patch_status.unwrap().1["conditions"].clone()).unwrap();
        let ready = find(&conds, PODS_READY).map(|c| (c.status.as_str(), c.reason.as_str()));
        assert_eq!(ready, Some(("False", "WaitForStart")));
        // The whole plan runs the 3 admitted workers, unheld: the hold is the job's own, not
        // the admitted view's (whose replicas differ from the Workload's count).
        let obs = crate::plan::Observed {
            queue: q,
            now: t(0),
            ..Default::default()
        };
        let planned = crate::plan::plan(&j, &obs, &Default::default()).0;
        let suspended = planned
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Suspended");
        assert!(
            suspended.is_none_or(|c| c.status != "True"),
            "{suspended:?}"
        );
        assert_eq!(planned.create.len(), 3);
    }

    #[test]
    fn an_evicted_workload_holds_the_job_and_is_requeued_once_no_worker_runs() {
        let j = elastic();
        let evicted = wl(
            &j,
            json!({
            "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 4, "flavors": {}}]},
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"},
                {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue", "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        let q = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&evicted, "uid-1", &BTreeMap::new()))),
            priority: None,
        };
        assert_eq!(hold(&j, &q).unwrap().reason, "Preempted");
        let pod: Pod = serde_json::from_value(
            json!({"metadata": {"name": "train-worker-0"}, "status": {"phase": "Running"}}),
        )
        .unwrap();
        assert!(
            queue_plan(&j, &q, &[pod], None, 0, t(0))
                .patch_status
                .is_none(),
            "workers still run"
        );
        let (name, patch) = queue_plan(&j, &q, &[], None, 0, t(0)).patch_status.unwrap();
        assert_eq!(name, "diphomajob-train");
        assert!(patch["admission"].is_null());
        let conds: Vec<Condition> = serde_json::from_value(patch["conditions"].clone()).unwrap();
        let st = |t: &str| find(&conds, t).map(|c| (c.status.as_str(), c.reason.as_str()));
        assert_eq!(st("QuotaReserved"), Some(("False", "Pending")));
        assert_eq!(st("Admitted"), Some(("False", "NoReservation")));
        assert_eq!(st("Requeued"), Some(("True", "Preempted")));
    }

    /// `PodsReady` as Kueue's own integrations write it: False `WaitForStart` until the
    /// admitted count of workers run in the ring, True `Started`, False `WaitForRecovery` when
    /// one is lost, True `Recovered` once replaced; written only when it changes, and never on a
    /// Workload not admitted.
    /// An admission check's `podSetUpdates` (a ProvisioningRequest's, a custom check's) reach
    /// the workers: labels and annotations on their template, node selector and tolerations in
    /// their placement, beside the flavor's; another podSet's updates do not.
    #[test]
    fn admission_checks_pod_set_updates_reach_the_workers() {
        let j = elastic();
        let admitted = wl(
            &j,
            json!({
            "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 4, "flavors": {"nvidia.com/gpu": "gpu"}}]},
            "admissionChecks": [{"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z",
                "podSetUpdates": [
                    {"name": "workers", "labels": {"provisioned": "yes"}, "annotations": {"cluster-autoscaler.kubernetes.io/consume-provisioning-request": "pr-1"},
                     "nodeSelector": {"pool": "reserved"}, "tolerations": [{"key": "reserved", "operator": "Exists", "effect": "NoSchedule"}]},
                    {"name": "other", "labels": {"wrong": "podset"}}]}],
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        let flavors = BTreeMap::from([("gpu".to_owned(), json!({"nodeLabels": {"gpu": "h100"}}))]);
        let q = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&admitted, "uid-1", &flavors))),
            priority: None,
        };
        let run = admitted_view(&j, &q).unwrap();
        let pod = build::worker_pod(&run, 0, 0).unwrap();
        let meta = &pod.metadata;
        assert_eq!(meta.labels.as_ref().unwrap()["provisioned"], "yes");
        assert!(!meta.labels.as_ref().unwrap().contains_key("wrong"));
        assert_eq!(
            meta.annotations.as_ref().unwrap()["cluster-autoscaler.kubernetes.io/consume-provisioning-request"],
            "pr-1"
        );
        let spec = pod.spec.unwrap();
        let selector = spec.node_selector.unwrap_or_default();
        assert_eq!(
            (selector["pool"].as_str(), selector["gpu"].as_str()),
            ("reserved", "h100")
        );
        assert!(
            spec.tolerations
                .unwrap_or_default()
                .iter()
                .any(|t| t.key.as_deref() == Some("reserved"))
        );
    }

    #[test]
    fn pods_ready_follows_the_workers_in_the_ring_as_kueue_writes_it() {
        let j = elastic();
        let admission = json!({"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 3, "flavors": {}}]});
        let at = |ready: Option<(&str, &str)>| {
            let cond = |t: &str| json!({"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"});
            let mut conds = vec![cond("QuotaReserved"), cond("Admitted")];
            if let Some((s, r)) = ready {
                conds.push(json!({"type": "PodsReady", "status": s, "reason": r, "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"}));
            }
            let object = wl(&j, json!({"admission": admission, "conditions": conds}));
            view(&object, "uid-1", &BTreeMap::new())
        };
        let next = |ready, n| pods_ready(&at(ready), n).map(|(s, r, _)| (s, r));
        assert_eq!(next(None, 0), Some(("False", "WaitForStart")));
        assert_eq!(next(None, 2), Some(("False", "WaitForStart")));
        assert_eq!(next(Some(("False", "WaitForStart")), 2), None, "unchanged");
        assert_eq!(
            next(Some(("False", "WaitForStart")), 3),
            Some(("True", "Started"))
        );
        assert_eq!(next(Some(("True", "Started")), 3), None);
        assert_eq!(
            next(Some(("True", "Started")), 2),
            Some(("False", "WaitForRecovery"))
        );
        assert_eq!(next(Some(("False", "WaitForRecovery")), 2), None);
        assert_eq!(
            next(Some(("False", "WaitForRecovery")), 3),
            Some(("True", "Recovered"))
        );
        assert_eq!(
            next(Some(("True", "Recovered")), 2),
            Some(("False", "WaitForRecovery"))
        );
        let pending = view(&wl(&j, json!({})), "uid-1", &BTreeMap::new());
        assert_eq!(pods_ready(&pending, 4), None, "not admitted");
    }

    #[test]
    fn scaling_replaces_the_workload_and_a_finished_job_finishes_it() {
        let mut j = elastic();
        let w = wl(&j, json!({}));
        j.spec.replicas = 3;
        let q = Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(view(&w, "uid-1", &BTreeMap::new()))),
            priority: None,
        };
        assert!(mismatched(&j, &q));
        assert_eq!(
            queue_plan(&j, &q, &[], None, 0, t(0)).delete.as_deref(),
            Some("diphomajob-train")
        );
        j.spec.replicas = 4;
        let done = queue_plan(&j, &q, &[], Some(Phase::Succeeded), 0, t(0));
        let conds: Vec<Condition> =
            serde_json::from_value(done.patch_status.unwrap().1["conditions"].clone()).unwrap();
        assert!(is_true(&conds, "Finished"));
    }

    /// An admitted Workload of `count` workers (the podSet's count too), as Kueue writes it.
    fn admitted_wl(j: &DiphomaJob, name: &str, count: i32, created: &str) -> WorkloadView {
        let cond = |t: &str| json!({"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"});
        let mut w = wl(
            j,
            json!({"admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": count, "flavors": {}}]},
                   "conditions": [cond("QuotaReserved"), cond("Admitted")]}),
        );
        w["metadata"]["name"] = json!(name);
        w["metadata"]["creationTimestamp"] = json!(created);
        w["spec"]["podSets"][0]["count"] = json!(count);
        view(&w, "uid-1", &BTreeMap::new())
    }

    fn sliced_job(replicas: i32) -> DiphomaJob {
        let mut j = elastic();
        j.metadata
            .annotations
            .get_or_insert_default()
            .insert(ELASTIC_JOB_ANNOTATION.into(), "true".into());
        j.metadata.namespace = Some("ns".into());
        j.metadata.generation = Some(7);
        j.spec.replicas = replicas;
        j
    }

    fn in_team(w: WorkloadView) -> Queue {
        Queue::Queued {
            queue: "team".into(),
            workload: Some(Box::new(w)),
            priority: None,
        }
    }

    /// Kueue's `EnsureWorkloadSlices` for a job with slices: a scale-up of an admitted
    /// Workload asks for a new slice and keeps the workers at the admitted size (not held);
    /// a scale-down, or a Workload not admitted yet, is resized in place; `minReplicas`
    /// changed on an admitted one, or a job without the annotation, replaces the Workload.
    #[test]
    fn a_sliced_job_scales_through_workload_slices_and_keeps_its_workers() {
        let j = sliced_job(4);
        let w = admitted_wl(&j, "diphomajob-train", 2, "2027-01-01T00:00:00Z");
        assert_eq!(scaling(&j, "team", &w), Scaling::NewSlice);
        let q = in_team(w.clone());
        assert!(hold(&j, &q).is_none(), "the workers keep running");
        assert!(!mismatched(&j, &q));
        assert_eq!(admitted_view(&j, &q).unwrap().spec.replicas, 2);
        let plan = queue_plan(&j, &q, &[], None, 2, t(0));
        let slice = plan.create.expect("a new slice");
        assert_eq!(slice["metadata"]["name"], "diphomajob-train-7");
        let a = &slice["metadata"]["annotations"];
        assert_eq!(a[REPLACEMENT_FOR], "ns/diphomajob-train");
        assert_eq!(a[SLICE_NAME], "diphomajob-train");
        assert_eq!(a[ELASTIC_JOB_ANNOTATION], "true");
        assert_eq!(slice["spec"]["podSets"][0]["count"], 4);
        // The first Workload of such a job is marked elastic too.
        let first = workload(&j, "team", None);
        assert_eq!(
            first["metadata"]["annotations"][SLICE_NAME],
            "diphomajob-train"
        );
        // A scale-down of the admitted Workload: its count shrinks in place.
        let down = sliced_job(1);
        let mut w2 = w.clone();
        w2.min_count = Some(1);
        w2.count = 3;
        let mut down_min2 = down.clone();
        down_min2.spec.elastic.as_mut().unwrap().min_replicas = 1;
        assert_eq!(
            queue_plan(&down_min2, &in_team(w2.clone()), &[], None, 1, t(0)).resize,
            Some(("diphomajob-train".into(), 1, None))
        );
        // minReplicas changed on an admitted Workload: immutable there, so it is replaced.
        let mut other_min = sliced_job(2);
        other_min.spec.elastic.as_mut().unwrap().min_replicas = 1;
        assert_eq!(scaling(&other_min, "team", &w), Scaling::Replace);
        // Not admitted yet: count and minCount in place.
        let pending = view(&wl(&j, json!({})), "uid-1", &BTreeMap::new());
        assert_eq!(
            scaling(&other_min, "team", &pending),
            Scaling::Resize {
                count: 2,
                min_count: Some(1)
            }
        );
        // Without the annotation, the Workload is replaced as before.
        let mut plain = j.clone();
        plain.metadata.annotations = None;
        assert_eq!(scaling(&plain, "team", &w), Scaling::Replace);
        assert!(mismatched(&plain, &in_team(w)));
    }

    /// Two slices: the old one runs the workers while the new one waits (resized in place to
    /// the job's count, `status.waiting` says so), and is finished once Kueue admitted the new
    /// one as its replacement, whose admission then runs the workers.
    #[test]
    fn the_old_slice_runs_until_kueue_admits_its_replacement() {
        let j = sliced_job(4);
        let mut old = admitted_wl(&j, "diphomajob-train", 2, "2027-01-01T00:00:00Z");
        let mut next = wl(
            &j,
            json!({"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
            "message": "couldn't assign flavors to pod set workers: insufficient quota", "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        next["metadata"]["name"] = json!("diphomajob-train-7");
        next["metadata"]["creationTimestamp"] = json!("2027-01-01T00:00:00Z");
        next["metadata"]["annotations"] = json!({REPLACEMENT_FOR: "ns/diphomajob-train"});
        next["spec"]["podSets"][0]["count"] = json!(3);
        let next = view(&next, "uid-1", &BTreeMap::new());
        // Ordered by creation, the replaced slice first (same second: the annotation decides).
        let current = slices(vec![next.clone(), old.clone()]).unwrap();
        assert_eq!(current.name, "diphomajob-train");
        assert_eq!(
            current.replacement.as_ref().unwrap().name,
            "diphomajob-train-7"
        );
        old.replacement = Some(Box::new(next.clone()));
        let q = in_team(old.clone());
        assert_eq!(scaling(&j, "team", &old), Scaling::Pending(Some(4)));
        assert!(hold(&j, &q).is_none());
        assert_eq!(admitted_view(&j, &q).unwrap().spec.replicas, 2);
        let plan = queue_plan(&j, &q, &[], None, 2, t(0));
        assert_eq!(plan.resize, Some(("diphomajob-train-7".into(), 4, None)));
        assert!(plan.create.is_none());
        let waiting = queue_waiting(&j, &q).unwrap();
        assert!(
            waiting.contains("diphomajob-train-7") && waiting.contains("insufficient quota"),
            "{waiting}"
        );
        // Scaled back to the running size: the pending slice is dropped, and a slice being
        // deleted is passed over (the job is not held for it).
        let back = sliced_job(2);
        assert_eq!(scaling(&back, "team", &old), Scaling::DropPending);
        let plan = queue_plan(&back, &q, &[], None, 2, t(0));
        assert_eq!(plan.delete.as_deref(), Some("diphomajob-train-7"));
        let mut dropping = next.clone();
        dropping.deleting = true;
        let mut alone = old.clone();
        alone.replacement = None;
        let current = slices(vec![alone.clone(), dropping]).unwrap();
        assert_eq!(
            (current.name.as_str(), current.replacement.is_none()),
            ("diphomajob-train", true)
        );
        assert!(hold(&back, &in_team(current)).is_none());
        // Admitted as its replacement: the old slice is finished, the new admission runs.
        let mut admitted = admitted_wl(&j, "diphomajob-train-7", 4, "2027-01-01T00:00:00Z");
        admitted.replacement_for = Some("ns/diphomajob-train".into());
        old.replacement = Some(Box::new(admitted));
        let q = in_team(old.clone());
        assert_eq!(admitted_view(&j, &q).unwrap().spec.replicas, 4);
        let (name, patch) = queue_plan(&j, &q, &[], None, 2, t(0)).patch_status.unwrap();
        assert_eq!(name, "diphomajob-train");
        let conds: Vec<Condition> = serde_json::from_value(patch["conditions"].clone()).unwrap();
        assert_eq!(
            find(&conds, "Finished").map(|c| (c.status.as_str(), c.reason.as_str())),
            Some(("True", "OutOfSync"))
        );
        // Kueue finished the old slice and has not admitted the new one yet: the old
        // admission runs the workers meanwhile, and nothing is written on the old slice.
        let mut replaced = old.clone();
        replaced.finished = true;
        replaced.replacement = None;
        let mut waiting_next = next.clone();
        waiting_next.replacement_for = Some("ns/diphomajob-train".into());
        let current = slices(vec![replaced.clone(), waiting_next.clone()]).unwrap();
        assert_eq!(current.name, "diphomajob-train");
        let q = in_team(current.clone());
        assert!(
            hold(&j, &q).is_none(),
            "not suspended between Kueue's two writes"
        );
        assert_eq!(admitted_view(&j, &q).unwrap().spec.replicas, 2);
        let plan = queue_plan(&j, &q, &[], None, 2, t(0));
        assert!(
            plan.patch_status.is_none() && plan.create.is_none(),
            "{plan:?}"
        );
        // The replacement, admitted once, evicted and requeued since (admission cleared): the
        // replaced slice's stale admission does not run the workers; the job is held.
        let mut evicted = waiting_next.clone();
        evicted.conditions = serde_json::from_value(json!([
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"},
            {"type": "Admitted", "status": "False", "reason": "NoReservation", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"}]))
        .unwrap();
        let current = slices(vec![replaced.clone(), evicted]).unwrap();
        assert_eq!(current.name, "diphomajob-train-7");
        assert!(hold(&j, &in_team(current)).is_some());
        // Every slice finished while the job runs (its last one replaced and deleted): held,
        // and a new Workload is created under a slice's name.
        let mut gone = old.clone();
        gone.finished = true;
        gone.replacement = None;
        let q = in_team(gone);
        assert_eq!(hold(&j, &q).unwrap().reason, NO_WORKLOAD_YET);
        let fresh = queue_plan(&j, &q, &[], None, 0, t(0)).create.unwrap();
        assert_eq!(fresh["metadata"]["name"], "diphomajob-train-7");
        assert!(
            fresh["metadata"]["annotations"]
                .get(REPLACEMENT_FOR)
                .is_none()
        );
        // Finished slices are history: the newest active one is the job's Workload.
        let mut done = old.clone();
        done.finished = true;
        done.replacement = None;
        let newest = admitted_wl(&j, "diphomajob-train-7", 4, "2027-01-01T00:00:05Z");
        assert_eq!(
            slices(vec![done.clone(), newest]).unwrap().name,
            "diphomajob-train-7"
        );
        assert_eq!(
            slices(vec![done]).unwrap().name,
            "diphomajob-train",
            "a finished job's"
        );
    }

    /// Kueue admitted fewer workers than `replicas` (partial admission): the job runs them and
    /// `status.waiting` says so; Kueue never grows the Workload by itself.
    #[test]
    fn a_partial_admission_is_said_in_the_status() {
        let mut j = sliced_job(3);
        j.spec.elastic.as_mut().unwrap().min_replicas = 1;
        let w = admitted_wl(&j, "diphomajob-train-7", 1, "2027-01-01T00:00:00Z");
        let mut w3 = w.clone();
        w3.count = 3;
        let q = in_team(w3);
        let said = queue_waiting(&j, &q).unwrap();
        assert!(
            said.starts_with(
                "running 1 of 3 workers: Kueue admitted Workload diphomajob-train-7 partially"
            ),
            "{said}"
        );
        let full = in_team(admitted_wl(
            &j,
            "diphomajob-train-7",
            3,
            "2027-01-01T00:00:00Z",
        ));
        assert_eq!(queue_waiting(&j, &full), None);
    }

    /// A slice shrunk in place keeps its admission's count: the workers and `PodsReady` go by
    /// the podSet's count.
    #[test]
    fn a_slice_shrunk_in_place_is_ready_at_its_new_count() {
        let j = sliced_job(2);
        let mut w = wl(
            &j,
            json!({"admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 4, "flavors": {}}]},
                   "conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted", "message": "", "lastTransitionTime": "2027-01-01T00:00:00Z"}]}),
        );
        w["spec"]["podSets"][0]["count"] = json!(2);
        let v = view(&w, "uid-1", &BTreeMap::new());
        assert_eq!(v.admitted.as_ref().unwrap().count, 2);
        assert_eq!(pods_ready(&v, 2).map(|r| r.0), Some("True"));
    }
}
