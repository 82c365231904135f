//! Pure tests of the plan: phases, failure causes, scaling, gang waiting, suspension, deadlines,
//! budgets, and what is never counted.

use std::collections::BTreeMap;

use diphoma_contract::{LABEL_GENERATION, LABEL_RANK, Member};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::api::RingStatus;
use crate::build;
use crate::build::tests::{basic, job};
use serde_json::json;

/// The plan of a job with nothing remembered ([`memory::Memory`]'s default).
fn plan(j: &DiphomaJob, o: &Observed) -> Plan {
    super::plan(j, o, &memory::Memory::default()).0
}

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn obs(pods: Vec<Pod>, ring: Option<Membership>) -> Observed {
    Observed {
        pods,
        foreign: Default::default(),
        missing: vec![],
        orphans: vec![],
        heartbeat_version: None,
        heartbeat_changed: None,
        ring,
        nodes: BTreeMap::new(),
        progress: None,
        reports: vec![],
        restarts: vec![],
        now: t(100),
        refused: BTreeMap::new(),
        queue: Default::default(),
        gang: Default::default(),
        scheduler_name: None,
        workload_refused: None,
        gang_repairing: None,
        answering: Default::default(),
        exited: Default::default(),
    }
}

/// A lost node: neither its Lease nor a Ready Node was found.
fn lost_node() -> NodeHealth {
    NodeHealth::default()
}

/// A Ready node whose 8 s Lease was last seen to change 5 s ago: late (a renewal missed), not
/// lost (detectionSeconds 10).
fn late_node() -> NodeHealth {
    NodeHealth {
        lease_age: Some(Duration::from_secs(5)),
        lease_duration_seconds: Some(8),
        ready: true,
        clock_skew: None,
    }
}

/// Worker pod `i` (attempt 0) in `phase`, Ready when Running, on node `n<i>`.
fn pod(j: &DiphomaJob, i: i32, phase: &str) -> Pod {
    let mut p = build::worker_pod(j, i, 0).unwrap();
    p.metadata.uid = Some(format!("uid-{}", p.name_any()));
    let ready = if phase == "Running" { "True" } else { "False" };
    p.spec.as_mut().unwrap().node_name = Some(format!("n{i}"));
    p.status = Some(serde_json::from_value(json!({
        "phase": phase, "podIP": format!("127.0.0.{}", i + 2),
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]
    })).unwrap());
    p
}

fn exited(p: Pod, code: i32, reason: &str) -> Pod {
    exited_saying(p, code, reason, None)
}

/// [`exited`], its container's termination message `message`.
fn exited_saying(mut p: Pod, code: i32, reason: &str, message: Option<&str>) -> Pod {
    p.status = Some(serde_json::from_value(json!({
        "phase": "Failed", "podIP": "127.0.0.9",
        "containerStatuses": [{"name": "w", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": "2027-01-15T08:01:30Z",
                "message": message}}}]
    })).unwrap());
    p
}

fn ring(j: &DiphomaJob, generation: u64, idx: &[i32]) -> Membership {
    Membership {
        generation,
        job_uid: "uid-1".into(),
        members: idx
            .iter()
            .enumerate()
            .map(|(r, &i)| Member {
                rank: r as u32,
                pod: build::pod_name(&j.name_any(), i, 0),
                address: format!("127.0.0.{}", i + 2).parse().unwrap(),
                port: 29500,
            })
            .collect(),
    }
}

fn with_status(mut j: DiphomaJob, phase: Phase) -> DiphomaJob {
    j.status = Some(DiphomaJobStatus {
        phase: Some(phase),
        start_time: Some(t(0).to_string()),
        ..Default::default()
    });
    j
}

#[test]
fn new_job_creates_every_worker_and_waits() {
    let j = basic();
    let p = plan(&j, &obs(vec![], None));
    let names: Vec<String> = p.create.iter().map(|p| p.name_any()).collect();
    assert_eq!(
        names,
        [
            "train-worker-0",
            "train-worker-1",
            "train-worker-2",
            "train-worker-3"
        ]
    );
    assert_eq!(p.status.phase, Some(Phase::Pending));
    assert!(p.publish.is_none());
    assert_eq!(p.status.ready.as_deref(), Some("0/4"));
    assert!(
        p.status
            .waiting
            .as_deref()
            .unwrap()
            .contains("0 of 4 workers ready")
    );
}

#[test]
fn first_ring_waits_for_starting_workers_then_forms() {
    let j = basic();
    let mut pods: Vec<Pod> = (0..3).map(|i| pod(&j, i, "Running")).collect();
    pods.push(pod(&j, 3, "Pending"));
    let p = plan(&j, &obs(pods.clone(), None));
    assert!(p.publish.is_none(), "a scheduled worker is still starting");
    assert_eq!(p.status.phase, Some(Phase::Starting));
    pods[3] = pod(&j, 3, "Running");
    let p = plan(&j, &obs(pods, None));
    let m = p.publish.expect("ring formed");
    assert_eq!((m.generation, m.members.len()), (1, 4));
    assert_eq!(m.members[2].pod, "train-worker-2");
    assert_eq!(m.members[2].address.to_string(), "127.0.0.4");
    assert_eq!(p.status.phase, Some(Phase::Running));
    assert_eq!(p.status.ring.as_ref().unwrap().generation, 1);
    assert!(p.create.is_empty() && p.delete.is_empty());
}

/// The workers created for the first ring carry the rank and generation it gives them, so
/// forming it relabels none (issue 14); a worker the ring leaves out has its guess removed,
/// and one created into a running ring is labelled only once it is a member.
#[test]
fn the_first_ring_relabels_no_worker_created_for_it() {
    let j = basic();
    let created = plan(&j, &obs(vec![], None)).create;
    let labels = |p: &Pod| {
        let l = p.labels();
        (l.get(LABEL_RANK).cloned(), l.get(LABEL_GENERATION).cloned())
    };
    for (i, p) in created.iter().enumerate() {
        assert_eq!(labels(p), (Some(i.to_string()), Some("1".into())));
    }
    let running = |p: &Pod| {
        let mut p = p.clone();
        p.status = pod(&j, build::replica_index(&p).unwrap(), "Running").status;
        p
    };
    let pods: Vec<Pod> = created.iter().map(running).collect();
    let p = plan(&j, &obs(pods.clone(), None));
    assert_eq!(p.publish.as_ref().map(|m| m.generation), Some(1));
    assert!(p.relabel.is_empty(), "{:?}", p.relabel);
    // Worker 1 cannot be placed when an elastic ring of at least 3 forms: 2 and 3 move up a
    // rank, worker 1's guess is removed.
    let mut e = elastic(3);
    e.status = None;
    let mut pods = pods;
    pods[1].status = Some(
        serde_json::from_value(json!({"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}))
        .unwrap(),
    );
    let p = plan(&e, &obs(pods.clone(), None));
    let relabel: Vec<(&str, Option<(u32, u64)>)> =
        p.relabel.iter().map(|r| (r.pod.as_str(), r.rank)).collect();
    assert_eq!(p.publish.map(|m| m.members.len()), Some(3));
    assert_eq!(
        relabel,
        [
            ("train-worker-1", None),
            ("train-worker-2", Some((1, 1))),
            ("train-worker-3", Some((2, 1)))
        ]
    );
    // A replacement created into a running ring carries no rank until it is a member.
    let j = with_status(basic(), Phase::Running);
    let live: Vec<Pod> = [0, 2, 3].iter().map(|&i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(live, Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert_eq!(p.create.len(), 1);
    assert_eq!(labels(&p.create[0]), (None, None));
}

#[test]
fn a_ring_reformed_event_names_who_left_and_who_joined() {
    let j = basic();
    let before = ring(&j, 2, &[0, 1, 2]);
    let reformed = |idx: &[i32]| ring::changes(Some(&before), &ring(&j, 3, idx));
    assert_eq!(reformed(&[0, 2]), " (lost train-worker-1 (rank 1))");
    assert_eq!(
        reformed(&[0, 2, 3]),
        " (lost train-worker-1 (rank 1); added train-worker-3)"
    );
    assert_eq!(reformed(&[0, 1, 2]), "");
    assert_eq!(ring::changes(None, &before), "");
}

#[test]
fn several_workers_created_at_once_are_one_event() {
    let created = |pod: &str| {
        EventNote::normal("WorkerCreated", "Create", format!("created worker {pod}")).about(pod)
    };
    let other = EventNote::normal(
        "RingReformed",
        "Publish",
        "generation 1 with 2 workers".into(),
    );
    let folded = fold_created(vec![created("a"), other.clone(), created("b")]);
    assert_eq!(
        folded,
        [
            EventNote::normal("WorkerCreated", "Create", "created workers a, b".into()),
            other.clone()
        ]
    );
    // One creation keeps its pod as the related object.
    let one = vec![created("a"), other];
    assert_eq!(fold_created(one.clone()), one);
}

#[test]
fn steady_ring_changes_nothing() {
    let j = with_status(basic(), Phase::Running);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert!(
        p.publish.is_none() && p.create.is_empty() && p.delete.is_empty() && p.failures.is_empty()
    );
    assert_eq!(p.status.phase, Some(Phase::Running));
    assert_eq!(p.status.ready.as_deref(), Some("4/4"));
}

fn elastic(min: i32) -> DiphomaJob {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.elastic = Some(crate::api::Elastic {
        min_replicas: min,
        max_replicas: 6,
    });
    j
}

#[test]
fn fixed_size_ring_waits_for_the_replacement() {
    let j = with_status(basic(), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = exited(pods[1].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert!(p.publish.is_none(), "3 < minReplicas 4");
    assert_eq!(p.create[0].name_any(), "train-worker-1-1");
    assert_eq!(p.status.repairs.by_cause["ProcessExit"], 1);
    assert_eq!(p.status.phase, Some(Phase::Repairing));
    assert_eq!(p.status.ready.as_deref(), Some("3/4"));
}

#[test]
fn process_exit_is_counted_replaced_and_the_ring_shrinks() {
    let j = elastic(2);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = exited(pods[1].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert_eq!(p.failures.len(), 1);
    let f = &p.failures[0];
    assert_eq!(
        (f.cause, f.exit_code, f.rank, f.retryable),
        (Cause::ProcessExit, Some(137), Some(1), true)
    );
    assert!(p.delete.is_empty(), "the failed pod stays for its logs");
    assert_eq!(
        p.create[0].name_any(),
        "train-worker-1-1",
        "the replacement gets a new name"
    );
    let m = p.publish.unwrap();
    assert_eq!(m.generation, 4);
    assert_eq!(
        m.members.iter().map(|m| m.pod.as_str()).collect::<Vec<_>>(),
        ["train-worker-0", "train-worker-2", "train-worker-3"]
    );
    assert_eq!(p.status.repairs.by_cause["ProcessExit"], 1);
    assert_eq!(p.status.failures.total, 1);
    assert_eq!(p.status.phase, Some(Phase::Repairing));
    let last = p.status.last_failure.unwrap();
    assert_eq!(
        (last.pod.as_str(), last.rank, last.exit_code),
        ("train-worker-1", Some(1), Some(137))
    );
    assert!(
        p.status.repairs.last_seconds.unwrap() > 0.0,
        "time to repair from the exit to the new ring"
    );
}

#[test]
fn a_counted_failure_is_not_counted_again() {
    let j = with_status(basic(), Phase::Repairing);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = exited(pods[1].clone(), 137, "Error");
    pods[1]
        .annotations_mut()
        .insert(ANNOT_FAILURE_COUNTED.into(), "ProcessExit".into());
    let p = plan(&j, &obs(pods, Some(ring(&j, 4, &[0, 2, 3]))));
    assert!(p.failures.is_empty());
    assert!(p.delete.is_empty(), "the failed pod stays for its logs");
    assert_eq!(p.create[0].name_any(), "train-worker-1-1");
    assert_eq!(p.status.failures.total, 0);
}

/// `j` whose status already counts `pod`'s loss by `cause` (`uid`: the pod's, none for a member
/// that vanished), its mark not yet written (the operator was stopped between the status write
/// and the mark).
fn counted_unmarked(mut j: DiphomaJob, pod: &str, uid: Option<&str>, cause: Cause) -> DiphomaJob {
    let st = j.status.as_mut().unwrap();
    st.failures.add(cause.as_str());
    st.counted_pods = vec![crate::api::CountedPod {
        pod: pod.into(),
        uid: uid.map(str::to_owned),
        cause: cause.as_str().into(),
    }];
    j
}

#[test]
fn a_failure_the_status_counts_is_not_counted_again_when_its_mark_was_never_written() {
    let j = elastic(2);
    let j = counted_unmarked(
        j,
        "train-worker-1",
        Some("uid-train-worker-1"),
        Cause::ProcessExit,
    );
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = exited(pods[1].clone(), 137, "Error");
    // Stopped before the mark and before the new ring: the old ring still lists the pod.
    let p = plan(&j, &obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    assert_eq!(p.status.failures.total, 1);
    let marked: Vec<&str> = p.mark.iter().map(|c| c.pod.as_str()).collect();
    assert_eq!(marked, ["train-worker-1"]);
    assert_eq!(p.mark[0].cause, "ProcessExit");
    assert_eq!(p.status.counted_pods, p.mark, "kept until the mark is seen");
    assert!(p.delete.is_empty(), "the failed pod stays for its logs");
    assert_eq!(p.create[0].name_any(), "train-worker-1-1");
    let m = p.publish.expect("the ring re-formed without it");
    assert!(m.rank_of("train-worker-1").is_none());
    // The mark seen: the entry goes, and the pod is still counted once.
    pods[1]
        .annotations_mut()
        .insert(ANNOT_FAILURE_COUNTED.into(), "ProcessExit".into());
    let p = plan(&j, &obs(pods, Some(m)));
    assert!(p.failures.is_empty() && p.mark.is_empty());
    assert!(p.status.counted_pods.is_empty());
    assert_eq!(p.status.failures.total, 1);
}

#[test]
fn a_new_failure_is_counted_with_its_mark_journaled_in_the_status() {
    let j = elastic(2);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[2] = exited(pods[2].clone(), 1, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3, 4]))));
    // train-worker-4 vanished (deleted by someone): counted, but there is nothing to mark.
    let journal: Vec<(&str, Option<&str>, &str)> = (p.status.counted_pods.iter())
        .map(|c| (c.pod.as_str(), c.uid.as_deref(), c.cause.as_str()))
        .collect();
    assert_eq!(
        journal,
        [
            ("train-worker-2", Some("uid-train-worker-2"), "ProcessExit"),
            ("train-worker-4", None, "PodDeleted")
        ]
    );
    let marked: Vec<&str> = p.mark.iter().map(|c| c.pod.as_str()).collect();
    assert_eq!(marked, ["train-worker-2"]);
}

#[test]
fn a_vanished_member_the_status_counts_is_not_counted_again() {
    let j = counted_unmarked(elastic(2), "train-worker-1", None, Cause::PodDeleted);
    let mut pods: Vec<Pod> = [0, 2, 3].map(|i| pod(&j, i, "Running")).to_vec();
    let p = plan(&j, &obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    assert_eq!(p.status.failures.total, 1);
    assert!(p.mark.is_empty(), "nothing to mark");
    assert_eq!(p.status.counted_pods.len(), 1, "while the ring lists it");
    assert_eq!(
        p.create[0].name_any(),
        "train-worker-1",
        "its name is free again"
    );
    // Its replacement, of the same name, is a new pod: neither counted nor deleted.
    let mut replacement = pod(&j, 1, "Running");
    replacement.metadata.uid = Some("uid-replacement".into());
    pods.push(replacement);
    let o = obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3])));
    let again = plan(&j, &o);
    assert!(again.failures.is_empty() && again.delete.is_empty());
    assert!(again.status.counted_pods.is_empty() && again.mark.is_empty());
    // The ring no longer lists it: nothing can count it again.
    pods.pop();
    let p = plan(&j, &obs(pods, p.publish));
    assert!(p.failures.is_empty() && p.status.counted_pods.is_empty());
}

#[test]
fn a_hung_member_counted_before_is_replaced_not_counted_again() {
    // Counted, its mark not written (journal), or marked and not yet deleted (the operator
    // stopped between the mark and the deletion): either way deleted at once, counted once.
    let journaled = counted_unmarked(
        elastic(2),
        "train-worker-1",
        Some("uid-train-worker-1"),
        Cause::Hung,
    );
    let pods: Vec<Pod> = (0..4).map(|i| pod(&journaled, i, "Running")).collect();
    let mut marked_pods = pods.clone();
    marked_pods[1]
        .annotations_mut()
        .insert(ANNOT_FAILURE_COUNTED.into(), "Hung".into());
    let mut marked = journaled.clone();
    marked.status.as_mut().unwrap().counted_pods.clear();
    for (j, pods) in [(journaled, pods), (marked, marked_pods)] {
        let p = plan(&j, &obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3]))));
        assert!(p.failures.is_empty(), "{:?}", p.failures);
        assert_eq!(p.status.failures.total, 1);
        let deleted: Vec<(&str, bool)> =
            p.delete.iter().map(|d| (d.pod.as_str(), d.force)).collect();
        assert_eq!(
            deleted,
            [("train-worker-1", true)],
            "a frozen process is force-deleted"
        );
        assert!(p.publish.unwrap().rank_of("train-worker-1").is_none());
    }
}

#[test]
fn a_finished_job_keeps_no_counted_pods() {
    let mut j = counted_unmarked(elastic(2), "train-worker-1", None, Cause::ProcessExit);
    j.status.as_mut().unwrap().phase = Some(Phase::Failed);
    let pods = vec![exited(pod(&j, 1, "Running"), 1, "Error")];
    let p = plan(&j, &obs(pods, None));
    assert!(p.status.counted_pods.is_empty() && p.mark.is_empty());
    assert_eq!(p.status.failures.total, 1);
}

#[test]
fn joiner_enters_at_the_next_generation_once_ready() {
    let mut j = elastic(2);
    j.status.as_mut().unwrap().phase = Some(Phase::Repairing);
    let mut pods: Vec<Pod> = [0, 2, 3].iter().map(|&i| pod(&j, i, "Running")).collect();
    let mut joiner = pod(&j, 1, "Running");
    joiner.metadata.name = Some("train-worker-1-1".into());
    pods.push(joiner);
    let p = plan(&j, &obs(pods, Some(ring(&j, 4, &[0, 2, 3]))));
    let m = p.publish.unwrap();
    assert_eq!(m.generation, 5);
    assert_eq!(
        m.members[1].pod, "train-worker-1-1",
        "ranks follow replica indices"
    );
    assert!(p.failures.is_empty());
    assert_eq!(p.status.phase, Some(Phase::Running));
    assert_eq!(p.status.repairs.total, 0, "a join is no repair");
    assert_eq!(p.status.ready.as_deref(), Some("4/4"));
}

#[test]
fn a_failed_workers_last_log_lines_reach_last_failure_and_the_condition() {
    let j = with_status(basic(), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let long = "x".repeat(3000);
    let said = format!(
        "{long}\nTraceback (most recent call last):\n  File \"train.py\", line 3\nValueError: bad shard 7\n"
    );
    pods[1] = exited_saying(pods[1].clone(), 1, "Error", Some(&said));
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    let last = p.status.last_failure.clone().unwrap();
    let message = last.message.unwrap();
    assert_eq!(
        message.len(),
        failures::MESSAGE_BYTES,
        "the end kept, within the bound"
    );
    assert!(said.trim_end().ends_with(&message));
    let condition = p
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Failed")
        .unwrap();
    assert!(
        condition.message.ends_with(": ValueError: bad shard 7"),
        "{}",
        condition.message
    );
}

#[test]
fn non_retryable_exit_fails_the_job_with_last_failure() {
    let j = with_status(basic(), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[2] = exited(pods[2].clone(), 1, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Failed));
    let failed = p
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Failed")
        .unwrap();
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "NonRetryableExit")
    );
    assert_eq!(p.status.last_failure.unwrap().exit_code, Some(1));
    assert!(p.create.is_empty() && p.publish.is_none());
    // cleanPodPolicy Running: the three running workers go, the failed one stays.
    let mut deleted: Vec<&str> = p.delete.iter().map(|d| d.pod.as_str()).collect();
    deleted.sort();
    assert_eq!(
        deleted,
        ["train-worker-0", "train-worker-1", "train-worker-3"]
    );
}

#[test]
fn restart_on_exit_codes_overrides_the_default() {
    let mut j = elastic(2);
    j.spec.fault_tolerance.restart_on_exit_codes = Some(vec![1]);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[2] = exited(pods[2].clone(), 1, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Repairing));
}

#[test]
fn spent_backoff_limit_fails_the_job_and_it_stays_failed() {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.run_policy.backoff_limit = 1;
    j.status.as_mut().unwrap().failures.add("ProcessExit");
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[0] = exited(pods[0].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 2, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Failed));
    assert_eq!(
        p.status
            .conditions
            .iter()
            .find(|c| c.type_ == "Failed")
            .unwrap()
            .reason,
        "BackoffLimitExceeded"
    );

    let mut failed = j.clone();
    failed.status = Some(p.status.clone());
    let later = plan(
        &failed,
        &Observed {
            now: t(500),
            ..obs(vec![], Some(ring(&j, 2, &[0, 1, 2, 3])))
        },
    );
    assert_eq!(
        later.status.phase,
        Some(Phase::Failed),
        "a Failed job stays Failed when its pods are gone"
    );
    assert!(later.create.is_empty() && later.failures.is_empty() && later.publish.is_none());
    assert_eq!(later.status.failures, p.status.failures);
}

#[test]
fn node_loss_and_eviction_are_classified() {
    let j = elastic(2);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let mut evicted = pods[3].status.clone().unwrap();
    evicted.conditions.as_mut().unwrap().push(serde_json::from_value(json!({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"})).unwrap());
    pods[3].status = Some(evicted);
    pods[3].metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(90)));
    let mut o = obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3])));
    o.nodes.insert("n2".into(), lost_node());
    let p = plan(&j, &o);
    let causes: BTreeMap<String, Cause> = p
        .failures
        .iter()
        .map(|f| (f.pod.clone(), f.cause))
        .collect();
    assert_eq!(causes["train-worker-2"], Cause::NodeLost);
    assert_eq!(causes["train-worker-3"], Cause::Evicted);
    assert!(
        p.delete.contains(&Deletion {
            pod: "train-worker-2".into(),
            force: true,
            reason: "Replaced"
        }),
        "a lost node's pod is force-deleted"
    );
    assert_eq!(p.status.repairs.by_cause["NodeLost"], 1);
    assert_eq!(p.status.repairs.by_cause["Evicted"], 1);
    assert_eq!(p.publish.unwrap().members.len(), 2);
}

#[test]
fn a_member_deleted_outright_counts_as_pod_deleted() {
    let j = elastic(2);
    let pods: Vec<Pod> = [0, 1, 3].iter().map(|&i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.failures.len(), 1);
    assert_eq!(
        (p.failures[0].cause, p.failures[0].exists),
        (Cause::PodDeleted, false)
    );
    assert_eq!(p.status.repairs.by_cause["PodDeleted"], 1);
    assert_eq!(p.create[0].name_any(), "train-worker-2");
}

#[test]
fn scale_down_deletes_high_indices_without_counting() {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.replicas = 2;
    j.spec.elastic = Some(crate::api::Elastic {
        min_replicas: 2,
        max_replicas: 6,
    });
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    let deleted: Vec<(&str, &str)> = p
        .delete
        .iter()
        .map(|d| (d.pod.as_str(), d.reason))
        .collect();
    assert_eq!(
        deleted,
        [
            ("train-worker-2", "ScaledDown"),
            ("train-worker-3", "ScaledDown")
        ]
    );
    assert!(p.failures.is_empty());
    assert_eq!(p.status.failures.total, 0);
    assert_eq!(p.publish.unwrap().members.len(), 2);
    assert_eq!(p.status.phase, Some(Phase::Running));
    assert_eq!(p.status.repairs.total, 0);
}

#[test]
fn scale_up_beyond_capacity_keeps_training_and_says_what_is_short() {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.replicas = 5;
    j.spec.elastic = Some(crate::api::Elastic {
        min_replicas: 2,
        max_replicas: 6,
    });
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let mut stuck = build::worker_pod(&j, 4, 0).unwrap();
    stuck.status = Some(serde_json::from_value(json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]})).unwrap());
    pods.push(stuck);
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert!(p.publish.is_none() && p.create.is_empty());
    assert_eq!(p.status.phase, Some(Phase::Scaling));
    assert!(
        p.status
            .waiting
            .unwrap()
            .contains("Insufficient nvidia.com/gpu")
    );
}

#[test]
fn gang_waits_below_min_replicas_with_the_scheduler_reason() {
    let mut j = basic();
    j.spec.replicas = 4;
    let mut pods: Vec<Pod> = (0..2).map(|i| pod(&j, i, "Running")).collect();
    for i in 2..4 {
        let mut stuck = build::worker_pod(&j, i, 0).unwrap();
        stuck.status = Some(serde_json::from_value(json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "Insufficient nvidia.com/gpu"}]})).unwrap());
        pods.push(stuck);
    }
    let p = plan(&j, &obs(pods, None));
    assert!(p.publish.is_none(), "2 < minReplicas 4: no ring");
    assert!(p.status.waiting.unwrap().contains(
        "2 of 4 workers ready; train-worker-2: Unschedulable: Insufficient nvidia.com/gpu"
    ));
}

#[test]
fn suspend_deletes_workers_keeps_status_and_resume_recreates() {
    let mut j = with_status(basic(), Phase::Running);
    j.status.as_mut().unwrap().repairs.add("Hung");
    j.spec.run_policy.suspend = true;
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(pods, Some(ring(&j, 2, &[0, 1, 2, 3]))));
    assert_eq!(p.delete.len(), 4);
    assert!(p.delete.iter().all(|d| d.reason == "Suspended"));
    assert_eq!(p.status.phase, Some(Phase::Suspended));
    assert_eq!(p.status.repairs.total, 1, "status kept");
    assert_eq!(p.status.failures.total, 0, "suspension is not a failure");

    let mut resumed = j.clone();
    resumed.status = Some(p.status);
    resumed.spec.run_policy.suspend = false;
    let r = plan(&resumed, &obs(vec![], Some(ring(&j, 2, &[0, 1, 2, 3]))));
    assert_eq!(r.create.len(), 4);
    assert!(
        r.failures.is_empty(),
        "members gone while suspended are not failures"
    );
}

#[test]
fn a_job_created_suspended_never_misses_its_deadline_and_starts_its_clock_when_it_runs() {
    // Created suspended, with a deadline far shorter than its time suspended (now = t(100)).
    let mut j = basic();
    j.spec.run_policy.active_deadline_seconds = Some(5);
    j.spec.run_policy.suspend = true;
    let held = plan(&j, &obs(vec![], None));
    assert_eq!(held.status.phase, Some(Phase::Suspended));
    assert_eq!(
        held.status.start_time, None,
        "no start time while suspended"
    );
    assert!(held.create.is_empty());
    // Resumed long after: it runs, and its deadline counts from now.
    j.status = Some(held.status);
    j.spec.run_policy.suspend = false;
    let resumed = plan(&j, &obs(vec![], None));
    assert_eq!(resumed.create.len(), 4, "{:?}", resumed.status);
    assert_eq!(resumed.status.start_time, Some(t(100).to_string()));
    assert_eq!(resumed.requeue_after, Some(Duration::from_millis(5_100)));
}

#[test]
fn suspending_clears_the_start_time_and_stops_the_deadline() {
    let mut j = with_status(basic(), Phase::Running); // started at t(0)
    j.spec.run_policy.active_deadline_seconds = Some(300);
    j.spec.run_policy.suspend = true;
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Suspended));
    assert_eq!(p.status.start_time, None);
    // Suspended past the old deadline (t(300)): still not failed.
    let mut later = j.clone();
    later.status = Some(p.status);
    let mut o = obs(vec![], Some(ring(&j, 1, &[0, 1, 2, 3])));
    o.now = t(1000);
    let still = plan(&later, &o);
    assert_eq!(
        still.status.phase,
        Some(Phase::Suspended),
        "{:?}",
        still.status.conditions
    );
}

#[test]
fn deadline_fails_the_job_or_schedules_a_requeue() {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.run_policy.active_deadline_seconds = Some(300);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let early = plan(&j, &obs(pods.clone(), Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(early.status.phase, Some(Phase::Running));
    let wait = early.requeue_after.unwrap();
    assert!(
        wait > Duration::from_secs(199) && wait < Duration::from_secs(201),
        "{wait:?}"
    );
    let late = plan(
        &j,
        &Observed {
            now: t(301),
            ..obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3])))
        },
    );
    assert_eq!(late.status.phase, Some(Phase::Failed));
    assert_eq!(
        late.status
            .conditions
            .iter()
            .find(|c| c.type_ == "Failed")
            .unwrap()
            .reason,
        "DeadlineExceeded"
    );
}

#[test]
fn completion_succeeds_and_ttl_deletes_later() {
    let mut j = with_status(basic(), Phase::Running);
    j.spec.run_policy.ttl_seconds_after_finished = Some(60);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Succeeded")).collect();
    let p = plan(&j, &obs(pods.clone(), Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Succeeded));
    assert!(
        p.delete.is_empty(),
        "cleanPodPolicy Running keeps finished pods"
    );
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_secs(60) + Duration::from_millis(100))
    );
    let mut done = j.clone();
    done.status = Some(p.status);
    assert!(
        !plan(
            &done,
            &Observed {
                now: t(159),
                ..obs(pods.clone(), None)
            }
        )
        .delete_job
    );
    assert!(
        plan(
            &done,
            &Observed {
                now: t(161),
                ..obs(pods, None)
            }
        )
        .delete_job
    );
}

#[test]
fn members_finishing_one_by_one_are_neither_replaced_nor_re_formed_around() {
    let j = with_status(elastic(2), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[0] = pod(&j, 0, "Succeeded");
    pods[2] = pod(&j, 2, "Succeeded");
    let r = ring(&j, 3, &[0, 1, 2, 3]);
    let p = plan(&j, &obs(pods.clone(), Some(r.clone())));
    assert!(p.create.is_empty(), "a finished worker is not replaced");
    assert!(
        p.publish.is_none(),
        "no new generation while the ring completes"
    );
    assert!(p.failures.is_empty() && p.delete.is_empty());
    assert_eq!(p.status.phase, Some(Phase::Running));

    // Still running 6 × detectionSeconds (10 s) after the first member finished: stuck, and the
    // ring has completed without it; before that, a requeue for when the grace ends.
    let done_at = |mut p: Pod, secs: i64| {
        p.status.as_mut().unwrap().container_statuses = Some(vec![
            serde_json::from_value(json!({"name": "w", "image": "x", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"terminated": {"exitCode": 0, "finishedAt": t(secs).to_string()}}}))
            .unwrap(),
        ]);
        p
    };
    let mut stuck = pods.clone();
    stuck[0] = done_at(stuck[0].clone(), 50);
    let p = plan(&j, &obs(stuck.clone(), Some(r.clone())));
    assert_eq!(p.status.phase, Some(Phase::Running));
    assert_eq!(p.requeue_after, Some(Duration::from_millis(10_100)));
    stuck[0] = done_at(stuck[0].clone(), 39);
    let p = plan(&j, &obs(stuck, Some(r.clone())));
    assert_eq!(p.status.phase, Some(Phase::Succeeded));
    assert_eq!(
        p.delete.iter().map(|d| d.pod.as_str()).collect::<Vec<_>>(),
        ["train-worker-1", "train-worker-3"],
        "cleanPodPolicy Running deletes the stuck members"
    );

    // A member deleted by someone exits 0 on SIGTERM: a deletion, not the end of training.
    let mut deleted = pods.clone();
    deleted[0] = pod(&j, 0, "Running");
    deleted[2] = pod(&j, 2, "Running");
    deleted[1] = pod(&j, 1, "Succeeded");
    deleted[1].metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(5)));
    let p = plan(&j, &obs(deleted, Some(r.clone())));
    assert_eq!(p.status.phase, Some(Phase::Repairing));
    assert_eq!(p.failures.len(), 1);
    assert_eq!(p.failures[0].cause, Cause::PodDeleted);

    // The last running member crashes after the others finished: the ring completed.
    pods[1] = pod(&j, 1, "Succeeded");
    pods[3] = exited(pods[3].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, Some(r)));
    assert_eq!(p.status.phase, Some(Phase::Succeeded));
    assert!(p.create.is_empty() && p.publish.is_none());
}

#[test]
fn unschedulable_pods_never_block_completion() {
    let mut j = with_status(basic(), Phase::Scaling);
    j.spec.replicas = 5;
    j.spec.elastic = Some(crate::api::Elastic {
        min_replicas: 2,
        max_replicas: 6,
    });
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Succeeded")).collect();
    pods.push(build::worker_pod(&j, 4, 0).unwrap());
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Succeeded));
    assert_eq!(
        p.delete.iter().map(|d| d.pod.as_str()).collect::<Vec<_>>(),
        ["train-worker-4"]
    );
}

#[test]
fn conditions_keep_transition_times_unless_they_flip() {
    let a = conditions(&[], Phase::Running, "RingFormed", "", t(1), Some(1));
    let b = conditions(&a, Phase::Running, "RingFormed", "", t(2), Some(1));
    assert_eq!(a, b);
    let c = conditions(&b, Phase::Repairing, "RingRepairing", "", t(3), Some(1));
    let ready = c.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.last_transition_time.clone()),
        ("False", Time(t(3)))
    );
    let progressing = c.iter().find(|c| c.type_ == "Progressing").unwrap();
    assert_eq!(progressing.last_transition_time, Time(t(1)));
}

#[test]
fn elastic_bounds_and_exit_code_policy() {
    let j = job(
        json!({"replicas": 3, "elastic": {"minReplicas": 2, "maxReplicas": 5}, "template": {}}),
    );
    assert_eq!(j.spec.bounds(), (2, 5));
    assert!(j.spec.retryable_exit(137) && !j.spec.retryable_exit(1) && !j.spec.retryable_exit(127));
    assert_eq!(basic().spec.bounds(), (4, 4));
}

fn report(reporter: i32, suspect: i32, generation: u64, at: i64) -> FailureReport {
    FailureReport {
        generation,
        reporter: build::pod_name("train", reporter, 0),
        suspect: Some(build::pod_name("train", suspect, 0)),
        error: "Timeout".into(),
        time: t(at).to_string(),
        job_uid: None,
    }
}

#[test]
fn a_silent_member_blamed_by_its_neighbours_is_hung() {
    let j = elastic(2);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let r = ring(&j, 2, &[0, 1, 2, 3]);
    // Rank 1 froze: ranks 0 and 2 blame it; rank 3 blames rank 2, which cascaded the error.
    let reports = vec![
        report(0, 1, 2, 96),
        report(2, 1, 2, 96),
        report(3, 2, 2, 97),
        report(3, 0, 1, 10),
    ];
    let early = plan(
        &j,
        &Observed {
            reports: reports.clone(),
            now: t(98),
            ..obs(pods.clone(), Some(r.clone()))
        },
    );
    assert!(early.failures.is_empty(), "reports are still arriving");
    assert_eq!(early.requeue_after, Some(Duration::from_millis(3100)));
    let p = plan(
        &j,
        &Observed {
            reports,
            now: t(102),
            ..obs(pods, Some(r))
        },
    );
    assert_eq!(
        p.failures
            .iter()
            .map(|f| (f.pod.as_str(), f.cause))
            .collect::<Vec<_>>(),
        [("train-worker-1", Cause::Hung)]
    );
    assert!(p.delete.contains(&Deletion {
        pod: "train-worker-1".into(),
        force: true,
        reason: "Replaced"
    }));
    assert_eq!(p.status.repairs.by_cause["Hung"], 1);
    assert_eq!(p.publish.unwrap().members.len(), 3);
}

#[test]
fn a_silent_member_on_a_node_with_a_late_lease_is_a_node_loss() {
    let j = elastic(2);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let mut o = Observed {
        reports: vec![report(0, 1, 2, 96), report(2, 1, 2, 96)],
        now: t(102),
        ..obs(pods, Some(ring(&j, 2, &[0, 1, 2, 3])))
    };
    o.nodes.insert("n1".into(), late_node());
    let p = plan(&j, &o);
    let got: Vec<_> = p
        .failures
        .iter()
        .map(|f| (f.pod.as_str(), f.cause))
        .collect();
    assert_eq!(got, [("train-worker-1", Cause::NodeLost)]);
    assert_eq!(p.status.repairs.by_cause["NodeLost"], 1);
    assert_eq!(p.status.repairs.by_cause.get("Hung"), None);
    let replacement = serde_json::to_string(&p.create[0].spec.as_ref().unwrap().affinity).unwrap();
    assert!(
        replacement.contains("n1"),
        "the replacement avoids the dead node: {replacement}"
    );
}

#[test]
fn a_node_is_lost_only_past_both_a_late_renewal_and_detection_seconds() {
    let lease = |age_ms: u64, duration: Option<i32>, detection: i32| {
        node_lease(Some(Duration::from_millis(age_ms)), duration, detection)
    };
    // The process kubelet: 8 s Leases renewed every 2 s; late after 4 s, lost after 5 s when
    // detectionSeconds is 5.
    assert_eq!(lease(3_900, Some(8), 4), NodeLease::Fresh);
    assert_eq!(lease(4_100, Some(8), 5), NodeLease::Late);
    assert_eq!(lease(5_100, Some(8), 5), NodeLease::Lost);
    // A real kubelet renews a 40 s Lease every 10 s: with detectionSeconds 4 a node whose renewal
    // is late is not lost; it is, once a whole renewal was missed.
    assert_eq!(lease(14_900, Some(40), 4), NodeLease::Fresh);
    assert_eq!(lease(19_900, None, 4), NodeLease::Fresh);
    assert_eq!(lease(20_100, None, 4), NodeLease::Lost);
    assert_eq!(lease(20_100, Some(40), 30), NodeLease::Late);
    assert_eq!(node_lease(None, Some(40), 10), NodeLease::Lost);
}

#[test]
fn reports_of_an_older_generation_are_ignored_and_progress_is_copied() {
    let j = with_status(basic(), Phase::Running);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let progress = ProgressReport {
        generation: 3,
        step: 120,
        total_steps: Some(500),
        loss: Some(0.25),
        samples_per_second: Some(900.0),
        last_checkpoint_step: Some(100),
        test_accuracy: Some(0.97),
        min_share: Some(10),
        max_share: Some(18),
        time: t(99).to_string(),
        job_uid: None,
    };
    let o = Observed {
        reports: vec![report(0, 1, 2, 10)],
        progress: Some(progress),
        ..obs(pods, Some(ring(&j, 3, &[0, 1, 2, 3])))
    };
    let p = plan(&j, &o);
    assert!(p.failures.is_empty());
    let got = p.status.progress.unwrap();
    assert_eq!(
        (got.step, got.total_steps, got.last_checkpoint_step),
        (120, Some(500), Some(100))
    );
    assert_eq!((got.loss, got.test_accuracy), (Some(0.25), Some(0.97)));
    // The spread of the speed-weighted split.
    assert_eq!(
        (got.min_batch_share, got.max_batch_share),
        (Some(10), Some(18))
    );
}

#[test]
fn a_pod_bound_to_a_lost_node_before_it_ran_is_rescheduled_uncounted() {
    let j = with_status(basic(), Phase::Repairing);
    let mut pods: Vec<Pod> = [0, 2, 3].iter().map(|&i| pod(&j, i, "Running")).collect();
    let mut fresh = build::worker_pod(&j, 1, 1).unwrap();
    fresh.spec.as_mut().unwrap().node_name = Some("n9".into());
    pods.push(fresh);
    let mut o = obs(pods, Some(ring(&j, 2, &[0, 2, 3])));
    o.nodes.insert("n9".into(), lost_node());
    let p = plan(&j, &o);
    assert!(p.failures.is_empty());
    assert_eq!(p.status.failures.total, 0);
    assert!(p.delete.contains(&Deletion {
        pod: "train-worker-1-1".into(),
        force: true,
        reason: "Rescheduled"
    }));
    let next = &p.create[0];
    assert_eq!(next.name_any(), "train-worker-1-2");
    let affinity = serde_json::to_string(&next.spec.as_ref().unwrap().affinity).unwrap();
    assert!(
        affinity.contains("n9"),
        "the replacement avoids the lost node: {affinity}"
    );
}

#[test]
fn resumed_workers_named_like_departed_members_get_a_new_generation_and_are_not_blamed() {
    // Suspended at generation 1 (every member departed), then resumed: new pods, same names,
    // and the old generation's failure reports (blaming worker-1) still in the heartbeat.
    let mut j = with_status(basic(), Phase::Suspended);
    let r = ring(&j, 1, &[0, 1, 2, 3]);
    j.status.as_mut().unwrap().ring = Some(RingStatus {
        generation: 1,
        size: 4,
        config_map: "train-ring".into(),
        departed: r.members.iter().map(|m| m.pod.clone()).collect(),
        ..Default::default()
    });
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let mut o = obs(pods, Some(r));
    let old = (o.now - jiff::SignedDuration::from_secs(60)).to_string();
    o.reports = ["train-worker-0", "train-worker-2"]
        .iter()
        .map(|reporter| FailureReport {
            generation: 1,
            reporter: (*reporter).into(),
            suspect: Some("train-worker-1".into()),
            error: "timeout".into(),
            time: old.clone(),
            job_uid: None,
        })
        .collect();
    let p = plan(&j, &o);
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    assert_eq!(p.publish.map(|m| m.generation), Some(2));
}

#[test]
fn the_plan_says_when_to_look_again() {
    // A running job without nodes to watch and without timers waits for a change (node health,
    // pods and reports are watched); one on a node is looked at again when the node would be
    // lost without a renewal; a shorter timer of its own wins.
    let j = with_status(basic(), Phase::Running);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let steady = plan(&j, &obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3]))));
    assert_eq!(steady.look_again, None);
    let fresh = NodeHealth {
        lease_age: Some(Duration::from_secs(1)),
        lease_duration_seconds: Some(8),
        ready: true,
        clock_skew: None,
    };
    let on_node = Observed {
        nodes: BTreeMap::from([("n0".to_owned(), fresh)]),
        ..obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3])))
    };
    // detectionSeconds 10, seen renewed 1 s ago: lost in 9 s (and 100 ms) unless renewed.
    let node_check = Duration::from_millis(9_100);
    assert_eq!(plan(&j, &on_node).look_again, Some(node_check));
    let mut o = Observed {
        reports: vec![report(0, 1, 3, 98)],
        ..on_node
    };
    o.now = t(100);
    let young = plan(&j, &o);
    assert!(young.requeue_after.unwrap() < node_check);
    assert_eq!(young.look_again, young.requeue_after);
    // A finished job waits for a change, or for its TTL only.
    let failed = with_status(basic(), Phase::Failed);
    assert_eq!(plan(&failed, &obs(vec![], None)).look_again, None);
    let mut ttl = failed.clone();
    ttl.spec.run_policy.ttl_seconds_after_finished = Some(3600);
    ttl.status.as_mut().unwrap().completion_time = Some(t(0).to_string());
    let p = plan(&ttl, &obs(vec![], None));
    assert_eq!(p.look_again, p.requeue_after);
    assert!(p.look_again.unwrap() > Duration::from_secs(3000));
}

#[test]
fn children_the_table_no_longer_builds_are_pruned() {
    let job = with_status(basic(), Phase::Running);
    let mut o = obs(vec![], None);
    assert!(plan(&job, &o).prune.is_empty());
    o.orphans = vec![(crate::build::Kind::NetworkPolicy, "train".into())];
    assert_eq!(plan(&job, &o).prune, o.orphans);
}

#[test]
fn static_children_are_applied_when_the_spec_generation_moves_until_the_job_finishes() {
    let new = basic();
    assert!(plan(&new, &obs(vec![], None)).apply_children);
    let mut seen = with_status(basic(), Phase::Running);
    seen.status.as_mut().unwrap().observed_generation = Some(1);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&seen, i, "Running")).collect();
    let ring4 = Some(ring(&seen, 1, &[0, 1, 2, 3]));
    assert!(!plan(&seen, &obs(pods.clone(), ring4.clone())).apply_children);
    seen.metadata.generation = Some(2);
    assert!(plan(&seen, &obs(pods, ring4)).apply_children);
    let mut finished = with_status(basic(), Phase::Succeeded);
    finished.metadata.generation = Some(5);
    assert!(!plan(&finished, &obs(vec![], None)).apply_children);
}

#[test]
fn a_template_that_cannot_build_a_worker_blocks_it_and_stops_nothing_else() {
    // Stored before the schema refused it: a running elastic job whose template lost its
    // containers.
    let mut j = with_status(basic(), Phase::Running);
    j.spec.elastic = serde_json::from_value(json!({"minReplicas": 2, "maxReplicas": 4})).unwrap();
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let ring4 = Some(ring(&j, 1, &[0, 1, 2, 3]));
    j.spec.template = serde_json::from_value(json!({"spec": {"containers": []}})).unwrap();
    let mut pods = pods;
    pods[1] = exited(pods[1].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, ring4));
    // The lost worker is still counted and the ring still re-formed without it…
    assert_eq!(p.status.failures.total, 1);
    assert_eq!(p.status.repairs.by_cause["ProcessExit"], 1);
    assert_eq!(p.publish.as_ref().map(|r| r.members.len()), Some(3));
    // …but no replacement is created, and the status names the pod and why.
    assert!(p.create.is_empty());
    let waiting = p.status.waiting.unwrap();
    assert!(
        waiting.contains(
            "train-worker-1-1: InvalidTemplate: job train: spec.template.spec.containers is empty"
        ),
        "{waiting}"
    );
}

#[test]
fn a_job_that_does_not_decode_is_reported_on_itself_with_the_field_named() {
    let mut object = serde_json::to_value(with_status(basic(), Phase::Running)).unwrap();
    object["metadata"]["generation"] = json!(3);
    object["spec"]["template"]["spec"]["containers"][0]["args"] = json!("train --steps 100");
    let p = invalid(&object, t(5)).expect("does not decode");
    let field = "spec.template.spec.containers[0].args";
    assert_eq!(p.events.len(), 1);
    assert!(p.events[0].warning && p.events[0].reason == "InvalidSpec");
    assert!(p.events[0].note.contains(field), "{}", p.events[0].note);
    let ready = p
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert!(ready.message.contains(field));
    assert_eq!(p.status.observed_generation, Some(3));
    assert!(p.status.waiting.as_deref().unwrap().contains(field));
    assert!(p.create.is_empty() && p.delete.is_empty() && p.publish.is_none());
    // A job that decodes has nothing to report.
    assert!(invalid(&serde_json::to_value(basic()).unwrap(), t(5)).is_none());
}

#[test]
fn each_lost_worker_is_its_own_event_naming_its_pod() {
    let j = with_status(basic(), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = exited(pod(&j, 1, "Running"), 137, "Error");
    pods[2] = exited(pod(&j, 2, "Running"), 137, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    let lost: Vec<&EventNote> = p
        .events
        .iter()
        .filter(|e| e.reason == "WorkerFailed")
        .collect();
    let about: Vec<Option<&str>> = lost.iter().map(|e| e.pod.as_deref()).collect();
    assert_eq!(about, [Some("train-worker-1"), Some("train-worker-2")]);
    // The recorder keys on (type, reason, action, related object): these never merge, and no
    // event says only "Reconcile".
    assert!(
        p.events
            .iter()
            .all(|e| e.action != "Reconcile" && !e.action.is_empty())
    );
    let created: Vec<Option<&str>> = p
        .events
        .iter()
        .filter(|e| e.reason == "WorkerCreated")
        .map(|e| e.pod.as_deref())
        .collect();
    assert_eq!(
        created,
        [Some("train-worker-1-1"), Some("train-worker-2-1")]
    );
}

#[test]
fn status_replicas_counts_the_workers_that_exist() {
    let j = with_status(basic(), Phase::Running); // spec.replicas 4
    let pods = vec![
        pod(&j, 0, "Running"),
        pod(&j, 1, "Pending"),
        exited(pod(&j, 2, "Running"), 137, "Error"),
    ];
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2]))));
    assert_eq!(
        p.status.replicas, 2,
        "worker 2 failed, worker 3 is not there yet"
    );
}

#[test]
fn a_job_that_fails_without_a_repair_counts_none() {
    let j = with_status(basic(), Phase::Running);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[3] = exited(pod(&j, 3, "Running"), 1, "Error"); // 1: not retryable
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Failed));
    assert_eq!(p.status.failures.total, 1);
    assert_eq!(p.status.repairs.total, 0, "RESTARTS counts repairs only");
}

/// `basic()` with 4 replicas, elastic 2..4, running workers 0 and 1 and no ring yet.
fn elastic_pair() -> (DiphomaJob, Vec<Pod>) {
    let mut j = basic();
    j.spec.elastic = Some(crate::api::Elastic {
        min_replicas: 2,
        max_replicas: 4,
    });
    let pods = (0..2).map(|i| pod(&j, i, "Running")).collect();
    (j, pods)
}

#[test]
fn refused_workers_are_reported_and_the_ring_forms_at_min_replicas() {
    let (j, pods) = elastic_pair();
    let quota = "exceeded quota: gpu, requested: requests.nvidia.com/gpu=2, used: 4, limited: 4";
    let refused: BTreeMap<String, String> = ["train-worker-2", "train-worker-3"]
        .map(|p| (p.to_owned(), quota.to_owned()))
        .into();
    // Before any refusal the missing workers are starting: the ring waits for them.
    let first = plan(&j, &obs(pods.clone(), None));
    assert!(first.publish.is_none());
    let o = Observed {
        refused,
        ..obs(pods, None)
    };
    let p = plan(&j, &o);
    assert_eq!(p.create.len(), 2, "refused workers are retried");
    let m = p.publish.as_ref().expect("the ring forms at minReplicas");
    assert_eq!(m.members.len(), 2);
    let waiting = p.status.waiting.as_deref().unwrap();
    assert!(
        waiting.contains("train-worker-2: CreateRefused: exceeded quota"),
        "{waiting}"
    );
    let blocked: Vec<Option<&str>> = p
        .events
        .iter()
        .filter(|e| e.reason == "WorkerBlocked" && e.warning)
        .map(|e| e.pod.as_deref())
        .collect();
    assert_eq!(blocked, [Some("train-worker-2"), Some("train-worker-3")]);
}

#[test]
fn a_worker_that_cannot_pull_its_image_is_named_once() {
    let (j, mut pods) = elastic_pair();
    let mut stuck = build::worker_pod(&j, 2, 0).unwrap();
    stuck.status = Some(serde_json::from_value(json!({"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [{"name": "w", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image diphoma-ghost:1"}}}]})).unwrap());
    pods.truncate(1); // one worker ready: below minReplicas 2
    pods.push(stuck);
    let p = plan(&j, &obs(pods.clone(), None));
    assert!(p.publish.is_none());
    let waiting = p.status.waiting.clone().unwrap();
    assert!(
        waiting.contains("train-worker-2: ErrImagePull: no such image diphoma-ghost:1"),
        "{waiting}"
    );
    let ready = p
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "ErrImagePull");
    let warned = |p: &Plan| {
        p.events
            .iter()
            .filter(|e| e.reason == "WorkerBlocked")
            .count()
    };
    assert_eq!(warned(&p), 1);
    // The next reconcile sees the same thing: no second event.
    let mut again = j.clone();
    again.status = Some(p.status.clone());
    assert_eq!(warned(&plan(&again, &obs(pods, None))), 0);
}

/// Worker `i`, attempt `attempt`, exited 137 and already counted.
fn counted_exit(j: &DiphomaJob, i: i32, attempt: i32) -> Pod {
    let mut p = exited(build::worker_pod(j, i, attempt).unwrap(), 137, "Error");
    p.metadata.annotations = Some(
        [(
            build::ANNOT_FAILURE_COUNTED.to_owned(),
            "ProcessExit".to_owned(),
        )]
        .into(),
    );
    p
}

#[test]
fn failed_pods_stay_for_their_logs_as_clean_pod_policy_says() {
    let mut j = with_status(basic(), Phase::Repairing);
    let mut pods: Vec<Pod> = [0, 2, 3].map(|i| pod(&j, i, "Running")).to_vec();
    pods.push(counted_exit(&j, 1, 0));
    pods.push(exited(build::worker_pod(&j, 1, 1).unwrap(), 137, "Error")); // new failure
    let o = obs(pods, Some(ring(&j, 2, &[0, 2, 3])));
    // Running (the default): the most recent failed pod of worker 1 stays, the older goes.
    let p = plan(&j, &o);
    assert_eq!(p.failures.len(), 1);
    let deleted: Vec<(&str, &str)> = p
        .delete
        .iter()
        .map(|d| (d.pod.as_str(), d.reason))
        .collect();
    assert_eq!(deleted, [("train-worker-1", "Pruned")]);
    assert_eq!(p.create[0].name_any(), "train-worker-1-2");
    // None: every failed pod stays.
    j.spec.run_policy.clean_pod_policy = crate::api::CleanPodPolicy::None;
    let p = plan(&j, &o);
    assert!(p.delete.is_empty(), "{:?}", p.delete);
    assert_eq!(p.create[0].name_any(), "train-worker-1-2");
}

#[test]
fn a_job_that_fails_keeps_only_the_newest_failed_pod_of_each_worker() {
    let mut j = with_status(basic(), Phase::Repairing);
    j.spec.run_policy.backoff_limit = 1;
    j.status.as_mut().unwrap().failures.add("ProcessExit");
    let mut pods: Vec<Pod> = [0, 2, 3].map(|i| pod(&j, i, "Running")).to_vec();
    pods.push(counted_exit(&j, 1, 0));
    pods.push(exited(build::worker_pod(&j, 1, 1).unwrap(), 137, "Error"));
    let p = plan(&j, &obs(pods, Some(ring(&j, 2, &[0, 2, 3]))));
    assert_eq!(p.status.phase, Some(Phase::Failed));
    let deleted: Vec<(&str, &str)> = p
        .delete
        .iter()
        .map(|d| (d.pod.as_str(), d.reason))
        .filter(|(pod, _)| pod.starts_with("train-worker-1"))
        .collect();
    assert_eq!(deleted, [("train-worker-1", "Pruned")]);
}

/// `pods[i]` carries the API server's `DisruptionTarget` condition with `reason` and is being
/// deleted gracefully: requested at `t(90)` with 20 s of grace, so its `deletionTimestamp` (the
/// deadline) is `t(110)`, after `now` (`t(100)`).
fn disrupted(mut p: Pod, reason: &str) -> Pod {
    let mut st = p.status.clone().unwrap();
    st.conditions.as_mut().unwrap().push(
        serde_json::from_value(
            json!({"type": "DisruptionTarget", "status": "True", "reason": reason}),
        )
        .unwrap(),
    );
    p.status = Some(st);
    p.metadata.deletion_timestamp = Some(Time(t(110)));
    p.metadata.deletion_grace_period_seconds = Some(20);
    p
}

#[test]
fn disruptions_spend_their_own_limit_never_the_backoff_limit() {
    let mut j = elastic(2);
    j.spec.run_policy.backoff_limit = 0;
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[1] = disrupted(pods[1].clone(), "EvictionByEvictionAPI");
    pods[2] = disrupted(pods[2].clone(), "PreemptionByScheduler");
    let mut o = obs(pods.clone(), Some(ring(&j, 1, &[0, 1, 2, 3])));
    o.nodes.insert("n3".into(), lost_node());
    let p = plan(&j, &o);
    assert_eq!(p.status.phase, Some(Phase::Repairing), "no limit: repaired");
    assert_eq!(p.status.failures.total, 0, "{:?}", p.status.failures);
    assert_eq!(p.status.disruptions.total, 3);
    for c in ["Evicted", "Preempted", "NodeLost"] {
        assert_eq!(p.status.disruptions.by_cause[c], 1, "{c}");
        assert_eq!(p.status.repairs.by_cause[c], 1, "{c}");
    }
    // With a limit of 2, the third disruption fails the job, by its own reason.
    j.spec.fault_tolerance.disruption_limit = Some(2);
    let p = plan(&j, &o);
    assert_eq!(p.status.phase, Some(Phase::Failed));
    let failed = p.status.conditions.iter().find(|c| c.type_ == "Failed");
    assert_eq!(failed.unwrap().reason, "DisruptionLimitExceeded");
    // The job's own failure still spends backoffLimit 0.
    j.spec.fault_tolerance.disruption_limit = None;
    pods[0] = exited(pods[0].clone(), 137, "Error");
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    assert_eq!(
        (p.status.failures.total, p.status.disruptions.total),
        (1, 2)
    );
    let failed = p.status.conditions.iter().find(|c| c.type_ == "Failed");
    assert_eq!(failed.unwrap().reason, "BackoffLimitExceeded");
}

#[test]
fn a_graceful_deletion_is_timed_when_observed_not_at_its_deadline() {
    let j = elastic(2);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    pods[3] = disrupted(pods[3].clone(), "EvictionByEvictionAPI");
    let p = plan(&j, &obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3]))));
    let last = p.status.last_failure.unwrap();
    assert_eq!(last.reason, "EvictionByEvictionAPI");
    // Requested at t(90) with 20 s of grace: timed from the request, not the deadline t(110).
    assert_eq!(last.time, t(90).to_string());
}

#[test]
fn a_lost_ring_configmap_never_takes_the_generation_back() {
    let mut j = with_status(basic(), Phase::Running);
    j.status.as_mut().unwrap().ring = Some(RingStatus {
        generation: 3,
        size: 4,
        ..Default::default()
    });
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    // Deleted (or left by another job): the next publication is above the status' generation.
    let p = plan(&j, &obs(pods.clone(), None));
    assert_eq!(p.publish.map(|m| m.generation), Some(4));
    assert_eq!(p.status.ring.unwrap().generation, 4);
    // A published ring older than the status cannot take it back either.
    let mut o = obs(pods, Some(ring(&j, 1, &[0, 1, 2])));
    o.pods[3] = pod(&j, 3, "Running");
    let p = plan(&j, &o);
    assert_eq!(p.publish.map(|m| m.generation), Some(4));
}

#[test]
fn names_held_by_another_jobs_pods_are_skipped_and_never_counted() {
    let j = basic();
    let mut o = obs(vec![], None);
    o.foreign = ["train-worker-0", "train-worker-2", "train-worker-2-1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let p = plan(&j, &o);
    let names: Vec<String> = p.create.iter().map(|p| p.name_any()).collect();
    assert_eq!(
        names,
        [
            "train-worker-0-1",
            "train-worker-1",
            "train-worker-2-2",
            "train-worker-3"
        ]
    );
    assert!(p.failures.is_empty() && p.status.failures.total == 0);
}

#[test]
fn a_missing_child_is_restored_and_a_lost_reporting_path_shows() {
    let mut j = with_status(basic(), Phase::Running);
    j.status.as_mut().unwrap().observed_generation = Some(1);
    j.status.as_mut().unwrap().progress = Some(crate::api::Progress {
        step: 10,
        ..Default::default()
    });
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let reporting = |o: &Observed| {
        let p = plan(&j, o);
        let c = p.status.conditions.iter().find(|c| c.type_ == "Reporting");
        let c = c.cloned().expect("a Reporting condition");
        (p.apply_children, c.status, c.reason)
    };
    let mut o = obs(pods, Some(ring(&j, 1, &[0, 1, 2, 3])));
    o.heartbeat_changed = Some(t(95));
    assert_eq!(
        reporting(&o),
        (false, "True".into(), "ReportsArriving".into())
    );
    o.missing = vec!["RoleBinding/train-worker".into()];
    assert_eq!(
        reporting(&o),
        (true, "False".into(), "ReportingPathLost".into())
    );
    // A Service is not on the reporting path: restored, reporting unaffected.
    o.missing = vec!["Service/train".into()];
    assert_eq!(
        reporting(&o),
        (true, "True".into(), "ReportsArriving".into())
    );
    // Unchanged for longer than 3 × detectionSeconds (at least 30 s), by this operator's clock.
    o.missing = vec![];
    o.heartbeat_changed = Some(t(60));
    assert_eq!(
        reporting(&o),
        (false, "False".into(), "ReportsStopped".into())
    );
}

/// The workers' reports falling silent is a timer of the plan's own: a running job that has
/// reported is looked at again when `Reporting` would turn `ReportsStopped` (30 s of silence for
/// `detectionSeconds` 10, judged in whole seconds), and then says so.
#[test]
fn reports_falling_silent_are_a_timer() {
    let j = with_status(basic(), Phase::Running);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let progress = ProgressReport {
        generation: 3,
        step: 120,
        total_steps: Some(500),
        time: t(90).to_string(),
        ..ProgressReport::default()
    };
    let at = |now: i64| Observed {
        progress: Some(progress.clone()),
        heartbeat_changed: Some(t(90)),
        now: t(now),
        ..obs(pods.clone(), Some(ring(&j, 3, &[0, 1, 2, 3])))
    };
    let reporting = |p: &Plan| {
        p.status
            .conditions
            .iter()
            .find(|c| c.type_ == "Reporting")
            .map(|c| c.reason.clone())
    };
    let quiet = plan(&j, &at(100));
    assert_eq!(quiet.look_again, Some(Duration::from_millis(21_100)));
    assert_eq!(reporting(&quiet).as_deref(), Some("ReportsArriving"));
    let due = plan(&j, &at(121));
    assert_eq!(reporting(&due).as_deref(), Some("ReportsStopped"));
    assert_eq!(due.look_again, None, "nothing left to wait for");
}

#[test]
fn a_spec_edit_that_reaches_the_workers_replaces_the_whole_ring_at_once() {
    let j = elastic(2);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let r = ring(&j, 3, &[0, 1, 2, 3]);
    // Scaling, the run policy and the failure policy reach no worker: nothing is replaced.
    let mut scaled = j.clone();
    scaled.spec.replicas = 5;
    scaled.spec.run_policy.backoff_limit = 9;
    scaled.spec.fault_tolerance.restart_on_exit_codes = Some(vec![3]);
    let p = plan(&scaled, &obs(pods.clone(), Some(r.clone())));
    assert!(p.delete.is_empty(), "{:?}", p.delete);
    // gpusPerWorker, an env var, the image: every worker of the old spec goes at once, none is
    // counted, and the replacements carry the new spec.
    let edits: [fn(&mut DiphomaJob); 3] = [
        |j| j.spec.gpus_per_worker += 1,
        |j| {
            let c = &mut j.spec.template.spec.as_mut().unwrap().containers[0];
            c.env
                .get_or_insert_default()
                .push(k8s_openapi::api::core::v1::EnvVar {
                    name: "LR".into(),
                    value: Some("0.1".into()),
                    value_from: None,
                });
        },
        |j| j.spec.template.spec.as_mut().unwrap().containers[0].image = Some("w:2".into()),
    ];
    for edit in edits {
        let mut edited = j.clone();
        edit(&mut edited);
        edited.metadata.generation = Some(2);
        let digest = build::worker_spec_digest(&edited);
        assert_ne!(digest, build::worker_spec_digest(&j));
        let p = plan(&edited, &obs(pods.clone(), Some(r.clone())));
        let deleted: Vec<(&str, &str)> = p
            .delete
            .iter()
            .map(|d| (d.pod.as_str(), d.reason))
            .collect();
        assert_eq!(
            deleted,
            (0..4)
                .map(|i| (pods[i].metadata.name.as_deref().unwrap(), "SpecChanged"))
                .collect::<Vec<_>>()
        );
        assert!(p.failures.is_empty() && p.status.failures.total == 0);
        assert!(p.publish.is_none(), "no ring of old and new workers");
        let created: Vec<String> = p.create.iter().map(|p| p.name_any()).collect();
        assert_eq!(
            created,
            [
                "train-worker-0-1",
                "train-worker-1-1",
                "train-worker-2-1",
                "train-worker-3-1"
            ]
        );
        assert!(p.create.iter().all(|c| !workers::stale(c, &digest)));
        let reason = |p: &Plan| {
            p.status
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.reason.clone())
        };
        assert_eq!(reason(&p).as_deref(), Some("SpecChanged"));
        let note = p
            .events
            .iter()
            .find(|e| e.reason == "SpecChanged")
            .map(|e| e.note.clone())
            .unwrap();
        assert!(
            note.contains("generation 2") && note.contains("4 workers"),
            "{note}"
        );
        // Once the old workers terminate, the new ones alone form the next generation.
        let new: Vec<Pod> = p
            .create
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut c = c.clone();
                c.status = pod(&edited, i as i32, "Running").status;
                c
            })
            .collect();
        let next = plan(&edited, &obs(new, Some(r.clone())));
        let members: Vec<String> = next
            .publish
            .unwrap()
            .members
            .into_iter()
            .map(|m| m.pod)
            .collect();
        assert_eq!(members, created);
    }
    // A worker made before the digest label existed is taken as built from the current spec.
    let mut unlabelled = pods[0].clone();
    unlabelled
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .remove(build::LABEL_WORKER_SPEC);
    assert!(!workers::stale(&unlabelled, "0000"));
}

#[test]
fn a_ring_stored_before_the_protection_default_changed_keeps_its_mode() {
    use crate::api::RingProtection;
    let mode = |p: &Pod| {
        let env = p.spec.as_ref().unwrap().containers[0].env.clone().unwrap();
        let e = env
            .into_iter()
            .find(|e| e.name == "DIPHOMA_RING_PROTECTION");
        e.and_then(|e| e.value).unwrap()
    };
    // Created when `integrity` was the default: its workers run it. The API server now reads
    // the job with the new default, `none`.
    let mut old = elastic(2);
    old.spec.ring.protection = RingProtection::Integrity;
    let mut read = old.clone();
    read.spec.ring.protection = RingProtection::None;
    let pods: Vec<Pod> = (0..3).map(|i| pod(&old, i, "Running")).collect();
    let r = ring(&old, 3, &[0, 1, 2]);
    let p = plan(&read, &obs(pods.clone(), Some(r.clone())));
    assert!(p.delete.is_empty(), "nothing replaced: {:?}", p.delete);
    let created: Vec<(String, String)> = p.create.iter().map(|c| (c.name_any(), mode(c))).collect();
    assert_eq!(
        created,
        [("train-worker-3".to_owned(), "integrity".to_owned())]
    );
    assert!(!workers::stale(
        &p.create[0],
        &build::worker_spec_digest(&old)
    ));
    // Without a live worker of the old mode the spec's applies: a new ring, all in `none`.
    let gone: Vec<Pod> = pods
        .iter()
        .map(|p| exited(p.clone(), 137, "OOMKilled"))
        .collect();
    let p = plan(&read, &obs(gone, Some(r.clone())));
    assert!(!p.create.is_empty() && p.create.iter().all(|c| mode(c) == "none"));
    // An edit that reaches the workers replaces them all at once, in the spec's mode.
    let mut edited = read.clone();
    edited.spec.template.spec.as_mut().unwrap().containers[0].image = Some("w:2".into());
    let p = plan(&edited, &obs(pods.clone(), Some(r)));
    assert_eq!(p.delete.len(), 3);
    assert!(p.create.len() == 4 && p.create.iter().all(|c| mode(c) == "none"));
    // A job whose workers run the spec's mode is planned from the spec as it is.
    assert!(workers::kept_protection(&read, &[pod(&read, 0, "Running")]).is_none());
}

#[test]
fn a_blamed_member_that_answers_its_probe_is_not_hung_unless_cut_off() {
    let j = elastic(2);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let r = ring(&j, 2, &[0, 1, 2, 3]);
    // Rank 1 is blamed and its own report is late, lost, or of the generation it is behind in.
    let reports = vec![
        report(0, 1, 2, 96),
        report(2, 1, 2, 96),
        report(1, 3, 1, 90),
    ];
    let at = |now: i64, progress: Option<ProgressReport>| Observed {
        reports: reports.clone(),
        now: t(now),
        progress,
        answering: ["train-worker-1".to_owned()].into(),
        ..obs(pods.clone(), Some(r.clone()))
    };
    // The controller would probe exactly the member the reports make silent.
    let suspects: Vec<String> = failures::suspects(&j, &at(102, None))
        .into_iter()
        .map(|m| m.pod)
        .collect();
    assert_eq!(suspects, ["train-worker-1"]);
    let p = plan(&j, &at(102, None));
    assert!(
        p.failures.is_empty() && p.delete.is_empty(),
        "{:?}",
        p.failures
    );
    assert!(p.publish.is_none());
    // Looked at again when it would be cut off (3 × detectionSeconds after the first blame).
    assert_eq!(p.requeue_after, Some(Duration::from_millis(24_100)));
    // Its ring committed a step since: it is fine, whenever asked.
    let stepped = ProgressReport {
        generation: 2,
        step: 9,
        time: t(99).to_string(),
        ..ProgressReport::default()
    };
    assert!(plan(&j, &at(200, Some(stepped))).failures.is_empty());
    // Alive but no step for 3 × detectionSeconds: cut off from its peers, counted and replaced.
    let p = plan(&j, &at(127, None));
    assert_eq!(
        p.failures
            .iter()
            .map(|f| (f.pod.as_str(), f.cause, f.reason.as_str()))
            .collect::<Vec<_>>(),
        [("train-worker-1", Cause::Hung, "CutOff")]
    );
}

#[test]
fn a_blamed_member_whose_port_refuses_is_left_to_its_exit_status() {
    let j = elastic(2);
    let mut pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let r = ring(&j, 2, &[0, 1, 2, 3]);
    let reports = vec![report(0, 1, 2, 96), report(2, 1, 2, 96)];
    let at = |now: i64, pods: Vec<Pod>| Observed {
        reports: reports.clone(),
        now: t(now),
        exited: ["train-worker-1".to_owned()].into(),
        ..obs(pods, Some(r.clone()))
    };
    // Killed, its pod still Running: not counted yet, looked at again within detectionSeconds.
    let p = plan(&j, &at(102, pods.clone()));
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    assert_eq!(p.requeue_after, Some(Duration::from_millis(4100)));
    // The kubelet reports the exit: counted by the cause that ended it.
    pods[1] = exited(pods[1].clone(), 137, "Error");
    let p = plan(&j, &at(102, pods.clone()));
    let causes: Vec<Cause> = p.failures.iter().map(|f| f.cause).collect();
    assert_eq!(causes, [Cause::ProcessExit]);
    // No status within detectionSeconds after all: hung, so the ring does not wait forever.
    let running: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let causes: Vec<Cause> = plan(&j, &at(107, running))
        .failures
        .iter()
        .map(|f| f.cause)
        .collect();
    assert_eq!(causes, [Cause::Hung]);
}

#[test]
fn a_blame_the_ring_stepped_past_is_settled_for_the_rest_of_its_generation() {
    let j = elastic(2);
    let pods: Vec<Pod> = (0..4).map(|i| pod(&j, i, "Running")).collect();
    let r = ring(&j, 2, &[0, 1, 2, 3]);
    let stepped = |at: i64| ProgressReport {
        generation: 2,
        step: 50,
        time: t(at).to_string(),
        ..ProgressReport::default()
    };
    let o = |progress| Observed {
        reports: vec![report(0, 1, 2, 96), report(2, 1, 2, 96)],
        now: t(500),
        progress: Some(progress),
        ..obs(pods.clone(), Some(r.clone()))
    };
    // Rank 0 committed a step after the blames: nobody is a suspect, nobody is counted.
    let settled = o(stepped(97));
    assert!(failures::suspects(&j, &settled).is_empty());
    assert!(plan(&j, &settled).failures.is_empty());
    // Progress older than the blames settles nothing.
    let open = o(stepped(95));
    assert_eq!(failures::suspects(&j, &open).len(), 1);
    assert_eq!(plan(&j, &open).failures.len(), 1);
}
