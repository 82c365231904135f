//! The reconciler's memory of one job, between its reconciles: what the API server refused (worker
//! creations with their back-off, the Kueue Workload), the heartbeat's version and when it was
//! first seen, whether the job's gang is being repaired, and the reconciles failed in a row. The
//! plan owns it, as a state machine owns its state (quinn-proto, raft-rs): [`recall`] reads it
//! into the observation, [`super::plan`] decides from it and returns the next one, and
//! [`remember`] folds in what the API server answered to the plan's writes. The controller only
//! stores it, by job UID, and forgets it with the job.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

use super::{Observed, Plan};

/// What the reconciler remembers of one job between its reconciles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Memory {
    /// The worker creations the API server refused, and their back-off.
    pub refused: Refusals,
    /// The heartbeat ConfigMap's `resourceVersion` as last seen, and when this operator first
    /// saw that version ([`Observed::heartbeat_changed`]).
    pub heartbeat: Option<(String, Timestamp)>,
    /// The API server's message when it refused the job's Kueue Workload at the last attempt
    /// ([`Observed::workload_refused`]).
    pub workload_refused: Option<String>,
    /// The job's gang was being repaired at its last reconcile ([`super::gang::repairing`]):
    /// other gangs not yet placed yield to it ([`Observed::gang_repairing`]).
    pub repairing: bool,
    /// Reconciles failed in a row, for the error policy's back-off ([`retry_delay`]); zero after
    /// one that succeeds.
    pub retries: u32,
}

/// The worker creations the API server refused (a ResourceQuota, a pod it finds invalid). Only
/// their creation backs off ([`retry_delay`]): the job is still reconciled at its usual cadence
/// (progress, node loss, hangs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusals {
    /// Refused pod → the API server's message; the next plan observes them
    /// ([`Observed::refused`]).
    pub pods: BTreeMap<String, String>,
    /// Apply rounds with a refusal in a row.
    pub rounds: u32,
    /// Until when the refused pods are not tried again.
    pub until: Option<Timestamp>,
}

/// What the API server answered to one apply of a plan, as far as the memory keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answered {
    /// The worker creations were tried (an earlier write of the apply did not fail first).
    pub created: bool,
    /// The creations it refused: pod → its message.
    pub refused: BTreeMap<String, String>,
    /// The Kueue Workload: none when its creation was not tried; `Some(Ok)` when it was created;
    /// `Some(Err(message))` when the API server refused it.
    pub workload: Option<Result<(), String>>,
}

/// Delay before retrying after `n` failures in a row (1 for the first): 2 s, doubled each time,
/// at most 5 minutes. The back-off of refused creations and of failed reconciles.
pub fn retry_delay(n: u32) -> Duration {
    Duration::from_secs(
        2u64.saturating_mul(1 << n.saturating_sub(1).min(8))
            .min(300),
    )
}

impl Memory {
    /// Whether the refused creations are still held at `now`: not tried again before their
    /// back-off ends.
    pub fn held(&self, now: Timestamp) -> bool {
        self.refused.until.is_some_and(|until| now < until)
    }

    /// How long the refused creations are still held after `now` (a timer of the job's own):
    /// zero once the back-off has ended (they are due now); none without a back-off.
    pub fn held_for(&self, now: Timestamp) -> Option<Duration> {
        let left = self.refused.until?.duration_since(now);
        Some(if left.is_positive() {
            left.unsigned_abs()
        } else {
            Duration::ZERO
        })
    }
}

/// The heartbeat as seen at `now` with `version` (none: no heartbeat ConfigMap of the job's):
/// the version and when this operator first saw it. A version not seen before was first seen
/// now; without a ConfigMap the last one seen is kept.
fn heartbeat_seen(
    prev: Option<&(String, Timestamp)>,
    version: Option<&str>,
    now: Timestamp,
) -> Option<(String, Timestamp)> {
    match (prev, version) {
        (prev, None) => prev.cloned(),
        (Some((v, since)), Some(version)) if v == version => Some((v.clone(), *since)),
        (_, Some(version)) => Some((version.to_owned(), now)),
    }
}

/// Reads what `memory` recalls into `obs`: the refused creations ([`Observed::refused`]), the
/// refused Workload ([`Observed::workload_refused`]) and when the heartbeat last changed
/// ([`Observed::heartbeat_changed`], from [`Observed::heartbeat_version`]).
pub fn recall(memory: &Memory, obs: &mut Observed) {
    obs.refused = memory.refused.pods.clone();
    obs.workload_refused = memory.workload_refused.clone();
    obs.heartbeat_changed = obs.heartbeat_version.as_deref().and_then(|v| {
        heartbeat_seen(memory.heartbeat.as_ref(), Some(v), obs.now).map(|(_, since)| since)
    });
}

/// The plan's part of [`super::plan`]: the refused creations still held are taken out of
/// `plan` (with their `WorkerCreated` notes: their `CreateRefused` is in the status), and the
/// memory the plan leaves: the heartbeat as seen now, whether the job's gang is being repaired.
pub fn decide(
    job: &crate::api::DiphomaJob,
    obs: &Observed,
    memory: &Memory,
    plan: &mut Plan,
) -> Memory {
    if memory.held(obs.now) {
        let held = |pod: &str| memory.refused.pods.contains_key(pod);
        plan.create
            .retain(|p| !held(&kube::ResourceExt::name_any(p)));
        plan.events
            .retain(|e| !(e.reason == "WorkerCreated" && e.pod.as_deref().is_some_and(held)));
    }
    Memory {
        heartbeat: heartbeat_seen(
            memory.heartbeat.as_ref(),
            obs.heartbeat_version.as_deref(),
            obs.now,
        ),
        repairing: super::gang::repairing(job, &obs.pods),
        ..memory.clone()
    }
}

/// The memory after the API server `answered` the writes of a plan made at `now` from `before`
/// (`next`: what the plan left, [`decide`]). Refusals: the held ones are kept, a new refusal
/// starts the next back-off round ([`retry_delay`]), a round without one ends the back-off.
/// The Workload's refusal is kept until its creation is tried again.
pub fn remember(before: &Memory, next: Memory, answered: &Answered, now: Timestamp) -> Memory {
    let refused = if answered.created {
        let held = before.held(now);
        let mut pods: BTreeMap<String, String> = before
            .refused
            .pods
            .iter()
            .filter(|_| held)
            .map(|(p, m)| (p.clone(), m.clone()))
            .collect();
        pods.extend(answered.refused.clone());
        let prev = &before.refused;
        let (rounds, until) = match answered.refused.len() {
            0 if held => (prev.rounds, prev.until),
            0 => (0, None),
            _ => (prev.rounds + 1, Some(now + retry_delay(prev.rounds + 1))),
        };
        Refusals {
            pods,
            rounds,
            until,
        }
    } else {
        next.refused
    };
    let workload_refused = match &answered.workload {
        None => next.workload_refused,
        Some(Ok(())) => None,
        Some(Err(message)) => Some(message.clone()),
    };
    Memory {
        refused,
        workload_refused,
        ..next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Gang as GangSpec, GangScheduler};
    use crate::build::{self, tests::basic};
    use k8s_openapi::api::core::v1::Pod;
    use kube::ResourceExt;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    /// Worker `i` of `job`, Running and Ready on `node`, or Pending without one.
    fn pod(job: &crate::api::DiphomaJob, i: i32, node: Option<&str>) -> Pod {
        let mut p = build::worker_pod(job, i, 0).unwrap();
        p.metadata.uid = Some(format!("uid-{i}"));
        p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
        let status = match node {
            Some(_) => {
                serde_json::json!({"phase": "Running", "podIP": format!("127.0.0.{}", i + 2),
                "conditions": [{"type": "Ready", "status": "True"}]})
            }
            None => serde_json::json!({"phase": "Pending"}),
        };
        p.status = Some(serde_json::from_value(status).unwrap());
        p
    }

    fn at(pods: Vec<Pod>, now: Timestamp) -> Observed {
        Observed {
            pods,
            now,
            ..Observed::default()
        }
    }

    fn tried(pods: &[&str]) -> Answered {
        Answered {
            created: true,
            refused: pods
                .iter()
                .map(|p| (p.to_string(), "exceeded quota".to_string()))
                .collect(),
            workload: None,
        }
    }

    #[test]
    fn a_refusal_backs_off_doubling_and_a_round_without_one_ends_it() {
        let start = Memory::default();
        let one = remember(&start, start.clone(), &tried(&["w-4"]), t(100));
        assert_eq!((one.refused.rounds, one.refused.until), (1, Some(t(102))));
        assert!(one.held(t(101)) && !one.held(t(102)));
        assert_eq!(one.held_for(t(101)), Some(Duration::from_secs(1)));
        // Ended while a reconcile ran: due at once, not at the next safety-net resync.
        assert_eq!(one.held_for(t(105)), Some(Duration::ZERO));
        assert_eq!(Memory::default().held_for(t(105)), None);
        // Held: not tried, still refused, the same deadline.
        let held = remember(&one, one.clone(), &tried(&[]), t(101));
        assert_eq!(held.refused, one.refused);
        // Tried again after the back-off and refused again: the next round waits twice as long.
        let two = remember(&held, held.clone(), &tried(&["w-4"]), t(103));
        assert_eq!((two.refused.rounds, two.refused.until), (2, Some(t(107))));
        // Created at last: the back-off ends and the refusal is forgotten.
        let done = remember(&two, two.clone(), &tried(&[]), t(108));
        assert_eq!(done.refused, Refusals::default());
    }

    #[test]
    fn an_apply_that_failed_before_its_creations_keeps_the_refusals() {
        let before = remember(
            &Memory::default(),
            Memory::default(),
            &tried(&["w-4"]),
            t(100),
        );
        let after = remember(&before, before.clone(), &Answered::default(), t(200));
        assert_eq!(after.refused, before.refused);
    }

    #[test]
    fn held_creations_are_left_out_of_the_plan_and_tried_once_the_back_off_ends() {
        let mut job = basic();
        job.spec.replicas = 5;
        let pods: Vec<Pod> = (0..4).map(|i| pod(&job, i, Some("n0"))).collect();
        let memory = remember(
            &Memory::default(),
            Memory::default(),
            &tried(&["train-worker-4"]),
            t(100),
        );
        let planned = |now| {
            let mut o = at(pods.clone(), now);
            recall(&memory, &mut o);
            let (plan, _) = crate::plan::plan(&job, &o, &memory);
            let names: Vec<String> = plan.create.iter().map(|p| p.name_any()).collect();
            let event = plan.events.iter().any(|e| e.reason == "WorkerCreated");
            (names, event, plan.status.waiting.unwrap_or_default())
        };
        let (names, event, waiting) = planned(t(101));
        assert!(names.is_empty() && !event, "{names:?}");
        assert!(waiting.contains("exceeded quota"), "{waiting}");
        let (names, event, _) = planned(t(102));
        assert_eq!(names, ["train-worker-4"]);
        assert!(event);
    }

    #[test]
    fn the_heartbeat_is_dated_by_when_its_version_was_first_seen() {
        let mut memory = Memory::default();
        let mut seen = |version: Option<&str>, now: i64| {
            let mut o = at(vec![], t(now));
            o.heartbeat_version = version.map(str::to_owned);
            recall(&memory, &mut o);
            memory = decide(&basic(), &o, &memory, &mut Plan::default());
            o.heartbeat_changed
        };
        assert_eq!(seen(Some("7"), 10), Some(t(10)));
        assert_eq!(seen(Some("7"), 20), Some(t(10)));
        assert_eq!(seen(None, 25), None); // no ConfigMap: nothing to date, the last one kept
        assert_eq!(seen(Some("7"), 30), Some(t(10)));
        assert_eq!(seen(Some("9"), 40), Some(t(40)));
    }

    #[test]
    fn a_workload_refusal_is_kept_until_its_creation_is_tried_again() {
        let answered = |workload| Answered {
            workload,
            ..Answered::default()
        };
        let m = Memory::default();
        let refused = remember(&m, m.clone(), &answered(Some(Err("quota".into()))), t(1));
        assert_eq!(refused.workload_refused.as_deref(), Some("quota"));
        let kept = remember(&refused, refused.clone(), &answered(None), t(2));
        assert_eq!(kept.workload_refused.as_deref(), Some("quota"));
        let created = remember(&kept, kept.clone(), &answered(Some(Ok(()))), t(3));
        assert_eq!(created.workload_refused, None);
    }

    #[test]
    fn a_placed_gang_below_its_minimum_with_a_worker_waiting_is_remembered_as_being_repaired() {
        let mut job = basic();
        job.spec.gang = Some(GangSpec {
            scheduler: GangScheduler::Kubernetes,
        });
        let repairing = |pods: Vec<Pod>| {
            let memory = Memory {
                repairing: true, // what the last reconcile saw is not what this one sees
                ..Memory::default()
            };
            decide(&job, &at(pods, t(1)), &memory, &mut Plan::default()).repairing
        };
        let whole: Vec<Pod> = (0..4).map(|i| pod(&job, i, Some("n0"))).collect();
        assert!(!repairing(whole.clone()));
        let mut lost_one = whole;
        lost_one[3] = pod(&job, 3, None); // its replacement, waiting for room
        assert!(repairing(lost_one));
    }

    #[test]
    fn retries_back_off_exponentially_up_to_five_minutes() {
        let delays: Vec<u64> = (1..=10).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(delays, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
    }
}
