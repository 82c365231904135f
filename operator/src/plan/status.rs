//! Step 5 of the plan: the status — what carries over from the previous status, the progress
//! the workers report, readiness, why the ring waits, the phase, and the conditions (each with
//! its own reason and message; `lastTransitionTime` moves only when a condition flips), among
//! them, while the job runs, `Reporting`: whether the workers' reports reach the operator. Pure.

use std::collections::BTreeMap;

use diphoma_contract::{ProgressReport, RestartReport};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use super::ring::RingView;
use super::workers::Workers;
use super::{EventNote, Observed, Plan, parse_ts};
use crate::api::{DiphomaJob, DiphomaJobStatus, Phase, Progress};
use crate::build;

/// The previous status with this job's selector and generation.
pub fn carried(job: &DiphomaJob) -> DiphomaJobStatus {
    DiphomaJobStatus {
        selector: Some(build::selector(&job.name_any())),
        observed_generation: job.metadata.generation,
        ..job.status.clone().unwrap_or_default()
    }
}

/// `status.replicas`: the worker pods that exist and run on (not finished, not being deleted,
/// not deleted by this plan), as `/scale` reports them next to `spec.replicas`.
pub fn observed_replicas(obs: &Observed, plan: &Plan) -> i32 {
    obs.pods
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !matches!(super::pod_phase(p), "Succeeded" | "Failed")
                && !plan.delete.iter().any(|d| d.pod == p.name_any())
        })
        .count() as i32
}

/// Rank 0's latest progress.
pub fn progress(status: &mut DiphomaJobStatus, obs: &Observed) {
    if let Some(p) = &obs.progress {
        status.progress = Some(next_progress(status.progress.take(), p));
    }
}

/// `status.inPlaceRestarts` from the launchers' `reports` (one per pod): per cause the sum over
/// the pods, never below what the status already counted (a heartbeat recreated empty does
/// not take restarts back).
pub fn in_place_restarts(status: &mut DiphomaJobStatus, reports: &[RestartReport]) {
    let mut sum = BTreeMap::<String, i32>::new();
    for (cause, n) in reports.iter().flat_map(|r| &r.by_cause) {
        *sum.entry(cause.clone()).or_default() += n.max(&0);
    }
    let counts = &mut status.in_place_restarts;
    for (cause, n) in sum {
        let kept = counts.by_cause.entry(cause).or_default();
        *kept = (*kept).max(n);
    }
    counts.total = counts.by_cause.values().sum();
}

/// The status' progress after report `p`, given the previous one: the report's fields, plus
/// the percentage done and, from the step rate between the two reports (both times written by
/// the same reporting worker, so no clock skew enters), the ETA. A report that did not move the
/// step forward (the same step again, or a roll-back after a repair) keeps the previous rate and
/// step time, so a stalled job's status does not change with every report.
pub fn next_progress(prev: Option<Progress>, p: &ProgressReport) -> Progress {
    let step = p.step as i64;
    let total = p.total_steps.map(|t| t as i64);
    let (steps_per_second, step_time) = match prev {
        Some(prev) if step <= prev.step => (prev.steps_per_second, prev.step_time),
        Some(prev) => {
            let rate = prev
                .step_time
                .as_deref()
                .and_then(parse_ts)
                .zip(parse_ts(&p.time))
                .map(|(t0, t1)| t1.duration_since(t0).as_secs_f64())
                .filter(|dt| *dt > 0.0)
                .map(|dt| (step - prev.step) as f64 / dt);
            (rate.or(prev.steps_per_second), Some(p.time.clone()))
        }
        None => (None, Some(p.time.clone())),
    };
    let left = total.map(|t| (t - step).max(0));
    let eta_seconds = match (left, steps_per_second) {
        (Some(0), _) => Some(0),
        (Some(left), Some(rate)) if rate > 0.0 => Some((left as f64 / rate).ceil() as i64),
        _ => None,
    };
    Progress {
        step,
        total_steps: total,
        loss: p.loss,
        samples_per_second: p.samples_per_second,
        last_checkpoint_step: p.last_checkpoint_step.map(|s| s as i64),
        test_accuracy: p.test_accuracy,
        min_batch_share: p.min_share.map(|s| s as i64),
        max_batch_share: p.max_share.map(|s| s as i64),
        percentage: total
            .filter(|t| *t > 0)
            .map(|t| format!("{}%", (step.min(t) * 100) / t)),
        steps_per_second,
        eta_seconds,
        step_time,
    }
}

/// Step 5: readiness, waiting, phase and conditions of a job that runs on.
pub fn running(
    job: &DiphomaJob,
    obs: &Observed,
    workers: &Workers,
    ring: &RingView,
    plan: &mut Plan,
) {
    let prev = job.status.clone().unwrap_or_default();
    let desired = job.spec.replicas;
    let (min, _) = job.spec.bounds();
    let respec = respec(obs, plan);
    let status = &mut plan.status;
    let ring_size = status.ring.as_ref().map_or(0, |r| r.size);
    let members: std::collections::BTreeSet<&str> = plan
        .publish
        .as_ref()
        .or(obs.ring.as_ref())
        .iter()
        .flat_map(|r| r.members.iter().map(|m| m.pod.as_str()))
        .collect();
    status.ready_replicas = ring
        .ready
        .iter()
        .filter(|n| members.contains(n.as_str()))
        .count() as i32;
    status.ready = Some(format!("{}/{}", status.ready_replicas, desired));
    let blocked = workers.blocked.first();
    let ready = ring.ready.len();
    status.waiting = match (ring.enough, blocked) {
        (false, Some(b)) => Some(format!("{ready} of {min} workers ready; {b}")),
        (false, None) => Some(format!(
            "{ready} of {min} workers ready; waiting for workers to start"
        )),
        (true, Some(b)) => Some(format!("running with {ready} of {desired} workers; {b}")),
        (true, None) => None,
    };
    // A gang bound all together or not at all says so while none of it is bound.
    let gang = super::gang::waiting(job, &obs.pods, &workers.blocked).filter(|_| !ring.enough);
    if gang.is_some() {
        status.waiting = gang.clone();
    }
    let unrepaired = ring.lost_member && plan.publish.is_none();
    let phase = if obs.ring.is_none() && plan.publish.is_none() {
        if obs.pods.is_empty() {
            Phase::Pending
        } else {
            Phase::Starting
        }
    } else if unrepaired || !plan.failures.is_empty() {
        Phase::Repairing
    } else if ring_size == desired {
        Phase::Running
    } else if prev.phase == Some(Phase::Repairing) && ring_size < desired && workers.starting > 0 {
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
        _ if gang.is_some() => ("GangWaiting", gang.clone().unwrap_or_default()),
        // What keeps the ring from forming names the conditions' reason.
        _ if !ring.enough && blocked.is_some() => (
            blocked.map_or("", |b| b.reason.as_str()),
            status.waiting.clone().unwrap_or_default(),
        ),
        // Workers of an older spec still leaving: the whole ring is being replaced.
        _ if respec => (
            super::workers::SPEC_CHANGED,
            format!(
                "the spec changed what the workers run: every worker is replaced at once; {}",
                status.waiting.clone().unwrap_or_default()
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
        obs.now,
        job.metadata.generation,
    );
    let reported = status.progress.is_some();
    let reporting = reporting(job, obs, reported);
    status.conditions.push(condition(
        &prev.conditions,
        "Reporting",
        reporting,
        obs.now,
        job.metadata.generation,
    ));
    if let Some(d) = reports_due(job, obs, reported) {
        plan.due_in(d);
    }
    // Each worker that does not start is announced when what the job waits for changes, not on
    // every reconcile.
    if plan.status.waiting != prev.waiting {
        plan.events.extend(
            workers
                .blocked
                .iter()
                .map(|b| EventNote::warning("WorkerBlocked", "Start", b.to_string()).about(&b.pod)),
        );
    }
}

/// The status of a job whose spec cannot be decoded: `prev` kept (counts, ring, phase, or
/// `Pending` for a new job), `waiting` is `message`, and the conditions say `InvalidSpec` (Ready
/// and Progressing False).
pub fn invalid(
    prev: DiphomaJobStatus,
    generation: Option<i64>,
    message: &str,
    now: Timestamp,
) -> DiphomaJobStatus {
    DiphomaJobStatus {
        phase: Some(prev.phase.unwrap_or(Phase::Pending)),
        conditions: conditions(
            &prev.conditions,
            Phase::Pending,
            "InvalidSpec",
            message,
            now,
            generation,
        ),
        waiting: Some(message.to_owned()),
        observed_generation: generation,
        ..prev
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

/// Whether workers of an older spec are leaving (deleted by this plan, or still terminating
/// after an earlier one's [`super::workers::SPEC_CHANGED`] deletion).
fn respec(obs: &Observed, plan: &Plan) -> bool {
    let spec_changed = super::workers::SPEC_CHANGED;
    plan.delete.iter().any(|d| d.reason == spec_changed)
        || obs.pods.iter().any(|p| {
            p.annotations()
                .get(crate::build::ANNOT_DELETED_BY_OPERATOR)
                .is_some_and(|r| r == spec_changed)
        })
}

/// How long the workers' heartbeat ConfigMap may stay unchanged, once they have reported,
/// before the `Reporting` condition says their reports stopped: `detectionSeconds` times this,
/// and at least [`MIN_REPORT_SILENCE_SECONDS`] (rank 0 reports every 5 s while it steps).
pub const REPORT_SILENCE_FACTOR: i64 = 3;

/// See [`REPORT_SILENCE_FACTOR`].
pub const MIN_REPORT_SILENCE_SECONDS: i64 = 30;

/// Children without which the workers cannot report (the heartbeat ConfigMap they write, the
/// ServiceAccount, Role and RoleBinding that let them), as `Kind/` prefixes of
/// [`super::Observed::missing`].
const REPORTING_PATH: [&str; 4] = ["ConfigMap/", "ServiceAccount/", "Role/", "RoleBinding/"];

/// The `Reporting` condition of a running job (status, reason, message): `False` while a child
/// on the workers' reporting path is missing (`ReportingPathLost`, it is being restored) or, once
/// they have reported (`reported`), while their heartbeat has not changed for the silence of
/// [`REPORT_SILENCE_FACTOR`] (`ReportsStopped`; timed by this operator's clock alone); `Unknown`
/// before a first report (`NoReportYet`); `True` otherwise (`ReportsArriving`).
pub fn reporting(
    job: &DiphomaJob,
    obs: &Observed,
    reported: bool,
) -> (&'static str, &'static str, String) {
    let lost: Vec<&str> = obs
        .missing
        .iter()
        .filter(|m| REPORTING_PATH.iter().any(|k| m.starts_with(k)))
        .map(String::as_str)
        .collect();
    if !lost.is_empty() {
        return (
            "False",
            "ReportingPathLost",
            format!(
                "the workers cannot report without {}: restoring it",
                lost.join(", ")
            ),
        );
    }
    let silence = (i64::from(job.spec.fault_tolerance.detection_seconds) * REPORT_SILENCE_FACTOR)
        .max(MIN_REPORT_SILENCE_SECONDS);
    let quiet = obs
        .heartbeat_changed
        .map(|t| obs.now.duration_since(t).as_secs());
    match quiet {
        Some(q) if reported && q > silence => (
            "False",
            "ReportsStopped",
            format!("no report from the workers for {q} s (more than {silence} s)"),
        ),
        _ if reported => (
            "True",
            "ReportsArriving",
            "the workers report their progress".into(),
        ),
        _ => (
            "Unknown",
            "NoReportYet",
            "the workers have not reported progress yet".into(),
        ),
    }
}

/// How long until [`reporting`] would say `ReportsStopped` if no report arrives meanwhile (the
/// silence passed by whole seconds, plus 100 ms); none once it does, or before a first report.
pub fn reports_due(
    job: &DiphomaJob,
    obs: &Observed,
    reported: bool,
) -> Option<std::time::Duration> {
    let silence = (i64::from(job.spec.fault_tolerance.detection_seconds) * REPORT_SILENCE_FACTOR)
        .max(MIN_REPORT_SILENCE_SECONDS);
    let changed = obs.heartbeat_changed.filter(|_| reported)?;
    let due = changed + jiff::SignedDuration::from_secs(silence + 1);
    let left = due.duration_since(obs.now);
    left.is_positive()
        .then(|| left.unsigned_abs() + std::time::Duration::from_millis(100))
}

/// Condition `type_` with (status, reason, message) `now`; it keeps its `lastTransitionTime`
/// from `prev` unless its status flips.
fn condition(
    prev: &[Condition],
    type_: &str,
    (status, reason, message): (&str, &str, String),
    now: Timestamp,
    generation: Option<i64>,
) -> Condition {
    let last_transition_time = match prev.iter().find(|c| c.type_ == type_) {
        Some(o) if o.status == status => o.last_transition_time.clone(),
        _ => Time(now),
    };
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time,
        observed_generation: generation,
    }
}

/// The condition types, in the order they are written.
pub const CONDITION_TYPES: [&str; 5] = ["Ready", "Progressing", "Suspended", "Complete", "Failed"];

/// (status, reason, message) of condition `type_` in `phase`, whose own reason and message are
/// `reason` and `message`. Each condition's reason says why that condition has its status:
/// `Ready` and `Progressing` follow the phase; `Suspended`, `Complete` and `Failed` carry the
/// phase's reason only when they are True, and say what they are not otherwise.
fn condition_of(type_: &str, phase: Phase, reason: &str, message: &str) -> (bool, String, String) {
    let (truth, own) = match type_ {
        "Ready" => (phase == Phase::Running, None),
        "Progressing" => (
            matches!(
                phase,
                Phase::Starting | Phase::Running | Phase::Repairing | Phase::Scaling
            ),
            None,
        ),
        "Suspended" => (
            phase == Phase::Suspended,
            Some(("NotSuspended", "the job is not suspended")),
        ),
        "Complete" if phase == Phase::Failed => (
            false,
            Some(("JobFailed", "the job failed before its ring completed")),
        ),
        "Complete" => (
            phase == Phase::Succeeded,
            Some(("NotCompleted", "the ring has not completed")),
        ),
        "Failed" => (
            phase == Phase::Failed,
            Some(("NotFailed", "no fatal failure")),
        ),
        _ => (false, None),
    };
    match own {
        Some((r, m)) if !truth => (truth, r.to_owned(), m.to_owned()),
        _ => (truth, reason.to_owned(), message.to_owned()),
    }
}

/// The job's conditions ([`CONDITION_TYPES`]) for `phase`, whose reason and message are `reason`
/// and `message`; a condition keeps its `lastTransitionTime` unless its status flips.
pub fn conditions(
    prev: &[Condition],
    phase: Phase,
    reason: &str,
    message: &str,
    now: Timestamp,
    generation: Option<i64>,
) -> Vec<Condition> {
    CONDITION_TYPES
        .iter()
        .map(|t| {
            let (truth, reason, message) = condition_of(t, phase, reason, message);
            let status = if truth { "True" } else { "False" };
            condition(prev, t, (status, &reason, message), now, generation)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn find<'a>(c: &'a [Condition], t: &str) -> (&'a str, &'a str) {
        let c = c.iter().find(|c| c.type_ == t).unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    fn report(step: u64, secs: i64) -> ProgressReport {
        ProgressReport {
            generation: 1,
            step,
            total_steps: Some(1000),
            loss: Some(0.5),
            samples_per_second: None,
            last_checkpoint_step: None,
            test_accuracy: None,
            min_share: None,
            max_share: None,
            time: t(secs).to_string(),
            job_uid: None,
        }
    }

    #[test]
    fn in_place_restarts_sum_the_pods_by_cause_and_never_go_back() {
        let pod = |causes: &[(&str, i32)]| RestartReport {
            by_cause: causes.iter().map(|(c, n)| (c.to_string(), *n)).collect(),
            ..RestartReport::default()
        };
        let mut status = DiphomaJobStatus::default();
        let two = [
            pod(&[("MemberLost", 1), ("MemberJoined", 1)]),
            pod(&[("MemberLost", 1)]),
        ];
        in_place_restarts(&mut status, &two);
        let counts = &status.in_place_restarts;
        assert_eq!(counts.total, 3);
        assert_eq!(counts.by_cause["MemberLost"], 2);
        assert_eq!(counts.by_cause["MemberJoined"], 1);
        // A heartbeat recreated empty, then one pod's report again: nothing is taken back.
        in_place_restarts(&mut status, &[]);
        in_place_restarts(&mut status, &two[1..]);
        assert_eq!(status.in_place_restarts.total, 3);
        in_place_restarts(&mut status, &[pod(&[("RingFault", 1)]), two[0].clone()]);
        assert_eq!(status.in_place_restarts.total, 4);
    }

    #[test]
    fn progress_gives_the_percentage_and_an_eta_from_the_recent_step_rate() {
        let first = next_progress(None, &report(100, 0));
        assert_eq!(first.percentage.as_deref(), Some("10%"));
        assert_eq!((first.steps_per_second, first.eta_seconds), (None, None));
        // 150 steps in 10 s: 15 steps/s, 750 left: 50 s.
        let second = next_progress(Some(first), &report(250, 10));
        assert_eq!(second.steps_per_second, Some(15.0));
        assert_eq!(second.eta_seconds, Some(50));
        assert_eq!(second.percentage.as_deref(), Some("25%"));
        // The rate follows the latest interval: 30 steps in 10 s.
        let third = next_progress(Some(second.clone()), &report(280, 20));
        assert_eq!(third.steps_per_second, Some(3.0));
        assert_eq!(third.eta_seconds, Some(240));
        // A stalled report (same step, later time) changes nothing but what it reports.
        let stalled = next_progress(Some(third.clone()), &report(280, 25));
        assert_eq!(stalled, third);
        // A roll-back after a repair keeps the rate; the ETA grows by the lost steps.
        let back = next_progress(Some(third), &report(270, 30));
        assert_eq!(
            (back.steps_per_second, back.eta_seconds),
            (Some(3.0), Some(244))
        );
        let done = next_progress(Some(back), &report(1000, 40));
        assert_eq!(
            (done.percentage.as_deref(), done.eta_seconds),
            (Some("100%"), Some(0))
        );
    }

    #[test]
    fn each_condition_gives_its_own_reason() {
        let running = conditions(
            &[],
            Phase::Running,
            "RingFormed",
            "4 workers",
            t(1),
            Some(1),
        );
        assert_eq!(find(&running, "Ready"), ("True", "RingFormed"));
        assert_eq!(find(&running, "Progressing"), ("True", "RingFormed"));
        assert_eq!(find(&running, "Complete"), ("False", "NotCompleted"));
        assert_eq!(find(&running, "Suspended"), ("False", "NotSuspended"));
        assert_eq!(find(&running, "Failed"), ("False", "NotFailed"));
        let failed = conditions(
            &[],
            Phase::Failed,
            "DeadlineExceeded",
            "late",
            t(1),
            Some(1),
        );
        assert_eq!(find(&failed, "Failed"), ("True", "DeadlineExceeded"));
        assert_eq!(find(&failed, "Complete"), ("False", "JobFailed"));
        assert_eq!(find(&failed, "Ready"), ("False", "DeadlineExceeded"));
        let suspended = conditions(&[], Phase::Suspended, "Suspended", "s", t(1), None);
        assert_eq!(find(&suspended, "Suspended"), ("True", "Suspended"));
        let done = conditions(&[], Phase::Succeeded, "RingCompleted", "all", t(1), None);
        assert_eq!(find(&done, "Complete"), ("True", "RingCompleted"));
        assert_eq!(find(&done, "Failed"), ("False", "NotFailed"));
    }
}
