//! Step 4 of the plan: the ring — publish generation g+1 when the live membership changes (a
//! member lost, or grown once nobody is still starting, or the ring ConfigMap lost), never below
//! `minReplicas`, and the ring's status view. Generations only grow: g is the larger of the
//! published ring's and the status'. Pure; it neither creates nor deletes pods.

use std::collections::{BTreeMap, BTreeSet};

use diphoma_contract::{LABEL_GENERATION, LABEL_RANK, Member, Membership};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::failures::Found;
use super::workers::{Workers, ready_member};
use super::{EventNote, Observed, Plan, Relabel, parse_ts};
use crate::api::{DiphomaJob, MAX_LISTED_MEMBERS, RingMember, RingStatus};
use crate::build;

/// The number of the next generation: one above both the published ring's and the one the
/// job's status records (the status is the source of truth: a deleted or foreign ring
/// ConfigMap never makes the generation go back, and the workers ignore an older one).
fn next_number(ring: Option<&Membership>, job: &DiphomaJob) -> u64 {
    let recorded = job
        .status
        .as_ref()
        .and_then(|s| s.ring.as_ref())
        .map_or(0, |r| u64::try_from(r.generation).unwrap_or(0));
    ring.map_or(0, |r| r.generation).max(recorded) + 1
}

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

/// What changed from ring `before` to `after`, for the `RingReformed` event: `" (lost
/// train-worker-1 (rank 1); added train-worker-3)"`, empty for the first ring or no change.
pub fn changes(before: Option<&Membership>, after: &Membership) -> String {
    let Some(before) = before else {
        return String::new();
    };
    let lost: Vec<String> = before
        .members
        .iter()
        .filter(|m| after.rank_of(&m.pod).is_none())
        .map(|m| format!("{} (rank {})", m.pod, m.rank))
        .collect();
    let added: Vec<&str> = after
        .members
        .iter()
        .filter(|m| before.rank_of(&m.pod).is_none())
        .map(|m| m.pod.as_str())
        .collect();
    let mut parts = vec![];
    if !lost.is_empty() {
        parts.push(format!("lost {}", lost.join(", ")));
    }
    if !added.is_empty() {
        parts.push(format!("added {}", added.join(", ")));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join("; "))
    }
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
    if obs.ring.is_none() {
        prelabel(job, &workers.live, &mut plan.create);
    }
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
        let generation = next_number(ring, job);
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
            format!(
                "generation {generation} with {} workers{}",
                m.members.len(),
                changes(ring, &m)
            ),
        ));
        status.ring = Some(ring_status(
            &job.name_any(),
            job.spec.processes_per_worker(),
            &m,
            vec![],
            &obs.pods,
        ));
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
            job.spec.processes_per_worker(),
            r,
            found.departed.into_iter().collect(),
            &obs.pods,
        ));
    }
    plan.relabel = relabel(obs, plan);
    RingView {
        ready: ready_names,
        lost_member,
        enough,
    }
}

/// The status view of ring generation `m` of job `job`, whose workers run `processes` training
/// processes each (the layout: `size` pods × `processesPerWorker` = `worldSize` ranks); `pods`
/// give the members' nodes.
pub fn ring_status(
    job: &str,
    processes: i32,
    m: &Membership,
    departed: Vec<String>,
    pods: &[Pod],
) -> RingStatus {
    let node = |pod: &str| {
        let p = pods.iter().find(|p| p.name_any() == pod)?;
        super::node_of(p).map(str::to_owned)
    };
    let listed = m.members.len() <= MAX_LISTED_MEMBERS;
    RingStatus {
        generation: m.generation as i64,
        size: m.members.len() as i32,
        processes_per_worker: processes,
        world_size: if processes > 1 {
            m.members.len() as i32 * processes
        } else {
            0
        },
        config_map: diphoma_contract::membership_configmap_name(job),
        departed,
        members: m
            .members
            .iter()
            .filter(|_| listed)
            .map(|mem| RingMember {
                rank: mem.rank as i32,
                pod: mem.pod.clone(),
                node: node(&mem.pod),
            })
            .collect(),
    }
}

/// The rank and generation labels of worker `pod` in ring `m` (the one in effect: published by
/// this plan, else observed), none outside it.
pub fn rank_labels(m: &Membership, pod: &str) -> Option<(u32, u64)> {
    Some((m.rank_of(pod)? as u32, m.generation))
}

/// The pods whose rank labels must change (pods being deleted are left alone): a member whose
/// [`LABEL_RANK`] is not its rank in the ring in effect ([`rank_labels`]) gets its rank and the
/// ring's generation as [`LABEL_GENERATION`] (the generation since which it holds that rank); a
/// member that keeps its rank keeps both labels, so a new generation patches only the members
/// whose rank moved and the new ones (not every member); a pod outside the ring loses both.
/// While no ring is in effect nothing changes (the workers carry [`prelabel`]'s guess).
pub fn relabel(obs: &Observed, plan: &Plan) -> Vec<Relabel> {
    let Some(ring) = plan.publish.as_ref().or(obs.ring.as_ref()) else {
        return vec![];
    };
    let deleting: BTreeSet<&str> = plan.delete.iter().map(|d| d.pod.as_str()).collect();
    obs.pods
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none() && !deleting.contains(p.name_any().as_str())
        })
        .filter_map(|p| {
            let want = rank_labels(ring, &p.name_any());
            let labels = p.labels();
            let (rank, generation) = (labels.get(LABEL_RANK), labels.get(LABEL_GENERATION));
            let same = match want {
                Some((r, g)) => {
                    rank == Some(&r.to_string())
                        && generation
                            .and_then(|have| have.parse::<u64>().ok())
                            .is_some_and(|have| have <= g)
                }
                None => (rank, generation) == (None, None),
            };
            (!same).then(|| Relabel {
                pod: p.name_any(),
                rank: want,
            })
        })
        .collect()
}

/// Labels the workers `create`d while no ring is in effect with the rank and generation that
/// the ring they await will give them, so that forming it patches none of them (4 pod writes
/// fewer per job of 4, issue 14). [`next_generation`] ranks the ready workers in replica index
/// order, so a new worker's rank is the number of live or new workers with a lower index, and
/// the generation is the next one. A guess the ring does not confirm (a worker not ready when
/// it forms) is corrected by [`relabel`] once it does.
pub fn prelabel(job: &DiphomaJob, live: &BTreeMap<i32, &Pod>, create: &mut [Pod]) {
    let generation = next_number(None, job).to_string();
    let indices: BTreeSet<i32> = live
        .keys()
        .copied()
        .chain(create.iter().filter_map(build::replica_index))
        .collect();
    for pod in create {
        let Some(i) = build::replica_index(pod) else {
            continue;
        };
        let rank = indices.range(..i).count().to_string();
        let labels = pod.metadata.labels.get_or_insert_default();
        labels.insert(LABEL_RANK.to_owned(), rank);
        labels.insert(LABEL_GENERATION.to_owned(), generation.clone());
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
            ..Default::default()
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

    fn pod(name: &str, node: &str, labels: &[(&str, &str)]) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels.iter().copied().collect::<std::collections::BTreeMap<_, _>>()},
            "spec": {"containers": [], "nodeName": node},
        }))
        .unwrap()
    }

    #[test]
    fn ranks_are_labelled_as_the_ring_says_and_small_rings_list_their_members() {
        let ring = Membership {
            generation: 7,
            job_uid: "uid-1".into(),
            members: ["w-2", "w-0", "w-4", "w-5"]
                .iter()
                .enumerate()
                .map(|(rank, pod)| Member {
                    rank: rank as u32,
                    pod: (*pod).into(),
                    address: [127, 0, 0, 2].into(),
                    port: 29500,
                })
                .collect(),
        };
        let obs = Observed {
            pods: vec![
                pod("w-0", "n0", &[(LABEL_RANK, "0"), (LABEL_GENERATION, "6")]), // rank moved
                pod("w-1", "n1", &[(LABEL_RANK, "1"), (LABEL_GENERATION, "6")]), // left the ring
                pod("w-2", "n2", &[(LABEL_RANK, "0"), (LABEL_GENERATION, "7")]), // up to date
                pod("w-3", "n3", &[]), // not a member, no labels: nothing to do
                pod("w-4", "n4", &[(LABEL_RANK, "2"), (LABEL_GENERATION, "5")]), // kept its rank
                pod("w-5", "n5", &[(LABEL_RANK, "3")]), // a rank without its generation
            ],
            ring: Some(ring.clone()),
            ..Default::default()
        };
        let plan = Plan::default();
        assert_eq!(
            relabel(&obs, &plan),
            [
                Relabel {
                    pod: "w-0".into(),
                    rank: Some((1, 7))
                },
                Relabel {
                    pod: "w-1".into(),
                    rank: None
                },
                Relabel {
                    pod: "w-5".into(),
                    rank: Some((3, 7))
                },
            ]
        );
        let status = ring_status("j", 1, &ring, vec![], &obs.pods);
        let listed: Vec<_> = status
            .members
            .iter()
            .map(|m| (m.rank, m.pod.as_str(), m.node.as_deref()))
            .collect();
        assert_eq!(
            listed,
            [
                (0, "w-2", Some("n2")),
                (1, "w-0", Some("n0")),
                (2, "w-4", Some("n4")),
                (3, "w-5", Some("n5"))
            ]
        );
        let mut big = ring;
        big.members = (0..=MAX_LISTED_MEMBERS as u32)
            .map(|rank| Member {
                rank,
                pod: format!("w-{rank}"),
                address: [127, 0, 0, 2].into(),
                port: 29500,
            })
            .collect();
        assert!(ring_status("j", 1, &big, vec![], &[]).members.is_empty());
        // One process per member says nothing more than before the layout existed: an
        // operator whose CRD predates these fields still writes the status of such a job.
        let single = serde_json::to_value(ring_status("j", 1, &big, vec![], &[])).unwrap();
        assert!(single.get("processesPerWorker").is_none() && single.get("worldSize").is_none());
        let layout = ring_status("j", 8, &big, vec![], &[]);
        assert_eq!(
            (layout.size, layout.processes_per_worker, layout.world_size),
            (big.members.len() as i32, 8, big.members.len() as i32 * 8),
            "pods × processes"
        );
    }
}
