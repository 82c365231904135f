//! Shared by the e2e test binaries: one control plane and one process kubelet per binary,
//! pod builders and waits.
#![allow(dead_code, missing_docs)]

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use diphoma_e2e::cluster::{ControlPlane, TempNamespace};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::{Kubelet, KubeletConfig};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::runtime::wait::await_condition;
use kube::{Api, Client};
use libtest_mimic::{Arguments, Failed, Trial};

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

/// Sends `sig` to a pod process (one this test's kubelet started, by its recorded pid).
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, sig) };
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

/// One e2e test: takes the binary's shared context and a fresh namespace.
pub type TestFn<C> = fn(Arc<C>, String) -> Pin<Box<dyn Future<Output = Result<()>>>>;

/// `tests![a, b]`: the named async test functions as `(name, TestFn)` pairs.
#[macro_export]
macro_rules! tests {
    ($($name:ident),* $(,)?) => { vec![$((stringify!($name), (|c, ns| Box::pin($name(c, ns))) as $crate::common::TestFn<_>)),*] };
}

/// The command-line arguments, tests forced to run one at a time (they share one cluster).
pub fn sequential_args() -> Arguments {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    args
}

/// A multi-thread runtime for the whole test binary.
pub fn runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    Ok(Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    ))
}

/// Each test as a libtest-mimic trial: run on `rt` in a temp namespace (deleted afterwards),
/// bounded by 240 s, its error chain as the failure message.
pub fn trials<C: Send + Sync + 'static>(
    rt: &Arc<tokio::runtime::Runtime>,
    ctx: &Arc<C>,
    client: fn(&C) -> &Client,
    list: Vec<(&'static str, TestFn<C>)>,
) -> Vec<Trial> {
    list.into_iter()
        .map(|(name, f)| {
            let (rt, ctx) = (rt.clone(), ctx.clone());
            Trial::test(name, move || {
                let prefix: String = name.chars().take(20).collect::<String>().replace('_', "-");
                rt.block_on(async {
                    let ns = TempNamespace::create(client(&ctx), &prefix).await?;
                    let r = tokio::time::timeout(
                        Duration::from_secs(240),
                        f(ctx.clone(), ns.name.clone()),
                    )
                    .await;
                    let _ = ns.delete().await;
                    r.map_err(|_| anyhow::anyhow!("timed out after 240 s"))?
                })
                .map_err(|e| Failed::from(format!("{e:#}")))
            })
        })
        .collect()
}
