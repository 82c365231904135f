//! The operator's Prometheus metrics (own registry, `diphoma_operator_` prefix, bounded labels:
//! error kind, cause, phase, state — never a pod name; one per-job gauge, computed from the job
//! cache like kube-state-metrics, carries the namespace and name of each live job, and only while
//! it runs: a finished job has no series) and the `/metrics`, `/healthz`, `/readyz` endpoints.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::api::{Counts, DiphomaJob, DiphomaJobStatus, Phase};
use crate::plan::{Cause, Plan};

/// Every metric the operator exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `diphoma_operator_reconciles_total`.
    pub reconciles: IntCounter,
    /// `diphoma_operator_reconcile_errors_total{error}`.
    pub errors: IntCounterVec,
    /// `diphoma_operator_reconcile_duration_seconds`.
    pub duration: Histogram,
    /// `diphoma_operator_ring_repairs_total{cause}`: ring members lost and replaced.
    pub repairs: IntCounterVec,
    /// `diphoma_operator_worker_failures_total{cause}`: every worker failure, by cause; the
    /// disruption causes (Evicted, Preempted, NodeLost) are the ones not counted against
    /// backoffLimit (they count against `faultTolerance.disruptionLimit`).
    pub failures: IntCounterVec,
    /// `diphoma_operator_time_to_repair_seconds`: from a member's loss to the ring re-formed.
    pub time_to_repair: Histogram,
    /// `diphoma_operator_ring_generations_total`: generations published.
    pub generations: IntCounter,
    /// `diphoma_operator_jobs{phase}` (computed at scrape time from the job cache).
    pub jobs: IntGaugeVec,
    /// `diphoma_operator_workers{state}` with state `desired` or `ready` (at scrape time).
    pub workers: IntGaugeVec,
    /// `diphoma_operator_leader`: 1 while this replica reconciles.
    pub leader: IntGauge,
}

/// Prefix of every metric name (the registry's, and the per-scrape job gauge's).
const PREFIX: &str = "diphoma_operator";
/// Name of the per-job repairs gauge (without the prefix).
const JOB_REPAIRS: &str = "job_repairs";
/// Its labels: the job's namespace and name (`namespace` and `job` would clash with the target
/// labels Prometheus attaches to the operator's own series), and the cause.
const JOB_REPAIRS_LABELS: [&str; 3] = ["job_namespace", "diphoma_job", "cause"];

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::new_custom(Some(PREFIX.into()), None).expect("valid prefix");
        let counter = |n: &str, h: &str| IntCounter::new(n, h).expect("valid metric");
        let counter_vec = |n: &str, h: &str, l: &str| {
            IntCounterVec::new(Opts::new(n, h), &[l]).expect("valid metric")
        };
        let gauge_vec = |n: &str, h: &str, l: &str| {
            IntGaugeVec::new(Opts::new(n, h), &[l]).expect("valid metric")
        };
        let buckets = vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];
        let m = Metrics {
            reconciles: counter("reconciles_total", "Reconciles run"),
            errors: counter_vec(
                "reconcile_errors_total",
                "Reconciles that failed, by error kind",
                "error",
            ),
            duration: Histogram::with_opts(
                HistogramOpts::new("reconcile_duration_seconds", "Reconcile latency").buckets(
                    vec![0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
                ),
            )
            .expect("valid metric"),
            repairs: counter_vec(
                "ring_repairs_total",
                "Ring members lost and replaced, by cause",
                "cause",
            ),
            failures: counter_vec(
                "worker_failures_total",
                "Worker failures counted in the jobs' statuses, by cause: each job's status.failures plus status.disruptions rise by what this counter rises (Evicted, Preempted and NodeLost count against disruptionLimit, the others against backoffLimit)",
                "cause",
            ),
            time_to_repair: Histogram::with_opts(
                HistogramOpts::new(
                    "time_to_repair_seconds",
                    "From a member's loss to the ring re-formed without it",
                )
                .buckets(buckets),
            )
            .expect("valid metric"),
            generations: counter("ring_generations_total", "Ring generations published"),
            jobs: gauge_vec("jobs", "Jobs by phase", "phase"),
            workers: gauge_vec(
                "workers",
                "Workers over all jobs: desired and ready",
                "state",
            ),
            leader: IntGauge::new(
                "leader",
                "Whether this replica holds the leader lease and reconciles (1) or waits (0)",
            )
            .expect("valid metric"),
            registry,
        };
        for c in [
            Box::new(m.reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.errors.clone()),
            Box::new(m.duration.clone()),
            Box::new(m.repairs.clone()),
            Box::new(m.failures.clone()),
            Box::new(m.time_to_repair.clone()),
            Box::new(m.generations.clone()),
            Box::new(m.jobs.clone()),
            Box::new(m.workers.clone()),
            Box::new(m.leader.clone()),
        ] {
            m.registry.register(c).expect("unique metric");
        }
        // Every known label value exists from the start at 0, so that rates and dashboards have
        // data before the first error or repair (Prometheus: "avoid missing metrics").
        for l in crate::error::Error::LABELS {
            m.errors.with_label_values(&[l]);
        }
        for c in Cause::ALL {
            m.repairs.with_label_values(&[c.as_str()]);
            m.failures.with_label_values(&[c.as_str()]);
        }
        m
    }
}

/// A status's counts by cause: its repairs (`repairs`), else its failures plus disruptions.
fn by_cause(s: &DiphomaJobStatus, repairs: bool) -> BTreeMap<String, i64> {
    let counts: Vec<&Counts> = if repairs {
        vec![&s.repairs]
    } else {
        vec![&s.failures, &s.disruptions]
    };
    let mut n: BTreeMap<String, i64> = BTreeMap::new();
    for (cause, k) in counts.into_iter().flat_map(|c| c.by_cause.iter()) {
        *n.entry(cause.clone()).or_default() += i64::from(*k);
    }
    n
}

impl Metrics {
    /// Records what a status write counted: by cause, the rise from `prev` (the status the
    /// write was conditional on) to `next` of the failures plus disruptions, and of the repairs.
    /// So the counters rise exactly as the jobs' statuses do (a plan made again from stale
    /// caches writes the same counts and adds nothing).
    pub fn observe_failures(&self, prev: Option<&DiphomaJobStatus>, next: &DiphomaJobStatus) {
        for (counter, repairs) in [(&self.failures, false), (&self.repairs, true)] {
            let before = prev.map(|p| by_cause(p, repairs)).unwrap_or_default();
            for (cause, n) in by_cause(next, repairs) {
                let rise = n - before.get(&cause).copied().unwrap_or(0);
                if rise > 0 {
                    counter
                        .with_label_values(&[cause.as_str()])
                        .inc_by(rise as u64);
                }
            }
        }
    }

    /// Records a plan's ring publication (and the repair it ends), once the ring is written: a
    /// write that fails after it must not lose it (the next reconcile finds it published).
    pub fn observe_publish(&self, plan: &Plan) {
        if plan.publish.is_some() {
            self.generations.inc();
            if let Some(s) = plan
                .status
                .repairs
                .last_seconds
                .filter(|_| plan.status.phase != Some(Phase::Succeeded))
            {
                self.time_to_repair.observe(s);
            }
        }
    }

    /// `diphoma_operator_job_repairs{job_namespace, diphoma_job, cause}`: each live (not
    /// finished) job's `status.repairs.byCause`, every cause present (0 before its first repair).
    /// Built per scrape and never registered, so the series of a job that finished or was
    /// deleted simply stop: the series count follows the running jobs, not every job kept.
    fn job_repairs(jobs: &[&DiphomaJob]) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::core::Collector;
        let g = IntGaugeVec::new(
            Opts::new(
                JOB_REPAIRS,
                "Ring repairs of each job, by cause (its status.repairs)",
            )
            .namespace(PREFIX),
            &JOB_REPAIRS_LABELS,
        )
        .expect("valid metric");
        let live = jobs.iter().filter(|j| {
            !j.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(Phase::is_terminal)
        });
        for j in live {
            let (ns, name) = (
                j.metadata.namespace.as_deref().unwrap_or_default(),
                j.metadata.name.as_deref().unwrap_or_default(),
            );
            let by_cause = j.status.as_ref().map(|s| &s.repairs.by_cause);
            for c in Cause::ALL {
                let n = by_cause
                    .and_then(|m| m.get(c.as_str()))
                    .copied()
                    .unwrap_or(0);
                g.with_label_values(&[ns, name, c.as_str()]).set(n.into());
            }
        }
        // The text encoder refuses a family without samples (no jobs yet).
        g.collect()
            .into_iter()
            .filter(|f| !f.get_metric().is_empty())
            .collect()
    }

    /// The text exposition, with the job and worker gauges computed from `jobs`.
    pub fn render(&self, jobs: &[&DiphomaJob]) -> String {
        // Counted here, then set: concurrent scrapes never see a half-built gauge.
        let mut by_phase: std::collections::BTreeMap<String, i64> = Phase::ALL
            .iter()
            .map(|p| (format!("{p:?}"), 0))
            .chain([("Unknown".to_owned(), 0)])
            .collect();
        let (mut desired, mut ready) = (0, 0);
        for j in jobs {
            let st = j.status.clone().unwrap_or_default();
            let phase = st.phase.map_or("Unknown".to_owned(), |p| format!("{p:?}"));
            *by_phase.entry(phase).or_default() += 1;
            if !st.phase.is_some_and(Phase::is_terminal) {
                desired += i64::from(j.spec.replicas);
                ready += i64::from(st.ready_replicas);
            }
        }
        for (phase, n) in by_phase {
            self.jobs.with_label_values(&[phase.as_str()]).set(n);
        }
        self.workers.with_label_values(&["desired"]).set(desired);
        self.workers.with_label_values(&["ready"]).set(ready);
        let mut families = self.registry.gather();
        families.extend(Self::job_repairs(jobs));
        let mut out = vec![];
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("text encoding");
        String::from_utf8(out).expect("UTF-8 exposition")
    }
}

/// Serves `/metrics` (from `metrics` and the job cache `store`), `/healthz` (always OK) and
/// `/readyz` (OK once `ready` is set) on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    store: Store<DeserializeGuard<DiphomaJob>>,
    ready: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || async move {
                let jobs = store.state();
                let decoded: Vec<&DiphomaJob> =
                    jobs.iter().filter_map(|j| j.0.as_ref().ok()).collect();
                metrics.render(&decoded)
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || async move {
                if ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        );
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_feed_counters_and_gauges_come_from_jobs() {
        let m = Metrics::default();
        let mut before = crate::api::DiphomaJobStatus::default();
        before.disruptions.add("NodeLost");
        let mut after = before.clone();
        after.disruptions.add("NodeLost");
        after.disruptions.add("NodeLost");
        after.repairs.add("NodeLost");
        m.observe_failures(Some(&before), &after);
        // The same status written again (a plan made from stale caches) adds nothing.
        m.observe_failures(Some(&after), &after);
        let mut job = crate::build::tests::basic();
        let mut status = crate::api::DiphomaJobStatus {
            phase: Some(Phase::Running),
            ready_replicas: 3,
            ..Default::default()
        };
        status.repairs.add("ProcessExit");
        status.repairs.add("ProcessExit");
        job.status = Some(status);
        job.metadata.namespace = Some("team-a".into());
        let text = m.render(&[&job]);
        let per_job = |cause: &str, n: i64| {
            let line = format!(
                "diphoma_operator_job_repairs{{cause=\"{cause}\",diphoma_job=\"train\",job_namespace=\"team-a\"}} {n}"
            );
            assert!(text.contains(&line), "{line} missing from {text}");
        };
        per_job("ProcessExit", 2);
        per_job("NodeLost", 0);
        // A finished job keeps no series: their number follows the running jobs.
        let mut done = job.clone();
        done.metadata.name = Some("done".into());
        done.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
        let with_done = m.render(&[&job, &done]);
        assert!(
            !with_done.contains("diphoma_job=\"done\"")
                && with_done.contains("diphoma_job=\"train\""),
            "{with_done}"
        );
        assert!(!m.render(&[&done]).contains("diphoma_operator_job_repairs"));
        let none = m.render(&[]);
        assert!(
            none.contains("diphoma_operator_jobs{phase=\"Running\"} 0")
                && !none.contains("diphoma_operator_job_repairs"),
            "{none}"
        );
        assert!(
            text.contains("diphoma_operator_worker_failures_total{cause=\"NodeLost\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("diphoma_operator_ring_repairs_total{cause=\"NodeLost\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("diphoma_operator_jobs{phase=\"Running\"} 1"),
            "{text}"
        );
        // Known label values exist before anything happened to them.
        for zero in [
            "diphoma_operator_jobs{phase=\"Failed\"} 0",
            "diphoma_operator_ring_repairs_total{cause=\"Hung\"} 0",
            "diphoma_operator_worker_failures_total{cause=\"Evicted\"} 0",
            "diphoma_operator_reconcile_errors_total{error=\"observe\"} 0",
        ] {
            assert!(text.contains(zero), "{zero} missing from {text}");
        }
        assert!(
            text.contains("diphoma_operator_workers{state=\"ready\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("diphoma_operator_workers{state=\"desired\"} 4"),
            "{text}"
        );
    }
}
