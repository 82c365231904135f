//! Shared by the e2e test binaries: one control plane and one process kubelet per binary,
//! pod builders and waits.
#![allow(dead_code, missing_docs)]

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use diphoma_e2e::cluster::ControlPlane;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::{Kubelet, KubeletConfig};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::runtime::wait::await_condition;
use kube::{Api, Client};

/// Directory of the workspace binaries (the test binary lives in `target/<profile>/deps`).
pub fn bin_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_BIN_EXE_diphoma-probe"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Starts the process kubelet on `cp` with `nodes`; `diphoma-ghost` maps to a missing binary.
pub async fn start_kubelet(
    cp: &ControlPlane,
    client: &Client,
    nodes: Vec<NodeConfig>,
) -> Result<Kubelet> {
    let mut cfg =
        KubeletConfig::from_kubeconfig(&cp.kubeconfig, nodes, &bin_dir(), cp.kubelet_root())?;
    cfg.images
        .insert("diphoma-ghost", "/nonexistent/diphoma-ghost".into());
    Ok(Kubelet::start(client.clone(), cfg).await?)
}

/// A pod running `diphoma-probe ARGS` with `restartPolicy: Never`, merged with `extra` (a JSON
/// object deep-merged into the pod: e.g. resources, volumes).
pub fn probe_pod(name: &str, args: &[&str], extra: serde_json::Value) -> Pod {
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": "diphoma-probe:dev", "args": args}]
        }
    });
    merge(&mut pod, extra);
    serde_json::from_value(pod).expect("valid pod")
}

/// JSON deep merge; arrays of objects merge element-wise (so `containers[0]` can be extended).
pub fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    use serde_json::Value::{Array, Object};
    match (a, b) {
        (Object(a), Object(b)) => b
            .into_iter()
            .for_each(|(k, v)| merge(a.entry(k).or_insert(serde_json::Value::Null), v)),
        (Array(a), Array(b)) => {
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

pub async fn create(client: &Client, ns: &str, pod: &Pod) -> Result<Pod> {
    Ok(Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), pod)
        .await?)
}

/// Waits (at most `secs`) until `cond` holds for the pod; returns the pod then.
pub async fn wait_pod(
    client: &Client,
    ns: &str,
    name: &str,
    secs: u64,
    what: &str,
    cond: impl Fn(&Pod) -> bool,
) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let found = tokio::time::timeout(
        Duration::from_secs(secs),
        await_condition(api.clone(), name, move |p: Option<&Pod>| {
            p.is_some_and(&cond)
        }),
    )
    .await;
    match found {
        Ok(Ok(Some(p))) => Ok(p),
        Ok(Err(e)) => Err(e.into()),
        _ => {
            let now = api.get_opt(name).await?;
            bail!(
                "pod {ns}/{name}: not {what} after {secs} s; it is: {}",
                serde_json::to_string(&now.and_then(|p| p.status))?
            )
        }
    }
}

pub fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// The pid of the first container from `containerID: process://<pid>`.
pub fn pid_of(p: &Pod) -> Result<u32> {
    let id = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c[0].container_id.clone())
        .context("no containerID")?;
    Ok(id.trim_start_matches("process://").parse()?)
}

/// The state letter of a process (`R`, `S`, `T`, `Z`, …) or `None` when it no longer exists.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    proc_state(pid).is_some_and(|s| s != 'Z')
}

/// Polls `f` every 200 ms for up to `secs` seconds.
pub async fn eventually<F: AsyncFnMut() -> Result<bool>>(
    secs: u64,
    what: &str,
    mut f: F,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("not {what} after {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
