//! Gang scheduling, decided (`spec.gang`): the job's gang object and why a gang waits. Pure;
//! the controller watches the gang objects and writes what this module decides
//! (`crate::gang`).
//!
//! With `spec.gang.scheduler: Kubernetes` the workers are placed by the kube-scheduler's own
//! gang scheduling (KEP-4671 "Gang Scheduling using Workload Object", alpha in Kubernetes 1.35:
//! the `GangScheduling` plugin of `k8s.io/kubernetes/pkg/scheduler/framework/plugins`):
//! - the job owns a `scheduling.k8s.io/v1alpha1` `Workload` ([`crate::build::gang_workload`])
//!   with one pod group whose gang policy's `minCount` is the ring's minimum
//!   ([`crate::api::DiphomaJobSpec::min_workers`]), and every worker points at it
//!   (`spec.workloadRef`);
//! - the scheduler keeps the workers in its queue until `minCount` of them exist (PreEnqueue),
//!   then holds each placed one at its Permit stage, unbound, until `minCount` are placed; they
//!   are then bound together. A gang that stays incomplete is released after the plugin's
//!   scheduling timeout (5 minutes in 1.35) and tried again. Workers beyond `minCount` (an
//!   elastic ring above its minimum) and replacements of lost members of a gang already bound
//!   are placed one by one;
//! - `spec.podGroups` of a Workload is immutable: when the minimum changes (`elastic.minReplicas`,
//!   or `replicas` of a fixed-size job) the Workload is deleted and created again with the new
//!   `minCount` under the same name, the one the workers point at.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1alpha1::Workload;
use kube::ResourceExt;

use super::Hold;
use super::workers::Blocked;
use crate::api::{DiphomaJob, GangScheduler, Phase};
use crate::build;

/// The job's gang object as observed.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Gang {
    /// The job asks for no gang scheduler.
    #[default]
    Off,
    /// The job asks for Kubernetes' gang scheduling, but the API server does not serve
    /// `scheduling.k8s.io/v1alpha1` Workloads (seen when the operator started).
    Unserved,
    /// The job's gang Workload (named [`build::gang_workload_name`]), if it exists.
    Observed(Option<GroupView>),
}

/// What the plan reads of a gang Workload.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupView {
    /// `metadata.name`.
    pub name: String,
    /// Owned by this job (owner UID): the Workload of a deleted job of the same name is not.
    pub owned: bool,
    /// Being deleted.
    pub deleting: bool,
    /// The gang policy's `minCount` of pod group [`build::GANG_POD_GROUP`] (none: no such
    /// group, or not a gang).
    pub min_count: Option<i32>,
}

/// The view of Workload `w` for the job of UID `uid`.
pub fn view(w: &Workload, uid: &str) -> GroupView {
    GroupView {
        name: w.name_any(),
        owned: w
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true)),
        deleting: w.metadata.deletion_timestamp.is_some(),
        min_count: w
            .spec
            .pod_groups
            .iter()
            .find(|g| g.name == build::GANG_POD_GROUP)
            .and_then(|g| g.policy.gang.as_ref())
            .map(|g| g.min_count),
    }
}

/// What the controller does with the job's gang Workload this reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GangPlan {
    /// Create this Workload.
    pub create: Option<Workload>,
    /// Delete the Workload of this name (its `minCount` is no longer the ring's minimum).
    pub delete: Option<String>,
}

/// [`Hold::reason`] of a gang that yields to another gang's repair ([`hold`]).
pub const YIELDS: &str = "GangYields";

/// How often a gang that waits (none of it bound) or yields looks whether another gang's repair
/// started or ended (that job's pods are not this job's, so no event of its own reconciles it
/// then). Reconciles read the caches: the look costs no API request.
pub const YIELD_LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The hold the gang puts on the job:
/// - Kubernetes' gang scheduling asked for, but not served by the API server (the workers would
///   be placed one by one, which the job asked not to be): reason `GangSchedulerUnavailable`;
/// - none of its workers bound while another gang job is being repaired
///   ([`Observed::gang_repairing`](super::Observed)): reason [`YIELDS`]. Its waiting workers
///   would otherwise be held by the scheduler in the room freed by the other's lost worker,
///   waiting for room they may never get, while the other's replacement waits behind them: each
///   gang waiting on the other (the gang plugin releases them after 5 minutes, and they take the
///   room again). Its workers are deleted, as for a suspension, and created again once the
///   repair is done: a running ring comes before one that has not started.
pub fn hold(job: &DiphomaJob, obs: &super::Observed) -> Option<Hold> {
    if job.spec.gang_scheduler() != GangScheduler::Kubernetes {
        return None;
    }
    if obs.gang == Gang::Unserved {
        return Some(Hold {
            reason: "GangSchedulerUnavailable".into(),
            message: "spec.gang.scheduler is Kubernetes, but the API server does not serve \
                      scheduling.k8s.io/v1alpha1 Workloads (feature gates GenericWorkload and \
                      GangScheduling on the API server and the scheduler, \
                      --runtime-config=scheduling.k8s.io/v1alpha1=true; the operator looks at \
                      start)"
                .into(),
        });
    }
    let other = obs.gang_repairing.as_ref()?;
    (!live(&obs.pods).iter().any(|p| super::node_of(p).is_some())).then(|| Hold {
        reason: YIELDS.into(),
        message: format!(
            "the gang yields the GPUs to the repair of gang {other}, whose replacement waits \
             for room; it is placed again once that ring is whole"
        ),
    })
}

/// Whether the scheduler holds `pod` at its Permit stage: a gang member placed (its
/// `status.nominatedNodeName` set) and not bound, waiting for the rest of its gang.
pub fn at_permit(pod: &Pod) -> bool {
    super::node_of(pod).is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.nominated_node_name.as_deref())
            .is_some_and(|n| !n.is_empty())
}

/// Whether `job`'s gang was placed (a worker bound) and is now below its minimum with a live
/// worker waiting for room: a repair that waiting gangs yield to ([`hold`]).
pub fn repairing(job: &DiphomaJob, pods: &[Pod]) -> bool {
    if job.spec.gang_scheduler() != GangScheduler::Kubernetes {
        return false;
    }
    let live = live(pods);
    let bound = live.iter().filter(|p| super::node_of(p).is_some()).count();
    bound > 0 && (bound as i32) < job.spec.min_workers() && bound < live.len()
}

/// The job's live workers: not finished, not being deleted.
fn live(pods: &[Pod]) -> Vec<&Pod> {
    pods.iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !matches!(super::pod_phase(p), "Succeeded" | "Failed")
        })
        .collect()
}

/// What to do with the gang Workload: create it when missing (before the workers, which wait
/// for it), replace it when its `minCount` is no longer the ring's minimum; nothing for a
/// finished job, or while a Workload of another owner (a deleted job's) is still there.
pub fn gang_plan(job: &DiphomaJob, gang: &Gang, phase: Option<Phase>) -> GangPlan {
    let mut plan = GangPlan::default();
    let Gang::Observed(current) = gang else {
        return plan;
    };
    if job.spec.gang_scheduler() != GangScheduler::Kubernetes
        || phase.is_some_and(Phase::is_terminal)
    {
        return plan;
    }
    let min = job.spec.min_workers();
    match current {
        None => plan.create = Some(build::gang_workload(job, min)),
        Some(w) if !w.owned || w.deleting => {} // wait for it to go
        Some(w) if w.min_count != Some(min) => plan.delete = Some(w.name.clone()),
        Some(_) => {}
    }
    plan
}

/// Why the gang waits, for `status.waiting`: none of the job's live workers is bound yet
/// (a gang is bound all together or not at all), e.g. `gang of 3 waits: 2 of 3 workers can be
/// placed, none is bound; train-worker-2: Unschedulable: 0/2 nodes are available: 2
/// Insufficient nvidia.com/gpu.`, ending with `why`: the first of the job's workers that does
/// not start ([`super::workers::Workers::blocked`]: the scheduler's reason, or the API server's
/// refusal of a worker, e.g. an exceeded ResourceQuota, which keeps the gang from ever being
/// complete); "waiting for the scheduler" when none says why. A worker the scheduler holds
/// at its Permit stage has a `nominatedNodeName` and no node: it can be placed. None when the
/// job asks for no gang, has no live worker, or has a bound one (a gang once bound replaces
/// its lost members one by one).
pub fn waiting(job: &DiphomaJob, pods: &[Pod], why: Option<&Blocked>) -> Option<String> {
    if job.spec.gang_scheduler() == GangScheduler::None {
        return None;
    }
    let live = live(pods);
    if live.is_empty() || live.iter().any(|p| super::node_of(p).is_some()) {
        return None;
    }
    let min = job.spec.min_workers();
    let placeable = live.iter().filter(|p| at_permit(p)).count();
    let why = why.map_or_else(
        || "waiting for the scheduler".to_owned(),
        ToString::to_string,
    );
    Some(format!(
        "gang of {min} waits: {placeable} of {min} workers can be placed, none is bound; {why}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Gang as GangSpec;
    use crate::build::tests::basic;
    use serde_json::json;

    fn gang_job(replicas: i32, min: Option<i32>) -> DiphomaJob {
        let mut j = basic();
        j.spec.replicas = replicas;
        j.spec.elastic = min.map(|m| crate::api::Elastic {
            min_replicas: m,
            max_replicas: replicas.max(m),
        });
        j.spec.gang = Some(GangSpec {
            scheduler: GangScheduler::Kubernetes,
        });
        j.metadata.uid = Some("uid-1".into());
        j
    }

    fn observed(j: &DiphomaJob, min: i32) -> Gang {
        Gang::Observed(Some(view(
            &build::gang_workload(j, min),
            j.metadata.uid.as_deref().unwrap(),
        )))
    }

    #[test]
    fn the_gang_is_created_with_the_ring_minimum_and_replaced_when_it_changes() {
        let j = gang_job(4, Some(3));
        let plan = gang_plan(&j, &Gang::Observed(None), Some(Phase::Pending));
        let w = plan.create.expect("created");
        assert_eq!(w.name_any(), "train");
        assert_eq!(w.spec.pod_groups[0].name, "workers");
        assert_eq!(
            w.spec.pod_groups[0].policy.gang.as_ref().unwrap().min_count,
            3
        );
        assert_eq!(w.owner_references()[0].uid, "uid-1");
        // In step: nothing to do.
        assert_eq!(
            gang_plan(&j, &observed(&j, 3), Some(Phase::Running)),
            GangPlan::default()
        );
        // minReplicas moved to 2: the Workload goes, to be created again with minCount 2.
        let moved = gang_job(4, Some(2));
        let plan = gang_plan(&moved, &observed(&j, 3), Some(Phase::Running));
        assert_eq!(plan.delete.as_deref(), Some("train"));
        // A fixed-size job's minimum is its replicas; a finished job's gang is left alone.
        let fixed = gang_job(2, None);
        let plan = gang_plan(&fixed, &Gang::Observed(None), None);
        let w = plan.create.unwrap();
        assert_eq!(
            w.spec.pod_groups[0].policy.gang.as_ref().unwrap().min_count,
            2
        );
        assert_eq!(
            gang_plan(&fixed, &Gang::Observed(None), Some(Phase::Succeeded)),
            GangPlan::default()
        );
    }

    #[test]
    fn another_owners_gang_is_waited_for_and_an_unserved_gang_holds_the_job() {
        let j = gang_job(2, None);
        let mut other = build::gang_workload(&j, 2);
        other.metadata.owner_references.as_mut().unwrap()[0].uid = "old".into();
        let g = Gang::Observed(Some(view(&other, "uid-1")));
        assert_eq!(gang_plan(&j, &g, None), GangPlan::default());
        let with = |gang: Gang| super::super::Observed {
            gang,
            ..Default::default()
        };
        let h = hold(&j, &with(Gang::Unserved)).expect("held");
        assert_eq!(h.reason, "GangSchedulerUnavailable");
        assert!(hold(&j, &with(g)).is_none());
        assert!(hold(&basic(), &with(Gang::Unserved)).is_none());
    }

    #[test]
    fn workers_point_at_their_gang_only_when_the_job_asks() {
        let j = gang_job(2, None);
        let p = build::worker_pod(&j, 1, 0).unwrap();
        let r = p.spec.unwrap().workload_ref.expect("workloadRef");
        assert_eq!(
            (r.name.as_str(), r.pod_group.as_str()),
            ("train", "workers")
        );
        let p = build::worker_pod(&basic(), 1, 0).unwrap();
        assert!(p.spec.unwrap().workload_ref.is_none());
    }

    #[test]
    fn the_waiting_gang_says_how_many_can_be_placed_and_why_the_others_cannot() {
        let j = gang_job(3, None);
        let pod = |i: i32, status: serde_json::Value, node: Option<&str>| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(serde_json::from_value(status).unwrap());
            p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
            p
        };
        let held = json!({"phase": "Pending", "nominatedNodeName": "gpu-0"});
        let unschedulable = json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
            "status": "False", "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]});
        let pods = vec![
            pod(0, held.clone(), None),
            pod(1, held, None),
            pod(2, unschedulable, None),
        ];
        let why = pods.iter().find_map(crate::plan::workers::blocked);
        assert_eq!(
            waiting(&j, &pods, why.as_ref()).as_deref(),
            Some(
                "gang of 3 waits: 2 of 3 workers can be placed, none is bound; train-worker-2: \
                 Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
            )
        );
        // One bound: the gang was placed (a repair replaces members one by one).
        let mut bound = pods.clone();
        bound[0] = pod(0, json!({"phase": "Running"}), Some("gpu-0"));
        assert_eq!(waiting(&j, &bound, why.as_ref()), None);
        // No gang asked for: nothing said here.
        assert_eq!(waiting(&basic(), &pods, why.as_ref()), None);
        // A worker the API server refused (a ResourceQuota): the gang can never be complete, and
        // says so rather than "waiting for the scheduler".
        let refused = Blocked {
            pod: "train-worker-2".into(),
            reason: "CreateRefused".into(),
            message: "exceeded quota: gpu".into(),
        };
        let waiting_one = [pod(0, json!({"phase": "Pending"}), None)];
        assert_eq!(
            waiting(&j, &waiting_one, Some(&refused)).as_deref(),
            Some(
                "gang of 3 waits: 0 of 3 workers can be placed, none is bound; train-worker-2: \
                 CreateRefused: exceeded quota: gpu"
            )
        );
        assert_eq!(
            waiting(&j, &waiting_one, None).as_deref(),
            Some(
                "gang of 3 waits: 0 of 3 workers can be placed, none is bound; waiting for the scheduler"
            )
        );
    }

    /// A placed gang below its minimum with a worker waiting is being repaired; a gang with no
    /// worker bound yields to it (deleted workers, `Suspended` with reason `GangYields`), and a
    /// placed one does not.
    #[test]
    fn a_gang_not_yet_placed_yields_to_another_gangs_repair() {
        let j = gang_job(3, None);
        let pod = |i: i32, node: Option<&str>| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(serde_json::from_value(json!({"phase": "Pending"})).unwrap());
            p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
            p
        };
        // Two of three bound, the replacement waiting: a repair. All bound, or none: not one.
        let repairing = [pod(0, Some("n0")), pod(1, Some("n1")), pod(2, None)];
        assert!(super::repairing(&j, &repairing));
        assert!(!super::repairing(&j, &repairing[..2])); // nothing waiting
        assert!(!super::repairing(&j, &[pod(0, None), pod(1, None)]));
        assert!(!super::repairing(&basic(), &repairing)); // no gang asked for
        let waiting = super::super::Observed {
            pods: vec![pod(0, None), pod(1, None)],
            gang: Gang::Observed(None),
            gang_repairing: Some("ns/other".into()),
            ..Default::default()
        };
        let h = hold(&j, &waiting).expect("a waiting gang yields");
        assert_eq!(h.reason, YIELDS);
        assert!(h.message.contains("ns/other"), "{}", h.message);
        let placed = super::super::Observed {
            pods: repairing.to_vec(),
            ..waiting.clone()
        };
        assert_eq!(hold(&j, &placed), None);
        let nobody = super::super::Observed {
            gang_repairing: None,
            ..waiting
        };
        assert_eq!(hold(&j, &nobody), None);
    }

    /// A yielding gang's workers that the scheduler holds at Permit are deleted after the others:
    /// kube-scheduler v1.35.4 panics when one is deleted while another of its gang reaches Permit
    /// (README, "Gang scheduling"); the unplaced ones gone first, none is left to reach it.
    #[test]
    fn a_yielding_gang_deletes_its_workers_held_at_permit_last() {
        let j = gang_job(3, None);
        let pod = |i: i32, nominated: Option<&str>| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(
                serde_json::from_value(json!({"phase": "Pending", "nominatedNodeName": nominated}))
                    .unwrap(),
            );
            p
        };
        let obs = super::super::Observed {
            pods: vec![pod(0, Some("n0")), pod(1, None), pod(2, Some("n1"))],
            gang: Gang::Observed(None),
            gang_repairing: Some("ns/other".into()),
            ..Default::default()
        };
        assert!(at_permit(&obs.pods[0]) && !at_permit(&obs.pods[1]));
        let order: Vec<String> = super::super::plan(&j, &obs, &Default::default())
            .0
            .delete
            .into_iter()
            .map(|d| d.pod)
            .collect();
        let name = |i: usize| obs.pods[i].metadata.name.clone().unwrap();
        assert_eq!(order, [name(1), name(0), name(2)]);
    }
}
