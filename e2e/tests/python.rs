//! PyTorch jobs on the local control plane, under the operator installed by its chart, in the
//! image `diphoma-pytorch` (which this binary's process kubelet runs as the python of the cached
//! torch venv with the freshly built `diphoma` wheel, `python/install.sh`):
//! `manifests/examples/pytorch-digits.yaml` (an elastic DDP script in a ConfigMap) through a
//! kill -9 of a worker, scraped by a real Prometheus that finds every worker up and data for every
//! query of the Training dashboard; an unchanged torchrun script (`python/tests/scripts/torchrun_ddp.py`)
//! under `python -m diphoma.run` through a kill -9, restarted in place in the surviving pods;
//! a rank that raises, its traceback's last line in the job's status; `kubectl diphoma
//! submit` of a script; and pods of two training processes each (`processesPerWorker: 2`)
//! through a kill -9 of one process.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::kit::{pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJobStatus, Phase};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::LogParams;
use serde_json::json;

fn main() -> Result<()> {
    let venv =
        run_ok(std::process::Command::new("bash").arg(repo_root().join("python/install.sh")))
            .context("the torch venv with the diphoma wheel (python/install.sh)")?;
    let python = PathBuf::from(venv.trim()).join("bin/python");
    EXTRA_IMAGES
        .set(vec![("diphoma-pytorch".to_owned(), python)])
        .expect("set once");
    let nodes = (0..2)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 4))
        .collect();
    run_tests(
        nodes,
        OperatorMode::Chart,
        tests![
            the_pytorch_digits_example_survives_a_killed_worker,
            a_torchrun_script_is_restarted_in_place_through_a_killed_worker,
            a_frozen_torchrun_process_is_reported_by_its_peers_and_replaced,
            a_raising_rank_fails_the_job_with_its_traceback_in_last_failure,
            kubectl_diphoma_submit_runs_a_script_as_a_job,
            pods_of_two_processes_go_on_through_a_killed_process
        ],
    )
}

/// The example as shipped, but `steps` steps (the manifest's `STEPS` value replaced).
fn example(steps: u64) -> Result<String> {
    let path = repo_root().join("manifests/examples/pytorch-digits.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let from = "- name: STEPS\n              value: \"600\"";
    ensure!(
        text.contains(from),
        "{} has no STEPS of 600",
        path.display()
    );
    Ok(text.replace(
        from,
        &format!("- name: STEPS\n              value: \"{steps}\""),
    ))
}

/// Applies manifest `text` (written to a temporary file for `kubectl apply -f`) in `ns`.
fn apply_text(ctx: &Ctx, ns: &str, text: &str) -> Result<()> {
    let file = std::env::temp_dir().join(format!("manifest-{ns}.yaml"));
    std::fs::write(&file, text)?;
    let applied = run_ok(ctx.cp.kubectl().args(["-n", ns, "apply", "-f"]).arg(&file));
    std::fs::remove_file(&file)?;
    applied.map(drop)
}

/// The digits example's workers that outlive worker 1 in these tests.
const DIGITS_SURVIVORS: [&str; 3] = [
    "pytorch-digits-worker-0",
    "pytorch-digits-worker-2",
    "pytorch-digits-worker-3",
];

/// The process of each of `names`, in order.
async fn pids(pods: &Api<Pod>, names: &[&str]) -> Result<Vec<u32>> {
    let mut out = vec![];
    for n in names {
        out.push(pid_of(&pods.get(n).await?)?);
    }
    Ok(out)
}

/// Fails unless each of `names` ran its first process (`pids`, for the message) to exit 0 with
/// no container restart; returns their logs, concatenated.
async fn kept_their_process(pods: &Api<Pod>, names: &[&str], pids: &[u32]) -> Result<String> {
    let mut logs = String::new();
    for (name, pid) in names.iter().zip(pids) {
        let p = pods.get(name).await?;
        let restarts = first_container(&p).map_or(-1, |c| c.restart_count);
        ensure!(
            terminated(&p).map(|t| t.0) == Some(0) && restarts == 0,
            "{name} (pid {pid}) did not keep its process: {:?}, {restarts} restarts",
            terminated(&p)
        );
        logs.push_str(&pods.logs(name, &LogParams::default()).await?);
    }
    Ok(logs)
}

/// The example as shipped, in a namespace that enforces Pod Security "restricted", through a
/// kill -9 of worker 1: one repair, the survivors keep their process, Succeeded with a test
/// accuracy of at least 95 %; Prometheus scrapes every worker and every query of the Training
/// dashboard has data.
async fn the_pytorch_digits_example_survives_a_killed_worker(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const STEPS: u64 = 300;
    // As users run it: in a namespace that enforces Pod Security "restricted".
    run_ok(ctx.cp.kubectl().args([
        "label",
        "namespace",
        &ns,
        "pod-security.kubernetes.io/enforce=restricted",
    ]))?;
    apply_text(&ctx, &ns, &example(STEPS)?)?;
    let status = async || -> Result<DiphomaJobStatus> {
        Ok(job_status(&ctx.client, &ns, "pytorch-digits")
            .await?
            .status
            .unwrap_or_default())
    };
    let scraped = Scraped::start(&ctx, &ns).await?;
    let start = jiff::Timestamp::now().as_second() as f64;
    // Training: rank 0's progress record reached the status, and Prometheus scrapes all four
    // workers' /metrics (the chart's PodMonitor labels: docs/prometheus-scrape.yaml).
    eventually(240, "progress in the status, every worker scraped", async || {
        let now = jiff::Timestamp::now().as_second() as f64;
        let up = scraped.prom.query_range(
            &format!("up{{job=\"diphoma-workers\", diphoma_job=\"pytorch-digits\", namespace=\"{ns}\"}} == 1"),
            now - 1.0,
            now,
            1.0,
        )?;
        Ok(up.len() == 4 && status().await?.progress.is_some_and(|p| p.step > 0))
    })
    .await?;
    // `kubectl diphoma top` shows the PyTorch workers as it shows the Rust ones: a row per rank
    // with its mean allreduce time and its step, read from the same /metrics.
    let (top, rows) = top_rows(&ctx, "pytorch-digits", &ns)?;
    ensure!(rows.len() == 4, "{top}");
    for r in &rows {
        ensure!(
            r.len() == 7 && r[4] == "ms" && r[3].parse::<f64>().is_ok_and(|ms| ms > 0.0),
            "allreduce: {top}"
        );
        ensure!(r[6].parse::<f64>().is_ok(), "step: {top}");
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let before = pids(&pods, &DIGITS_SURVIVORS).await?;
    signal(
        pids(&pods, &["pytorch-digits-worker-1"]).await?[0],
        libc::SIGKILL,
    );
    let mut last = None;
    eventually(600, "the job Succeeded", async || {
        let st = status().await?;
        let done = st.phase.is_some_and(Phase::is_terminal);
        last = Some(st);
        Ok(done)
    })
    .await
    .with_context(|| format!("last status {last:?}"))?;
    let st = last.context("no status")?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(st.repairs.total == 1, "repairs {:?}", st.repairs);
    kept_their_process(&pods, &DIGITS_SURVIVORS, &before).await?;
    let progress = st.progress.context("no progress")?;
    let accuracy = progress.test_accuracy.context("no test accuracy")?;
    ensure!(
        progress.step == i64::try_from(STEPS)? && accuracy >= 0.95,
        "step {} of {STEPS}, test accuracy {accuracy}",
        progress.step
    );
    // The Training dashboard shows the PyTorch job as it shows a Rust one: every query has data.
    let end = jiff::Timestamp::now().as_second() as f64;
    let file = "diphoma-training.json";
    let text = std::fs::read_to_string(chart().join("dashboards").join(file))?;
    let board: serde_json::Value = serde_json::from_str(&text)?;
    let gaps = dashboard_gaps(
        &scraped.prom,
        file,
        &board,
        (&ns, "pytorch-digits"),
        (start, end),
    )?;
    ensure!(
        gaps.is_empty(),
        "{gaps:#?}\nprometheus log:\n{}",
        scraped.prom.log_tail()
    );
    Ok(())
}

/// A job of `replicas` CPU workers in the `diphoma-pytorch` image running `python -m
/// diphoma.run SCRIPT ARGS` (the script from `python/tests/scripts`, in a ConfigMap), the
/// host directory `shared` mounted at /shared (for snapshots), `env` added.
fn torchrun_job(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    (replicas, script): (i32, &str),
    args: &[&str],
    env: serde_json::Value,
    shared: &std::path::Path,
) -> Result<()> {
    let path = repo_root().join("python/tests/scripts").join(script);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    apply_json(
        ctx,
        ns,
        &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("{name}-script")},
                "data": {"train.py": text}}),
    )?;
    let mut command = vec!["python", "-m", "diphoma.run", "/scripts/train.py"];
    command.extend(args);
    apply_json(
        ctx,
        ns,
        &json!({
            "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "metadata": {"name": name},
            "spec": {
                "replicas": replicas, "elastic": {"minReplicas": 2, "maxReplicas": replicas},
                "gpusPerWorker": 0,
                "template": {"spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "worker", "image": "ghcr.io/diphoma/diphoma-pytorch:0.1.0",
                        "command": command, "env": env,
                        "volumeMounts": [{"name": "script", "mountPath": "/scripts"},
                                         {"name": "shared", "mountPath": "/shared"}]}],
                    "volumes": [{"name": "script", "configMap": {"name": format!("{name}-script")}},
                                {"name": "shared", "hostPath": {"path": shared, "type": "DirectoryOrCreate"}}]}}}}),
    )
}

/// A host directory for a test's snapshots, removed when dropped.
struct Shared(PathBuf);

impl Shared {
    fn new(ns: &str) -> Result<Shared> {
        let dir = std::env::temp_dir().join(format!("diphoma-shared-{ns}"));
        std::fs::create_dir_all(&dir)?;
        Ok(Shared(dir))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// PyTorch's torchrun tutorial script (changed only in its backend and device) in 3 pods under
/// `python -m diphoma.run`: a kill -9 of worker 1's pod, and the two survivors' launchers keep
/// their pod and process and restart the script in place at the new generations; it resumes
/// from rank 0's snapshot and the job Succeeds.
async fn a_torchrun_script_is_restarted_in_place_through_a_killed_worker(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const EPOCHS: &str = "20";
    let shared = Shared::new(&ns)?;
    let env = json!([{"name": "EPOCH_SECONDS", "value": "1"}]);
    let args = [EPOCHS, "/shared/snapshot.pt"];
    torchrun_job(
        &ctx,
        &ns,
        "torchrun",
        (3, "torchrun_ddp.py"),
        &args,
        env,
        &shared.0,
    )?;
    // Training: rank 0 saved a snapshot (after its first epoch), and its optimizer steps reach
    // the status although the script never calls diphoma.report.
    eventually(
        180,
        "rank 0's first snapshot and steps in the status",
        async || {
            let st = status(&ctx, &ns, "torchrun").await?;
            Ok(shared.0.join("snapshot.pt").exists() && st.progress.is_some_and(|p| p.step > 0))
        },
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let survivors = ["torchrun-worker-0", "torchrun-worker-2"];
    let mut before = vec![];
    for name in survivors {
        before.push(pid_of(&pods.get(name).await?)?);
    }
    signal(
        pid_of(&pods.get("torchrun-worker-1").await?)?,
        libc::SIGKILL,
    );
    // Each survivor's launcher restarts the script without worker 1, and is the same process.
    let restarted = |log: &str| {
        log.lines()
            .any(|l| l.contains(" in place: ") && l.contains("lost torchrun-worker-1"))
    };
    eventually(120, "both survivors restarted in place", async || {
        for name in survivors {
            if !restarted(&pods.logs(name, &LogParams::default()).await?) {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await?;
    for (name, pid) in survivors.iter().zip(&before) {
        let now = pid_of(&pods.get(name).await?)?;
        ensure!(
            now == *pid,
            "{name}'s launcher changed: pid {pid}, now {now}"
        );
    }
    let st = finished(&ctx, &ns, "torchrun", 200).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(st.repairs.total == 1, "repairs {:?}", st.repairs);
    // Each survivor restarted its process in place at least once for the lost member.
    let restarts = &st.in_place_restarts;
    ensure!(
        restarts.by_cause.get("MemberLost").is_some_and(|&n| n >= 2),
        "in-place restarts {restarts:?}"
    );
    let mut logs = String::new();
    for name in survivors {
        let p = pods.get(name).await?;
        ensure!(
            terminated(&p).map(|t| t.0) == Some(0),
            "{name} did not finish its run: {:?}",
            terminated(&p)
        );
        let log = pods.logs(name, &LogParams::default()).await?;
        ensure!(
            log.contains("Resuming training from snapshot at Epoch"),
            "{name} did not resume from the snapshot:\n{log}"
        );
        logs.push_str(&log);
    }
    ensure!(
        logs.contains(&format!("trained: epochs {EPOCHS} loss")),
        "rank 0 never finished:\n{logs}"
    );
    Ok(())
}

/// PyTorch's torchrun tutorial script in 3 pods, worker 1's training process frozen (SIGSTOP;
/// its launcher runs on, so the pod looks alive): the survivors' rings find it silent, their
/// processes report it (the failure report names it) before their launchers restart them, the
/// operator finds it does not answer and replaces it as `Hung`, and the job Succeeds.
async fn a_frozen_torchrun_process_is_reported_by_its_peers_and_replaced(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let shared = Shared::new(&ns)?;
    let env = json!([{"name": "EPOCH_SECONDS", "value": "1"}]);
    let args = ["12", "/shared/snapshot.pt"];
    torchrun_job(
        &ctx,
        &ns,
        "frozen",
        (3, "torchrun_ddp.py"),
        &args,
        env,
        &shared.0,
    )?;
    eventually(180, "rank 0's first snapshot", async || {
        Ok(shared.0.join("snapshot.pt").exists())
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let launcher = pid_of(&pods.get("frozen-worker-1").await?)?;
    let children = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))?;
    let script = children
        .split_whitespace()
        .next()
        .context("worker 1's launcher runs no script")?
        .parse()?;
    signal(script, libc::SIGSTOP);
    let st = finished(&ctx, &ns, "frozen", 300).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(
        st.repairs.by_cause.get("Hung") == Some(&1),
        "repairs {:?}",
        st.repairs
    );
    ensure!(
        st.in_place_restarts
            .by_cause
            .get("MemberLost")
            .is_some_and(|&n| n >= 2),
        "in-place restarts {:?}",
        st.in_place_restarts
    );
    Ok(())
}

/// A torchrun-style script whose rank 1 raises `ValueError` after its first collective: the job
/// fails at once (exit 1 is not retried), and `status.lastFailure.message` and the Failed
/// condition carry the traceback (the worker container's `FallbackToLogsOnError`).
async fn a_raising_rank_fails_the_job_with_its_traceback_in_last_failure(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let shared = Shared::new(&ns)?;
    torchrun_job(
        &ctx,
        &ns,
        "raising",
        (2, "raise_on_rank.py"),
        &["1"],
        json!([]),
        &shared.0,
    )?;
    let st = finished(&ctx, &ns, "raising", 180).await?;
    ensure!(st.phase == Some(Phase::Failed), "{st:?}");
    let last = st.last_failure.clone().context("no lastFailure")?;
    let message = last.message.clone().unwrap_or_default();
    ensure!(
        last.pod == "raising-worker-1"
            && last.exit_code == Some(1)
            && message.contains("Traceback (most recent call last)")
            && message.contains("ValueError: bad batch on rank 1"),
        "{last:?}"
    );
    let failed = st.conditions.iter().find(|c| c.type_ == "Failed");
    ensure!(
        failed.is_some_and(|c| c.message.contains("ValueError: bad batch on rank 1")),
        "{failed:?}"
    );
    Ok(())
}

/// `kubectl diphoma submit SCRIPT --workers 2 -- ARGS` of a torchrun-style script: the job
/// (named after the script) runs it under `python -m diphoma.run` to Succeeded, with the
/// script's ConfigMap owned by the job; a second submit of the same name is refused with exit
/// code 5 and changes nothing; deleting the job takes the ConfigMap with it.
async fn kubectl_diphoma_submit_runs_a_script_as_a_job(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let script = repo_root().join("python/tests/scripts/raise_on_rank.py");
    let script = script.to_str().context("script path")?;
    let args = ["-n", &ns, "submit", script, "--workers", "2", "--", "-1"];
    let said = plugin_ok(&ctx, &args)?;
    ensure!(said.contains("raise-on-rank submitted"), "{said}");
    let st = finished(&ctx, &ns, "raise-on-rank", 180).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let log = pods
        .logs("raise-on-rank-worker-0", &LogParams::default())
        .await?;
    ensure!(log.contains("local 0 restart 0 run "), "{log}");
    let job = job_status(&ctx.client, &ns, "raise-on-rank").await?;
    let cms: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let cm = cms.get("raise-on-rank-script").await?;
    let again = plugin(&ctx, &args)?;
    ensure!(again.status.code() == Some(5), "a second submit: {again:?}");
    let after = (
        job_status(&ctx.client, &ns, "raise-on-rank")
            .await?
            .metadata
            .uid,
        cms.get("raise-on-rank-script")
            .await?
            .metadata
            .resource_version,
    );
    ensure!(
        after
            == (
                job.metadata.uid.clone(),
                cm.metadata.resource_version.clone()
            ),
        "the refused submit changed the job or its script"
    );
    ensure!(
        cm.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| Some(&o.uid) == job.metadata.uid.as_ref()),
        "the script's ConfigMap is not the job's: {:?}",
        cm.metadata.owner_references
    );
    run_ok(
        ctx.cp
            .kubectl()
            .args(["-n", &ns, "delete", "dpj", "raise-on-rank"]),
    )?;
    eventually(
        60,
        "the script's ConfigMap collected with its job",
        async || Ok(cms.get_opt("raise-on-rank-script").await?.is_none()),
    )
    .await
}

/// The children of process `pid` (its main thread's, from procfs).
fn children(pid: u32) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))?;
    Ok(text
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

/// `processesPerWorker: 2` with `gpusPerWorker: 2` (fake GPUs): 2 pods of 2 elastic training
/// processes each (`python -m diphoma.run --elastic`, `python/tests/scripts/elastic_train.py`),
/// the status's layout 2 × 2 = 4; a kill -9 of one process of worker 1 takes its pod out (its
/// launcher stops the sibling and exits 137), the operator replaces the pod, worker 0's
/// processes keep theirs and the job Succeeds.
async fn pods_of_two_processes_go_on_through_a_killed_process(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let shared = Shared::new(&ns)?;
    let path = repo_root().join("python/tests/scripts/elastic_train.py");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    apply_json(
        &ctx,
        &ns,
        &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "local-script"},
                "data": {"train.py": text}}),
    )?;
    apply_json(
        &ctx,
        &ns,
        &json!({
            "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "metadata": {"name": "local"},
            "spec": {
                "replicas": 2, "gpusPerWorker": 2, "processesPerWorker": 2,
                "template": {"spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "worker", "image": "ghcr.io/diphoma/diphoma-pytorch:0.1.0",
                        "command": ["python", "-m", "diphoma.run", "--elastic", "/scripts/train.py", "/shared", "300"],
                        "env": [{"name": "DIPHOMA_TIMEOUT", "value": "60"}],
                        "volumeMounts": [{"name": "script", "mountPath": "/scripts"},
                                         {"name": "shared", "mountPath": "/shared"}]}],
                    "volumes": [{"name": "script", "configMap": {"name": "local-script"}},
                                {"name": "shared", "hostPath": {"path": shared.0, "type": "DirectoryOrCreate"}}]}}}}),
    )?;
    let record = |name: &str| -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(shared.0.join(format!("{name}.json"))).ok()?;
        serde_json::from_str(&text).ok()
    };
    let step = |name: &str| record(name).and_then(|r| r["step"].as_u64()).unwrap_or(0);
    let first = [
        "local-worker-0.0",
        "local-worker-0.1",
        "local-worker-1.0",
        "local-worker-1.1",
    ];
    eventually(240, "4 processes training at world 4", async || {
        Ok(first
            .iter()
            .all(|n| step(n) >= 5 && record(n).is_some_and(|r| r["world"] == 4)))
    })
    .await?;
    let st = status(&ctx, &ns, "local").await?;
    let ring = st.ring.context("no ring in the status")?;
    ensure!(
        (ring.size, ring.processes_per_worker, ring.world_size) == (2, 2, 4),
        "layout {ring:?}"
    );
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let launcher = pid_of(&pods.get("local-worker-1").await?)?;
    let killed = record("local-worker-1.1").context("no record")?["pid"]
        .as_u64()
        .context("no pid")? as u32;
    ensure!(
        children(launcher)?.contains(&killed),
        "{killed} is not a process of worker 1's launcher {launcher}"
    );
    let survivors: Vec<u64> = ["local-worker-0.0", "local-worker-0.1"]
        .iter()
        .map(|n| record(n).and_then(|r| r["pid"].as_u64()).unwrap_or(0))
        .collect();
    signal(killed, libc::SIGKILL);
    let st = finished(&ctx, &ns, "local", 300).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(st.repairs.total >= 1, "repairs {:?}", st.repairs);
    for (name, pid) in ["local-worker-0.0", "local-worker-0.1"]
        .iter()
        .zip(&survivors)
    {
        let r = record(name).context("no record")?;
        ensure!(
            r["pid"].as_u64() == Some(*pid),
            "{name} changed its process: {r}"
        );
        ensure!(
            r["step"] == 300 && r["generation"].as_u64() > Some(1),
            "{name}: {r}"
        );
    }
    Ok(())
}
