//! Step 2 of the plan: the job's lifecycle — a finished job's clean-up and TTL, the terminal
//! outcomes (a non-retryable exit, a spent `backoffLimit` or `disruptionLimit`,
//! `activeDeadlineSeconds`, the ring's completion) and suspension. Pure; it never creates workers or publishes a ring.

use std::collections::BTreeSet;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::failures::{Found, PRUNED, loss_time};
use super::ring::ring_status;
use super::status::conditions;
use super::{
    Deletion, EventNote, Hold, Observed, Plan, by_operator, parse_ts, pod_phase, present_pod, ts,
};
use crate::api::{CleanPodPolicy, DiphomaJob, DiphomaJobStatus, Phase};

/// How many detectionSeconds the members of a completing ring get to follow the first one out.
const COMPLETION_GRACE: u64 = 6;

/// A finished job stays finished: `cleanPodPolicy` and the TTL, nothing else.
pub fn finished(job: &DiphomaJob, obs: &Observed, plan: &mut Plan) {
    plan.delete = finished_deletions(job.spec.run_policy.clean_pod_policy, &obs.pods);
    plan.status.counted_pods.clear(); // a finished job counts nothing more
    let prev = job.status.clone().unwrap_or_default();
    ttl(job, &prev, obs.now, plan);
}

/// How a running job's lifecycle goes on after its failures were recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The plan is complete: the job finished, holds while its ring completes, or is suspended.
    Done,
    /// The job runs on: plan its workers and its ring.
    Run,
}

/// Step 2: ends the job when a failure is fatal, the budget is spent, the deadline passed or the
/// ring completed; holds while the members of a completing ring finish; suspends while `hold`
/// ([`super::admission::hold`]). Sets `plan.requeue_after` for the deadline and the completion
/// grace.
pub fn lifecycle(
    job: &DiphomaJob,
    obs: &Observed,
    hold: Option<&Hold>,
    found: &Found,
    plan: &mut Plan,
) -> Next {
    if let Some((reason, msg)) = failed(job, obs.now, hold.is_some(), plan) {
        finish(job, obs, plan, Phase::Failed, reason, msg);
        return Next::Done;
    }
    match completion(job, obs, found, plan) {
        Some(Completion::Holding) => return Next::Done,
        Some(Completion::Completed(msg)) => {
            finish(job, obs, plan, Phase::Succeeded, "RingCompleted", msg);
            return Next::Done;
        }
        None => {}
    }
    if let Some(hold) = hold {
        suspend(job, obs, hold, plan);
        return Next::Done;
    }
    Next::Run
}

/// The terminal failure, if any: (reason, message). A deadline not yet reached sets
/// `plan.requeue_after` for it.
fn failed(
    job: &DiphomaJob,
    now: Timestamp,
    held: bool,
    plan: &mut Plan,
) -> Option<(&'static str, String)> {
    let spec = &job.spec;
    let status = &plan.status;
    let fatal = plan.failures.iter().find(|f| !f.retryable).map(|f| {
        (
            "NonRetryableExit",
            format!(
                "worker {} exited with non-retryable code {}{}",
                f.pod,
                f.exit_code.unwrap_or_default(),
                // The last line of what it said: a traceback's exception.
                f.message
                    .as_deref()
                    .and_then(|m| m.lines().rev().find(|l| !l.trim().is_empty()))
                    .map_or(String::new(), |l| format!(": {}", l.trim()))
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
    let mut due = None;
    // The deadline does not run while the job is held (suspended, queued).
    let deadline = spec
        .run_policy
        .active_deadline_seconds
        .filter(|_| !held)
        .and_then(|d| {
            let start = parse_ts(status.start_time.as_deref()?)?;
            let end = start + jiff::SignedDuration::from_secs(d);
            if now >= end {
                Some((
                    "DeadlineExceeded",
                    format!("job ran longer than activeDeadlineSeconds {d}"),
                ))
            } else {
                due = Some(
                    Duration::from_secs_f64(end.duration_since(now).as_secs_f64().max(0.0))
                        + Duration::from_millis(100),
                );
                None
            }
        });
    let disruptions = spec
        .fault_tolerance
        .disruption_limit
        .filter(|limit| status.disruptions.total > *limit)
        .map(|limit| {
            (
                "DisruptionLimitExceeded",
                format!(
                    "{} disruptions exceed faultTolerance.disruptionLimit {limit}",
                    status.disruptions.total
                ),
            )
        });
    if let Some(d) = due {
        plan.due_in(d);
    }
    fatal.or(budget).or(disruptions).or(deadline)
}

/// Where a ring's completion stands.
enum Completion {
    /// Some members finished, others still run within the grace: hold the status.
    Holding,
    /// The ring has completed (the message says which generation).
    Completed(String),
}

/// Members exit 0 one by one once the last step is committed. The ring has completed when one
/// has and none still runs; until then a finished worker is neither replaced nor re-formed
/// around, and the status holds. A member still running `COMPLETION_GRACE × detectionSeconds`
/// after the first finished is stuck (its neighbours, gone, can no longer blame it): the ring
/// has completed without it.
fn completion(
    job: &DiphomaJob,
    obs: &Observed,
    found: &Found,
    plan: &mut Plan,
) -> Option<Completion> {
    let r = obs.ring.as_ref()?;
    // Finished its work: exit 0, not deleted (a deleted worker exits 0 on SIGTERM too, and is a
    // failure of its own cause).
    let succeeded: BTreeSet<String> = obs
        .pods
        .iter()
        .filter(|p| pod_phase(p) == "Succeeded" && !by_operator(p))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| p.name_any())
        .filter(|n| !found.failed_pods.contains(n))
        .collect();
    let finished = |pod: &String| {
        succeeded.contains(pod) || found.failed_pods.contains(pod) || !present_pod(obs, pod)
    };
    if !r.members.iter().any(|m| succeeded.contains(&m.pod)) {
        return None;
    }
    if !r.members.iter().all(|m| finished(&m.pod)) {
        let first_done = obs
            .pods
            .iter()
            .filter(|p| succeeded.contains(&p.name_any()))
            .filter_map(loss_time)
            .min();
        let grace = Duration::from_secs(
            COMPLETION_GRACE * job.spec.fault_tolerance.detection_seconds.max(1) as u64,
        );
        let waited = first_done.map_or(Duration::ZERO, |t| {
            Duration::from_secs_f64(obs.now.duration_since(t).as_secs_f64().max(0.0))
        });
        if waited < grace {
            let again = grace - waited + Duration::from_millis(100);
            plan.due_in(again);
            return Some(Completion::Holding);
        }
    }
    Some(Completion::Completed(format!(
        "all {} workers of generation {} completed",
        r.members.len(),
        r.generation
    )))
}

/// Suspension (or a queue's hold): delete every worker, keep the status but the start time
/// (set again when the workers run after the resumption, as batch Job's).
fn suspend(job: &DiphomaJob, obs: &Observed, hold: &Hold, plan: &mut Plan) {
    let spec = &job.spec;
    let prev = job.status.clone().unwrap_or_default();
    for p in obs.pods.iter().filter(|p| !by_operator(p)) {
        plan.delete.push(Deletion {
            pod: p.name_any(),
            force: false,
            reason: "Suspended",
        });
    }
    if prev.phase != Some(Phase::Suspended) {
        plan.events.push(EventNote::normal(
            "JobSuspended",
            "Suspend",
            format!("{}: workers deleted; status kept", hold.message),
        ));
    }
    let status = &mut plan.status;
    if let Some(r) = &obs.ring {
        // Every member leaves by the operator's hand: none of them is a failure later.
        status.ring = Some(ring_status(
            &job.name_any(),
            job.spec.processes_per_worker(),
            r,
            r.members.iter().map(|m| m.pod.clone()).collect(),
            &obs.pods,
        ));
    }
    status.phase = Some(Phase::Suspended);
    status.start_time = None;
    status.ready_replicas = 0;
    status.ready = Some(format!("0/{}", spec.replicas));
    status.waiting = Some(format!("{}: {}", hold.reason, hold.message));
    status.conditions = conditions(
        &prev.conditions,
        Phase::Suspended,
        &hold.reason,
        &hold.message,
        obs.now,
        job.metadata.generation,
    );
}

/// Ends the job: terminal phase, completion time, conditions, clean-up.
fn finish(
    job: &DiphomaJob,
    obs: &Observed,
    plan: &mut Plan,
    phase: Phase,
    reason: &'static str,
    msg: String,
) {
    let prev = job.status.clone().unwrap_or_default();
    let status = &mut plan.status;
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
        EventNote::normal("JobSucceeded", "Finish", msg)
    } else {
        EventNote::warning("JobFailed", "Finish", msg)
    };
    plan.events.push(event);
    // Nothing replaces a lost worker any more: only forced deletions (lost node, frozen
    // process) and the pruning of older failed pods stay; cleanPodPolicy decides about the rest
    // (the most recent failed pod of each worker stays for its logs).
    plan.delete.retain(|d| d.force || d.reason == PRUNED);
    let already: BTreeSet<String> = plan.delete.iter().map(|d| d.pod.clone()).collect();
    plan.delete.extend(
        finished_deletions(job.spec.run_policy.clean_pod_policy, &obs.pods)
            .into_iter()
            .filter(|d| !already.contains(&d.pod)),
    );
    plan.create.clear();
    plan.publish = None;
    let status = plan.status.clone();
    ttl(job, &status, obs.now, plan);
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
        plan.due_in(
            Duration::from_secs_f64(due.duration_since(now).as_secs_f64())
                + Duration::from_millis(100),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::tests::job;
    use serde_json::json;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn ttl_deletes_the_job_when_due_and_requeues_before() {
        let j = job(
            json!({"replicas": 1, "runPolicy": {"ttlSecondsAfterFinished": 60}, "template": {}}),
        );
        let status = DiphomaJobStatus {
            completion_time: Some(t(0).to_string()),
            ..Default::default()
        };
        let mut early = Plan::default();
        ttl(&j, &status, t(50), &mut early);
        assert!(!early.delete_job);
        assert_eq!(early.requeue_after, Some(Duration::from_millis(10_100)));
        let mut due = Plan::default();
        ttl(&j, &status, t(60), &mut due);
        assert!(due.delete_job && due.requeue_after.is_none());
    }

    #[test]
    fn clean_pod_policy_running_keeps_finished_pods() {
        let pod = |name: &str, phase: &str| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": name}, "status": {"phase": phase}}))
                .unwrap()
        };
        let pods = [
            pod("a", "Running"),
            pod("b", "Failed"),
            pod("c", "Succeeded"),
        ];
        let names = |policy| -> Vec<String> {
            finished_deletions(policy, &pods)
                .into_iter()
                .map(|d| d.pod)
                .collect()
        };
        assert_eq!(names(CleanPodPolicy::Running), ["a"]);
        assert_eq!(names(CleanPodPolicy::All), ["a", "b", "c"]);
        assert!(names(CleanPodPolicy::None).is_empty());
    }
}
