//! Container probes as the kubelet's prober runs them (`pkg/kubelet/prober/worker.go`): an
//! `httpGet` or `tcpSocket` attempt against the pod IP, first after `initialDelaySeconds`, then
//! every `periodSeconds`, each bounded by `timeoutSeconds`; the verdict flips after
//! `successThreshold` (`failureThreshold`) agreeing results in a row. Readiness starts failed,
//! liveness passing. `exec` and `grpc` probes are not supported: they are refused with a message;
//! `httpGet`'s `scheme`, `host` and `httpHeaders` are ignored (plain HTTP to the pod IP).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Which probe of a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `readinessProbe`: gates the container's `ready` and the pod's `Ready` condition.
    Readiness,
    /// `livenessProbe`: a failing verdict gets the container killed (and restarted by policy).
    Liveness,
}

impl Kind {
    /// Both kinds, in the order they are started.
    pub const ALL: [Kind; 2] = [Kind::Readiness, Kind::Liveness];

    /// The verdict before the first result: readiness failed, liveness passing (as the kubelet).
    pub fn initial(self) -> bool {
        self == Kind::Liveness
    }

    /// The container's probe of this kind, if it has one.
    pub fn of(self, c: &Container) -> Option<&Probe> {
        match self {
            Kind::Readiness => c.readiness_probe.as_ref(),
            Kind::Liveness => c.liveness_probe.as_ref(),
        }
    }
}

/// What one attempt does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `GET path` answered with a status in 200..400.
    Http {
        /// Pod IP and port.
        addr: SocketAddr,
        /// Request path.
        path: String,
    },
    /// A TCP connection accepted.
    Tcp(SocketAddr),
}

/// Resolves the probe's action against the pod IP and the container's (named) ports.
///
/// Errors: a message naming the unsupported handler or the port that the container lacks.
pub fn action(p: &Probe, c: &Container, ip: IpAddr) -> Result<Action, String> {
    if let Some(h) = &p.http_get {
        let path = h.path.clone().unwrap_or_else(|| "/".into());
        return Ok(Action::Http {
            addr: SocketAddr::new(ip, port(&h.port, c)?),
            path,
        });
    }
    if let Some(t) = &p.tcp_socket {
        return Ok(Action::Tcp(SocketAddr::new(ip, port(&t.port, c)?)));
    }
    Err(format!(
        "container {}: only httpGet and tcpSocket probes are supported by the process kubelet",
        c.name
    ))
}

fn port(p: &IntOrString, c: &Container) -> Result<u16, String> {
    let n = match p {
        IntOrString::Int(n) => *n,
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .map(|cp| cp.container_port)
            .ok_or_else(|| format!("container {}: probe port {name:?} is not named", c.name))?,
    };
    u16::try_from(n).map_err(|_| format!("container {}: probe port {n} out of range", c.name))
}

/// The current verdict and the run of disagreeing results behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    ok: bool,
    run: i32,
}

impl Verdict {
    /// A verdict that starts at `ok`.
    pub fn new(ok: bool) -> Self {
        Verdict { ok, run: 0 }
    }

    /// Takes one result; returns the new verdict when `successThreshold` successes (or
    /// `failureThreshold` failures, default 3) in a row flip it.
    pub fn observe(&mut self, success: bool, p: &Probe) -> Option<bool> {
        if success == self.ok {
            self.run = 0;
            return None;
        }
        self.run += 1;
        let threshold = if success {
            p.success_threshold.unwrap_or(1)
        } else {
            p.failure_threshold.unwrap_or(3)
        };
        (self.run >= threshold.max(1)).then(|| {
            *self = Verdict::new(success);
            success
        })
    }
}

fn seconds(v: Option<i32>, default: u64) -> Duration {
    Duration::from_secs(v.map_or(default, |s| s.max(0) as u64))
}

/// One attempt, bounded by `timeout`.
pub async fn attempt(a: &Action, timeout: Duration) -> bool {
    let run = async {
        match a {
            Action::Http { addr, path } => crate::cluster::http_get(*addr, path)
                .await
                .ok()
                .and_then(|(line, _)| line.split_whitespace().nth(1)?.parse::<u16>().ok())
                .is_some_and(|code| (200..400).contains(&code)),
            Action::Tcp(addr) => tokio::net::TcpStream::connect(addr).await.is_ok(),
        }
    };
    tokio::time::timeout(timeout, run).await.unwrap_or(false)
}

/// Probes every `periodSeconds` (on a fixed schedule, as the kubelet's ticker) until the task is
/// aborted or `flip`, called with each new verdict, returns false (nobody listens any more).
pub async fn run(a: Action, p: Probe, kind: Kind, mut flip: impl FnMut(bool) -> bool) {
    tokio::time::sleep(seconds(p.initial_delay_seconds, 0)).await;
    let timeout = seconds(p.timeout_seconds, 1);
    let mut tick = tokio::time::interval(seconds(p.period_seconds, 10).max(Duration::from_secs(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut verdict = Verdict::new(kind.initial());
    loop {
        tick.tick().await;
        if let Some(ok) = verdict.observe(attempt(&a, timeout).await, &p)
            && !flip(ok)
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn probe(v: serde_json::Value) -> Probe {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn thresholds_count_results_in_a_row() {
        let p = probe(json!({"successThreshold": 2, "failureThreshold": 2}));
        let mut v = Verdict::new(false);
        assert_eq!(v.observe(true, &p), None);
        assert_eq!(v.observe(false, &p), None, "a failure resets the run");
        assert_eq!(v.observe(true, &p), None);
        assert_eq!(v.observe(true, &p), Some(true));
        assert_eq!(v.observe(true, &p), None);
        assert_eq!(v.observe(false, &p), None);
        assert_eq!(v.observe(false, &p), Some(false));
        let defaults = probe(json!({}));
        let mut live = Verdict::new(Kind::Liveness.initial());
        assert_eq!(live.observe(false, &defaults), None);
        assert_eq!(live.observe(false, &defaults), None);
        assert_eq!(
            live.observe(false, &defaults),
            Some(false),
            "three by default"
        );
    }

    #[test]
    fn named_and_numbered_ports_resolve_against_the_pod_ip() {
        let c: Container = serde_json::from_value(json!({
            "name": "op", "ports": [{"name": "metrics", "containerPort": 8080}]
        }))
        .unwrap();
        let ip: IpAddr = "127.1.0.5".parse().unwrap();
        let http = probe(json!({"httpGet": {"path": "/readyz", "port": "metrics"}}));
        assert_eq!(
            action(&http, &c, ip),
            Ok(Action::Http {
                addr: "127.1.0.5:8080".parse().unwrap(),
                path: "/readyz".into()
            })
        );
        let tcp = probe(json!({"tcpSocket": {"port": 9000}}));
        assert_eq!(
            action(&tcp, &c, ip),
            Ok(Action::Tcp("127.1.0.5:9000".parse().unwrap()))
        );
        let unnamed = probe(json!({"httpGet": {"port": "grpc"}}));
        assert!(action(&unnamed, &c, ip).unwrap_err().contains("\"grpc\""));
        let exec = probe(json!({"exec": {"command": ["true"]}}));
        assert!(
            action(&exec, &c, ip)
                .unwrap_err()
                .contains("httpGet and tcpSocket")
        );
    }
}
