//! Pod status as a kubelet writes it, computed from the state of each container's process (pure).
//! The shapes follow kwok's pod stages and `pkg/kubelet/status` (phase, conditions,
//! containerStatuses with state, exit code, reason and restartCount).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

/// What one container's process is doing.
#[derive(Debug, Clone, PartialEq)]
pub enum RunState {
    /// Not running: being prepared, backing off before a restart, or unable to start.
    Waiting {
        /// `ContainerCreating`, `CrashLoopBackOff`, `ErrImagePull`, `CreateContainerConfigError`, …
        reason: String,
        /// Human-readable detail (names the image, binary or field at fault).
        message: String,
    },
    /// The process runs.
    Running {
        /// When it was started.
        started: Time,
        /// Its process id.
        pid: u32,
    },
    /// The process has exited.
    Terminated {
        /// Exit code; 128 + signal number when killed by a signal (137 for SIGKILL).
        exit_code: i32,
        /// `Completed` for exit 0, `Error` otherwise.
        reason: String,
        /// When it was started.
        started: Time,
        /// When it exited.
        finished: Time,
        /// Its termination message (under `FallbackToLogsOnError`, the end of its log after a
        /// failed exit: [`super::logs::termination_message`]).
        message: Option<String>,
    },
}

/// One container as the kubelet tracks it.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerRecord {
    /// Container name.
    pub name: String,
    /// Image reference from the spec.
    pub image: String,
    /// Current state.
    pub state: RunState,
    /// The previous run's termination, after a restart.
    pub last: Option<RunState>,
    /// Restarts so far.
    pub restart_count: i32,
    /// The readiness probe's verdict for the running process (true without a probe).
    pub ready: bool,
}

impl ContainerRecord {
    /// A container about to be started (`ContainerCreating`).
    pub fn creating(name: &str, image: &str) -> Self {
        ContainerRecord {
            name: name.to_owned(),
            image: image.to_owned(),
            state: RunState::Waiting {
                reason: "ContainerCreating".into(),
                message: String::new(),
            },
            last: None,
            restart_count: 0,
            ready: false,
        }
    }
}

/// The exit code and reason a kubelet reports for a finished process.
pub fn termination(status: std::process::ExitStatus) -> (i32, &'static str) {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    (code, if code == 0 { "Completed" } else { "Error" })
}

/// Whether a container that exited with `exit_code` is started again under `restart_policy`.
pub fn should_restart(restart_policy: &str, exit_code: i32) -> bool {
    match restart_policy {
        "Never" => false,
        "OnFailure" => exit_code != 0,
        _ => true,
    }
}

/// Pod phase from its containers: `Succeeded`/`Failed` once every container has terminated for
/// good, `Running` while any runs or will restart, `Pending` before anything started.
pub fn phase(containers: &[ContainerRecord]) -> &'static str {
    let terminated: Vec<i32> = containers
        .iter()
        .filter_map(|c| match c.state {
            RunState::Terminated { exit_code, .. } => Some(exit_code),
            _ => None,
        })
        .collect();
    if !containers.is_empty() && terminated.len() == containers.len() {
        if terminated.iter().all(|&c| c == 0) {
            "Succeeded"
        } else {
            "Failed"
        }
    } else if containers
        .iter()
        .any(|c| matches!(c.state, RunState::Running { .. }) || c.restart_count > 0)
    {
        "Running"
    } else {
        "Pending"
    }
}

/// Whether every readiness gate of the pod (`spec.readinessGates`) has a True condition.
pub fn gates_pass(pod: &Pod) -> bool {
    let gates = pod.spec.as_ref().and_then(|s| s.readiness_gates.as_ref());
    let conds = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    gates.into_iter().flatten().all(|g| {
        conds
            .into_iter()
            .flatten()
            .any(|c| c.type_ == g.condition_type && c.status == "True")
    })
}

/// Whether every container runs and passes its readiness probe (`ContainersReady`).
pub fn containers_ready(containers: &[ContainerRecord]) -> bool {
    containers
        .iter()
        .all(|c| c.ready && matches!(c.state, RunState::Running { .. }))
}

/// Whether the pod's current `Ready` condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

fn state_json(s: &RunState) -> Value {
    match s {
        RunState::Waiting { reason, message } => {
            json!({"waiting": {"reason": reason, "message": message}})
        }
        RunState::Running { started, .. } => json!({"running": {"startedAt": started}}),
        RunState::Terminated {
            exit_code,
            reason,
            started,
            finished,
            message,
        } => json!({"terminated": {
            "exitCode": exit_code, "reason": reason, "startedAt": started, "finishedAt": finished,
            "message": message}}),
    }
}

/// The strategic-merge patch body for `pods/<name>/status`: phase, IPs, conditions (merged by
/// type, so the scheduler's `PodScheduled` and readiness-gate conditions survive) and
/// containerStatuses. A container is ready when it runs and passes its readiness probe; the pod
/// when all are and `gates` ([`gates_pass`] for the pod) holds. `now` stamps transitions.
pub fn status_patch(
    containers: &[ContainerRecord],
    pod_ip: Option<&str>,
    host_ip: &str,
    start_time: &Time,
    gates: bool,
    now: &Time,
) -> Value {
    let phase = phase(containers);
    let all_ready = containers_ready(containers);
    let terminal = matches!(phase, "Succeeded" | "Failed");
    let cond = |t: &str, ok: bool, reason: &str| {
        let mut c = json!({"type": t, "status": if ok { "True" } else { "False" }, "lastTransitionTime": now});
        if !ok {
            c["reason"] = json!(reason);
        }
        c
    };
    let not_ready = if terminal {
        "PodCompleted"
    } else {
        "ContainersNotReady"
    };
    let statuses: Vec<Value> = containers
        .iter()
        .map(|c| {
            let running = matches!(c.state, RunState::Running { .. });
            let mut s = json!({
                "name": c.name, "image": c.image, "imageID": "", "ready": running && c.ready,
                "started": running, "restartCount": c.restart_count, "state": state_json(&c.state),
            });
            if let RunState::Running { pid, .. } = c.state {
                s["containerID"] = json!(format!("process://{pid}"));
            }
            if let Some(last) = &c.last {
                s["lastState"] = state_json(last);
            }
            s
        })
        .collect();
    let mut status = json!({
        "phase": phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "startTime": start_time,
        "conditions": [
            cond("PodReadyToStartContainers", true, ""),
            cond("Initialized", true, ""),
            cond("ContainersReady", all_ready, not_ready),
            cond("Ready", all_ready && gates, not_ready),
        ],
        "containerStatuses": statuses,
    });
    if let Some(ip) = pod_ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({ "status": status })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Time {
        Time(jiff::Timestamp::UNIX_EPOCH)
    }

    /// A container in `state` that passes its readiness probe.
    fn rec(state: RunState) -> ContainerRecord {
        ContainerRecord {
            state,
            ready: true,
            ..ContainerRecord::creating("c", "img")
        }
    }

    fn exited(code: i32) -> RunState {
        RunState::Terminated {
            exit_code: code,
            reason: "x".into(),
            started: t(),
            finished: t(),
            message: None,
        }
    }

    #[test]
    fn phase_follows_containers() {
        assert_eq!(phase(&[ContainerRecord::creating("c", "i")]), "Pending");
        assert_eq!(
            phase(&[rec(RunState::Running {
                started: t(),
                pid: 1
            })]),
            "Running"
        );
        assert_eq!(phase(&[rec(exited(0)), rec(exited(0))]), "Succeeded");
        assert_eq!(phase(&[rec(exited(0)), rec(exited(3))]), "Failed");
        assert_eq!(
            phase(&[
                rec(exited(0)),
                rec(RunState::Running {
                    started: t(),
                    pid: 1
                })
            ]),
            "Running"
        );
        let backing_off = ContainerRecord {
            restart_count: 1,
            ..ContainerRecord::creating("c", "i")
        };
        assert_eq!(phase(&[backing_off]), "Running");
    }

    #[test]
    fn restart_policy_decides_restarts() {
        assert!(!should_restart("Never", 1));
        assert!(should_restart("OnFailure", 1) && !should_restart("OnFailure", 0));
        assert!(should_restart("Always", 0));
    }

    #[test]
    fn terminated_status_carries_exit_code_and_not_ready() {
        let p = status_patch(
            &[rec(exited(3))],
            Some("127.1.0.2"),
            "127.1.0.1",
            &t(),
            true,
            &t(),
        );
        let s = &p["status"];
        assert_eq!(s["phase"], "Failed");
        assert_eq!(s["podIP"], "127.1.0.2");
        assert_eq!(
            s["containerStatuses"][0]["state"]["terminated"]["exitCode"],
            3
        );
        assert_eq!(s["conditions"][3]["status"], "False");
        assert_eq!(s["conditions"][3]["reason"], "PodCompleted");
    }

    #[test]
    fn running_pod_is_ready_only_when_gates_pass() {
        let running = [rec(RunState::Running {
            started: t(),
            pid: 42,
        })];
        let open = status_patch(&running, Some("127.1.0.2"), "127.1.0.1", &t(), true, &t());
        assert_eq!(open["status"]["conditions"][3]["status"], "True");
        assert_eq!(
            open["status"]["containerStatuses"][0]["containerID"],
            "process://42"
        );
        let gated = status_patch(&running, Some("127.1.0.2"), "127.1.0.1", &t(), false, &t());
        assert_eq!(gated["status"]["conditions"][3]["status"], "False");
        assert_eq!(gated["status"]["conditions"][2]["status"], "True");
    }

    #[test]
    fn a_running_container_failing_its_readiness_probe_is_not_ready() {
        let probing = [ContainerRecord {
            ready: false,
            ..rec(RunState::Running {
                started: t(),
                pid: 42,
            })
        }];
        let s = &status_patch(&probing, Some("127.1.0.2"), "127.1.0.1", &t(), true, &t())["status"];
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["containerStatuses"][0]["ready"], false);
        assert_eq!(s["containerStatuses"][0]["started"], true);
        assert_eq!(s["conditions"][2]["status"], "False");
        assert_eq!(s["conditions"][3]["status"], "False");
    }

    #[test]
    fn signals_map_to_128_plus_signal() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            termination(std::process::ExitStatus::from_raw(9)),
            (137, "Error")
        );
        assert_eq!(
            termination(std::process::ExitStatus::from_raw(0)),
            (0, "Completed")
        );
        assert_eq!(
            termination(std::process::ExitStatus::from_raw(3 << 8)),
            (3, "Error")
        );
    }
}
