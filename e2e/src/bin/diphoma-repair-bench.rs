//! `diphoma-repair-bench`: ring repair on the local control plane, measured (performance.md §2).
//!
//! Starts a control plane, the process kubelet (one 1-GPU node per worker, plus one per node-loss
//! run and a spare), the operator as its own process, and one elastic 4-worker digits training
//! job (`elastic 2..4`). Then, `--runs` times each:
//! - `kill -9` of a worker (never rank 0): **time-to-repair** = kill → rank 0's `/metrics` shows a
//!   step committed at a newer generation; **join** = the replacement's process start (from
//!   `/proc`) → its own `/metrics` shows a committed step; **repeated steps** = steps rank 0
//!   logged at the old generation and logged again at the new one;
//! - node loss (`FailMode::Freeze` of a worker's node: Lease stopped, processes frozen):
//!   **detection** = failure → the ring ConfigMap publishes a generation without the worker, and
//!   the time until rank 0 trains again.
//!
//! Prints one table: median, min and max over the runs. Not a test: nothing is asserted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use diphoma_contract::{self as contract, Membership};
use diphoma_e2e::cluster::{ControlPlane, TempNamespace, http_get};
use diphoma_e2e::kit::{JobManifest, free_addr, pid_of, process_start, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::{FailMode, Kubelet, KubeletConfig};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::json;

type AnyErr = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser)]
#[command(
    name = "diphoma-repair-bench",
    about = "Time-to-repair, node-loss detection, join time and repeated steps of the ring"
)]
struct Args {
    /// Runs of each fault (the table shows median, min and max).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// `faultTolerance.detectionSeconds` of the job.
    #[arg(long, default_value_t = 4)]
    detection_seconds: u64,
    /// Directory of the workspace binaries (diphoma-operator, diphoma-worker).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
}

const JOB: &str = "repair";
const WORKERS: usize = 4;
const METRICS_PORT: u16 = contract::DEFAULT_METRICS_PORT;

/// The operator process; killed (by its pid) and reaped when dropped.
struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() -> Result<(), AnyErr> {
    let args = Args::parse();
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .ok_or("no binary directory")?
            .to_owned(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    eprintln!("starting the control plane …");
    let cp = ControlPlane::start()?;
    cp.install_crd()?;
    let operator = Operator(
        Command::new(bin_dir.join("diphoma-operator"))
            .args(["run", "--metrics-addr"])
            .arg(free_addr()?.to_string())
            .env("KUBECONFIG", &cp.kubeconfig)
            .env("RUST_LOG", "error")
            .spawn()?,
    );
    let result = rt.block_on(async {
        let client = cp.client().await?;
        let nodes = (0..WORKERS + args.runs + 1)
            .map(|i| NodeConfig::gpu(&format!("node-{i}"), 1))
            .collect();
        let cfg =
            KubeletConfig::from_kubeconfig(&cp.kubeconfig, nodes, &bin_dir, cp.kubelet_root())?;
        let kubelet = Kubelet::start(client.clone(), cfg).await?;
        let ns = TempNamespace::create(&client, "repair-bench").await?;
        let r = bench(&client, &kubelet, &ns.name, &args).await;
        let _ = ns.delete().await;
        kubelet.shutdown().await;
        r
    });
    drop(operator);
    drop(cp);
    let rows = result?;
    print_table(&rows, &args);
    Ok(())
}

/// Samples of each measured quantity.
#[derive(Default)]
struct Rows {
    repair_s: Vec<f64>,
    join_s: Vec<f64>,
    repeated_kill: Vec<f64>,
    node_detect_s: Vec<f64>,
    node_train_s: Vec<f64>,
    repeated_node: Vec<f64>,
}

fn job_manifest(detection: u64) -> JobManifest {
    let mut job = JobManifest {
        detection_seconds: Some(detection),
        grace_seconds: 2,
        extra: json!({"spec": {
            "elastic": {"minReplicas": 2, "maxReplicas": WORKERS},
            "runPolicy": {"backoffLimit": 1000},
        }}),
        ..JobManifest::training(JOB, WORKERS as i32, 100_000_000, 1)
    };
    let op_timeout = (detection as f64 / 4.0).max(0.5);
    job.args
        .extend(["--op-timeout-s".into(), format!("{op_timeout}")]);
    job
}

async fn bench(client: &Client, kubelet: &Kubelet, ns: &str, args: &Args) -> Result<Rows, AnyErr> {
    let gvk = GroupVersionKind::gvk("diphoma.io", "v1alpha1", "DiphomaJob");
    let jobs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk));
    let manifest: DynamicObject =
        serde_json::from_value(job_manifest(args.detection_seconds).build())?;
    jobs.patch(
        JOB,
        &PatchParams::apply("diphoma-repair-bench"),
        &Patch::Apply(&manifest),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let mut rows = Rows::default();
    for fault in ["kill", "node"] {
        for run in 0..args.runs {
            let ring = steady_ring(&cms, &pods, &jobs).await?;
            let rank0 = member_metrics(&pods, &ring.members[0]).await?;
            let victim = ring.members[1 + run % (WORKERS - 1)].clone();
            let victim_pod = pods.get(&victim).await?;
            let rank0_pod = pods.get(&ring.members[0]).await?;
            let t0 = Instant::now();
            match fault {
                "kill" => {
                    signal(pid_of(&victim_pod)?, libc::SIGKILL);
                }
                _ => {
                    let node = victim_pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_name.clone())
                        .ok_or("victim unbound")?;
                    kubelet.fail_node(&node, FailMode::Freeze)?;
                }
            }
            let mut published = None;
            let mut connected_at = None;
            let trained = loop {
                if published.is_none() {
                    let now = read_ring(&cms).await?;
                    if now.generation > ring.generation && !now.members.contains(&victim) {
                        published = Some(t0.elapsed().as_secs_f64());
                    }
                }
                // The gauge shows the new generation once it is connected; a step committed
                // after that is the first completed allreduce in it.
                let (generation, step) = scrape(rank0).await.unwrap_or((0, 0));
                if generation > ring.generation {
                    match connected_at {
                        None => connected_at = Some(step),
                        Some(s) if step > s => break t0.elapsed().as_secs_f64(),
                        Some(_) => {}
                    }
                }
                if t0.elapsed() > Duration::from_secs(120) {
                    return Err(format!("{fault} run {run}: no repair after 120 s").into());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let rank0_log = kubelet.log_text(&rank0_pod, "worker")?;
            let repeated = repeated_steps(&rank0_log, ring.generation)? as f64;
            match fault {
                "kill" => {
                    rows.repair_s.push(trained);
                    rows.repeated_kill.push(repeated);
                    rows.join_s.push(join_time(&pods, &ring.members).await?);
                }
                _ => {
                    let published = loop {
                        if let Some(p) = published {
                            break p;
                        }
                        let now = read_ring(&cms).await?;
                        if now.generation > ring.generation && !now.members.contains(&victim) {
                            published = Some(t0.elapsed().as_secs_f64());
                        }
                        if t0.elapsed() > Duration::from_secs(120) {
                            return Err(format!(
                                "{fault} run {run}: {victim:?} still in the ring after 120 s"
                            )
                            .into());
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    };
                    rows.node_detect_s.push(published);
                    rows.node_train_s.push(trained);
                    rows.repeated_node.push(repeated);
                }
            }
            eprintln!(
                "{fault} run {run}: trained again after {trained:.3} s, {repeated} steps repeated"
            );
        }
    }
    Ok(rows)
}

/// A ring generation as published (only what the benchmark needs).
#[derive(Clone)]
struct Ring {
    generation: u64,
    members: Vec<String>,
}

async fn read_ring(cms: &Api<ConfigMap>) -> Result<Ring, AnyErr> {
    let cm = cms
        .get_opt(&contract::membership_configmap_name(JOB))
        .await?;
    let m = cm
        .and_then(|c| c.data)
        .and_then(|d| d.get(contract::MEMBERSHIP_KEY).cloned())
        .map(|json| Membership::parse(&json))
        .transpose()?;
    Ok(Ring {
        generation: m.as_ref().map_or(0, |m| m.generation),
        members: m
            .into_iter()
            .flat_map(|m| m.members)
            .map(|m| m.pod)
            .collect(),
    })
}

/// Waits until the job runs a full ring whose rank 0 trains; returns the ring.
async fn steady_ring(
    cms: &Api<ConfigMap>,
    pods: &Api<Pod>,
    jobs: &Api<DynamicObject>,
) -> Result<Ring, AnyErr> {
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        let ring = read_ring(cms).await?;
        let job = jobs.get(JOB).await?;
        let phase = job.data["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if ring.members.len() == WORKERS && phase == "Running" {
            let m = member_metrics(pods, &ring.members[0]).await?;
            let first = scrape(m).await.unwrap_or((0, 0));
            // Deliberate: let rank 0 train a little, to see its step move.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let second = scrape(m).await.unwrap_or((0, 0));
            if first.0 == ring.generation && second.1 > first.1 {
                return Ok(ring);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err("the job never ran a full ring".into())
}

async fn member_metrics(pods: &Api<Pod>, name: &str) -> Result<SocketAddr, AnyErr> {
    let ip = pods
        .get(name)
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .ok_or_else(|| format!("{name} has no IP"))?;
    Ok(SocketAddr::new(ip.parse()?, METRICS_PORT))
}

/// (`diphoma_worker_ring_generation`, `diphoma_worker_step`) from a worker's `/metrics`.
async fn scrape(addr: SocketAddr) -> Result<(u64, u64), AnyErr> {
    let (_, body) = http_get(addr, "/metrics").await?;
    let value = |name: &str| {
        body.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0) as u64
    };
    Ok((
        value("diphoma_worker_ring_generation"),
        value("diphoma_worker_step"),
    ))
}

/// Steps rank 0 committed (logged) at generation `old` or before and committed again at a newer
/// generation: `last old step - first new step + 1`, at least 0.
fn repeated_steps(text: &str, old: u64) -> Result<u64, AnyErr> {
    let mut last_old = None;
    let mut first_new = None;
    for l in text.lines() {
        let mut w = l.split_whitespace();
        let (Some("step"), Some(step), Some("generation"), Some(generation)) =
            (w.next(), w.next(), w.next(), w.next())
        else {
            continue;
        };
        let (Ok(step), Ok(generation)) = (step.parse::<u64>(), generation.parse::<u64>()) else {
            continue;
        };
        if generation <= old {
            last_old = Some(step);
        } else if first_new.is_none() {
            first_new = Some(step);
        }
    }
    match (last_old, first_new) {
        (Some(o), Some(n)) => Ok((o + 1).saturating_sub(n)),
        _ => Err(format!("rank 0's log: no steps around generation {old}").into()),
    }
}

/// Waits for the replacement of the lost member (a pod not in `old`) to commit a step; returns
/// the seconds from its process start.
async fn join_time(pods: &Api<Pod>, old: &[String]) -> Result<f64, AnyErr> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut joiner: Option<(SocketAddr, SystemTime)> = None;
    while Instant::now() < deadline {
        match joiner {
            None => {
                let list = pods.list(&Default::default()).await?.items;
                for p in list {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    if old.contains(&name) || p.metadata.deletion_timestamp.is_some() {
                        continue;
                    }
                    if let (Ok(pid), Some(ip)) =
                        (pid_of(&p), p.status.as_ref().and_then(|s| s.pod_ip.clone()))
                        && let Some(start) = process_start(pid)
                    {
                        joiner = Some((SocketAddr::new(ip.parse()?, METRICS_PORT), start));
                    }
                }
            }
            Some((addr, start)) => {
                if let Ok((generation, step)) = scrape(addr).await
                    && generation > 0
                    && step > 0
                {
                    return Ok(SystemTime::now().duration_since(start)?.as_secs_f64());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Err("the replacement never trained".into())
}

fn stats(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

fn print_table(r: &Rows, a: &Args) {
    let d = a.detection_seconds as f64;
    println!(
        "# diphoma-repair-bench: {WORKERS} digits workers (elastic 2..{WORKERS}), detectionSeconds {}, {} runs each",
        a.detection_seconds, a.runs
    );
    println!(
        "# {:<52} {:>9} {:>9} {:>9}  bar (performance.md §2)",
        "measure", "median", "min", "max"
    );
    let rows: [(&str, &[f64], usize, String); 6] = [
        (
            "time-to-repair: kill -9 -> first step at g+1 (s)",
            &r.repair_s,
            3,
            "< 2 s".into(),
        ),
        (
            "join: replacement process start -> its first step (s)",
            &r.join_s,
            3,
            "-".into(),
        ),
        (
            "repeated steps after kill -9",
            &r.repeated_kill,
            1,
            "<= 1 (the one in flight)".into(),
        ),
        (
            "node loss: freeze -> ring published without it (s)",
            &r.node_detect_s,
            3,
            format!("< {} s (detectionSeconds + 2)", d + 2.0),
        ),
        (
            "node loss: freeze -> first step at g+1 (s)",
            &r.node_train_s,
            3,
            "-".into(),
        ),
        (
            "repeated steps after node loss",
            &r.repeated_node,
            1,
            "<= 1 (the one in flight)".into(),
        ),
    ];
    for (name, xs, digits, bar) in rows {
        let (med, min, max) = stats(xs);
        let p = |x: f64| format!("{x:.digits$}");
        println!(
            "  {name:<52} {:>9} {:>9} {:>9}  {bar}",
            p(med),
            p(min),
            p(max)
        );
    }
}
