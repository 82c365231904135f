//! What the plugin prints, from objects already fetched: the ring table, the "why" narrative and
//! the per-rank throughput table, plus the few Prometheus samples it reads. Pure: no API calls,
//! no printing (`main.rs` does both).

use std::collections::BTreeMap;

use diphoma_contract::membership::Membership;
use diphoma_operator::api::DiphomaJob;
use k8s_openapi::api::core::v1::{Event, Pod};

/// One Prometheus scrape of a worker: the unlabelled samples by metric name.
pub type Samples = BTreeMap<String, f64>;

/// The unlabelled samples of a Prometheus text exposition (`name value`); labelled series,
/// comments and unparsable lines are skipped.
pub fn parse_samples(text: &str) -> Samples {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let (name, value) = (parts.next()?, parts.next()?);
            (!name.contains('{')).then_some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// Whether the pod's Ready condition is True.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Lays out rows under a header, columns separated by three spaces and left-aligned.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        format!("{}\n", padded.join("   ").trim_end())
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The training processes each worker pod of `pods` runs: the operator's
/// `DIPHOMA_PROCESSES_PER_WORKER` on a worker container (the largest found), else 1.
pub fn processes_per_worker(pods: &BTreeMap<String, Pod>) -> u32 {
    pods.values()
        .filter_map(|p| {
            let c = p.spec.as_ref()?.containers.first()?;
            let e = c
                .env
                .iter()
                .flatten()
                .find(|e| e.name == diphoma_contract::ENV_PROCESSES_PER_WORKER)?;
            e.value.as_deref()?.parse::<u32>().ok()
        })
        .max()
        .unwrap_or(1)
        .max(1)
}

/// `kubectl diphoma ring`: the generation, then per rank its pod, node, ring address, readiness,
/// and the last step and loss from its metrics (`-` where unknown). `pods` and `metrics` are
/// looked up by pod name. Where the pods run several processes each
/// ([`processes_per_worker`]), the first line gives the layout (`P pods × L processes = W
/// ranks`) and each pod's row its processes' ring ranks (`RANKS`, `p·L ..= p·L + L − 1`).
pub fn ring(
    m: &Membership,
    pods: &BTreeMap<String, Pod>,
    metrics: &BTreeMap<String, Samples>,
) -> String {
    let processes = processes_per_worker(pods);
    let rows: Vec<Vec<String>> = m
        .members
        .iter()
        .map(|mem| {
            let pod = pods.get(&mem.pod);
            let node = pod.and_then(|p| p.spec.as_ref()?.node_name.clone());
            let s = metrics.get(&mem.pod);
            let get = |k: &str| s.and_then(|s| s.get(k).copied());
            let mut row = vec![mem.rank.to_string()];
            if processes > 1 {
                let first = mem.rank * processes;
                row.push(format!("{first}-{}", first + processes - 1));
            }
            row.extend([
                mem.pod.clone(),
                opt(node),
                format!("{}:{}", mem.address, mem.port),
                pod.map_or("gone".into(), |p| pod_ready(p).to_string()),
                opt(get("diphoma_worker_step")),
                opt(get("diphoma_worker_loss").map(|l| format!("{l:.4}"))),
            ]);
            row
        })
        .collect();
    if processes > 1 {
        let header = [
            "RANK", "RANKS", "POD", "NODE", "ADDRESS", "READY", "STEP", "LOSS",
        ];
        let pods_n = m.members.len();
        return format!(
            "generation {} ({pods_n} pods × {processes} processes = {} ranks)\n{}",
            m.generation,
            pods_n * processes as usize,
            table(&header, &rows)
        );
    }
    let header = ["RANK", "POD", "NODE", "ADDRESS", "READY", "STEP", "LOSS"];
    format!("generation {}\n{}", m.generation, table(&header, &rows))
}

/// `kubectl diphoma top`: per rank, samples/s, the mean allreduce time per step and the share of
/// wall time spent in allreduce between two scrapes `seconds` apart (`-` where unknown).
pub fn top(
    m: &Membership,
    before: &BTreeMap<String, Samples>,
    after: &BTreeMap<String, Samples>,
    seconds: f64,
) -> String {
    const SUM: &str = "diphoma_worker_allreduce_seconds_sum";
    const COUNT: &str = "diphoma_worker_allreduce_seconds_count";
    let rows: Vec<Vec<String>> = m
        .members
        .iter()
        .map(|mem| {
            let a = after.get(&mem.pod);
            let b = before.get(&mem.pod);
            let get = |s: Option<&Samples>, k: &str| s.and_then(|s| s.get(k).copied());
            let mean = get(a, SUM)
                .zip(get(a, COUNT))
                .filter(|(_, n)| *n > 0.0)
                .map(|(s, n)| format!("{:.2} ms", 1e3 * s / n));
            let share = get(a, SUM)
                .zip(get(b, SUM))
                .map(|(a, b)| format!("{:.0}%", 100.0 * (a - b) / seconds));
            vec![
                mem.rank.to_string(),
                mem.pod.clone(),
                opt(get(a, "diphoma_worker_samples_per_second").map(|v| format!("{v:.1}"))),
                opt(mean),
                opt(share),
                opt(get(a, "diphoma_worker_step")),
            ]
        })
        .collect();
    let header = [
        "RANK",
        "POD",
        "SAMPLES/S",
        "ALLREDUCE",
        "ALLREDUCE SHARE",
        "STEP",
    ];
    format!(
        "generation {} (share of the last {seconds:.1} s)\n{}",
        m.generation,
        table(&header, &rows)
    )
}

/// Why a pending pod is not running, in the scheduler's words (its PodScheduled=False message),
/// or the first waiting container's reason and message.
pub fn pending_reason(pod: &Pod) -> Option<String> {
    let st = pod.status.as_ref()?;
    let unscheduled = st
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    if let Some(c) = unscheduled {
        return Some(format!(
            "not scheduled ({}): {}",
            c.reason.as_deref().unwrap_or("Unschedulable"),
            c.message.as_deref().unwrap_or("")
        ));
    }
    let waiting = st
        .container_statuses
        .iter()
        .flatten()
        .find_map(|c| c.state.as_ref()?.waiting.clone())?;
    Some(format!(
        "container waiting ({}): {}",
        waiting.reason.unwrap_or_default(),
        waiting.message.unwrap_or_default()
    ))
}

/// `kubectl diphoma why`: the phase and what it means, the conditions that hold, why the ring
/// waits (the job's own words and each pending worker's scheduler reason), the last failure,
/// the repairs, the failures against the backoff limit and the disruptions against theirs, and
/// the most recent events of the job and
/// its workers (at most `max_events`, oldest first).
pub fn why(job: &DiphomaJob, workers: &[Pod], events: &[Event], max_events: usize) -> String {
    let mut out = vec![];
    let st = job.status.clone().unwrap_or_default();
    let phase = st
        .phase
        .map_or("unknown (not reconciled yet)".into(), |p| format!("{p:?}"));
    out.push(format!("phase: {phase}"));
    for c in st.conditions.iter().filter(|c| c.status == "True") {
        out.push(format!("  {} ({}): {}", c.type_, c.reason, c.message));
    }
    if let Some(w) = &st.waiting {
        out.push(format!("waiting: {w}"));
    }
    for p in workers {
        let pending = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
        if let Some(r) = pending.then(|| pending_reason(p)).flatten() {
            out.push(format!(
                "  worker {} is pending, {r}",
                p.metadata.name.clone().unwrap_or_default()
            ));
        }
    }
    if let Some(f) = &st.last_failure {
        let rank = f.rank.map_or(String::new(), |r| format!(" (rank {r})"));
        let code = f
            .exit_code
            .map_or(String::new(), |c| format!(", exit code {c}"));
        out.push(format!(
            "last failure: pod {}{rank} lost by {} ({}{code}) at {}",
            f.pod, f.cause, f.reason, f.time
        ));
        for line in f.message.iter().flat_map(|m| m.lines()) {
            out.push(format!("  | {line}"));
        }
    }
    let causes = |c: &diphoma_operator::api::Counts| {
        let by: Vec<String> = c
            .by_cause
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        by.join(", ")
    };
    if st.repairs.total > 0 {
        let took = st
            .repairs
            .last_seconds
            .map_or(String::new(), |s| format!("; the last took {s:.2} s"));
        out.push(format!(
            "repaired {} time(s): {}{took}; ring generation {}",
            st.repairs.total,
            causes(&st.repairs),
            st.ring.as_ref().map_or(0, |r| r.generation)
        ));
    } else {
        out.push("never repaired".into());
    }
    out.push(format!(
        "failures counted: {} of backoffLimit {}{}",
        st.failures.total,
        job.spec.run_policy.backoff_limit,
        if st.failures.total > 0 {
            format!(" ({})", causes(&st.failures))
        } else {
            String::new()
        }
    ));
    let limit = job
        .spec
        .fault_tolerance
        .disruption_limit
        .map_or("no disruptionLimit".to_owned(), |l| {
            format!("of disruptionLimit {l}")
        });
    out.push(format!(
        "disruptions counted: {} {limit}{}",
        st.disruptions.total,
        if st.disruptions.total > 0 {
            format!(" ({})", causes(&st.disruptions))
        } else {
            String::new()
        }
    ));
    let mut evs: Vec<&Event> = events.iter().collect();
    evs.sort_by_key(|e| event_time(e));
    let skip = evs.len().saturating_sub(max_events);
    if !evs.is_empty() {
        out.push("recent events:".into());
    }
    for e in &evs[skip..] {
        out.push(format!(
            "  {} {} {} {}: {}",
            event_time(e).map_or("-".into(), |t| t.to_string()),
            e.type_.as_deref().unwrap_or(""),
            e.involved_object.name.as_deref().unwrap_or(""),
            e.reason.as_deref().unwrap_or(""),
            e.message.as_deref().unwrap_or("").trim_end()
        ));
    }
    out.join("\n") + "\n"
}

/// When an event last happened (series, last timestamp, event time or creation, in that order).
fn event_time(e: &Event) -> Option<jiff::Timestamp> {
    e.series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
        .or(e.last_timestamp.as_ref().map(|t| t.0))
        .or(e.event_time.as_ref().map(|t| t.0))
        .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn membership() -> Membership {
        Membership::parse(
            r#"{"generation": 3, "jobUid": "u", "members": [
                {"rank": 0, "pod": "j-worker-0", "address": "127.0.0.2", "port": 29500},
                {"rank": 1, "pod": "j-worker-2", "address": "127.0.1.2", "port": 29500}]}"#,
        )
        .unwrap()
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn samples_are_the_unlabelled_series() {
        let s = parse_samples(
            "# HELP diphoma_worker_step x\ndiphoma_worker_step 42\nlabelled{a=\"b\"} 1\nbad x\n",
        );
        assert_eq!(s, Samples::from([("diphoma_worker_step".into(), 42.0)]));
    }

    #[test]
    fn ring_shows_the_layout_of_pods_of_several_processes() {
        let p0 = pod(
            json!({"metadata": {"name": "j-worker-0"}, "spec": {"containers": [{"name": "w",
            "env": [{"name": "DIPHOMA_PROCESSES_PER_WORKER", "value": "8"}]}]}}),
        );
        let pods = BTreeMap::from([("j-worker-0".to_owned(), p0)]);
        assert_eq!(processes_per_worker(&pods), 8);
        assert_eq!(processes_per_worker(&BTreeMap::new()), 1);
        let out = ring(&membership(), &pods, &BTreeMap::new());
        let lines: Vec<&str> = out.lines().collect();
        let n = membership().members.len();
        assert_eq!(
            lines[0],
            format!("generation 3 ({n} pods × 8 processes = {} ranks)", n * 8)
        );
        assert!(lines[1].starts_with("RANK   RANKS"), "{}", lines[1]);
        let r1: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(r1[..2], ["1", "8-15"]);
    }

    #[test]
    fn ring_lists_every_rank_with_what_is_known() {
        let p0 = pod(
            json!({"metadata": {"name": "j-worker-0"}, "spec": {"containers": [], "nodeName": "gpu-0"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
        );
        let pods = BTreeMap::from([("j-worker-0".to_owned(), p0)]);
        let metrics = BTreeMap::from([(
            "j-worker-0".to_owned(),
            parse_samples("diphoma_worker_step 7\ndiphoma_worker_loss 0.5\n"),
        )]);
        let out = ring(&membership(), &pods, &metrics);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "generation 3");
        assert!(lines[1].starts_with("RANK   POD"));
        let r0: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            r0,
            [
                "0",
                "j-worker-0",
                "gpu-0",
                "127.0.0.2:29500",
                "true",
                "7",
                "0.5000"
            ]
        );
        let r1: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(
            r1,
            ["1", "j-worker-2", "-", "127.0.1.2:29500", "gone", "-", "-"]
        );
    }

    #[test]
    fn top_computes_mean_allreduce_and_its_share_between_scrapes() {
        let s = |sum: f64, n: f64| {
            parse_samples(&format!(
                "diphoma_worker_allreduce_seconds_sum {sum}\ndiphoma_worker_allreduce_seconds_count {n}\ndiphoma_worker_samples_per_second 100\n"
            ))
        };
        let before = BTreeMap::from([("j-worker-0".to_owned(), s(1.0, 10.0))]);
        let after = BTreeMap::from([("j-worker-0".to_owned(), s(1.5, 20.0))]);
        let out = top(&membership(), &before, &after, 2.0);
        let r0: Vec<&str> = out.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(r0, ["0", "j-worker-0", "100.0", "75.00", "ms", "25%", "-"]);
    }

    #[test]
    fn why_names_the_failure_the_repairs_and_the_scheduler_reason() {
        let job: DiphomaJob = serde_json::from_value(json!({
            "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "metadata": {"name": "j"},
            "spec": {"replicas": 2, "template": {}, "runPolicy": {"backoffLimit": 6}},
            "status": {"phase": "Repairing", "waiting": "1 worker short of nvidia.com/gpu",
                "conditions": [{"type": "Progressing", "status": "True", "reason": "RingRepairing",
                    "message": "a member was lost", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                "repairs": {"total": 1, "byCause": {"ProcessExit": 1, "Hung": 0}, "lastSeconds": 0.5},
                "failures": {"total": 1, "byCause": {"ProcessExit": 1}},
                "disruptions": {"total": 2, "byCause": {"Evicted": 2}},
                "lastFailure": {"pod": "j-worker-1", "rank": 1, "exitCode": 137, "cause": "ProcessExit",
                    "reason": "Error", "time": "2026-01-01T00:00:00Z",
                    "message": "Traceback (most recent call last):\nValueError: bad shard"},
                "ring": {"generation": 2, "size": 1, "configMap": "j-ring"}}
        }))
        .unwrap();
        let pending = pod(
            json!({"metadata": {"name": "j-worker-2"}, "status": {"phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}),
        );
        let out = why(&job, &[pending], &[], 10);
        for want in [
            "phase: Repairing",
            "Progressing (RingRepairing): a member was lost",
            "waiting: 1 worker short of nvidia.com/gpu",
            "worker j-worker-2 is pending, not scheduled (Unschedulable): 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            "last failure: pod j-worker-1 (rank 1) lost by ProcessExit (Error, exit code 137)",
            "  | Traceback (most recent call last):\n  | ValueError: bad shard\n",
            "repaired 1 time(s): ProcessExit 1; the last took 0.50 s; ring generation 2",
            "failures counted: 1 of backoffLimit 6 (ProcessExit 1)",
            "disruptions counted: 2 no disruptionLimit (Evicted 2)",
        ] {
            assert!(out.contains(want), "{want:?} missing in:\n{out}");
        }
    }
}
