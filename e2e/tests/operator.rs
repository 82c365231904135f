//! The operator against the local control plane: the CRD refuses bad manifests, a job gets its
//! GPU pods and its ring, a lost worker is replaced at a new generation and counted once, and a
//! restarted operator creates no duplicates. Workers run `diphoma-probe` (they only need to live).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::cluster::ControlPlane;
use diphoma_e2e::kubelet::Kubelet;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJob, Phase};
use diphoma_worker::contract::{MEMBERSHIP_KEY, Membership};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::rbac::v1::Role;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, ResourceExt};
use tokio::sync::oneshot;

struct Ctx {
    client: Client,
    kubelet: Kubelet,
    cp: ControlPlane,
    operator: Mutex<Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>>,
}

impl Ctx {
    fn start_operator(&self) {
        let (tx, rx) = oneshot::channel::<()>();
        let client = self.client.clone();
        let opts = diphoma_operator::controller::Options::default();
        let task = tokio::spawn(async move {
            let stop = async move {
                let _ = rx.await;
            };
            if let Err(e) = diphoma_operator::controller::run(client, opts, stop).await {
                panic!("operator: {e}");
            }
        });
        *self.operator.lock().unwrap() = Some((tx, task));
    }

    async fn stop_operator(&self) {
        let running = self.operator.lock().unwrap().take();
        if let Some((tx, task)) = running {
            let _ = tx.send(());
            let _ = task.await;
        }
    }
}

fn main() -> Result<()> {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args = sequential_args();
    let rt = runtime()?;
    let cp = ControlPlane::start()?;
    let crd = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/diphomajob.yaml");
    let out = cp.kubectl().args(["apply", "-f"]).arg(&crd).output()?;
    ensure!(
        out.status.success(),
        "installing the CRD: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cp
        .kubectl()
        .args([
            "wait",
            "--for=condition=Established",
            "crd/diphomajobs.diphoma.io",
            "--timeout=60s",
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "CRD not established: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ctx = rt.block_on(async {
        let client = cp.client().await?;
        let nodes = (0..3)
            .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 8))
            .collect();
        let kubelet = start_kubelet(&cp, &client, nodes).await?;
        let ctx = Arc::new(Ctx {
            client,
            kubelet,
            cp,
            operator: Mutex::new(None),
        });
        ctx.start_operator();
        anyhow::Ok(ctx)
    })?;
    let list = tests![
        invalid_manifests_are_refused_with_the_field_named,
        job_gets_gpu_pods_children_and_a_ring,
        lost_workers_are_replaced_at_a_new_generation_and_counted_once,
        restarted_operator_creates_no_duplicates,
        kubectl_scale_resizes_the_ring_without_counting_failures,
        a_silent_worker_blamed_by_its_neighbours_is_replaced,
        a_training_job_survives_a_killed_worker_and_succeeds,
        two_replicas_elect_one_leader_that_serves_metrics,
        node_loss_is_detected_from_its_lease_and_workers_move,
    ];
    let trials = trials(&rt, &ctx, |c: &Ctx| &c.client, list);
    let conclusion = libtest_mimic::run(&args, trials);
    let ctx = Arc::into_inner(ctx).context("tests still hold the context")?;
    let Ctx {
        kubelet,
        cp,
        operator,
        ..
    } = ctx;
    rt.block_on(async {
        if let Some((tx, task)) = operator.into_inner().unwrap() {
            let _ = tx.send(());
            let _ = task.await;
        }
        kubelet.shutdown().await;
    });
    drop(cp);
    conclusion.exit()
}

fn job_yaml(name: &str, replicas: i32, extra: &str) -> String {
    format!(
        "apiVersion: diphoma.io/v1alpha1\nkind: DiphomaJob\nmetadata:\n  name: {name}\nspec:\n  replicas: {replicas}\n  gpusPerWorker: 2\n{extra}  template:\n    spec:\n      terminationGracePeriodSeconds: 2\n      containers:\n      - name: worker\n        image: diphoma-probe:dev\n        args: [--sleep, \"3600\"]\n"
    )
}

/// Applies a job manifest and waits for its first ring of `size` workers.
async fn start_job(ctx: &Ctx, ns: &str, yaml: &str, name: &str, size: usize) -> Result<Membership> {
    let out = kubectl_apply(ctx, ns, yaml)?;
    ensure!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    running_ring(ctx, ns, name, size, 0).await
}

fn kubectl_apply(ctx: &Ctx, ns: &str, yaml: &str) -> Result<std::process::Output> {
    use std::io::Write;
    let mut child = ctx
        .cp
        .kubectl()
        .args(["-n", ns, "apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().unwrap().write_all(yaml.as_bytes())?;
    Ok(child.wait_with_output()?)
}

async fn ring(client: &Client, ns: &str, job: &str) -> Result<Option<Membership>> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(&format!("{job}-ring"))
        .await?;
    Ok(
        match cm
            .and_then(|c| c.data)
            .and_then(|d| d.get(MEMBERSHIP_KEY).cloned())
        {
            Some(json) => Some(Membership::parse(&json)?),
            None => None,
        },
    )
}

async fn job_status(client: &Client, ns: &str, name: &str) -> Result<DiphomaJob> {
    Ok(Api::<DiphomaJob>::namespaced(client.clone(), ns)
        .get(name)
        .await?)
}

fn phase_of(j: &DiphomaJob) -> Option<Phase> {
    j.status.as_ref().and_then(|s| s.phase)
}

/// Waits for the job to run with a ring of `size` at a generation above `after`; returns it.
async fn running_ring(
    ctx: &Ctx,
    ns: &str,
    job: &str,
    size: usize,
    after: u64,
) -> Result<Membership> {
    let mut found = None;
    let mut last = None;
    let waited = eventually(
        90,
        &format!("{job} Running with a ring of {size} after generation {after}"),
        async || {
            let j = job_status(&ctx.client, ns, job).await?;
            found = ring(&ctx.client, ns, job).await?;
            let done = phase_of(&j) == Some(Phase::Running)
                && found
                    .as_ref()
                    .is_some_and(|r| r.members.len() == size && r.generation > after);
            last = j.status;
            Ok(done)
        },
    )
    .await;
    if let Err(e) = waited {
        let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
            .list(&ListParams::default())
            .await?
            .items;
        let states: Vec<String> = pods
            .iter()
            .map(|p| {
                let st = p.status.clone().unwrap_or_default();
                let waiting = st
                    .container_statuses
                    .iter()
                    .flatten()
                    .find_map(|c| c.state.clone()?.waiting);
                format!(
                    "{} {:?} on {:?}: {:?}",
                    p.name_any(),
                    st.phase,
                    p.spec.as_ref().and_then(|s| s.node_name.clone()),
                    waiting.map(|w| (w.reason, w.message))
                )
            })
            .collect();
        return Err(e.context(format!(
            "last status: {}; pods: {states:#?}",
            serde_json::to_string(&last).unwrap_or_default()
        )));
    }
    Ok(found.unwrap())
}

async fn invalid_manifests_are_refused_with_the_field_named(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let cases = [
        ("below-min", job_yaml("below-min", 1, "  elastic: {minReplicas: 2, maxReplicas: 4}\n"), "spec.replicas"),
        ("negative-gpus", job_yaml("negative-gpus", 2, "").replace("gpusPerWorker: 2", "gpusPerWorker: -1"), "spec.gpusPerWorker"),
        ("bad-port", job_yaml("bad-port", 2, "  ringPort: 80\n"), "spec.ringPort"),
        ("no-template", "apiVersion: diphoma.io/v1alpha1\nkind: DiphomaJob\nmetadata: {name: no-template}\nspec: {replicas: 2}\n".to_owned(), "spec.template"),
    ];
    for (name, yaml, field) in cases {
        let out = kubectl_apply(&ctx, &ns, &yaml)?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{name} was accepted");
        ensure!(
            err.contains(field),
            "{name}: the error does not name {field}: {err}"
        );
    }
    let jobs = Api::<DiphomaJob>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    ensure!(
        jobs.items.is_empty() && pods.items.is_empty(),
        "something was created"
    );
    Ok(())
}

async fn job_gets_gpu_pods_children_and_a_ring(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let m = start_job(&ctx, &ns, &job_yaml("train", 3, ""), "train", 3).await?;
    ensure!(
        m.generation == 1,
        "first ring is generation {}",
        m.generation
    );
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default().labels("diphoma.io/job-name=train"))
        .await?
        .items;
    ensure!(pods.len() == 3, "{} pods", pods.len());
    for p in &pods {
        let limits = p.spec.as_ref().unwrap().containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.clone())
            .unwrap_or_default();
        ensure!(
            limits.get("nvidia.com/gpu").map(|q| q.0.as_str()) == Some("2"),
            "{} has GPU limits {limits:?}",
            p.name_any()
        );
        let ip = p
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        let member = m
            .members
            .iter()
            .find(|x| x.pod == p.name_any())
            .context("pod not in the ring")?;
        ensure!(
            member.address.to_string() == ip && member.port == 29500,
            "member {member:?} vs pod IP {ip}"
        );
    }
    Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns)
        .get("train-heartbeat")
        .await
        .context("no heartbeat ConfigMap")?;
    Api::<Secret>::namespaced(ctx.client.clone(), &ns)
        .get("train-key")
        .await?;
    Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .get("train")
        .await?;
    let role = Api::<Role>::namespaced(ctx.client.clone(), &ns)
        .get("train-worker")
        .await?;
    ensure!(
        role.rules
            .unwrap_or_default()
            .iter()
            .all(|r| r.resource_names.is_some()),
        "the workers' Role is not limited by resourceNames"
    );
    let j = job_status(&ctx.client, &ns, "train").await?;
    let st = j.status.unwrap();
    ensure!(st.ready.as_deref() == Some("3/3") && st.ring.map(|r| r.generation) == Some(1));
    let out = ctx
        .cp
        .kubectl()
        .args(["-n", &ns, "get", "dpj", "train"])
        .output()?;
    let table = String::from_utf8_lossy(&out.stdout);
    ensure!(
        table.contains("Running") && table.contains("3/3"),
        "printer columns: {table}"
    );
    Ok(())
}

async fn lost_workers_are_replaced_at_a_new_generation_and_counted_once(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let g1 = start_job(&ctx, &ns, &job_yaml("train", 3, ""), "train", 3).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);

    // kubectl delete: PodDeleted.
    pods.delete("train-worker-1", &DeleteParams::default())
        .await?;
    let g2 = running_ring(&ctx, &ns, "train", 3, g1.generation).await?;
    ensure!(
        g2.members.iter().any(|m| m.pod == "train-worker-1-1"),
        "no replacement in {g2:?}"
    );

    // kill -9 of a worker's process: ProcessExit with 137.
    let victim = pods.get("train-worker-2").await?;
    let pid = pid_of(&victim)?;
    signal(pid, libc::SIGKILL);
    let g3 = running_ring(&ctx, &ns, "train", 3, g2.generation).await?;
    ensure!(
        g3.members.iter().any(|m| m.pod == "train-worker-2-1"),
        "no replacement in {g3:?}"
    );

    let st = job_status(&ctx.client, &ns, "train").await?.status.unwrap();
    ensure!(st.repairs.total == 2, "repairs {:?}", st.repairs);
    ensure!(
        st.repairs.by_cause.get("PodDeleted") == Some(&1)
            && st.repairs.by_cause.get("ProcessExit") == Some(&1),
        "{:?}",
        st.repairs
    );
    let last = st.last_failure.context("no lastFailure")?;
    ensure!(
        last.pod == "train-worker-2" && last.exit_code == Some(137),
        "{last:?}"
    );
    // Counted once: a few more reconciles change nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = job_status(&ctx.client, &ns, "train").await?.status.unwrap();
    ensure!(
        again.failures.total == 2 && again.repairs.total == 2,
        "counted again: {:?}",
        again.failures
    );
    Ok(())
}

async fn restarted_operator_creates_no_duplicates(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let before = start_job(&ctx, &ns, &job_yaml("train", 3, ""), "train", 3).await?;
    ctx.stop_operator().await;
    ctx.start_operator();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default().labels("diphoma.io/job-name=train"))
        .await?
        .items;
    let mut names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    names.sort();
    ensure!(
        names == ["train-worker-0", "train-worker-1", "train-worker-2"],
        "pods after the restart: {names:?}"
    );
    let after = ring(&ctx.client, &ns, "train")
        .await?
        .context("ring gone")?;
    ensure!(
        after == before,
        "the ring changed across the restart: {before:?} -> {after:?}"
    );
    Ok(())
}

async fn a_silent_worker_blamed_by_its_neighbours_is_replaced(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let ft = "  faultTolerance: {detectionSeconds: 4}\n";
    let g1 = start_job(&ctx, &ns, &job_yaml("train", 3, ft), "train", 3).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let pid = pid_of(&pods.get("train-worker-1").await?)?;
    signal(pid, libc::SIGSTOP);
    // What ranks 0 and 2 write when their collective times out on the frozen rank 1.
    let now = jiff::Timestamp::now().to_string();
    let report = |reporter: &str| {
        serde_json::json!({"generation": g1.generation, "reporter": reporter, "suspect": "train-worker-1", "error": "Timeout", "time": now}).to_string()
    };
    // The operator created the heartbeat object; workers patch their reports into it.
    let reports = serde_json::json!({"data": {
        "report.train-worker-0": report("train-worker-0"),
        "report.train-worker-2": report("train-worker-2"),
    }});
    Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns)
        .patch(
            "train-heartbeat",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&reports),
        )
        .await?;
    let g2 = running_ring(&ctx, &ns, "train", 3, g1.generation).await?;
    ensure!(
        g2.members.iter().any(|m| m.pod == "train-worker-1-1"),
        "no replacement in {g2:?}"
    );
    let st = job_status(&ctx.client, &ns, "train").await?.status.unwrap();
    ensure!(
        st.repairs.by_cause.get("Hung") == Some(&1) && st.repairs.total == 1,
        "{:?}",
        st.repairs
    );
    eventually(30, "the frozen process gone", async || Ok(!alive(pid))).await?;
    Ok(())
}

async fn node_loss_is_detected_from_its_lease_and_workers_move(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let ft = "  faultTolerance: {detectionSeconds: 4}\n";
    let g1 = start_job(&ctx, &ns, &job_yaml("train", 3, ft), "train", 3).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let node = pods
        .get("train-worker-0")
        .await?
        .spec
        .and_then(|s| s.node_name)
        .context("unbound")?;
    let on_node: Vec<String> = pods
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str()))
        .map(|p| p.name_any())
        .collect();
    ctx.kubelet
        .fail_node(&node, diphoma_e2e::kubelet::FailMode::Freeze)?;
    let g2 = running_ring(&ctx, &ns, "train", 3, g1.generation).await?;
    let now = pods.list(&ListParams::default()).await?.items;
    for m in &g2.members {
        let p = now
            .iter()
            .find(|p| p.name_any() == m.pod)
            .context("member pod missing")?;
        ensure!(
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(node.as_str()),
            "{} still on the lost node",
            m.pod
        );
    }
    let st = job_status(&ctx.client, &ns, "train").await?.status.unwrap();
    ensure!(
        st.repairs.by_cause.get("NodeLost") == Some(&(on_node.len() as i32)),
        "{:?} for {on_node:?}",
        st.repairs
    );
    Ok(())
}

/// `GET http://addr/path` on loopback; returns (status line, body).
async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    Ok((
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    ))
}

fn free_addr() -> Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

async fn two_replicas_elect_one_leader_that_serves_metrics(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    use diphoma_operator::controller::{LeaderElection, Options, run};
    ctx.stop_operator().await;
    let mut replicas = vec![];
    for id in ["replica-a", "replica-b"] {
        let addr = free_addr()?;
        let opts = Options {
            metrics_addr: Some(addr),
            leader_election: Some(LeaderElection {
                namespace: ns.clone(),
                lease_name: "diphoma-operator".into(),
                identity: id.into(),
            }),
            ..Default::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        let client = ctx.client.clone();
        let task = tokio::spawn(async move {
            run(client, opts, async move {
                let _ = rx.await;
            })
            .await
        });
        replicas.push((addr, tx, task));
    }
    let result = async {
        let out = kubectl_apply(&ctx, &ns, &job_yaml("train", 2, ""))?;
        ensure!(
            out.status.success(),
            "apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        running_ring(&ctx, &ns, "train", 2, 0).await?;
        let mut leaders = 0;
        for (addr, _, _) in &replicas {
            let (status, body) = http_get(*addr, "/metrics").await?;
            ensure!(status.contains("200"), "{status}");
            if body.lines().any(|l| l == "diphoma_operator_leader 1") {
                leaders += 1;
                ensure!(
                    body.lines()
                        .any(|l| l == "diphoma_operator_ring_generations_total 1"),
                    "the leader published the ring:\n{body}"
                );
                ensure!(
                    body.contains("diphoma_operator_jobs{phase=\"Running\"}"),
                    "{body}"
                );
                ensure!(http_get(*addr, "/readyz").await?.0.contains("200"));
            } else {
                ensure!(
                    http_get(*addr, "/readyz").await?.0.contains("503"),
                    "a waiting replica is not ready"
                );
            }
            ensure!(http_get(*addr, "/healthz").await?.0.contains("200"));
        }
        ensure!(leaders == 1, "{leaders} leaders");
        Ok(())
    }
    .await;
    for (_, tx, task) in replicas {
        let _ = tx.send(());
        let _ = task.await;
    }
    ctx.start_operator();
    result
}

async fn a_training_job_survives_a_killed_worker_and_succeeds(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let yaml = job_yaml("digits", 3, "  faultTolerance: {detectionSeconds: 5}\n")
        .replace("image: diphoma-probe:dev", "image: diphoma-worker:dev")
        .replace(
            "args: [--sleep, \"3600\"]",
            "args: [train, --steps, \"2500\", --log-every, \"500\"]",
        );
    let g1 = start_job(&ctx, &ns, &yaml, "digits", 3).await?;
    eventually(60, "progress reported by rank 0", async || {
        Ok(job_status(&ctx.client, &ns, "digits")
            .await?
            .status
            .and_then(|s| s.progress)
            .is_some_and(|p| p.step > 0))
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let survivor = pid_of(&pods.get("digits-worker-0").await?)?;
    let victim = pid_of(&pods.get("digits-worker-1").await?)?;
    signal(victim, libc::SIGKILL);
    eventually(60, "the ring re-formed", async || {
        Ok(ring(&ctx.client, &ns, "digits")
            .await?
            .is_some_and(|r| r.generation > g1.generation))
    })
    .await?;
    let mut done = None;
    eventually(180, "digits Succeeded", async || {
        done = job_status(&ctx.client, &ns, "digits").await?.status;
        Ok(done.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded))
    })
    .await?;
    let st = done.unwrap();
    ensure!(
        st.repairs.total == 1 && st.repairs.by_cause.get("ProcessExit") == Some(&1),
        "{:?}",
        st.repairs
    );
    ensure!(
        st.progress.as_ref().map(|p| p.step) == Some(2500),
        "{:?}",
        st.progress
    );
    let w0 = pods.get("digits-worker-0").await?;
    let exit = w0
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c[0].state.clone())
        .and_then(|s| s.terminated)
        .map(|t| t.exit_code);
    ensure!(exit == Some(0), "worker 0 ended with {exit:?}");
    let log = std::fs::read_to_string(ctx.kubelet.log_file(&w0, "worker"))?;
    ensure!(
        log.matches("test accuracy").count() == 1,
        "worker 0 restarted or never finished:\n{log}"
    );
    let acc: f64 = log
        .lines()
        .find_map(|l| {
            l.strip_prefix("test accuracy ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .context("no accuracy")?;
    ensure!(acc >= 0.95, "test accuracy {acc}");
    ensure!(!alive(survivor) && !alive(victim), "processes left");
    Ok(())
}

async fn kubectl_scale_resizes_the_ring_without_counting_failures(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let elastic = "  elastic: {minReplicas: 2, maxReplicas: 4}\n";
    let g1 = start_job(&ctx, &ns, &job_yaml("train", 3, elastic), "train", 3).await?;
    let scale = |n: &str| {
        ctx.cp
            .kubectl()
            .args([
                "-n",
                &ns,
                "scale",
                "dpj",
                "train",
                &format!("--replicas={n}"),
            ])
            .output()
    };
    let out = scale("2")?;
    ensure!(
        out.status.success(),
        "kubectl scale: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g2 = running_ring(&ctx, &ns, "train", 2, g1.generation).await?;
    let out = scale("4")?;
    ensure!(
        out.status.success(),
        "kubectl scale: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g3 = running_ring(&ctx, &ns, "train", 4, g2.generation).await?;
    let survivors: Vec<&str> = g3.members.iter().map(|m| m.pod.as_str()).collect();
    ensure!(
        survivors.contains(&"train-worker-0") && survivors.contains(&"train-worker-1"),
        "{survivors:?}"
    );
    let st = job_status(&ctx.client, &ns, "train").await?.status.unwrap();
    ensure!(
        st.failures.total == 0 && st.repairs.total == 0,
        "scaling was counted: {:?} {:?}",
        st.failures,
        st.repairs
    );
    let out = scale("5")?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("spec.replicas"),
        "scaling past maxReplicas was accepted"
    );
    Ok(())
}
