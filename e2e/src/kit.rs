//! The test kit shared by `tests/` and the repair benchmark: the one builder of the `DiphomaJob`
//! manifests they submit ([`JobManifest`]), the JSON deep merge it and the pod builders use,
//! process lookup for the pods the process kubelet runs (pid, state, start time, signals) and
//! free loopback ports. Plain functions over values and `/proc`; it must not talk to the API
//! server or wait for anything (the tests' waits live in `tests/common`).

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{Value, json};

use crate::Error;

/// A `DiphomaJob` manifest as the tests and the benchmark submit it: `replicas` workers running
/// one container `worker` (`image` with `args`), `gpusPerWorker` GPUs each, then `extra`
/// deep-merged into the whole manifest (elastic bounds, run policy, checkpoints, a namespace …).
///
/// Start from [`JobManifest::probe`] or [`JobManifest::training`] and change fields with struct
/// update syntax; [`JobManifest::build`] renders it, `to_string()` gives JSON (valid YAML for
/// `kubectl apply`).
#[derive(Debug, Clone, PartialEq)]
pub struct JobManifest {
    /// `metadata.name`.
    pub name: String,
    /// `spec.replicas`.
    pub replicas: i32,
    /// `spec.gpusPerWorker`.
    pub gpus_per_worker: i32,
    /// `spec.faultTolerance.detectionSeconds`; `None` leaves the CRD's default.
    pub detection_seconds: Option<u64>,
    /// `terminationGracePeriodSeconds` of the worker pods, in seconds.
    pub grace_seconds: i64,
    /// The worker container's image (the process kubelet maps it to a workspace binary).
    pub image: String,
    /// The worker container's arguments.
    pub args: Vec<String>,
    /// A JSON object deep-merged into the manifest last (see [`merge`]); `{}` for none.
    pub extra: Value,
}

impl JobManifest {
    /// Workers that only need to live: `diphoma-probe --sleep 3600`, 1 GPU each, 5 s grace.
    pub fn probe(name: &str, replicas: i32) -> Self {
        Self::with_worker(name, replicas, "diphoma-probe:dev", &["--sleep", "3600"])
    }

    /// Real training workers: `diphoma-worker train --steps STEPS --log-every LOG_EVERY` (the
    /// digits MLP), 1 GPU each, 5 s grace.
    pub fn training(name: &str, replicas: i32, steps: u64, log_every: u64) -> Self {
        let (steps, log_every) = (steps.to_string(), log_every.to_string());
        let args = ["train", "--steps", &steps, "--log-every", &log_every];
        Self::with_worker(name, replicas, "diphoma-worker:dev", &args)
    }

    fn with_worker(name: &str, replicas: i32, image: &str, args: &[&str]) -> Self {
        JobManifest {
            name: name.to_owned(),
            replicas,
            gpus_per_worker: 1,
            detection_seconds: None,
            grace_seconds: 5,
            image: image.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            extra: json!({}),
        }
    }

    /// The manifest as JSON.
    pub fn build(&self) -> Value {
        let mut job = json!({
            "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob",
            "metadata": {"name": self.name},
            "spec": {
                "replicas": self.replicas,
                "gpusPerWorker": self.gpus_per_worker,
                "template": {"spec": {
                    "terminationGracePeriodSeconds": self.grace_seconds,
                    "containers": [{"name": "worker", "image": self.image, "args": self.args}],
                }},
            },
        });
        if let Some(s) = self.detection_seconds {
            job["spec"]["faultTolerance"] = json!({"detectionSeconds": s});
        }
        merge(&mut job, self.extra.clone());
        job
    }
}

impl std::fmt::Display for JobManifest {
    /// The manifest as one line of JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.build())
    }
}

/// JSON deep merge of `b` into `a`: objects key by key, arrays element-wise (so `containers[0]`
/// can be extended), anything else replaced.
pub fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => b
            .into_iter()
            .for_each(|(k, v)| merge(a.entry(k).or_insert(Value::Null), v)),
        (Value::Array(a), Value::Array(b)) => {
            for (i, v) in b.into_iter().enumerate() {
                match a.get_mut(i) {
                    Some(x) => merge(x, v),
                    None => a.push(v),
                }
            }
        }
        (a, b) => *a = b,
    }
}

/// A free TCP address on 127.0.0.1 (bound once by the OS, then released for the caller).
///
/// Errors: the OS error of the bind.
pub fn free_addr() -> std::io::Result<SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// The pid of the pod's first container, from `containerID: process://<pid>` (as the process
/// kubelet reports it).
///
/// Errors: [`Error::NoProcess`] while the container has no (parsable) containerID.
pub fn pid_of(p: &Pod) -> Result<u32, Error> {
    p.status
        .as_ref()
        .and_then(|s| {
            s.container_statuses
                .as_ref()?
                .first()?
                .container_id
                .as_deref()
        })
        .and_then(|id| id.strip_prefix("process://")?.parse().ok())
        .ok_or_else(|| Error::NoProcess {
            pod: format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()),
        })
}

/// The fields of `/proc/<pid>/stat` after the command name (the first is the state); `None`
/// when the process does not exist.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The state letter of a process (`R`, `S`, `T`, `Z`, …) or `None` when it no longer exists.
pub fn proc_state(pid: u32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    proc_state(pid).is_some_and(|s| s != 'Z')
}

/// When a process started, as wall-clock time (its start in clock ticks since boot, from
/// `/proc`); `None` when it no longer exists.
pub fn process_start(pid: u32) -> Option<SystemTime> {
    let ticks: u64 = stat_fields(pid)?.get(19)?.parse().ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let boot = SystemTime::now() - Duration::from_secs_f64(uptime);
    Some(boot + Duration::from_secs_f64(ticks as f64 / hz))
}

/// Sends `sig` to a process (one the caller's kubelet started, by its recorded pid).
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, sig) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_is_merged_into_the_built_manifest() {
        let job = JobManifest {
            detection_seconds: Some(4),
            extra: json!({"spec": {"faultTolerance": {"restartOnExitCodes": [1]},
                                   "template": {"spec": {"containers": [{"env": []}]}}}}),
            ..JobManifest::training("digits", 2, 600, 1)
        }
        .build();
        assert_eq!(
            job["spec"]["faultTolerance"],
            json!({"detectionSeconds": 4, "restartOnExitCodes": [1]})
        );
        let c = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["image"], "diphoma-worker:dev");
        assert_eq!(c["env"], json!([]));
        assert_eq!(
            c["args"],
            json!(["train", "--steps", "600", "--log-every", "1"])
        );
    }

    #[test]
    fn a_probe_job_has_no_fault_tolerance_unless_asked() {
        let job = JobManifest::probe("train", 3).build();
        assert!(job["spec"].get("faultTolerance").is_none());
        assert_eq!(job["spec"]["replicas"], 3);
        assert_eq!(job["metadata"]["name"], "train");
    }

    #[test]
    fn pid_of_reads_the_process_container_id() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "n"},
            "status": {"containerStatuses": [{"name": "c", "image": "i", "imageID": "",
                "ready": true, "restartCount": 0, "containerID": "process://42"}]}
        }))
        .unwrap();
        assert_eq!(pid_of(&pod).unwrap(), 42);
        let none = pid_of(&Pod::default()).unwrap_err().to_string();
        assert!(none.contains("no process"), "{none}");
    }

    #[test]
    fn this_process_is_alive_and_started_in_the_past() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(process_start(me).is_some_and(|t| t <= SystemTime::now()));
        assert_eq!(proc_state(u32::MAX), None);
    }
}
