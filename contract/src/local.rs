//! The local layout of a worker pod that runs several training processes (one per GPU,
//! `spec.processesPerWorker`): how a pod member of the ring membership expands into ring ranks,
//! and where each local process listens. Pure functions; no I/O.
//!
//! The pod stays the unit of membership: the ring ConfigMap lists pods ([`Membership`]), and
//! every process of a pod derives the same per-process view ([`Membership::per_process`]):
//! pod rank `p` of `pods`, local rank `l` of `P` is ring rank `p·P + l` of `pods·P`.
//!
//! # Ports
//!
//! Local rank `l` listens (TCP ring, UDP liveness) at the pod's ring port `+ 2·l`
//! ([`process_port`]). The pod's ring port `+ 1` stays the rendezvous store's
//! ([`crate::store_port`], served by global rank 0's process, which is local rank 0 of pod
//! rank 0), so the odd offsets are left free: a pod with `P` processes uses the ports
//! `ring port ..= ring port + 2·(P − 1)` (see [`last_port`]).

use crate::membership::{Member, Membership};

/// Env: how many training processes each worker pod runs (`spec.processesPerWorker`, at least
/// 1; unset: 1). Set by the operator for the pod's launcher (`python -m diphoma.run`), and by
/// the launcher for each of its processes, with [`ENV_LOCAL_RANK`]; a process without a local
/// rank is its pod's only one ([`Local::from_lookup`]).
pub const ENV_PROCESSES_PER_WORKER: &str = "DIPHOMA_PROCESSES_PER_WORKER";
/// Env: this training process's local rank in its pod, `0..processesPerWorker` (unset: 0). Set
/// by the pod's launcher (`python -m diphoma.run`) for each process it starts, next to
/// torchrun's `LOCAL_RANK`.
pub const ENV_LOCAL_RANK: &str = "DIPHOMA_LOCAL_RANK";

/// The most processes a worker pod may run (`spec.processesPerWorker`'s maximum): the ports
/// of [`process_port`] must stay below 65536 for any ring port the job may choose.
pub const MAX_PROCESSES_PER_WORKER: u32 = 64;

/// One process's place in its pod: local rank `rank` of `processes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Local {
    /// Local rank, `0..processes`.
    pub rank: u32,
    /// Processes in the pod, `1..=MAX_PROCESSES_PER_WORKER`.
    pub processes: u32,
}

impl Default for Local {
    /// The single process of a pod: local rank 0 of 1.
    fn default() -> Local {
        Local {
            rank: 0,
            processes: 1,
        }
    }
}

/// Why [`Local::from_lookup`] refused the local layout: the variable and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {problem}")]
pub struct LocalError {
    /// The variable ([`ENV_LOCAL_RANK`] or [`ENV_PROCESSES_PER_WORKER`]).
    pub var: &'static str,
    /// What is wrong with its value.
    pub problem: String,
}

impl Local {
    /// The layout from [`ENV_LOCAL_RANK`] and [`ENV_PROCESSES_PER_WORKER`] through `get` (a
    /// variable's value, `None` when unset). A process is one of several only when its launcher
    /// set [`ENV_LOCAL_RANK`]: without it, it is the pod's only process (local rank 0 of 1)
    /// whatever [`ENV_PROCESSES_PER_WORKER`] (the operator's instruction to a launcher) says,
    /// so a worker image that runs one process per pod (the Rust worker, a script started
    /// without `python -m diphoma.run`) stays the pod's one ring rank.
    ///
    /// # Errors
    /// [`LocalError`] naming the variable that is not a whole number in range (processes
    /// `1..=64`, local rank below them).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Local, LocalError> {
        if get(ENV_LOCAL_RANK).is_none_or(|v| v.trim().is_empty()) {
            return Ok(Local::default());
        }
        let read = |var: &'static str, default: u32| match get(var) {
            None => Ok(default),
            Some(v) if v.trim().is_empty() => Ok(default),
            Some(v) => v.trim().parse::<u32>().map_err(|_| LocalError {
                var,
                problem: format!("{v:?} is not a whole number"),
            }),
        };
        let processes = read(ENV_PROCESSES_PER_WORKER, 1)?;
        if !(1..=MAX_PROCESSES_PER_WORKER).contains(&processes) {
            return Err(LocalError {
                var: ENV_PROCESSES_PER_WORKER,
                problem: format!("{processes} is not in 1..={MAX_PROCESSES_PER_WORKER}"),
            });
        }
        let rank = read(ENV_LOCAL_RANK, 0)?;
        if rank >= processes {
            return Err(LocalError {
                var: ENV_LOCAL_RANK,
                problem: format!("{rank} is not below {ENV_PROCESSES_PER_WORKER} {processes}"),
            });
        }
        Ok(Local { rank, processes })
    }

    /// This process's ring rank in `m` when its pod `pod` is a member: pod rank `p` gives
    /// `p·processes + rank`.
    pub fn ring_rank(&self, m: &Membership, pod: &str) -> Option<usize> {
        m.rank_of(pod)
            .map(|p| p * self.processes as usize + self.rank as usize)
    }
}

/// The TCP ring port (and UDP liveness port) of local rank `local_rank` in a pod whose ring
/// port is `ring_port`: `ring_port + 2·local_rank` (see the module docs); saturates at 65535,
/// which the operator's validation of `spec.ringPort` and `spec.processesPerWorker` rules out.
pub fn process_port(ring_port: u16, local_rank: u32) -> u16 {
    u16::try_from(u32::from(ring_port) + 2 * local_rank).unwrap_or(u16::MAX)
}

/// The highest port a pod with `processes` processes listens on: [`process_port`] of its last
/// local rank (the ring port itself for one process).
pub fn last_port(ring_port: u16, processes: u32) -> u32 {
    u32::from(ring_port) + 2 * processes.saturating_sub(1)
}

impl Membership {
    /// The ring of processes this membership of pods means when every pod runs `processes`
    /// training processes: each member `p` becomes `processes` members, ranks
    /// `p·processes ..`, same pod name and address, ports [`process_port`]. With 1 it is a
    /// copy. The result names each pod `processes` times, so it is a per-process view, not a
    /// document to publish ([`Membership::validate`] refuses duplicate pods).
    pub fn per_process(&self, processes: u32) -> Membership {
        let members = self
            .members
            .iter()
            .flat_map(|m| (0..processes.max(1)).map(move |l| (m, l)))
            .enumerate()
            .map(|(rank, (m, l))| Member {
                rank: u32::try_from(rank).unwrap_or(u32::MAX),
                pod: m.pod.clone(),
                address: m.address,
                port: process_port(m.port, l),
            })
            .collect();
        Membership {
            generation: self.generation,
            job_uid: self.job_uid.clone(),
            members,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Membership {
        Membership::parse(
            r#"{"generation":4,"jobUid":"u","members":[
            {"rank":0,"pod":"w-0","address":"10.0.0.1","port":29500},
            {"rank":1,"pod":"w-3","address":"10.0.0.2","port":29500}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn each_pod_expands_into_its_processes_ranks_and_ports() {
        let m = pods().per_process(2);
        let got: Vec<_> = m
            .members
            .iter()
            .map(|x| (x.rank, x.pod.as_str(), x.port))
            .collect();
        assert_eq!(
            got,
            [
                (0, "w-0", 29500),
                (1, "w-0", 29502),
                (2, "w-3", 29500),
                (3, "w-3", 29502)
            ]
        );
        assert_eq!(m.generation, 4);
        assert_eq!(pods().per_process(1), pods());
        let l1 = Local {
            rank: 1,
            processes: 2,
        };
        assert_eq!(l1.ring_rank(&pods(), "w-3"), Some(3));
        assert_eq!(l1.ring_rank(&pods(), "w-9"), None);
        assert_eq!(m.addresses()[3].to_string(), "10.0.0.2:29502");
    }

    #[test]
    fn the_store_port_stays_free_of_every_process() {
        for l in 0..8 {
            assert_ne!(process_port(29500, l), crate::store_port(29500));
        }
        assert_eq!(last_port(29500, 8), 29514);
        assert_eq!(last_port(29500, 1), 29500);
    }

    #[test]
    fn the_layout_variables_are_checked_by_name() {
        let env = |pairs: &'static [(&str, &str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Local::from_lookup(env(&[])).unwrap(), Local::default());
        assert_eq!(
            Local::from_lookup(env(&[
                (ENV_PROCESSES_PER_WORKER, "8"),
                (ENV_LOCAL_RANK, "7")
            ])),
            Ok(Local {
                rank: 7,
                processes: 8
            })
        );
        let e = Local::from_lookup(env(&[
            (ENV_PROCESSES_PER_WORKER, "2"),
            (ENV_LOCAL_RANK, "2"),
        ]));
        assert_eq!(e.unwrap_err().var, ENV_LOCAL_RANK);
        assert_eq!(
            Local::from_lookup(env(&[(ENV_PROCESSES_PER_WORKER, "8")])).unwrap(),
            Local::default(),
            "no launcher set a local rank: the pod's one process"
        );
        let e = Local::from_lookup(env(&[
            (ENV_PROCESSES_PER_WORKER, "0"),
            (ENV_LOCAL_RANK, "0"),
        ]));
        assert_eq!(e.unwrap_err().var, ENV_PROCESSES_PER_WORKER);
        let e = Local::from_lookup(env(&[
            (ENV_PROCESSES_PER_WORKER, "two"),
            (ENV_LOCAL_RANK, "0"),
        ]));
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("DIPHOMA_PROCESSES_PER_WORKER")
        );
    }
}
