//! Step 1 of the plan: failures. From the nodes judged by [`super::nodes`], classifies lost
//! pods, finds silent ring members from the workers' reports (those that answer the operator's
//! liveness probe are alive, [`Observed::answering`]) and members that vanished, and
//! records each new failure (counts, last failure, event, the deletion of a lost pod that still
//! runs; finished failed pods are kept for their logs as `cleanPodPolicy` says). Pure; it
//! decides nothing about the job's end (that is [`super::lifecycle`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use diphoma_contract::{FailureReport, Membership};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::nodes::Nodes;
use super::{
    Cause, Deletion, EventNote, Failure, Observed, Plan, by_operator, condition, counted, node_of,
    parse_ts, pod_phase, present_pod, started, ts,
};
use crate::api::{CountedPod, DiphomaJob, DiphomaJobStatus, LastFailure};
use crate::build::ANNOT_FAILURE_COUNTED;

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

/// The most a failure's message keeps of its container's termination message (the kubelet's
/// own bound): the end, where a traceback names the exception.
pub const MESSAGE_BYTES: usize = diphoma_contract::TERMINATION_MESSAGE_BYTES;

/// What the container whose exit [`classify`] reads (the first terminated one) said as it
/// ended, after a failed exit: its termination message (the last log lines under
/// `FallbackToLogsOnError`), trimmed, its last [`MESSAGE_BYTES`] at most; `None` when it said
/// nothing.
pub fn termination_message(p: &Pod) -> Option<String> {
    let cs = p.status.as_ref()?.container_statuses.as_ref()?;
    let text = cs
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref())
        .filter(|t| t.exit_code != 0)?
        .message
        .as_deref()?
        .trim();
    (!text.is_empty()).then(|| diphoma_contract::tail(text, MESSAGE_BYTES).to_owned())
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

/// The failure reports still in force for `ring`: a report of its generation that rank 0's
/// progress at that generation postdates is settled (the ring committed a step after it, so
/// whoever it blamed recovered), and would otherwise blame for the rest of the generation
/// (reports are never deleted).
fn in_force(ring: &Membership, obs: &Observed) -> Vec<FailureReport> {
    let settled = obs
        .progress
        .as_ref()
        .filter(|p| p.generation == ring.generation)
        .and_then(|p| parse_ts(&p.time));
    obs.reports
        .iter()
        .filter(|r| settled.is_none_or(|s| parse_ts(&r.time).is_none_or(|t| t > s)))
        .cloned()
        .collect()
}

/// The members that the failures step would count as hung now ([`silent_members`] of the
/// published ring, their reports in force and old enough; only pods that run, not yet counted
/// nor being deleted), with their ring addresses: the controller asks each whether it is alive
/// before the plan decides ([`Observed::answering`]). None for a finished job.
pub fn suspects(job: &DiphomaJob, obs: &Observed) -> Vec<diphoma_contract::Member> {
    let Some(ring) = obs.ring.as_ref() else {
        return vec![];
    };
    let finished = job
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .is_some_and(crate::api::Phase::is_terminal);
    if finished || job.spec.run_policy.suspend {
        return vec![];
    }
    let detection = job.spec.fault_tolerance.detection_seconds;
    let (silent, _) = silent_members(ring, &in_force(ring, obs), obs.now, detection);
    let runs = |pod: &str| {
        obs.pods.iter().any(|p| {
            p.name_any() == pod
                && pod_phase(p) == "Running"
                && p.metadata.deletion_timestamp.is_none()
                && !counted(p)
        })
    };
    ring.members
        .iter()
        .filter(|m| silent.contains(&m.pod) && runs(&m.pod))
        .cloned()
        .collect()
}

/// A silent member that answers liveness probes but whose ring has not committed a step since
/// it was first blamed, for `CUT_OFF_FACTOR × detectionSeconds`, is cut off from its peers (a
/// network partition between them): it is counted `Hung` (reason `CutOff`) so the ring re-forms
/// without it, rather than waiting forever.
pub const CUT_OFF_FACTOR: i64 = 3;

/// When `pod` was first blamed at `ring`'s generation (the oldest report suspecting it).
fn blamed_at(ring: &Membership, reports: &[FailureReport], pod: &str) -> Option<Timestamp> {
    reports
        .iter()
        .filter(|r| r.generation == ring.generation && r.suspect.as_deref() == Some(pod))
        .filter_map(|r| parse_ts(&r.time))
        .min()
}

/// When a member blamed at `since` and answering probes will be cut off (none: it is now), for
/// [`CUT_OFF_FACTOR`] × `detection_seconds` of blame still in force: a step its ring committed
/// since would have settled the blame ([`in_force`]).
fn cut_off_in(since: Timestamp, now: Timestamp, detection_seconds: i32) -> Option<Duration> {
    let bound = jiff::SignedDuration::from_secs(CUT_OFF_FACTOR * i64::from(detection_seconds));
    let left = (since + bound).duration_since(now);
    left.is_positive()
        .then(|| left.unsigned_abs() + Duration::from_millis(100))
}

/// What the failures step found, for the steps after it.
#[derive(Debug, Clone, Default)]
pub struct Found {
    /// Pods lost (counted now or before, or rescheduled): never live workers.
    pub failed_pods: BTreeSet<String>,
    /// Members of this generation that left and were accounted for (a counted failure, an
    /// operator deletion); a pod with the same name now (resumed after a suspension) is new.
    pub departed: BTreeSet<String>,
    /// Nodes replacements avoid: the lost ones, and late ones whose silent member is counted
    /// `NodeLost`.
    pub dead_nodes: BTreeSet<String>,
}

/// Step 1: finds the failures since the last reconcile — lost pods, silent members, members
/// that vanished — and records each new one in `plan` (see `record`: the job's own failures and
/// disruptions are counted apart, [`Cause::is_disruption`]). Sets
/// `plan.requeue_after` when failure reports are still too young to judge.
pub fn detect(job: &DiphomaJob, obs: &Observed, nodes: &Nodes, plan: &mut Plan) -> Found {
    let spec = &job.spec;
    let now = obs.now;
    let prev_ring = job.status.as_ref().and_then(|s| s.ring.as_ref());
    let ring = obs.ring.as_ref();
    let rank_of = |pod: &str| ring.and_then(|r| r.rank_of(pod)).map(|r| r as i32);
    let mut found = Found {
        dead_nodes: nodes.lost.clone(),
        departed: match (prev_ring, ring) {
            (Some(s), Some(r)) if s.generation == r.generation as i64 => {
                s.departed.iter().cloned().collect()
            }
            _ => BTreeSet::new(),
        },
        ..Found::default()
    };
    // Counted by the status, not yet seen marked: counted already (see `unmarked`).
    plan.status.counted_pods = unmarked(&plan.status.counted_pods, obs);
    for p in &obs.pods {
        if by_operator(p) && p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let lost = classify(p, &nodes.lost);
        let journaled = (plan.status.counted_pods.iter())
            .find(|c| c.uid.is_some() && c.uid == p.uid())
            .map(|c| c.cause.clone());
        if let Some(cause) =
            journaled.or_else(|| p.annotations().get(ANNOT_FAILURE_COUNTED).cloned())
        {
            // Counted before (marked, or its mark not written yet: the operator stopped between
            // the two writes): a pod that still runs (frozen, on a lost node) must go; a
            // finished one stays for its logs, as `cleanPodPolicy` says (see `keep_failed`).
            found.failed_pods.insert(p.name_any());
            let force = (lost.iter().map(|l| l.0))
                .chain(Cause::ALL.into_iter().filter(|c| c.as_str() == cause))
                .any(Cause::force_delete);
            if (p.metadata.deletion_timestamp.is_none() && !terminal(p)) || force {
                plan.delete.push(Deletion {
                    pod: p.name_any(),
                    force,
                    reason: "Replaced",
                });
            }
            continue;
        }
        let Some((cause, reason, exit_code)) = lost else {
            continue;
        };
        found.failed_pods.insert(p.name_any());
        if cause == Cause::NodeLost && rank_of(&p.name_any()).is_none() && !started(p) {
            // Bound to a node that died before it ran: rescheduled, not a worker failure.
            plan.delete.push(Deletion {
                pod: p.name_any(),
                force: true,
                reason: "Rescheduled",
            });
            continue;
        }
        let retryable = match cause {
            Cause::ProcessExit => exit_code.is_none_or(|c| spec.retryable_exit(c)),
            _ => true,
        };
        plan.failures.push(Failure {
            pod: p.name_any(),
            rank: rank_of(&p.name_any()),
            cause,
            reason,
            exit_code,
            message: termination_message(p),
            retryable,
            exists: true,
            at: loss_time(p).map_or(now, |t| t.min(now)),
        });
    }
    // Hung or cut-off members: blamed by a neighbour's report at the current generation and
    // silent themselves, once the reports had `detectionSeconds / 2` to arrive, and not
    // answering this operator's probe (a live process is not hung, unless cut off from its
    // peers). On a node whose Lease is late, the node went quiet with its worker: a node loss.
    if let Some(r) = ring {
        let detection = spec.fault_tolerance.detection_seconds;
        let reports = in_force(r, obs);
        let (hung, wait) = silent_members(r, &reports, now, detection);
        let mut cut = BTreeSet::new();
        let hung: Vec<String> = hung
            .into_iter()
            .filter(|p| {
                !found.failed_pods.contains(p) && !found.departed.contains(p) && present_pod(obs, p)
            })
            .filter(|p| {
                let since = blamed_at(r, &reports, p).unwrap_or(now);
                if obs.exited.contains(p) {
                    // Exited: the pod's status is about to say how (the cause that ended it).
                    let grace = jiff::SignedDuration::from_secs(i64::from(detection));
                    let left = (since + grace).duration_since(now);
                    if left.is_positive() {
                        plan.due_in(left.unsigned_abs() + Duration::from_millis(100));
                        return false;
                    }
                    return true;
                }
                if !obs.answering.contains(p) {
                    return true;
                }
                match cut_off_in(since, now, detection) {
                    None => cut.insert(p.clone()),
                    Some(look_again) => {
                        plan.due_in(look_again);
                        false
                    }
                }
            })
            .collect();
        for pod in hung {
            found.failed_pods.insert(pod.clone());
            let node = obs
                .pods
                .iter()
                .find(|p| p.name_any() == pod)
                .and_then(node_of);
            let (cause, reason) = if let Some(n) = node.filter(|n| nodes.late.contains(*n)) {
                found.dead_nodes.insert(n.to_owned());
                (Cause::NodeLost, "NodeLost")
            } else if cut.contains(&pod) {
                (Cause::Hung, "CutOff")
            } else {
                (Cause::Hung, "Silent")
            };
            plan.failures.push(Failure {
                rank: rank_of(&pod),
                pod,
                cause,
                reason: reason.into(),
                exit_code: None,
                message: None,
                retryable: true,
                exists: true,
                at: now,
            });
        }
        if let Some(wait) = wait {
            plan.due_in(wait);
        }
    }
    // Members that vanished from the API without being accounted for were deleted by someone.
    let present: BTreeSet<String> = obs.pods.iter().map(|p| p.name_any()).collect();
    for m in ring.iter().flat_map(|r| r.members.iter()) {
        if !present.contains(&m.pod)
            && !found.departed.contains(&m.pod)
            && !plan.status.counted_pods.iter().any(|c| c.pod == m.pod)
        {
            plan.failures.push(Failure {
                pod: m.pod.clone(),
                rank: Some(m.rank as i32),
                cause: Cause::PodDeleted,
                reason: "Deleted".into(),
                exit_code: None,
                message: None,
                retryable: true,
                exists: false,
                at: now,
            });
        }
    }
    for f in plan.failures.clone() {
        let keep = obs
            .pods
            .iter()
            .any(|p| p.name_any() == f.pod && terminal(p));
        plan.status.counted_pods.push(CountedPod {
            pod: f.pod.clone(),
            uid: (obs.pods.iter())
                .find(|p| f.exists && p.name_any() == f.pod)
                .and_then(|p| p.uid()),
            cause: f.cause.as_str().into(),
        });
        record(
            &mut plan.status,
            &mut plan.delete,
            &mut plan.events,
            f,
            keep,
        );
    }
    plan.mark = (plan.status.counted_pods.iter())
        .filter(|c| c.uid.is_some())
        .filter(|c| obs.pods.iter().any(|p| p.uid() == c.uid && !counted(p)))
        .cloned()
        .collect();
    keep_failed(job, obs, plan);
    found
}

/// The entries of a status's `countedPods` (`journal`) whose mark is still not seen in `obs`:
/// a pod (by UID) that exists unmarked (its `diphoma.io/failure-counted` annotation missing),
/// or one that is gone, no pod holds its name and the published ring still lists it (a member
/// that vanished: only the ring could count it again). The status is written before the marks,
/// so an operator stopped between the two leaves such entries, and they keep the pod from being
/// counted again; once marked, the mark does, and a new pod of the same name is a new pod.
pub fn unmarked(journal: &[CountedPod], obs: &Observed) -> Vec<CountedPod> {
    let vanished = |pod: &str| {
        !present_pod(obs, pod) && obs.ring.as_ref().is_some_and(|r| r.rank_of(pod).is_some())
    };
    (journal.iter())
        .filter(|c| {
            let p = obs
                .pods
                .iter()
                .find(|p| c.uid.is_some() && p.uid() == c.uid);
            p.map_or_else(|| vanished(&c.pod), |p| !counted(p))
        })
        .cloned()
        .collect()
}

/// [`Deletion::reason`] of an older failed pod of a worker whose newer failed pod is kept.
pub const PRUNED: &str = "Pruned";

/// Whether a lost pod has finished (phase `Failed`, not being deleted): its containers are
/// gone, it holds no resources, and its logs are what the user wants to read.
fn terminal(p: &Pod) -> bool {
    pod_phase(p) == "Failed" && p.metadata.deletion_timestamp.is_none()
}

/// Finished failed pods are kept for `kubectl logs`: every one with `cleanPodPolicy: None`,
/// otherwise the most recent of each worker index (older ones are deleted, `Pruned`). A
/// replacement never needs its predecessor gone: it takes the next attempt's name.
fn keep_failed(job: &DiphomaJob, obs: &Observed, plan: &mut Plan) {
    if job.spec.run_policy.clean_pod_policy == crate::api::CleanPodPolicy::None {
        return;
    }
    let name = job.name_any();
    let mut newest: BTreeMap<i32, (i32, String)> = BTreeMap::new();
    let failed: Vec<(i32, i32, String)> = obs
        .pods
        .iter()
        .filter(|p| terminal(p))
        .filter_map(|p| {
            let i = crate::build::replica_index(p)?;
            Some((
                i,
                crate::build::attempt_of(&name, &p.name_any()),
                p.name_any(),
            ))
        })
        .collect();
    for (i, attempt, pod) in &failed {
        let e = newest.entry(*i).or_insert((*attempt, pod.clone()));
        if *attempt > e.0 {
            *e = (*attempt, pod.clone());
        }
    }
    for (i, _, pod) in failed {
        let already = plan.delete.iter().any(|d| d.pod == pod);
        if newest.get(&i).is_some_and(|(_, n)| *n != pod) && !already {
            plan.delete.push(Deletion {
                pod,
                force: false,
                reason: PRUNED,
            });
        }
    }
}

/// Counts a repair for each ring member this plan found lost, once the job is known to run on
/// (a job that fails or stops with the loss repairs nothing: RESTARTS counts repairs only).
pub fn count_repairs(plan: &mut Plan) {
    for f in plan.failures.iter().filter(|f| f.rank.is_some()) {
        plan.status.repairs.add(f.cause.as_str());
    }
}

/// Counts a failure, remembers it as the last one, announces it and, for a pod that still
/// exists and is not to be `keep`t (a finished pod stays for its logs), schedules its deletion
/// (it is replaced under a new name either way).
fn record(
    status: &mut DiphomaJobStatus,
    delete: &mut Vec<Deletion>,
    events: &mut Vec<EventNote>,
    f: Failure,
    keep: bool,
) {
    if f.cause.is_disruption() {
        status.disruptions.add(f.cause.as_str());
    } else {
        status.failures.add(f.cause.as_str());
    }
    status.last_failure = Some(LastFailure {
        pod: f.pod.clone(),
        rank: f.rank,
        exit_code: f.exit_code,
        cause: f.cause.as_str().into(),
        reason: f.reason.clone(),
        message: f.message.clone(),
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
    let reason = if f.cause == Cause::NodeLost {
        "NodeLost"
    } else {
        "WorkerFailed"
    };
    events.push(EventNote::warning(reason, "Replace", note).about(&f.pod));
    if f.exists && f.cause != Cause::PodDeleted && (!keep || f.cause.force_delete()) {
        delete.push(Deletion {
            pod: f.pod.clone(),
            force: f.cause.force_delete(),
            reason: "Replaced",
        });
    }
}

/// When a lost pod was lost: its container's finish time, else the request of its graceful
/// deletion (`deletionTimestamp` is the deadline: the request plus `deletionGracePeriodSeconds`,
/// in the future of the loss); none for a pod neither finished nor deleted (timed from when it
/// is observed).
pub(super) fn loss_time(p: &Pod) -> Option<Timestamp> {
    let finished = p
        .status
        .as_ref()
        .and_then(|st| st.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.finished_at.clone())
        .map(|t| t.0);
    let requested = p.metadata.deletion_timestamp.as_ref().map(|t| {
        let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(0);
        t.0 - jiff::SignedDuration::from_secs(grace)
    });
    finished.or(requested)
}
