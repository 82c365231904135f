//! Gang scheduling, decided (`spec.gang`): the job's gang objects and why a gang waits. Pure;
//! the controller watches the gang objects and writes what this module decides
//! (`crate::gang`).
//!
//! With `spec.gang.scheduler: Kubernetes` the workers are placed by the kube-scheduler's own
//! gang scheduling (KEP-4671, alpha in Kubernetes 1.36: the `GangScheduling` plugin of
//! `k8s.io/kubernetes/pkg/scheduler/framework/plugins` and the scheduler's pod group cycle):
//! - the job owns a `scheduling.k8s.io/v1alpha2` `Workload` ([`crate::build::gang_workload`])
//!   with one pod group template whose gang policy's `minCount` is the ring's minimum
//!   ([`crate::api::DiphomaJobSpec::min_workers`]), and a `PodGroup` made from it
//!   ([`crate::build::gang_pod_group`]) that every worker names
//!   (`spec.schedulingGroup.podGroupName`);
//! - the scheduler keeps the workers in its queue until `minCount` of them exist (PreEnqueue),
//!   then tries all of the group's unplaced workers in one cycle: it binds them if `minCount`
//!   can be placed, else places none (each worker's `PodScheduled` condition says why:
//!   [`placeable`]). Workers beyond `minCount` (an elastic ring above its minimum) and
//!   replacements of lost members of a gang already bound are placed as they fit;
//! - both objects are immutable: when the minimum changes (`elastic.minReplicas`, or
//!   `replicas` of a fixed-size job) they are deleted and created again with the new `minCount`
//!   under the same name, the one the workers name. The API server keeps a deleted PodGroup
//!   while a pod names it (finalizer `scheduling.k8s.io/podgroup-protection`): the new one
//!   follows once the job's workers are gone, and until then the old `minCount` places them.
//!
//! With `spec.gang.scheduler: Coscheduling` a second scheduler running the scheduler-plugins
//! coscheduling plugin places them (`sigs.k8s.io/scheduler-plugins`, tested with v0.34.7):
//! - the job owns a `scheduling.x-k8s.io/v1alpha1` `PodGroup` of the same name
//!   ([`crate::build::coscheduling_pod_group`]) whose `minMember` is the ring's minimum; every
//!   worker carries its label and names that scheduler (`schedulerName`, the operator's option);
//! - the plugin turns a worker away (PreFilter) while fewer than `minMember` of the group exist,
//!   holds each worker it found a node for at Permit until `minMember` of the group have one
//!   (bound ones included: the replacement of a lost member of a bound gang passes at once),
//!   and, when one cannot be placed, rejects those waiting (PostFilter): none is bound
//!   ([`placeable`] reads its reasons). Replaced like the native objects when the minimum
//!   changes.
//!
//! The operator's own rules are the same for both: a job whose gang API is not served is held
//! (`GangSchedulerUnavailable`), a gang none of whose workers is bound yields to another gang's
//! repair ([`hold`]), and `status.waiting` says why a gang waits ([`waiting`]).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1alpha2::{PodGroup, PodGroupSchedulingPolicy, Workload};
use kube::{Resource, ResourceExt};

use super::Hold;
use super::workers::Blocked;
use crate::api::{DiphomaJob, GangScheduler, Phase};
use crate::build;
use crate::build::coscheduling::CoschedulingPodGroup;

/// The job's gang objects as observed.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Gang {
    /// The job asks for no gang scheduler.
    #[default]
    Off,
    /// The job asks for a gang scheduler whose API the API server does not serve (seen when the
    /// operator started): `scheduling.k8s.io/v1alpha2` Workloads and PodGroups for
    /// `Kubernetes`, `scheduling.x-k8s.io/v1alpha1` PodGroups for `Coscheduling`.
    Unserved,
    /// The job's gang objects (named [`build::gang_name`]), each if it exists.
    Observed {
        /// The Workload (`Kubernetes`; none for `Coscheduling`).
        workload: Option<GroupView>,
        /// The PodGroup: `scheduling.k8s.io/v1alpha2` for `Kubernetes`,
        /// `scheduling.x-k8s.io/v1alpha1` for `Coscheduling`.
        pod_group: Option<GroupView>,
    },
}

impl Gang {
    /// Observed, neither object there yet.
    pub const NONE: Gang = Gang::Observed {
        workload: None,
        pod_group: None,
    };
}

/// What the plan reads of a gang Workload or PodGroup.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupView {
    /// `metadata.name`.
    pub name: String,
    /// Owned by this job (owner UID): the object of a deleted job of the same name is not.
    pub owned: bool,
    /// Being deleted.
    pub deleting: bool,
    /// The gang policy's `minCount` (of the Workload's template [`build::GANG_TEMPLATE`]; none:
    /// no such template, or not a gang), or the coscheduling PodGroup's `minMember`.
    pub min_count: Option<i32>,
}

/// The view of `obj` for the job of UID `uid`, its minimum `min_count`.
fn view<K: Resource>(obj: &K, uid: &str, min_count: Option<i32>) -> GroupView {
    GroupView {
        name: obj.name_any(),
        owned: obj
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true)),
        deleting: obj.meta().deletion_timestamp.is_some(),
        min_count,
    }
}

/// The gang policy's `minCount`.
fn min_count(policy: Option<&PodGroupSchedulingPolicy>) -> Option<i32> {
    policy.and_then(|p| p.gang.as_ref()).map(|g| g.min_count)
}

/// The view of Workload `w` for the job of UID `uid`.
pub fn view_workload(w: &Workload, uid: &str) -> GroupView {
    let template = w
        .spec
        .pod_group_templates
        .iter()
        .find(|t| t.name == build::GANG_TEMPLATE);
    view(w, uid, min_count(template.map(|t| &t.scheduling_policy)))
}

/// The view of PodGroup `g` for the job of UID `uid`.
pub fn view_pod_group(g: &PodGroup, uid: &str) -> GroupView {
    view(g, uid, min_count(Some(&g.spec.scheduling_policy)))
}

/// The view of coscheduling PodGroup `g` for the job of UID `uid`.
pub fn view_coscheduling_pod_group(g: &CoschedulingPodGroup, uid: &str) -> GroupView {
    view(g, uid, Some(g.spec.min_member))
}

/// What the controller does with one of the job's gang objects this reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Step<K> {
    /// Nothing.
    #[default]
    Keep,
    /// Create this object.
    Create(K),
    /// Delete the object of this name (its `minCount` is no longer the ring's minimum).
    Delete(String),
}

/// What the controller does with the job's gang objects this reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GangPlan {
    /// The Workload.
    pub workload: Step<Workload>,
    /// The PodGroup.
    pub pod_group: Step<PodGroup>,
    /// The coscheduling PodGroup (`Coscheduling`).
    pub coscheduling: Step<CoschedulingPodGroup>,
}

/// [`Hold::reason`] of a gang that yields to another gang's repair ([`hold`]).
pub const YIELDS: &str = "GangYields";

/// How often a gang that waits (none of it bound) or yields looks whether another gang's repair
/// started or ended (that job's pods are not this job's, so no event of its own reconciles it
/// then). Reconciles read the caches: the look costs no API request.
pub const YIELD_LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The hold the gang puts on the job:
/// - a gang scheduler asked for whose API the API server does not serve (the workers would be
///   placed one by one, which the job asked not to be): reason `GangSchedulerUnavailable`,
///   naming what is missing;
/// - none of its workers bound while another gang job is being repaired
///   ([`Observed::gang_repairing`](super::Observed)): reason [`YIELDS`]. Its waiting workers
///   would otherwise take the room freed by the other's lost worker whenever the scheduler
///   tries them first and they fit in it, leaving the other's replacement none. Its workers
///   are deleted, as for a suspension, and created again once the repair is done: a running
///   ring comes before one that has not started.
pub fn hold(job: &DiphomaJob, obs: &super::Observed) -> Option<Hold> {
    let scheduler = job.spec.gang_scheduler();
    if scheduler == GangScheduler::None {
        return None;
    }
    if obs.gang == Gang::Unserved {
        let message = match scheduler {
            GangScheduler::Coscheduling => {
                "spec.gang.scheduler is Coscheduling, but the API server does not serve \
                 scheduling.x-k8s.io/v1alpha1 PodGroups (install the scheduler-plugins \
                 PodGroup CRD, podgroups.scheduling.x-k8s.io, and run its scheduler with the \
                 Coscheduling plugin; the operator looks at start)"
            }
            _ => {
                "spec.gang.scheduler is Kubernetes, but the API server does not serve \
                 scheduling.k8s.io/v1alpha2 Workloads and PodGroups (Kubernetes 1.36: \
                 feature gates GenericWorkload and GangScheduling on the API server, the \
                 controller-manager and the scheduler, \
                 --runtime-config=scheduling.k8s.io/v1alpha2=true; the operator looks at \
                 start)"
            }
        };
        return Some(Hold {
            reason: "GangSchedulerUnavailable".into(),
            message: message.into(),
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

/// The reason the kube-scheduler's `GangScheduling` plugin gives a gang member it found a node
/// for while fewer than `minCount` of its gang could be placed (its Permit stage; in a
/// `PodScheduled` condition after `pod group is unschedulable, `).
pub const GANG_QUORUM: &str = "waiting for minCount pods from a gang to be scheduled";

/// The reasons the coscheduling plugin (scheduler-plugins v0.34) gives a gang member it found a
/// node for and then turned away, at Permit, for the rest of its gang: rejected while waiting
/// when a sibling could not be placed (PostFilter), when a sibling's placement was undone
/// (Unreserve), or at the end of its wait (the scheduler's "rejected due to timeout after
/// waiting 10s at plugin Coscheduling").
pub const COSCHEDULING_PERMIT: [&str; 3] = [
    "optimistic rejection in PostFilter",
    "rejection in Unreserve",
    "at plugin Coscheduling",
];

/// The reasons the coscheduling plugin gives a gang member at PreFilter, before looking for a
/// node, for its gang alone: too few of the group exist yet, or the group failed recently (its
/// back-off, `podGroupBackoffSeconds`). (The member that found no node gets its own reason,
/// followed by the plugin's `PodGroup … gets rejected due to Pod … is unschedulable even after
/// PostFilter`.)
pub const COSCHEDULING_GANG: [&str; 2] = ["cannot find enough sibling pods", "failed recently"];

/// Whether `pod`, not bound, could be placed were the rest of its gang: the scheduler's last
/// try found it a node and turned it away only for its gang ([`GANG_QUORUM`],
/// [`COSCHEDULING_PERMIT`]), or nominated it a node (it waits there for a preemption, or at
/// Permit).
pub fn placeable(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    super::node_of(pod).is_none()
        && (status
            .and_then(|s| s.nominated_node_name.as_deref())
            .is_some_and(|n| !n.is_empty())
            || super::workers::blocked(pod).is_some_and(|b| placed_but_gang(&b)))
}

/// Whether the scheduler found `b`'s worker a node and turned it away for the rest of its gang.
fn placed_but_gang(b: &Blocked) -> bool {
    b.message.contains(GANG_QUORUM) || COSCHEDULING_PERMIT.iter().any(|m| b.message.contains(m))
}

/// Whether the scheduler turned `b`'s worker away only for the rest of its gang, not for a
/// reason of its own (room, a taint...).
fn quorum_only(b: &Blocked) -> bool {
    placed_but_gang(b) || COSCHEDULING_GANG.iter().any(|m| b.message.contains(m))
}

/// Whether `job`'s gang was placed (a worker bound) and is now below its minimum with a live
/// worker waiting for room: a repair that waiting gangs yield to ([`hold`]).
pub fn repairing(job: &DiphomaJob, pods: &[Pod]) -> bool {
    if job.spec.gang_scheduler() == GangScheduler::None {
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

/// What to do with the gang objects: create each when missing (before the workers, which
/// wait for their PodGroup), replace it when its `minCount` is no longer the ring's minimum;
/// nothing for a finished job, or while an object of another owner (a deleted job's) is still
/// there.
pub fn gang_plan(job: &DiphomaJob, gang: &Gang, phase: Option<Phase>) -> GangPlan {
    let Gang::Observed {
        workload,
        pod_group,
    } = gang
    else {
        return GangPlan::default();
    };
    if phase.is_some_and(Phase::is_terminal) {
        return GangPlan::default();
    }
    let min = job.spec.min_workers();
    match job.spec.gang_scheduler() {
        GangScheduler::None => GangPlan::default(),
        GangScheduler::Kubernetes => GangPlan {
            workload: step(workload.as_ref(), min, || build::gang_workload(job, min)),
            pod_group: step(pod_group.as_ref(), min, || build::gang_pod_group(job, min)),
            ..Default::default()
        },
        GangScheduler::Coscheduling => GangPlan {
            coscheduling: step(pod_group.as_ref(), min, || {
                build::coscheduling_pod_group(job, min)
            }),
            ..Default::default()
        },
    }
}

/// [`gang_plan`]'s step for one object, `current` as observed, made by `make` when missing.
fn step<K>(current: Option<&GroupView>, min: i32, make: impl FnOnce() -> K) -> Step<K> {
    match current {
        None => Step::Create(make()),
        Some(g) if !g.owned || g.deleting => Step::Keep, // wait for it to go
        Some(g) if g.min_count != Some(min) => Step::Delete(g.name.clone()),
        Some(_) => Step::Keep,
    }
}

/// Why the gang waits, for `status.waiting`: none of the job's live workers is bound yet
/// (a gang is bound all together or not at all), e.g. `gang of 3 waits: 2 of 3 workers can be
/// placed, none is bound; train-worker-2: Unschedulable: 0/2 nodes are available: 2
/// Insufficient nvidia.com/gpu.` ([`placeable`] counts), ending with why: of the job's
/// workers that do not start (`blocked`, [`super::workers::Workers::blocked`]: the scheduler's
/// reason, or the API server's refusal of a worker, e.g. an exceeded ResourceQuota, which keeps
/// the gang from ever being complete), the first turned away for a reason of its own rather
/// than for its gang; "waiting for the scheduler" when none says why. None when the job asks
/// for no gang, has no live worker, or has a bound one (a gang once bound replaces its lost
/// members as they fit).
pub fn waiting(job: &DiphomaJob, pods: &[Pod], blocked: &[Blocked]) -> Option<String> {
    if job.spec.gang_scheduler() == GangScheduler::None {
        return None;
    }
    let live = live(pods);
    if live.is_empty() || live.iter().any(|p| super::node_of(p).is_some()) {
        return None;
    }
    let min = job.spec.min_workers();
    let placeable = live.iter().filter(|p| placeable(p)).count();
    let why = blocked.iter().find(|b| !quorum_only(b)).or(blocked.first());
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
        let uid = j.metadata.uid.as_deref().unwrap();
        Gang::Observed {
            workload: Some(view_workload(&build::gang_workload(j, min), uid)),
            pod_group: Some(view_pod_group(&build::gang_pod_group(j, min), uid)),
        }
    }

    /// The `minCount` of the objects `plan` creates.
    fn created_min(plan: &GangPlan) -> (Option<i32>, Option<i32>) {
        let Step::Create(w) = &plan.workload else {
            return (None, None);
        };
        let Step::Create(g) = &plan.pod_group else {
            return (None, None);
        };
        (
            view_workload(w, "uid-1").min_count,
            view_pod_group(g, "uid-1").min_count,
        )
    }

    #[test]
    fn the_gang_is_created_with_the_ring_minimum_and_replaced_when_it_changes() {
        let j = gang_job(4, Some(3));
        let plan = gang_plan(&j, &Gang::NONE, Some(Phase::Pending));
        assert_eq!(created_min(&plan), (Some(3), Some(3)));
        let (Step::Create(w), Step::Create(g)) = (&plan.workload, &plan.pod_group) else {
            panic!("{plan:?}")
        };
        assert_eq!(
            (w.name_any(), g.name_any()),
            ("train".into(), "train".into())
        );
        assert_eq!(w.spec.pod_group_templates[0].name, "workers");
        // The PodGroup is made from the Workload's template.
        let from = g.spec.pod_group_template_ref.as_ref().unwrap();
        let from = from.workload.as_ref().unwrap();
        assert_eq!(
            (
                from.workload_name.as_str(),
                from.pod_group_template_name.as_str()
            ),
            ("train", "workers")
        );
        assert_eq!(w.owner_references()[0].uid, "uid-1");
        assert_eq!(g.owner_references()[0].uid, "uid-1");
        // In step: nothing to do.
        assert_eq!(
            gang_plan(&j, &observed(&j, 3), Some(Phase::Running)),
            GangPlan::default()
        );
        // minReplicas moved to 2: both go, to be created again with minCount 2.
        let moved = gang_job(4, Some(2));
        let plan = gang_plan(&moved, &observed(&j, 3), Some(Phase::Running));
        assert_eq!(plan.workload, Step::Delete("train".into()));
        assert_eq!(plan.pod_group, Step::Delete("train".into()));
        // The PodGroup kept by the API server while workers name it: waited for; the Workload,
        // gone already, is created again.
        let Gang::Observed { pod_group, .. } = observed(&j, 3) else {
            unreachable!()
        };
        let deleting = Gang::Observed {
            workload: None,
            pod_group: pod_group.map(|g| GroupView {
                deleting: true,
                ..g
            }),
        };
        let plan = gang_plan(&moved, &deleting, Some(Phase::Running));
        assert!(matches!(plan.workload, Step::Create(_)), "{plan:?}");
        assert_eq!(plan.pod_group, Step::Keep);
        // A fixed-size job's minimum is its replicas; a finished job's gang is left alone.
        let fixed = gang_job(2, None);
        let plan = gang_plan(&fixed, &Gang::NONE, None);
        assert_eq!(created_min(&plan), (Some(2), Some(2)));
        assert_eq!(
            gang_plan(&fixed, &Gang::NONE, Some(Phase::Succeeded)),
            GangPlan::default()
        );
    }

    #[test]
    fn another_owners_gang_is_waited_for_and_an_unserved_gang_holds_the_job() {
        let j = gang_job(2, None);
        let mut other = build::gang_pod_group(&j, 2);
        other.metadata.owner_references.as_mut().unwrap()[0].uid = "old".into();
        let g = Gang::Observed {
            workload: None,
            pod_group: Some(view_pod_group(&other, "uid-1")),
        };
        let plan = gang_plan(&j, &g, None);
        assert_eq!(plan.pod_group, Step::Keep);
        let with = |gang: Gang| super::super::Observed {
            gang,
            ..Default::default()
        };
        let h = hold(&j, &with(Gang::Unserved)).expect("held");
        assert_eq!(h.reason, "GangSchedulerUnavailable");
        assert!(h.message.contains("v1alpha2"), "{}", h.message);
        assert!(hold(&j, &with(g)).is_none());
        assert!(hold(&basic(), &with(Gang::Unserved)).is_none());
    }

    #[test]
    fn workers_name_their_pod_group_only_when_the_job_asks() {
        let j = gang_job(2, None);
        let p = build::worker_pod(&j, 1, 0).unwrap();
        let g = p.spec.unwrap().scheduling_group.expect("schedulingGroup");
        assert_eq!(g.pod_group_name.as_deref(), Some("train"));
        let p = build::worker_pod(&basic(), 1, 0).unwrap();
        assert!(p.spec.unwrap().scheduling_group.is_none());
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
        let unscheduled = |message: &str| {
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable", "message": message}]})
        };
        // As kube-scheduler v1.36.3 leaves a gang of 3 with room for 2: the first two turned
        // away for the gang, the third for room.
        let quorum = unscheduled(&format!("pod group is unschedulable, {GANG_QUORUM}"));
        let pods = vec![
            pod(0, quorum.clone(), None),
            pod(1, quorum, None),
            pod(
                2,
                unscheduled("0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
                None,
            ),
        ];
        assert!(placeable(&pods[0]) && !placeable(&pods[2]));
        let blocked: Vec<Blocked> = pods
            .iter()
            .filter_map(crate::plan::workers::blocked)
            .collect();
        assert_eq!(
            waiting(&j, &pods, &blocked).as_deref(),
            Some(
                "gang of 3 waits: 2 of 3 workers can be placed, none is bound; train-worker-2: \
                 Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
            )
        );
        // A worker nominated a node (waiting for a preemption) can be placed too.
        let nominated = pod(
            2,
            json!({"phase": "Pending", "nominatedNodeName": "gpu-0"}),
            None,
        );
        assert!(placeable(&nominated));
        // One bound: the gang was placed (a repair replaces members as they fit).
        let mut bound = pods.clone();
        bound[0] = pod(0, json!({"phase": "Running"}), Some("gpu-0"));
        assert!(!placeable(&bound[0]));
        assert_eq!(waiting(&j, &bound, &blocked), None);
        // No gang asked for: nothing said here.
        assert_eq!(waiting(&basic(), &pods, &blocked), None);
        // A worker the API server refused (a ResourceQuota): the gang can never be complete, and
        // says so rather than "waiting for the scheduler".
        let refused = Blocked {
            pod: "train-worker-2".into(),
            reason: "CreateRefused".into(),
            message: "exceeded quota: gpu".into(),
        };
        let waiting_one = [pod(0, json!({"phase": "Pending"}), None)];
        assert_eq!(
            waiting(&j, &waiting_one, &[refused]).as_deref(),
            Some(
                "gang of 3 waits: 0 of 3 workers can be placed, none is bound; train-worker-2: \
                 CreateRefused: exceeded quota: gpu"
            )
        );
        assert_eq!(
            waiting(&j, &waiting_one, &[]).as_deref(),
            Some(
                "gang of 3 waits: 0 of 3 workers can be placed, none is bound; waiting for the scheduler"
            )
        );
    }

    fn cosched_job(replicas: i32, min: Option<i32>) -> DiphomaJob {
        let mut j = gang_job(replicas, min);
        j.spec.gang = Some(GangSpec {
            scheduler: GangScheduler::Coscheduling,
        });
        j
    }

    #[test]
    fn a_coscheduled_gang_gets_one_pod_group_of_the_ring_minimum_replaced_when_it_changes() {
        let j = cosched_job(4, Some(3));
        let plan = gang_plan(&j, &Gang::NONE, Some(Phase::Pending));
        // No native object; one scheduling.x-k8s.io PodGroup, named after the job, owned by it.
        assert_eq!(
            (&plan.workload, &plan.pod_group),
            (&Step::Keep, &Step::Keep)
        );
        let Step::Create(g) = &plan.coscheduling else {
            panic!("{plan:?}")
        };
        assert_eq!(g.name_any(), "train");
        assert_eq!(g.spec.min_member, 3);
        assert_eq!(g.spec.schedule_timeout_seconds, None);
        assert_eq!(g.owner_references()[0].uid, "uid-1");
        assert_eq!(g.owner_references()[0].controller, Some(true));
        let json = serde_json::to_value(g).unwrap();
        assert_eq!(json["apiVersion"], "scheduling.x-k8s.io/v1alpha1");
        assert_eq!(json["kind"], "PodGroup");
        assert_eq!(json["spec"], json!({"minMember": 3}));
        let observed = |min: i32| Gang::Observed {
            workload: None,
            pod_group: Some(view_coscheduling_pod_group(
                &build::coscheduling_pod_group(&j, min),
                "uid-1",
            )),
        };
        // In step: nothing to do; minReplicas moved: deleted, to be created again.
        assert_eq!(
            gang_plan(&j, &observed(3), Some(Phase::Running)),
            GangPlan::default()
        );
        let plan = gang_plan(&j, &observed(2), Some(Phase::Running));
        assert_eq!(plan.coscheduling, Step::Delete("train".into()));
        // A fixed-size job's minimum is its replicas; a finished job's group is left alone.
        let fixed = cosched_job(2, None);
        let plan = gang_plan(&fixed, &Gang::NONE, None);
        assert!(
            matches!(&plan.coscheduling, Step::Create(g) if g.spec.min_member == 2),
            "{plan:?}"
        );
        assert_eq!(
            gang_plan(&fixed, &Gang::NONE, Some(Phase::Failed)),
            GangPlan::default()
        );
    }

    #[test]
    fn coscheduled_workers_carry_the_pod_group_label_and_no_scheduling_group() {
        let p = build::worker_pod(&cosched_job(2, None), 1, 0).unwrap();
        assert_eq!(
            p.labels().get(build::coscheduling::POD_GROUP_LABEL),
            Some(&"train".to_owned())
        );
        assert!(p.spec.unwrap().scheduling_group.is_none());
        let p = build::worker_pod(&gang_job(2, None), 1, 0).unwrap();
        assert!(
            !p.labels()
                .contains_key(build::coscheduling::POD_GROUP_LABEL)
        );
    }

    #[test]
    fn without_the_pod_group_crd_a_coscheduled_job_is_held_naming_it() {
        let j = cosched_job(2, None);
        let with = |gang: Gang| super::super::Observed {
            gang,
            ..Default::default()
        };
        let h = hold(&j, &with(Gang::Unserved)).expect("held");
        assert_eq!(h.reason, "GangSchedulerUnavailable");
        assert!(
            h.message.contains("scheduling.x-k8s.io/v1alpha1 PodGroups")
                && h.message.contains("podgroups.scheduling.x-k8s.io"),
            "{}",
            h.message
        );
        assert!(hold(&j, &with(Gang::NONE)).is_none());
        assert_eq!(gang_plan(&j, &Gang::Unserved, None), GangPlan::default());
    }

    #[test]
    fn a_coscheduled_gang_waiting_says_how_many_the_plugin_placed_and_why_not_the_rest() {
        let j = cosched_job(3, None);
        let pod = |i: i32, message: &str| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(
                serde_json::from_value(json!({"phase": "Pending", "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message}]}))
                .unwrap(),
            );
            p
        };
        // As the coscheduling plugin leaves a gang of 3 with room for 2: the two it held at
        // Permit rejected when the third found no node (PostFilter), the third for room.
        let pods = vec![
            pod(0, "optimistic rejection in PostFilter"),
            pod(
                1,
                "rejected due to timeout after waiting 10s at plugin Coscheduling",
            ),
            pod(
                2,
                "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. PodGroup ns/train gets \
                 rejected due to Pod train-worker-2 is unschedulable even after PostFilter",
            ),
        ];
        assert!(placeable(&pods[0]) && placeable(&pods[1]) && !placeable(&pods[2]));
        let blocked: Vec<Blocked> = pods
            .iter()
            .filter_map(crate::plan::workers::blocked)
            .collect();
        let w = waiting(&j, &pods, &blocked).unwrap();
        assert!(
            w.starts_with(
                "gang of 3 waits: 2 of 3 workers can be placed, none is bound; train-worker-2: \
                 Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
            ),
            "{w}"
        );
        // Turned away at PreFilter, before any node was looked for, for its gang only (too few
        // siblings; the group's back-off), as the scheduler words it: not placeable, and not
        // the reason given while another worker has one of its own.
        let early = [
            pod(
                0,
                "0/2 nodes are available: pre-filter pod train-worker-0 cannot find enough \
                 sibling pods, current pods number: 2, minMember of group: 3.",
            ),
            pod(
                1,
                "0/2 nodes are available: podGroup ns/train failed recently. preemption: not \
                 eligible",
            ),
            pods[2].clone(),
        ];
        assert!(!placeable(&early[0]) && !placeable(&early[1]));
        let blocked: Vec<Blocked> = early
            .iter()
            .filter_map(crate::plan::workers::blocked)
            .collect();
        let w = waiting(&j, &early, &blocked).unwrap();
        assert!(
            w.starts_with(
                "gang of 3 waits: 0 of 3 workers can be placed, none is bound; train-worker-2: "
            ),
            "{w}"
        );
    }

    #[test]
    fn a_coscheduled_gang_yields_to_a_repair_and_its_repair_is_one() {
        let j = cosched_job(3, None);
        let pod = |i: i32, node: Option<&str>| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(serde_json::from_value(json!({"phase": "Pending"})).unwrap());
            p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
            p
        };
        assert!(super::repairing(
            &j,
            &[pod(0, Some("n0")), pod(1, Some("n1")), pod(2, None)]
        ));
        let waiting = super::super::Observed {
            pods: vec![pod(0, None)],
            gang: Gang::NONE,
            gang_repairing: Some("ns/other".into()),
            ..Default::default()
        };
        assert_eq!(hold(&j, &waiting).map(|h| h.reason), Some(YIELDS.into()));
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
            gang: Gang::NONE,
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
}
