//! Step 3 of the plan: the workers — one live pod per index below `replicas` (a missing one is
//! created, avoiding dead nodes and the names another owner's pods still hold), the indices above it scaled away. Pure; it does not decide
//! which workers are ring members (that is [`super::ring`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::failures::Found;
use super::{Deletion, EventNote, Observed, Plan, condition, pod_phase};
use crate::api::{DiphomaJob, RingProtection};
use crate::build;

/// The workers after this plan's creations and deletions.
#[derive(Debug, Clone, Default)]
pub struct Workers<'a> {
    /// The live pod of each index below `replicas` (not lost, not being deleted, not finished).
    pub live: BTreeMap<i32, &'a Pod>,
    /// Workers on their way to the ring: live ones not yet ready and not blocked, plus the
    /// ones this plan creates whose creation was not refused before.
    pub starting: usize,
    /// Workers that do not start, and why, in index order.
    pub blocked: Vec<Blocked>,
}

/// Why a worker does not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The pod.
    pub pod: String,
    /// Who says so, as a PascalCase reason: `InvalidTemplate` (the pod cannot be built from the
    /// job's template), `CreateRefused` (the API server refused the pod), the scheduler's (`Unschedulable`), or the container's waiting reason (`ErrImagePull`,
    /// `ImagePullBackOff`, `CreateContainerConfigError`, …).
    pub reason: String,
    /// The message that came with it.
    pub message: String,
}

impl std::fmt::Display for Blocked {
    /// `<pod>: <reason>: <message>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.pod, self.reason, self.message)
    }
}

/// [`Deletion::reason`] (and event reason) of a worker built from an older spec: a ring never
/// mixes specs, so a spec edit that reaches the workers ([`build::worker_spec_digest`]) replaces
/// every worker at once, and the new ones form a new generation.
pub const SPEC_CHANGED: &str = "SpecChanged";

/// Whether worker `p` was built from another spec than the one of digest `digest`. A pod without
/// the digest label (made by an operator before it) counts as built from the current spec.
pub fn stale(p: &Pod, digest: &str) -> bool {
    p.labels()
        .get(build::LABEL_WORKER_SPEC)
        .is_some_and(|d| d != digest)
}

/// The job as its live workers were built, when they run another `spec.ring.protection` than
/// the spec now reads; None when they run the spec's (or there are none). The field is
/// immutable, so this happens only to a job stored before `none` became the default and never
/// written since: the API server fills in the new default when it reads the job. Its ring keeps
/// its mode: replacements of another mode would be refused by the survivors' handshake, and the
/// new mode's digest would replace every worker. A worker counts when it is live, its first
/// container sets `DIPHOMA_RING_PROTECTION`, and its digest label is the job's under that mode
/// (it was built from this spec). Once no such worker is left the spec's mode applies.
pub fn kept_protection(job: &DiphomaJob, pods: &[Pod]) -> Option<DiphomaJob> {
    let mode = |p: &Pod| {
        let env = p.spec.as_ref()?.containers.first()?.env.as_ref()?;
        let v = env
            .iter()
            .find(|e| e.name == diphoma_contract::ENV_RING_PROTECTION)?;
        serde_json::from_value::<RingProtection>(v.value.clone()?.into()).ok()
    };
    pods.iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !matches!(pod_phase(p), "Succeeded" | "Failed")
        })
        .filter_map(|p| Some((p, mode(p)?)))
        .filter(|&(_, m)| m != job.spec.ring.protection)
        .find_map(|(p, m)| {
            let mut kept = job.clone();
            kept.spec.ring.protection = m;
            (!stale(p, &build::worker_spec_digest(&kept))).then_some(kept)
        })
}

/// What the job says when a spec edit replaces its `replaced` running workers at once.
fn spec_changed_note(job: &DiphomaJob, replaced: usize) -> String {
    let resume = job
        .status
        .as_ref()
        .and_then(|s| s.progress.as_ref())
        .and_then(|p| p.last_checkpoint_step)
        .map_or("from the start (no checkpoint yet)".to_owned(), |s| {
            format!("from its checkpoint at step {s}")
        });
    format!(
        "the spec (generation {}) changed what the workers run: its {replaced} workers are replaced at once by workers of the new spec, which form a new ring generation and resume {resume}",
        job.metadata.generation.unwrap_or_default()
    )
}

/// Step 3: creates the missing workers and deletes those above `replicas` and those of an older
/// spec ([`stale`]: all of them at once, [`SPEC_CHANGED`]). A worker that cannot
/// be built from the template is not created but [`Blocked`] (`InvalidTemplate`), so that the
/// other steps (failures counted, status, ring) still run.
pub fn workers<'a>(
    job: &DiphomaJob,
    obs: &'a Observed,
    found: &Found,
    plan: &mut Plan,
) -> Workers<'a> {
    let name = job.name_any();
    let desired = job.spec.replicas;
    let deleting: std::collections::BTreeSet<String> =
        plan.delete.iter().map(|d| d.pod.clone()).collect();
    // Old workers go only for new ones that can be built (a template that cannot build a
    // worker blocks the replacements, and must not take the ring down with it).
    let digest = build::worker_pod(job, 0, 0)
        .is_ok()
        .then(|| build::worker_spec_digest(job));
    let mut live: BTreeMap<i32, &Pod> = BTreeMap::new();
    let mut attempts: BTreeMap<i32, i32> = BTreeMap::new();
    for p in &obs.pods {
        let Some(i) = build::replica_index(p) else {
            continue;
        };
        let a = attempts.entry(i).or_insert(-1);
        *a = (*a).max(build::attempt_of(&name, &p.name_any()));
        let gone = p.metadata.deletion_timestamp.is_some()
            || found.failed_pods.contains(&p.name_any())
            || deleting.contains(&p.name_any());
        if !gone && pod_phase(p) != "Succeeded" {
            if i >= desired || digest.as_ref().is_some_and(|d| stale(p, d)) {
                plan.delete.push(Deletion {
                    pod: p.name_any(),
                    force: false,
                    reason: if i >= desired {
                        "ScaledDown"
                    } else {
                        SPEC_CHANGED
                    },
                });
            } else {
                live.insert(i, p);
            }
        }
    }
    let replaced = plan
        .delete
        .iter()
        .filter(|d| d.reason == SPEC_CHANGED)
        .count();
    if replaced > 0 {
        plan.events.push(EventNote::normal(
            SPEC_CHANGED,
            "Replace",
            spec_changed_note(job, replaced),
        ));
    }
    let mut invalid = vec![];
    for i in 0..desired {
        if !live.contains_key(&i) {
            let mut attempt = attempts.get(&i).map_or(0, |a| a + 1);
            // A name still held by another owner's pod (a deleted job's, terminating) is skipped.
            while obs.foreign.contains(&build::pod_name(&name, i, attempt)) {
                attempt += 1;
            }
            let mut pod = match build::worker_pod(job, i, attempt) {
                Ok(pod) => pod,
                Err(e) => {
                    invalid.push(Blocked {
                        pod: build::pod_name(&name, i, attempt),
                        reason: "InvalidTemplate".into(),
                        message: e.to_string(),
                    });
                    continue;
                }
            };
            build::avoid_nodes(&mut pod, &found.dead_nodes);
            if let (Some(name), Some(spec)) = (&obs.scheduler_name, pod.spec.as_mut()) {
                spec.scheduler_name = Some(name.clone());
            }
            plan.events.push(
                EventNote::normal(
                    "WorkerCreated",
                    "Create",
                    format!("created worker {}", pod.name_any()),
                )
                .about(&pod.name_any()),
            );
            plan.create.push(pod);
        }
    }
    let mut blocked: Vec<Blocked> = live.values().filter_map(|p| blocked(p)).collect();
    blocked.extend(invalid);
    blocked.extend(plan.create.iter().filter_map(|p| {
        let message = obs.refused.get(&p.name_any())?;
        Some(Blocked {
            pod: p.name_any(),
            reason: "CreateRefused".into(),
            message: message.clone(),
        })
    }));
    let starting = live
        .values()
        .copied()
        .filter(|p| !ready_member(p))
        .chain(plan.create.iter())
        .filter(|p| !blocked.iter().any(|b| b.pod == p.name_any()))
        .count();
    Workers {
        live,
        starting,
        blocked,
    }
}

/// Whether a pod is a healthy worker that can be a ring member now.
pub fn ready_member(p: &Pod) -> bool {
    pod_phase(p) == "Running"
        && p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some()
        && condition(p, "Ready").is_some_and(|c| c.status == "True")
}

/// Why a live pod does not start, if something says so: the scheduler (PodScheduled False), or
/// a container waiting for a reason other than the normal `ContainerCreating` and
/// `PodInitializing` (an image that cannot be pulled, a missing ConfigMap, a crash loop).
pub fn blocked(p: &Pod) -> Option<Blocked> {
    let pod = p.name_any();
    if let Some(c) = condition(p, "PodScheduled").filter(|c| c.status == "False") {
        return Some(Blocked {
            pod,
            reason: c.reason.clone().unwrap_or_else(|| "Unschedulable".into()),
            message: c.message.clone().unwrap_or_default(),
        });
    }
    let status = p.status.as_ref()?;
    let containers = status.init_container_statuses.iter().flatten();
    let waiting = containers
        .chain(status.container_statuses.iter().flatten())
        .find_map(|c| c.state.as_ref()?.waiting.clone())
        .filter(|w| {
            !matches!(
                w.reason.as_deref(),
                None | Some("ContainerCreating" | "PodInitializing")
            )
        })?;
    Some(Blocked {
        pod,
        reason: waiting.reason.unwrap_or_default(),
        message: waiting.message.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::tests::basic;
    use serde_json::json;

    #[test]
    fn missing_indices_are_created_and_high_ones_scaled_down() {
        let mut j = basic();
        j.spec.replicas = 2;
        let running = |i: i32| {
            let mut p = build::worker_pod(&j, i, 0).unwrap();
            p.status = Some(serde_json::from_value(json!({"phase": "Running"})).unwrap());
            p
        };
        let obs = Observed {
            pods: vec![running(0), running(2)],
            ring: None,
            ..Default::default()
        };
        let dead = Found {
            dead_nodes: ["n1".to_owned()].into(),
            ..Found::default()
        };
        let mut plan = Plan::default();
        let w = workers(&j, &obs, &dead, &mut plan);
        assert_eq!(w.live.keys().copied().collect::<Vec<_>>(), [0]);
        assert_eq!(plan.create.len(), 1);
        assert_eq!(plan.create[0].name_any(), "train-worker-1");
        assert!(
            plan.create[0].spec.as_ref().unwrap().affinity.is_some(),
            "avoids n1"
        );
        assert_eq!(
            (plan.delete[0].pod.as_str(), plan.delete[0].reason),
            ("train-worker-2", "ScaledDown")
        );
        // Worker 0 runs but is not Ready: starting, as is the new worker 1.
        assert_eq!(w.starting, 2);
    }

    #[test]
    fn new_workers_name_the_scheduler_observed_for_the_job() {
        let j = basic();
        let mut plan = Plan::default();
        let obs = Observed {
            scheduler_name: Some("diphoma-coscheduling".into()),
            ..Default::default()
        };
        workers(&j, &obs, &Found::default(), &mut plan);
        assert!(!plan.create.is_empty());
        for p in &plan.create {
            let spec = p.spec.as_ref().unwrap();
            assert_eq!(spec.scheduler_name.as_deref(), Some("diphoma-coscheduling"));
        }
        // None observed: the template's (here none: the default scheduler).
        let mut plan = Plan::default();
        workers(&j, &Observed::default(), &Found::default(), &mut plan);
        assert_eq!(plan.create[0].spec.as_ref().unwrap().scheduler_name, None);
    }
}
