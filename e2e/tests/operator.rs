//! The operator against the local control plane: the CRD refuses bad manifests, a job gets its
//! GPU pods and its ring, a lost worker is replaced at a new generation and counted once, and a
//! restarted operator creates no duplicates. Workers run `diphoma-probe` (they only need to live).

mod common;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::cluster::http_get;
use diphoma_e2e::kit::{JobManifest, alive, free_addr, pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJob, Phase};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::rbac::v1::Role;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;

fn main() -> Result<()> {
    let nodes = (0..3)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 8))
        .collect();
    run_tests(
        nodes,
        OperatorMode::InProcess,
        tests![
            invalid_manifests_are_refused_with_the_field_named,
            job_gets_gpu_pods_children_and_a_ring,
            lost_workers_are_replaced_at_a_new_generation_and_counted_once,
            restarted_operator_creates_no_duplicates,
            kubectl_scale_resizes_the_ring_without_counting_failures,
            a_silent_worker_blamed_by_its_neighbours_is_replaced,
            a_training_job_survives_a_killed_worker_and_succeeds,
            the_kubectl_plugin_shows_the_ring_logs_why_and_top_of_a_repaired_job,
            two_replicas_elect_one_leader_that_serves_metrics,
            node_loss_is_detected_from_its_lease_and_workers_move,
        ],
    )
}

/// `replicas` probe workers with 2 GPUs each and a 2 s grace period.
fn probe_job(name: &str, replicas: i32) -> JobManifest {
    JobManifest {
        gpus_per_worker: 2,
        grace_seconds: 2,
        ..JobManifest::probe(name, replicas)
    }
}

/// [`probe_job`] with `faultTolerance.detectionSeconds: 4`.
fn detecting_job(name: &str, replicas: i32) -> JobManifest {
    JobManifest {
        detection_seconds: Some(4),
        ..probe_job(name, replicas)
    }
}

async fn invalid_manifests_are_refused_with_the_field_named(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let with = |name: &str, replicas, extra| JobManifest {
        extra,
        ..probe_job(name, replicas)
    };
    let cases = [
        (
            "below-min",
            with("below-min", 1, json!({"spec": {"elastic": {"minReplicas": 2, "maxReplicas": 4}}}))
                .to_string(),
            "spec.replicas",
        ),
        (
            "negative-gpus",
            JobManifest {
                gpus_per_worker: -1,
                ..probe_job("negative-gpus", 2)
            }
            .to_string(),
            "spec.gpusPerWorker",
        ),
        (
            "bad-port",
            with("bad-port", 2, json!({"spec": {"ringPort": 80}})).to_string(),
            "spec.ringPort",
        ),
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
    let m = start_job(&ctx, &ns, &probe_job("train", 3), 3).await?;
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
    let g1 = start_job(&ctx, &ns, &probe_job("train", 3), 3).await?;
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
    // Counted once: a further reconcile changes nothing.
    let again = reconciled(&ctx.client, &ns, "train").await?;
    ensure!(
        again.failures.total == 2 && again.repairs.total == 2,
        "counted again: {:?}",
        again.failures
    );
    Ok(())
}

/// The operator stops; meanwhile the job's spec generation moves, which only a reconcile can
/// acknowledge (`status.observedGeneration`). The restarted operator must acknowledge it (it did
/// reconcile), and a second acknowledged change proves that reconcile finished: the same pods and
/// the same ring as before.
async fn restarted_operator_creates_no_duplicates(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let before = start_job(&ctx, &ns, &probe_job("train", 3), 3).await?;
    ctx.stop_operator().await;
    let unseen = touch_spec(&ctx.client, &ns, "train").await?;
    ctx.start_operator();
    observed(&ctx.client, &ns, "train", unseen)
        .await
        .context("the restarted operator never reconciled")?;
    // Reconciles of one job never overlap: once a later change is acknowledged, whatever the
    // first reconcile after the restart created exists.
    reconciled(&ctx.client, &ns, "train").await?;
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
    let g1 = start_job(&ctx, &ns, &detecting_job("train", 3), 3).await?;
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
    let g1 = start_job(&ctx, &ns, &detecting_job("train", 3), 3).await?;
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

async fn two_replicas_elect_one_leader_that_serves_metrics(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    use diphoma_operator::controller::{LeaderElection, Options, run};
    ctx.stop_operator().await;
    let mut replicas = vec![];
    for id in ["replica-a", "replica-b"] {
        let addr = free_addr()?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let opts = Options {
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
            run(client, opts, Some(listener), async move {
                let _ = rx.await;
            })
            .await
        });
        replicas.push((addr, tx, task));
    }
    let result = async {
        let out = kubectl_apply(&ctx, &ns, &probe_job("train", 2).to_string())?;
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
            }
            // Leader or standby, each is ready (a Deployment of two must roll out).
            ensure!(http_get(*addr, "/readyz").await?.0.contains("200"));
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
    let job = JobManifest {
        gpus_per_worker: 2,
        grace_seconds: 2,
        detection_seconds: Some(5),
        ..JobManifest::training("digits", 3, 2500, 500)
    };
    let g1 = start_job(&ctx, &ns, &job, 3).await?;
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
    let log = ctx.kubelet.log_text(&w0, "worker")?;
    ensure!(
        log.matches("test accuracy").count() == 1,
        "worker 0 restarted or never finished:\n{log}"
    );
    let acc = accuracy(&log).0.context("no accuracy")?;
    ensure!(acc >= 0.95, "test accuracy {acc}");
    ensure!(!alive(survivor) && !alive(victim), "processes left");
    Ok(())
}

/// `kubectl diphoma ARGS` (kubectl finds the plugin on `PATH`); its output.
fn plugin(ctx: &Ctx, args: &[&str]) -> Result<std::process::Output> {
    let exe = bin_dir().join("kubectl-diphoma");
    ensure!(
        exe.exists(),
        "{} missing: cargo build -p kubectl-diphoma",
        exe.display()
    );
    let path = std::env::join_paths(std::iter::once(bin_dir()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    Ok(ctx
        .cp
        .kubectl()
        .arg("diphoma")
        .args(args)
        .env("PATH", path)
        .output()?)
}

/// [`plugin`]'s stdout, or an error with its stderr.
fn plugin_ok(ctx: &Ctx, args: &[&str]) -> Result<String> {
    let out = plugin(ctx, args)?;
    ensure!(
        out.status.success(),
        "kubectl diphoma {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The plugin on a training job after a `kill -9` and its repair: `ring` (every member, its
/// node and step), `logs --rank` (plain and `-f`), `why` (the failure and the repair in words),
/// `top` (samples/s and allreduce share per rank); exit codes for a missing job and no cluster.
async fn the_kubectl_plugin_shows_the_ring_logs_why_and_top_of_a_repaired_job(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    let job = JobManifest {
        gpus_per_worker: 2,
        grace_seconds: 2,
        detection_seconds: Some(5),
        // long enough to still be training when the plugin looks
        ..JobManifest::training("plugged", 3, 1_000_000, 20)
    };
    let g1 = start_job(&ctx, &ns, &job, 3).await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    signal(pid_of(&pods.get("plugged-worker-1").await?)?, libc::SIGKILL);
    let ring = running_ring(&ctx, &ns, "plugged", 3, g1.generation).await?;

    let mut out = String::new();
    eventually(60, "every rank ready and rank 0 with a step", async || {
        out = plugin_ok(&ctx, &["ring", "plugged", "-n", &ns])?;
        let rows: Vec<Vec<&str>> = out
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        Ok(rows.len() == 3
            && rows.iter().all(|r| r[4] == "true")
            && rows[0][5].parse::<u64>().is_ok())
    })
    .await
    .with_context(|| out.clone())?;
    let lines: Vec<&str> = out.lines().collect();
    let generation: u64 = lines[0]
        .strip_prefix("generation ")
        .context("no generation")?
        .parse()?;
    ensure!(generation >= ring.generation, "{out}");
    for (row, member) in lines[2..].iter().zip(&ring.members) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        ensure!(
            cells[0] == member.rank.to_string() && cells[1] == member.pod,
            "{out}"
        );
        ensure!(
            cells[2].starts_with("gpu-") && cells[3].ends_with(":29500"),
            "{out}"
        );
    }

    let logs = plugin_ok(
        &ctx,
        &["logs", "plugged", "--rank", "0", "--tail", "3", "-n", &ns],
    )?;
    ensure!(
        logs.lines().count() == 3 && logs.contains("step "),
        "{logs}"
    );
    let mut follow = tokio::process::Command::from(ctx.cp.kubectl());
    let path = std::env::join_paths(std::iter::once(bin_dir()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    follow.args([
        "diphoma", "logs", "plugged", "--rank", "0", "-f", "--tail", "0", "-n", &ns,
    ]);
    let mut child = follow
        .env("PATH", path)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().context("no stdout")?).lines();
    // The deadline only guards against a hang: rank 0 logs every 20 steps.
    let line = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_line())
        .await
        .context("no line from logs -f in 60 s")??;
    child.start_kill()?;
    child.wait().await?;
    ensure!(
        line.as_deref().is_some_and(|l| l.starts_with("step ")),
        "{line:?}"
    );

    let why = plugin_ok(&ctx, &["why", "plugged", "-n", &ns])?;
    for want in [
        "phase: Running",
        "last failure: pod plugged-worker-1 (rank 1) lost by ProcessExit",
        "repaired 1 time(s): ProcessExit 1",
        "RingReformed",
    ] {
        ensure!(why.contains(want), "{want:?} missing in:\n{why}");
    }
    ensure!(
        !why.contains("FailedToUpdateEndpoint"),
        "the Service's events are not the job's:\n{why}"
    );

    let top = plugin_ok(&ctx, &["top", "plugged", "--interval", "1", "-n", &ns])?;
    let rows: Vec<Vec<&str>> = top
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .collect();
    ensure!(rows.len() == 3, "{top}");
    for r in &rows {
        ensure!(
            r[2].parse::<f64>().is_ok_and(|s| s > 0.0),
            "samples/s: {top}"
        );
        ensure!(r[5].ends_with('%'), "allreduce share: {top}");
    }

    let missing = plugin(&ctx, &["why", "nope", "-n", &ns])?;
    let err = String::from_utf8_lossy(&missing.stderr);
    ensure!(
        missing.status.code() == Some(1)
            && err.contains(&format!("diphomajob {ns}/nope not found")),
        "{err}"
    );

    let dir = ctx.cp.dir.join(format!("plugin-{ns}"));
    std::fs::create_dir_all(&dir)?;
    let unreachable = dir.join("unreachable.kubeconfig");
    let port = free_addr()?.port();
    let kc = std::fs::read_to_string(&ctx.cp.kubeconfig)?;
    let server = kc
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .context("no server")?;
    std::fs::write(
        &unreachable,
        kc.replace(server, &format!("https://127.0.0.1:{port}")),
    )?;
    for (kubeconfig, says) in [
        (dir.join("none"), "no usable kubeconfig"),
        (unreachable, "cannot be reached"),
    ] {
        let out = std::process::Command::new(bin_dir().join("kubectl-diphoma"))
            .args(["ring", "plugged", "-n", &ns])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", &dir)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.code() == Some(3) && err.contains("no cluster") && err.contains(says),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

async fn kubectl_scale_resizes_the_ring_without_counting_failures(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let elastic = JobManifest {
        extra: json!({"spec": {"elastic": {"minReplicas": 2, "maxReplicas": 4}}}),
        ..probe_job("train", 3)
    };
    let g1 = start_job(&ctx, &ns, &elastic, 3).await?;
    let scale = |n: &str| {
        run_ok(ctx.cp.kubectl().args([
            "-n",
            &ns,
            "scale",
            "dpj",
            "train",
            &format!("--replicas={n}"),
        ]))
    };
    scale("2")?;
    let g2 = running_ring(&ctx, &ns, "train", 2, g1.generation).await?;
    scale("4")?;
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
    let refused = scale("5").err().map(|e| format!("{e:#}"));
    ensure!(
        refused.is_some_and(|e| e.contains("spec.replicas")),
        "scaling past maxReplicas was accepted"
    );
    Ok(())
}
