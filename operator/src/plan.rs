//! The reconcile plan, a pure function of (job, observed pods, observed ring, lost and late
//! nodes, failure reports, now): which pods to create and delete, which failures to count, whether
//! to publish a new ring generation, and the status that results. Everything the operator decides
//! is decided here.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use diphoma_contract::{FailureReport, Member, Membership, ProgressReport};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::api::{
    CleanPodPolicy, Condition, DiphomaJob, DiphomaJobStatus, LastFailure, Phase, Progress,
    RingStatus,
};
use crate::build::{self, ANNOT_DELETED_BY_OPERATOR, ANNOT_FAILURE_COUNTED};

/// What the reconciler observed for one job.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The job's worker pods (by label).
    pub pods: Vec<Pod>,
    /// The published ring generation, if any.
    pub ring: Option<Membership>,
    /// Nodes considered lost ([`NodeLease::Lost`] or not Ready).
    pub lost_nodes: BTreeSet<String>,
    /// Nodes whose Lease missed a renewal ([`NodeLease::Late`] or lost): a silent member there
    /// is counted as `NodeLost`, not `Hung`, and its replacement avoids the node.
    pub late_nodes: BTreeSet<String>,
    /// Rank 0's latest progress record.
    pub progress: Option<ProgressReport>,
    /// The workers' failure reports (any generation).
    pub reports: Vec<FailureReport>,
    /// Now.
    pub now: Timestamp,
}

/// Lease duration assumed when a node's Lease has none: the kubelet's default
/// (`nodeLeaseDurationSeconds`, 40 s).
pub const DEFAULT_NODE_LEASE_SECONDS: i32 = 40;

/// How current a node's Lease in `kube-node-lease` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLease {
    /// Renewed on schedule.
    Fresh,
    /// A whole renewal was missed, but the node is not yet declared lost.
    Late,
    /// Older than both two renewal intervals and `detectionSeconds`, or never renewed.
    Lost,
}

/// Judges a node Lease renewed at `renewed` with `leaseDurationSeconds` `duration_s`, at `now`.
///
/// The kubelet renews every `leaseDurationSeconds / 4` (its `nodeLeaseRenewIntervalFraction`,
/// 0.25: every 10 s for the default 40 s). A Lease is late once it is older than two intervals (a
/// renewal was missed, not merely delayed), and lost once it is also older than
/// `detection_seconds`: a node is never declared lost for a slow renewal, however small
/// `detectionSeconds` is.
pub fn node_lease(
    renewed: Option<Timestamp>,
    duration_s: Option<i32>,
    now: Timestamp,
    detection_seconds: i32,
) -> NodeLease {
    let Some(renewed) = renewed else {
        return NodeLease::Lost;
    };
    let interval_ms = i64::from(duration_s.unwrap_or(DEFAULT_NODE_LEASE_SECONDS).max(1)) * 250;
    let late = jiff::SignedDuration::from_millis(interval_ms * 2);
    let detection = jiff::SignedDuration::from_secs(detection_seconds.into());
    match now.duration_since(renewed) {
        age if age > late && age > detection => NodeLease::Lost,
        age if age > late => NodeLease::Late,
        _ => NodeLease::Fresh,
    }
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
    /// Whether the worker is replaced (false: the job fails).
    pub retryable: bool,
    /// Whether the pod still exists (its failure is then recorded on it).
    pub exists: bool,
    /// When the loss happened, as far as the API tells.
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

/// A Kubernetes Event to publish: (type is Warning?, reason, note).
pub type EventNote = (bool, &'static str, String);

/// Everything one reconcile does, in order: record failures on pods, create pods, delete pods,
/// publish the ring, patch the status.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Failures to record (annotation on the pod) and count.
    pub failures: Vec<Failure>,
    /// Pods to create.
    pub create: Vec<Pod>,
    /// Pods to delete.
    pub delete: Vec<Deletion>,
    /// A new ring generation to publish.
    pub publish: Option<Membership>,
    /// The status to write.
    pub status: DiphomaJobStatus,
    /// Reconcile again after this long even without events (deadlines, TTL, node checks).
    pub requeue_after: Option<Duration>,
    /// Delete the job itself (`ttlSecondsAfterFinished` passed).
    pub delete_job: bool,
    /// Events to publish.
    pub events: Vec<EventNote>,
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

/// Classifies a pod that is lost, or returns `None` for a healthy (or still starting) one.
/// Returns (cause, reason, exit code).
pub fn classify(p: &Pod, lost_nodes: &BTreeSet<String>) -> Option<(Cause, String, Option<i32>)> {
    let disruption = condition(p, "DisruptionTarget")
        .filter(|c| c.status == "True")
        .and_then(|c| c.reason.clone());
    let from_disruption = |r: &str| match r {
        "EvictionByEvictionAPI" | "TerminationByKubelet" => Cause::Evicted,
        "PreemptionByScheduler" => Cause::Preempted,
        "DeletionByTaintManager" | "DeletionByPodGC" => Cause::NodeLost,
        _ => Cause::PodDeleted,
    };
    if let Some(r) = &disruption {
        return Some((from_disruption(r), r.clone(), None));
    }
    if pod_phase(p) == "Failed" {
        let term = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.iter().find_map(|c| c.state.as_ref()?.terminated.clone()));
        let (code, reason) = term
            .map(|t| {
                (
                    Some(t.exit_code),
                    t.reason.unwrap_or_else(|| "Error".into()),
                )
            })
            .unwrap_or((None, "Error".into()));
        let reason = if p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("Evicted") {
            "Evicted".to_owned()
        } else {
            reason
        };
        let cause = if reason == "Evicted" {
            Cause::Evicted
        } else {
            Cause::ProcessExit
        };
        return Some((cause, reason, code));
    }
    if node_of(p).is_some_and(|n| lost_nodes.contains(n)) && pod_phase(p) != "Succeeded" {
        return Some((Cause::NodeLost, "NodeLost".into(), None));
    }
    if p.metadata.deletion_timestamp.is_some() && !by_operator(p) {
        return Some((Cause::PodDeleted, "Deleted".into(), None));
    }
    None
}

/// Whether a pod is a healthy worker that can be a ring member now.
fn ready_member(p: &Pod) -> bool {
    pod_phase(p) == "Running"
        && p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some()
        && condition(p, "Ready").is_some_and(|c| c.status == "True")
}

/// Whether a live pod is waiting for the scheduler (PodScheduled False), with its message.
fn unschedulable(p: &Pod) -> Option<String> {
    condition(p, "PodScheduled")
        .filter(|c| c.status == "False")
        .map(|c| c.message.clone().unwrap_or_default())
}

/// Computes the plan. Pure: same inputs, same plan.
pub fn plan(job: &DiphomaJob, obs: &Observed) -> Plan {
    let spec = &job.spec;
    let name = job.name_any();
    let prev = job.status.clone().unwrap_or_default();
    let mut status = DiphomaJobStatus {
        replicas: spec.replicas,
        selector: Some(build::selector(&name)),
        observed_generation: job.metadata.generation,
        ..prev.clone()
    };
    let mut plan = Plan::default();
    let now = obs.now;
    let ring = obs.ring.clone();
    let rank_of = |pod: &str| ring.as_ref().and_then(|r| r.rank_of(pod)).map(|r| r as i32);

    // Finished jobs stay finished: apply cleanPodPolicy and the TTL, nothing else.
    if prev.phase.is_some_and(Phase::is_terminal) {
        plan.delete = finished_deletions(spec.run_policy.clean_pod_policy, &obs.pods);
        ttl(job, &prev, now, &mut plan);
        plan.status = status;
        return plan;
    }
    if status.start_time.is_none() {
        status.start_time = Some(ts(now));
    }
    if let Some(p) = &obs.progress {
        status.progress = Some(Progress {
            step: p.step as i64,
            total_steps: p.total_steps.map(|t| t as i64),
            loss: p.loss,
            samples_per_second: p.samples_per_second,
            last_checkpoint_step: p.last_checkpoint_step.map(|s| s as i64),
            test_accuracy: p.test_accuracy,
        });
    }

    // 1. Failures: pods lost since the last reconcile, and ring members that vanished.
    let mut failed_pods = BTreeSet::new();
    for p in &obs.pods {
        if by_operator(p) && p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some((cause, reason, exit_code)) = classify(p, &obs.lost_nodes) else {
            continue;
        };
        failed_pods.insert(p.name_any());
        if cause == Cause::NodeLost && rank_of(&p.name_any()).is_none() && !started(p) {
            // Bound to a node that died before it ran: rescheduled, not a worker failure.
            plan.delete.push(Deletion {
                pod: p.name_any(),
                force: true,
                reason: "Rescheduled",
            });
            continue;
        }
        if counted(p) {
            // Already counted: make sure it goes away so that its index is replaced.
            if p.metadata.deletion_timestamp.is_none() || cause.force_delete() {
                plan.delete.push(Deletion {
                    pod: p.name_any(),
                    force: cause.force_delete(),
                    reason: "Replaced",
                });
            }
            continue;
        }
        let retryable = match cause {
            Cause::ProcessExit => exit_code.is_none_or(|c| spec.retryable_exit(c)),
            _ => true,
        };
        let at = loss_time(p).unwrap_or(now);
        plan.failures.push(Failure {
            pod: p.name_any(),
            rank: rank_of(&p.name_any()),
            cause,
            reason,
            exit_code,
            retryable,
            exists: true,
            at,
        });
    }
    // Members of this generation that left and were accounted for (a counted failure, an
    // operator deletion); a pod with the same name now (resumed after a suspension) is new.
    let mut departed: BTreeSet<String> = match (&prev.ring, &ring) {
        (Some(s), Some(r)) if s.generation == r.generation as i64 => {
            s.departed.iter().cloned().collect()
        }
        _ => BTreeSet::new(),
    };
    // Replacements avoid lost nodes, and late nodes whose silent member is counted NodeLost.
    let mut dead_nodes = obs.lost_nodes.clone();
    // Hung or cut-off members: blamed by a neighbour's report at the current generation and
    // silent themselves, once the reports had `detectionSeconds / 2` to arrive. On a node whose
    // Lease is late, the node went quiet with its worker: that is a node loss.
    if let Some(r) = &ring {
        let (hung, wait) =
            silent_members(r, &obs.reports, now, spec.fault_tolerance.detection_seconds);
        let hung: Vec<String> = hung
            .into_iter()
            .filter(|p| !failed_pods.contains(p) && !departed.contains(p) && present_pod(obs, p))
            .collect();
        for pod in hung {
            failed_pods.insert(pod.clone());
            let node = obs
                .pods
                .iter()
                .find(|p| p.name_any() == pod)
                .and_then(node_of);
            let (cause, reason) = if let Some(n) = node.filter(|n| obs.late_nodes.contains(*n)) {
                dead_nodes.insert(n.to_owned());
                (Cause::NodeLost, "NodeLost")
            } else {
                (Cause::Hung, "Silent")
            };
            plan.failures.push(Failure {
                rank: rank_of(&pod),
                pod,
                cause,
                reason: reason.into(),
                exit_code: None,
                retryable: true,
                exists: true,
                at: now,
            });
        }
        plan.requeue_after = wait;
    }
    // Members that vanished from the API without being accounted for were deleted by someone.
    let present: BTreeSet<String> = obs.pods.iter().map(|p| p.name_any()).collect();
    for m in ring.iter().flat_map(|r| r.members.iter()) {
        if !present.contains(&m.pod) && !departed.contains(&m.pod) {
            plan.failures.push(Failure {
                pod: m.pod.clone(),
                rank: Some(m.rank as i32),
                cause: Cause::PodDeleted,
                reason: "Deleted".into(),
                exit_code: None,
                retryable: true,
                exists: false,
                at: now,
            });
        }
    }
    for f in plan.failures.clone() {
        record(&mut status, &mut plan, f);
    }

    // 2. Terminal outcomes: a non-retryable exit, a spent budget, the deadline, completion.
    let fatal = plan.failures.iter().find(|f| !f.retryable).map(|f| {
        (
            "NonRetryableExit",
            format!(
                "worker {} exited with non-retryable code {}",
                f.pod,
                f.exit_code.unwrap_or_default()
            ),
        )
    });
    let budget = (status.failures.total > spec.run_policy.backoff_limit).then(|| {
        (
            "BackoffLimitExceeded",
            format!(
                "{} worker failures exceed backoffLimit {}",
                status.failures.total, spec.run_policy.backoff_limit
            ),
        )
    });
    let deadline = spec.run_policy.active_deadline_seconds.and_then(|d| {
        let start = parse_ts(status.start_time.as_deref()?)?;
        let end = start + jiff::SignedDuration::from_secs(d);
        if now >= end {
            Some((
                "DeadlineExceeded",
                format!("job ran longer than activeDeadlineSeconds {d}"),
            ))
        } else {
            plan.requeue_after = Some(
                Duration::from_secs_f64(end.duration_since(now).as_secs_f64().max(0.0))
                    + Duration::from_millis(100),
            );
            None
        }
    });
    if let Some((reason, msg)) = fatal.or(budget).or(deadline) {
        return finish(job, obs, status, plan, Phase::Failed, reason, msg);
    }
    if let Some(r) = &ring {
        // Finished its work: exit 0, not deleted (a deleted worker exits 0 on SIGTERM too, and
        // is a failure of its own cause).
        let succeeded: BTreeSet<String> = obs
            .pods
            .iter()
            .filter(|p| pod_phase(p) == "Succeeded" && !by_operator(p))
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| p.name_any())
            .filter(|n| !failed_pods.contains(n))
            .collect();
        // Members exit 0 one by one once the last step is committed. The ring has completed
        // when one has and none still runs; until then a finished worker is neither replaced
        // nor re-formed around, and the status holds. A member still running
        // COMPLETION_GRACE × detectionSeconds after the first finished is stuck (its neighbours,
        // gone, can no longer blame it): the ring has completed without it.
        let finished = |pod: &String| {
            succeeded.contains(pod) || failed_pods.contains(pod) || !present_pod(obs, pod)
        };
        let completing = r.members.iter().any(|m| succeeded.contains(&m.pod));
        if completing && !r.members.iter().all(|m| finished(&m.pod)) {
            let first_done = obs
                .pods
                .iter()
                .filter(|p| succeeded.contains(&p.name_any()))
                .filter_map(loss_time)
                .min();
            let grace = Duration::from_secs(
                COMPLETION_GRACE * spec.fault_tolerance.detection_seconds.max(1) as u64,
            );
            let waited = first_done.map_or(Duration::ZERO, |t| {
                Duration::from_secs_f64(now.duration_since(t).as_secs_f64().max(0.0))
            });
            if waited < grace {
                let again = grace - waited + Duration::from_millis(100);
                plan.requeue_after = Some(plan.requeue_after.map_or(again, |r| r.min(again)));
                plan.status = status;
                return plan;
            }
        }
        if completing {
            return finish(
                job,
                obs,
                status,
                plan,
                Phase::Succeeded,
                "RingCompleted",
                format!(
                    "all {} workers of generation {} completed",
                    r.members.len(),
                    r.generation
                ),
            );
        }
    }

    // 3. Suspension: delete every worker, keep the status.
    if spec.run_policy.suspend {
        for p in obs.pods.iter().filter(|p| !by_operator(p)) {
            plan.delete.push(Deletion {
                pod: p.name_any(),
                force: false,
                reason: "Suspended",
            });
        }
        if prev.phase != Some(Phase::Suspended) {
            plan.events
                .push((false, "JobSuspended", "workers deleted; status kept".into()));
        }
        if let Some(r) = &ring {
            // Every member leaves by the operator's hand: none of them is a failure later.
            status.ring = Some(ring_status(
                &name,
                r,
                r.members.iter().map(|m| m.pod.clone()).collect(),
            ));
        }
        status.phase = Some(Phase::Suspended);
        status.ready_replicas = 0;
        status.ready = Some(format!("0/{}", spec.replicas));
        status.conditions = conditions(
            &prev.conditions,
            Phase::Suspended,
            "Suspended",
            "the job is suspended",
            now,
            job.metadata.generation,
        );
        plan.status = status;
        return plan;
    }

    // 4. Desired workers: one live pod per index below `replicas`; the rest are scaled away.
    let desired = spec.replicas;
    let deleting: BTreeSet<String> = plan.delete.iter().map(|d| d.pod.clone()).collect();
    let mut live_by_index: BTreeMap<i32, &Pod> = BTreeMap::new();
    let mut attempts: BTreeMap<i32, i32> = BTreeMap::new();
    for p in &obs.pods {
        let Some(i) = build::replica_index(p) else {
            continue;
        };
        let a = attempts.entry(i).or_insert(-1);
        *a = (*a).max(build::attempt_of(&name, &p.name_any()));
        let gone = p.metadata.deletion_timestamp.is_some()
            || failed_pods.contains(&p.name_any())
            || deleting.contains(&p.name_any());
        if !gone && pod_phase(p) != "Succeeded" {
            if i >= desired {
                plan.delete.push(Deletion {
                    pod: p.name_any(),
                    force: false,
                    reason: "ScaledDown",
                });
            } else {
                live_by_index.insert(i, p);
            }
        }
    }
    for i in 0..desired {
        if !live_by_index.contains_key(&i) {
            let attempt = attempts.get(&i).map_or(0, |a| a + 1);
            let mut pod = build::worker_pod(job, i, attempt);
            build::avoid_nodes(&mut pod, &dead_nodes);
            plan.events.push((
                false,
                "WorkerCreated",
                format!("created worker {}", pod.name_any()),
            ));
            plan.create.push(pod);
        }
    }

    // 5. The ring: publish g+1 when the live membership changes, never below minReplicas.
    let (min, _) = spec.bounds();
    let ready: Vec<&Pod> = live_by_index
        .values()
        .copied()
        .filter(|p| ready_member(p))
        .collect();
    let ready_names: BTreeSet<String> = ready.iter().map(|p| p.name_any()).collect();
    let ring_names: BTreeSet<String> = ring
        .iter()
        .flat_map(|r| r.members.iter().map(|m| m.pod.clone()))
        .collect();
    let starting = live_by_index
        .values()
        .filter(|p| !ready_member(p) && unschedulable(p).is_none())
        .count()
        + plan.create.len();
    let lost_member = ring_names.iter().any(|n| !ready_names.contains(n));
    // A ready pod named like an accounted-for departed member is a new pod (resume).
    let rejoined = ready_names.iter().any(|n| departed.contains(n));
    let grown = rejoined || ready_names.iter().any(|n| !ring_names.contains(n));
    let enough = ready.len() as i32 >= min;
    let change =
        (rejoined || ready_names != ring_names) && (lost_member || (grown && starting == 0));
    if enough && change {
        let generation = ring.as_ref().map_or(1, |r| r.generation + 1);
        let members = ready
            .iter()
            .enumerate()
            .map(|(rank, p)| Member {
                rank: rank as u32,
                pod: p.name_any(),
                address: p
                    .status
                    .as_ref()
                    .and_then(|s| s.pod_ip.as_ref())
                    .and_then(|ip| ip.parse().ok())
                    .unwrap_or([0, 0, 0, 0].into()),
                port: spec.ring_port as u16,
            })
            .collect();
        let m = Membership {
            generation,
            job_uid: job.uid().unwrap_or_default(),
            members,
        };
        if lost_member && ring.is_some() {
            // Time to repair: from the loss to the ring re-formed without it.
            let lost_at = status.last_failure.as_ref().and_then(|f| parse_ts(&f.time));
            status.repairs.last_seconds =
                lost_at.map(|t| now.duration_since(t).as_secs_f64().max(0.0));
        }
        plan.events.push((
            false,
            "RingReformed",
            format!("generation {generation} with {} workers", m.members.len()),
        ));
        status.ring = Some(ring_status(&name, &m, vec![]));
        plan.publish = Some(m);
    } else if let Some(r) = &ring {
        departed.extend(
            plan.failures
                .iter()
                .filter(|f| f.rank.is_some())
                .map(|f| f.pod.clone()),
        );
        departed.extend(
            plan.delete
                .iter()
                .filter(|d| r.rank_of(&d.pod).is_some())
                .map(|d| d.pod.clone()),
        );
        status.ring = Some(ring_status(&name, r, departed.into_iter().collect()));
    }
    let ring_size = status.ring.as_ref().map_or(0, |r| r.size);
    let members: BTreeSet<&str> = plan
        .publish
        .as_ref()
        .or(ring.as_ref())
        .iter()
        .flat_map(|r| r.members.iter().map(|m| m.pod.as_str()))
        .collect();
    status.ready_replicas = ready_names
        .iter()
        .filter(|n| members.contains(n.as_str()))
        .count() as i32;
    status.ready = Some(format!("{}/{}", status.ready_replicas, desired));
    status.waiting = if !enough {
        let short = live_by_index
            .values()
            .find_map(|p| unschedulable(p))
            .filter(|m| !m.is_empty());
        Some(match short {
            Some(msg) => format!(
                "{} of {min} workers ready; the scheduler says: {msg}",
                ready.len()
            ),
            None => format!(
                "{} of {min} workers ready; waiting for workers to start",
                ready.len()
            ),
        })
    } else {
        live_by_index
            .values()
            .find_map(|p| unschedulable(p))
            .map(|m| {
                format!(
                    "running with {} of {desired} workers; the scheduler says: {m}",
                    ready.len()
                )
            })
    };

    // 6. Phase and conditions.
    let unrepaired = lost_member && plan.publish.is_none();
    let phase = if ring.is_none() && plan.publish.is_none() {
        if obs.pods.is_empty() {
            Phase::Pending
        } else {
            Phase::Starting
        }
    } else if unrepaired || !plan.failures.is_empty() {
        Phase::Repairing
    } else if ring_size == desired {
        Phase::Running
    } else if prev.phase == Some(Phase::Repairing) && ring_size < desired && starting > 0 {
        Phase::Repairing
    } else {
        Phase::Scaling
    };
    status.phase = Some(phase);
    let (reason, msg) = match phase {
        Phase::Running => (
            "RingFormed",
            format!(
                "{ring_size} workers at generation {}",
                status.ring.as_ref().map_or(0, |r| r.generation)
            ),
        ),
        _ => (
            phase_reason(phase),
            status
                .waiting
                .clone()
                .unwrap_or_else(|| format!("{ring_size} of {desired} workers in the ring")),
        ),
    };
    status.conditions = conditions(
        &prev.conditions,
        phase,
        reason,
        &msg,
        now,
        job.metadata.generation,
    );
    plan.status = status;
    plan
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

/// Members of `ring` that neighbours blame in reports of its generation and that did not report
/// themselves: (pods, when to look again if the reports are still young). Reports get
/// `detection_seconds / 2` to arrive, so that a live member whose own report is late is not taken
/// for the silent one.
pub fn silent_members(
    ring: &Membership,
    reports: &[FailureReport],
    now: Timestamp,
    detection_seconds: i32,
) -> (Vec<String>, Option<Duration>) {
    let current: Vec<&FailureReport> = reports
        .iter()
        .filter(|r| r.generation == ring.generation)
        .collect();
    let Some(oldest) = current.iter().filter_map(|r| parse_ts(&r.time)).min() else {
        return (vec![], None);
    };
    let grace = jiff::SignedDuration::from_millis(i64::from(detection_seconds) * 500);
    let age = now.duration_since(oldest);
    if age < grace {
        let wait = (grace - age).unsigned_abs() + Duration::from_millis(100);
        return (vec![], Some(wait));
    }
    let reporters: BTreeSet<&str> = current.iter().map(|r| r.reporter.as_str()).collect();
    let hung = ring
        .members
        .iter()
        .map(|m| m.pod.as_str())
        .filter(|p| {
            !reporters.contains(p) && current.iter().any(|r| r.suspect.as_deref() == Some(*p))
        })
        .map(str::to_owned)
        .collect();
    (hung, None)
}

/// Counts a failure, remembers it as the last one, announces it and, for a pod that still
/// exists, schedules its deletion (it is replaced under a new name).
fn record(status: &mut DiphomaJobStatus, plan: &mut Plan, f: Failure) {
    status.failures.add(f.cause.as_str());
    status.last_failure = Some(LastFailure {
        pod: f.pod.clone(),
        rank: f.rank,
        exit_code: f.exit_code,
        cause: f.cause.as_str().into(),
        reason: f.reason.clone(),
        time: ts(f.at),
    });
    let note = match f.exit_code {
        Some(c) => format!(
            "worker {} ({}) lost: {} with exit code {c}",
            f.pod,
            f.cause.as_str(),
            f.reason
        ),
        None => format!("worker {} ({}) lost: {}", f.pod, f.cause.as_str(), f.reason),
    };
    if f.rank.is_some() {
        status.repairs.add(f.cause.as_str()); // a ring member lost: the ring must be re-formed
    }
    let reason = if f.cause == Cause::NodeLost {
        "NodeLost"
    } else {
        "WorkerFailed"
    };
    plan.events.push((true, reason, note));
    if f.exists && f.cause != Cause::PodDeleted {
        plan.delete.push(Deletion {
            pod: f.pod.clone(),
            force: f.cause.force_delete(),
            reason: "Replaced",
        });
    }
}

/// The status view of ring generation `m` of job `job`.
fn ring_status(job: &str, m: &Membership, departed: Vec<String>) -> RingStatus {
    RingStatus {
        generation: m.generation as i64,
        size: m.members.len() as i32,
        config_map: diphoma_contract::membership_configmap_name(job),
        departed,
    }
}

fn phase_reason(p: Phase) -> &'static str {
    match p {
        Phase::Pending => "Pending",
        Phase::Starting => "WorkersStarting",
        Phase::Running => "RingFormed",
        Phase::Repairing => "RingRepairing",
        Phase::Scaling => "RingScaling",
        Phase::Suspended => "Suspended",
        Phase::Succeeded => "RingCompleted",
        Phase::Failed => "Failed",
    }
}

/// How many detectionSeconds the members of a completing ring get to follow the first one out.
const COMPLETION_GRACE: u64 = 6;

/// When a lost pod was lost: its container's finish time, else its deletion time.
fn loss_time(p: &Pod) -> Option<Timestamp> {
    let st = p.status.as_ref()?;
    let finished = st
        .container_statuses
        .iter()
        .flatten()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.finished_at.clone());
    finished
        .map(|t| t.0)
        .or(p.metadata.deletion_timestamp.clone().map(|t| t.0))
}

/// Ends the job: terminal phase, completion time, conditions, clean-up.
fn finish(
    job: &DiphomaJob,
    obs: &Observed,
    mut status: DiphomaJobStatus,
    mut plan: Plan,
    phase: Phase,
    reason: &'static str,
    msg: String,
) -> Plan {
    let prev = job.status.clone().unwrap_or_default();
    status.phase = Some(phase);
    status.completion_time = Some(ts(obs.now));
    status.ready_replicas = 0;
    status.ready = Some(format!("0/{}", job.spec.replicas));
    status.waiting = None;
    status.conditions = conditions(
        &prev.conditions,
        phase,
        reason,
        &msg,
        obs.now,
        job.metadata.generation,
    );
    let event = if phase == Phase::Succeeded {
        "JobSucceeded"
    } else {
        "JobFailed"
    };
    plan.events.push((phase == Phase::Failed, event, msg));
    // Nothing replaces a lost worker any more: only forced deletions (lost node, frozen
    // process) stay; cleanPodPolicy decides about the rest (a failed pod stays for its logs).
    plan.delete.retain(|d| d.force);
    let already: BTreeSet<String> = plan.delete.iter().map(|d| d.pod.clone()).collect();
    plan.delete.extend(
        finished_deletions(job.spec.run_policy.clean_pod_policy, &obs.pods)
            .into_iter()
            .filter(|d| !already.contains(&d.pod)),
    );
    plan.create.clear();
    plan.publish = None;
    ttl(job, &status, obs.now, &mut plan);
    plan.status = status;
    plan
}

/// Pods to delete once the job has finished, per `cleanPodPolicy`.
fn finished_deletions(policy: CleanPodPolicy, pods: &[Pod]) -> Vec<Deletion> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| match policy {
            CleanPodPolicy::All => true,
            CleanPodPolicy::Running => !matches!(pod_phase(p), "Succeeded" | "Failed"),
            CleanPodPolicy::None => false,
        })
        .map(|p| Deletion {
            pod: p.name_any(),
            force: false,
            reason: "JobFinished",
        })
        .collect()
}

/// `ttlSecondsAfterFinished`: delete the job when due, else requeue for then.
fn ttl(job: &DiphomaJob, status: &DiphomaJobStatus, now: Timestamp, plan: &mut Plan) {
    let (Some(ttl), Some(done)) = (
        job.spec.run_policy.ttl_seconds_after_finished,
        status.completion_time.as_deref().and_then(parse_ts),
    ) else {
        return;
    };
    let due = done + jiff::SignedDuration::from_secs(ttl);
    if now >= due {
        plan.delete_job = true;
    } else {
        plan.requeue_after = Some(
            Duration::from_secs_f64(due.duration_since(now).as_secs_f64())
                + Duration::from_millis(100),
        );
    }
}

/// The job's conditions for `phase`; a condition keeps its `lastTransitionTime` unless its status
/// flips.
pub fn conditions(
    prev: &[Condition],
    phase: Phase,
    reason: &str,
    message: &str,
    now: Timestamp,
    generation: Option<i64>,
) -> Vec<Condition> {
    let truth = |t: &str| match t {
        "Ready" => phase == Phase::Running,
        "Progressing" => matches!(
            phase,
            Phase::Starting | Phase::Running | Phase::Repairing | Phase::Scaling
        ),
        "Suspended" => phase == Phase::Suspended,
        "Complete" => phase == Phase::Succeeded,
        "Failed" => phase == Phase::Failed,
        _ => false,
    };
    ["Ready", "Progressing", "Suspended", "Complete", "Failed"]
        .iter()
        .map(|t| {
            let status = if truth(t) { "True" } else { "False" }.to_owned();
            let old = prev.iter().find(|c| c.type_ == *t);
            let last_transition_time = match old {
                Some(o) if o.status == status => o.last_transition_time.clone(),
                _ => ts(now),
            };
            Condition {
                type_: (*t).into(),
                status,
                reason: reason.into(),
                message: message.into(),
                last_transition_time,
                observed_generation: generation,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
