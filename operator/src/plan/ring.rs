//! Step 4 of the plan: the ring — publish generation g+1 when the live membership changes (a
//! member lost, or grown once nobody is still starting), never below `minReplicas`, and the
//! ring's status view. Pure; it neither creates nor deletes pods.

use std::collections::BTreeSet;

use diphoma_contract::{Member, Membership};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::failures::Found;
use super::workers::{Workers, ready_member};
use super::{EventNote, Observed, Plan, parse_ts};
use crate::api::{DiphomaJob, RingStatus};

/// What the ring step saw of the workers, for the status.
#[derive(Debug, Clone, Default)]
pub struct RingView {
    /// Live workers ready to be members, by pod name.
    pub ready: BTreeSet<String>,
    /// A member of the observed generation is no longer a ready worker.
    pub lost_member: bool,
    /// At least `minReplicas` workers are ready.
    pub enough: bool,
}

/// Step 4: publishes the next generation when the ready workers differ from the ring's members
/// and the change is due, and writes the ring's status (with the members that departed, when
/// the generation stays).
pub fn next_generation(
    job: &DiphomaJob,
    obs: &Observed,
    workers: &Workers,
    mut found: Found,
    plan: &mut Plan,
) -> RingView {
    let spec = &job.spec;
    let ring = obs.ring.as_ref();
    let (min, _) = spec.bounds();
    let ready: Vec<&Pod> = workers
        .live
        .values()
        .copied()
        .filter(|p| ready_member(p))
        .collect();
    let ready_names: BTreeSet<String> = ready.iter().map(|p| p.name_any()).collect();
    let ring_names: BTreeSet<String> = ring
        .iter()
        .flat_map(|r| r.members.iter().map(|m| m.pod.clone()))
        .collect();
    let lost_member = ring_names.iter().any(|n| !ready_names.contains(n));
    // A ready pod named like an accounted-for departed member is a new pod (resume).
    let rejoined = ready_names.iter().any(|n| found.departed.contains(n));
    let grown = rejoined || ready_names.iter().any(|n| !ring_names.contains(n));
    let enough = ready.len() as i32 >= min;
    let change = (rejoined || ready_names != ring_names)
        && (lost_member || (grown && workers.starting == 0));
    let status = &mut plan.status;
    if enough && change {
        let generation = ring.map_or(1, |r| r.generation + 1);
        let members = ready
            .iter()
            .enumerate()
            .map(|(rank, p)| Member {
                rank: rank as u32,
                pod: p.name_any(),
                address: p
                    .status
                    .as_ref()
                    .and_then(|s| s.pod_ip.as_ref())
                    .and_then(|ip| ip.parse().ok())
                    .unwrap_or([0, 0, 0, 0].into()),
                port: spec.ring_port as u16,
            })
            .collect();
        let m = Membership {
            generation,
            job_uid: job.uid().unwrap_or_default(),
            members,
        };
        if lost_member && ring.is_some() {
            // Time to repair: from the loss to the ring re-formed without it.
            let lost_at = status.last_failure.as_ref().and_then(|f| parse_ts(&f.time));
            status.repairs.last_seconds =
                lost_at.map(|t| obs.now.duration_since(t).as_secs_f64().max(0.0));
        }
        plan.events.push(EventNote::normal(
            "RingReformed",
            "Publish",
            format!("generation {generation} with {} workers", m.members.len()),
        ));
        status.ring = Some(ring_status(&job.name_any(), &m, vec![]));
        plan.publish = Some(m);
    } else if let Some(r) = ring {
        found.departed.extend(
            plan.failures
                .iter()
                .filter(|f| f.rank.is_some())
                .map(|f| f.pod.clone()),
        );
        found.departed.extend(
            plan.delete
                .iter()
                .filter(|d| r.rank_of(&d.pod).is_some())
                .map(|d| d.pod.clone()),
        );
        status.ring = Some(ring_status(
            &job.name_any(),
            r,
            found.departed.into_iter().collect(),
        ));
    }
    RingView {
        ready: ready_names,
        lost_member,
        enough,
    }
}

/// The status view of ring generation `m` of job `job`.
pub fn ring_status(job: &str, m: &Membership, departed: Vec<String>) -> RingStatus {
    RingStatus {
        generation: m.generation as i64,
        size: m.members.len() as i32,
        config_map: diphoma_contract::membership_configmap_name(job),
        departed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::tests::job;
    use serde_json::json;

    #[test]
    fn a_kept_generation_lists_the_members_that_departed() {
        let j = job(json!({"replicas": 2, "template": {}}));
        let m = Membership {
            generation: 4,
            job_uid: "uid-1".into(),
            members: vec![Member {
                rank: 0,
                pod: "train-worker-0".into(),
                address: [127, 0, 0, 2].into(),
                port: 29500,
            }],
        };
        let obs = Observed {
            pods: vec![],
            ring: Some(m),
            nodes: Default::default(),
            progress: None,
            reports: vec![],
            now: jiff::Timestamp::UNIX_EPOCH,
            refused: Default::default(),
        };
        let mut plan = Plan::default();
        plan.delete.push(super::super::Deletion {
            pod: "train-worker-0".into(),
            force: false,
            reason: "Replaced",
        });
        let view = next_generation(&j, &obs, &Workers::default(), Found::default(), &mut plan);
        assert!(view.lost_member && !view.enough);
        assert!(plan.publish.is_none(), "never below minReplicas");
        let ring = plan.status.ring.unwrap();
        assert_eq!((ring.generation, ring.size), (4, 1));
        assert_eq!(ring.departed, ["train-worker-0"]);
    }
}
