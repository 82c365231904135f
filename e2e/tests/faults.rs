//! The fault catalogue with real `diphoma-worker train` workers (the digits MLP) under the
//! operator installed by its Helm chart (a pod under the chart's RBAC) on the local control plane:
//! the happy path, kill -9 against an undisturbed run, a pod deleted and a pod evicted, a hung
//! (SIGSTOPped) worker, a slow rank that is not a hung one, an unschedulable scale-up, a non-retryable exit, a crash loop, suspend and
//! resume, activeDeadlineSeconds, ttlSecondsAfterFinished, the loss of every worker at once, the
//! operator's own process killed mid-job, churn (kills every 3 s, with and without operator
//! kills), spec edits under a running ring, and a job applied again after an orphaning delete.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::kit::{JobManifest, alive, pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJobStatus, Phase};
use diphoma_worker::checkpoint::Checkpoint;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{EvictParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

/// GPUs per node (3 nodes); the unschedulable test asks for whole nodes.
const GPUS_PER_NODE: u32 = 4;

/// The GPU products of the nodes, in turn: mixed hardware (`manifests/examples/mixed-gpus.yaml`
/// places a job across both).
const GPU_PRODUCTS: [&str; 2] = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"];

fn main() -> Result<()> {
    let nodes = (0..3)
        .map(|i| NodeConfig {
            gpu_product: GPU_PRODUCTS[i % 2].to_owned(),
            ..NodeConfig::gpu(&format!("gpu-{i}"), GPUS_PER_NODE)
        })
        .collect();
    run_tests(
        nodes,
        OperatorMode::Chart,
        tests![
            four_workers_train_to_succeeded_and_are_cleaned_up,
            a_killed_worker_changes_nothing_in_the_final_parameters,
            a_periodic_job_across_two_gpu_products_survives_a_kill_9,
            deleted_and_evicted_pods_are_counted_with_their_cause,
            a_hung_worker_is_detected_and_replaced,
            a_slow_rank_is_waited_for_and_never_counted_hung,
            an_unschedulable_scale_up_keeps_training_and_names_the_short_resource,
            a_non_retryable_exit_fails_the_job,
            a_crash_loop_spends_the_backoff_limit_and_stays_failed,
            suspend_deletes_the_workers_and_resume_continues_from_the_checkpoint,
            active_deadline_fails_a_running_job,
            ttl_deletes_a_finished_job_and_its_children,
            a_job_that_loses_every_worker_resumes_from_its_newest_checkpoint,
            the_operator_pod_killed_mid_job_restarts_without_duplicates,
            under_churn_only_killed_workers_are_counted_and_the_metric_agrees,
            under_churn_with_the_operator_killed_only_killed_workers_are_counted,
            a_spec_edit_replaces_the_whole_ring_and_never_mixes_two_specs,
            a_job_applied_again_after_an_orphaning_delete_takes_over_its_children,
            // Last: the frozen node stays lost for the rest of the binary.
            a_lost_node_is_detected_and_its_worker_moves,
        ],
    )
}

/// Detection time of every job here (unless a test sets its own): the workers probe a silent peer
/// after a quarter of it and blame it after half; their `--op-timeout-s 1` bounds connects.
const DETECTION_SECONDS: u64 = 4;

/// A digits training job `name` of `replicas` real workers (one GPU each) for `steps` steps,
/// logging every step, with `extra` deep-merged into the manifest.
fn training_job(name: &str, replicas: i32, steps: u64, extra: Value) -> JobManifest {
    quick_job((name, replicas, steps), 1, DETECTION_SECONDS, extra)
}

/// The manifest fragment that gives a job checkpoints every `every` steps in a fresh host
/// directory (under the control plane's directory, removed with it); returns it and the directory.
fn with_checkpoints(ctx: &Ctx, ns: &str, every: u64) -> Result<(Value, PathBuf)> {
    let dir = ctx.cp.dir.join("checkpoints").join(ns);
    std::fs::create_dir_all(&dir)?;
    let extra = json!({"spec": {
        "checkpoint": {"volume": "ckpt", "everySteps": every},
        "template": {"spec": {"volumes": [{"name": "ckpt", "hostPath": {"path": dir}}]}},
    }});
    Ok((extra, dir))
}

/// Where job `job` of `ns` writes its checkpoints under the volume's directory `root`:
/// `<root>/<ns>/<job>/<uid>` (checkpoints belong to one job identity).
async fn own_checkpoints(ctx: &Ctx, ns: &str, job: &str, root: &Path) -> Result<PathBuf> {
    let uid = jobs(ctx, ns).get(job).await?.uid().context("no uid")?;
    Ok(root.join(ns).join(job).join(uid))
}

/// Checkpoint steps in `dir`, oldest first.
fn checkpoint_steps(dir: &Path) -> Result<Vec<u64>> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("ckpt-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort();
    Ok(steps)
}

fn checkpoint_at(dir: &Path, step: u64) -> Result<Checkpoint> {
    let path = dir.join(format!("ckpt-{step:012}.safetensors"));
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Checkpoint::decode(&bytes)?)
}

async fn submit(ctx: &Ctx, ns: &str, job: &JobManifest, replicas: usize) -> Result<u64> {
    Ok(start_job(ctx, ns, job, replicas).await?.generation)
}

fn pods(ctx: &Ctx, ns: &str) -> Api<Pod> {
    Api::namespaced(ctx.client.clone(), ns)
}

/// Merge-patches the job's spec.
async fn patch_spec(ctx: &Ctx, ns: &str, name: &str, spec: Value) -> Result<()> {
    jobs(ctx, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await?;
    Ok(())
}

async fn succeeded(ctx: &Ctx, ns: &str, name: &str, secs: u64) -> Result<DiphomaJobStatus> {
    let st = finished(ctx, ns, name, secs).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{name} ended: {st:?}");
    Ok(st)
}

/// Waits until the status reports progress satisfying `f`; returns the status then.
async fn progress_until(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    what: &str,
    f: impl Fn(&diphoma_operator::api::Progress) -> bool,
) -> Result<DiphomaJobStatus> {
    let mut st = None;
    eventually(60, what, async || {
        st = job_status(&ctx.client, ns, name).await?.status;
        Ok(st
            .as_ref()
            .and_then(|s| s.progress.as_ref())
            .is_some_and(&f))
    })
    .await?;
    Ok(st.unwrap())
}

/// Status condition `type_` is True.
fn condition_true(st: &DiphomaJobStatus, type_: &str) -> bool {
    st.conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

fn condition_reason<'a>(st: &'a DiphomaJobStatus, type_: &str) -> Option<&'a str> {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.reason.as_str())
}

/// The log of a pod's worker container (the kubelet keeps it after the pod is deleted).
fn log_of(ctx: &Ctx, pod: &Pod) -> Result<String> {
    Ok(ctx.kubelet.log_text(pod, "worker")?)
}

/// The last step rank 0 logged (`step N generation G loss L`, one line per step).
fn last_logged_step(log: &str) -> Option<u64> {
    log.lines()
        .rev()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .next()
}

/// The job's worker pods, by name.
async fn worker_pods(ctx: &Ctx, ns: &str, job: &str) -> Result<Vec<Pod>> {
    let mut list = pods(ctx, ns)
        .list(&ListParams::default().labels(&format!("diphoma.io/job-name={job}")))
        .await?
        .items;
    list.sort_by_key(|p| p.name_any());
    Ok(list)
}

fn exit_code(p: &Pod) -> Option<i32> {
    terminated(p).map(|(code, _)| code)
}

fn restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

/// Event reasons about the job, in no particular order.
async fn event_reasons(ctx: &Ctx, ns: &str, job: &str) -> Result<Vec<String>> {
    Ok(Api::<Event>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(job))
        .filter_map(|e| e.reason)
        .collect())
}

/// Checks that the named pods kept their first process until they finished: exit 0, no
/// container restart, one final accuracy in their log.
async fn kept_their_process(ctx: &Ctx, ns: &str, names: &[&str]) -> Result<()> {
    for name in names {
        let p = pods(ctx, ns).get(name).await?;
        let (_, finals) = accuracy(&log_of(ctx, &p)?);
        ensure!(
            exit_code(&p) == Some(0) && restarts(&p) == 0 && finals == 1,
            "{name} did not keep its process: exit {:?}, {} restarts, {finals} final accuracies",
            exit_code(&p),
            restarts(&p)
        );
    }
    Ok(())
}

async fn four_workers_train_to_succeeded_and_are_cleaned_up(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let extra = json!({"spec": {"runPolicy": {"cleanPodPolicy": "All"}}});
    let job = training_job("digits", 4, 600, extra);
    let g1 = submit(&ctx, &ns, &job, 4).await?;
    ensure!(g1 == 1, "first ring at generation {g1}");
    let workers = worker_pods(&ctx, &ns, "digits").await?;
    ensure!(workers.len() == 4, "{} workers", workers.len());
    let st = succeeded(&ctx, &ns, "digits", 120).await?;

    let progress = st.progress.clone().context("no progress")?;
    ensure!(
        progress.step == 600 && progress.total_steps == Some(600),
        "{progress:?}"
    );
    let loss = progress.loss.context("no loss")?;
    ensure!(loss.is_finite() && loss < 0.5, "final loss {loss}");
    ensure!(
        st.repairs.total == 0 && st.failures.total == 0,
        "{:?} {:?}",
        st.repairs,
        st.failures
    );
    ensure!(
        condition_true(&st, "Complete")
            && !condition_true(&st, "Failed")
            && !condition_true(&st, "Ready"),
        "{:?}",
        st.conditions
    );
    ensure!(
        st.completion_time.is_some()
            && st.start_time.is_some()
            && st.ready.as_deref() == Some("0/4"),
        "{st:?}"
    );
    ensure!(
        st.ring.as_ref().map(|r| (r.generation, r.size)) == Some((1, 4)),
        "{:?}",
        st.ring
    );
    // Every rank ends with the same model: one final accuracy each, all equal, and good.
    let mut accs = vec![];
    for p in &workers {
        let (acc, n) = accuracy(&log_of(&ctx, p)?);
        ensure!(n == 1, "{}: {n} final accuracies", p.name_any());
        accs.push(acc.context("no accuracy")?);
    }
    ensure!(
        accs.iter().all(|a| *a == accs[0]) && accs[0] >= 0.9,
        "test accuracies {accs:?}"
    );
    ensure!(
        progress
            .test_accuracy
            .is_some_and(|a| (a - accs[0]).abs() < 1e-4),
        "status says test accuracy {:?}, the workers {}",
        progress.test_accuracy,
        accs[0]
    );
    let mut reasons = vec![];
    eventually(
        30,
        "WorkerCreated, RingReformed and JobSucceeded events",
        async || {
            reasons = event_reasons(&ctx, &ns, "digits").await?;
            Ok(["WorkerCreated", "RingReformed", "JobSucceeded"]
                .iter()
                .all(|want| reasons.iter().any(|r| r == want)))
        },
    )
    .await
    .with_context(|| format!("events: {reasons:?}"))?;
    // cleanPodPolicy All: even the Succeeded workers go.
    eventually(30, "every worker pod deleted", async || {
        Ok(worker_pods(&ctx, &ns, "digits").await?.is_empty())
    })
    .await?;
    Ok(())
}

/// How far the final parameters of a run disturbed by a kill may be from the undisturbed run's.
/// A repair rolls back to the committed step and re-does it with the same samples and the same
/// world, so the difference is float rounding at most.
const PARAM_TOLERANCE: f32 = 1e-4;

async fn a_killed_worker_changes_nothing_in_the_final_parameters(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const STEPS: u64 = 1000;
    let (extra, dir) = with_checkpoints(&ctx, &ns, STEPS)?;
    // The undisturbed run: the same training, 4 ranks in one process, meanwhile.
    let reference = dir.join("reference");
    let undisturbed = tokio::process::Command::new(bin_dir().join("diphoma-worker"))
        .args(["train", "--standalone", "--world", "4", "--log-every", "0"])
        .arg(format!("--steps={STEPS}"))
        .arg(format!("--checkpoint-every={STEPS}"))
        .arg("--checkpoint-dir")
        .arg(&reference)
        .kill_on_drop(true)
        .output();
    let undisturbed = tokio::spawn(undisturbed);

    let g1 = submit(&ctx, &ns, &training_job("digits", 4, STEPS, extra), 4).await?;
    progress_until(&ctx, &ns, "digits", "training", |p| p.step > 0).await?;
    let pods = pods(&ctx, &ns);
    let victim = pid_of(&pods.get("digits-worker-1").await?)?;
    signal(victim, libc::SIGKILL);
    let g2 = running_ring(&ctx, &ns, "digits", 4, g1).await?;
    ensure!(
        g2.members.iter().any(|m| m.pod == "digits-worker-1-1"),
        "no replacement in {g2:?}"
    );
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.repairs.total == 1 && st.repairs.by_cause.get("ProcessExit") == Some(&1),
        "{:?}",
        st.repairs
    );
    kept_their_process(
        &ctx,
        &ns,
        &["digits-worker-0", "digits-worker-2", "digits-worker-3"],
    )
    .await?;

    let out = undisturbed.await??;
    ensure!(
        out.status.success(),
        "undisturbed run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = checkpoint_at(&own_checkpoints(&ctx, &ns, "digits", &dir).await?, STEPS)?;
    let b = checkpoint_at(&reference, STEPS)?;
    ensure!(a.params.len() == b.params.len(), "parameter counts differ");
    let diff = a
        .params
        .iter()
        .zip(&b.params)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    ensure!(
        diff <= PARAM_TOLERANCE,
        "final parameters differ by up to {diff} from the undisturbed run (tolerance {PARAM_TOLERANCE})"
    );
    Ok(())
}

/// `manifests/examples/mixed-gpus.yaml` as shipped (nodeAffinity `In` both products,
/// speed-weighted shares), with periodic averaging every 8 steps, 600 steps and a short connect
/// bound added: a worker killed with SIGKILL mid-run is repaired (the survivors roll back to
/// their last average), the job succeeds at ≥ 95 % test accuracy, its workers ran on nodes of
/// the two products only, and the status shows the split of the batch.
async fn a_periodic_job_across_two_gpu_products_survives_a_kill_9(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let path = repo_root().join("manifests/examples/mixed-gpus.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let (args, sync) = (
        r#"args: [train, --steps, "400", --log-every, "50"]"#,
        "  balance:\n",
    );
    ensure!(
        text.contains(args) && text.contains(sync),
        "{} changed: update this test",
        path.display()
    );
    let yaml = text
        .replace(
            args,
            r#"args: [train, --steps, "600", --log-every, "8", --op-timeout-s, "1"]"#,
        )
        .replace(
            sync,
            "  sync:\n    mode: Periodic\n    everySteps: 8\n  faultTolerance:\n    detectionSeconds: 4\n  balance:\n",
        );
    let out = kubectl_apply(&ctx, &ns, &yaml)?;
    ensure!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let name = "mixed-gpus";
    let g1 = running_ring(&ctx, &ns, name, 4, 0).await?;
    progress_until(&ctx, &ns, name, "training", |p| p.step >= 8).await?;
    let victim = pid_of(&pods(&ctx, &ns).get("mixed-gpus-worker-2").await?)?;
    signal(victim, libc::SIGKILL);
    running_ring(&ctx, &ns, name, 4, g1.generation).await?;
    let st = succeeded(&ctx, &ns, name, 240).await?;
    ensure!(st.repairs.total >= 1, "{:?}", st.repairs);
    let p = st.progress.context("no progress")?;
    ensure!(
        p.test_accuracy.is_some_and(|a| a >= 0.95),
        "test accuracy {:?}",
        p.test_accuracy
    );
    let (lo, hi) = (p.min_batch_share, p.max_batch_share);
    ensure!(
        lo.is_some_and(|l| l >= 1) && hi.is_some_and(|h| h >= lo.unwrap_or(0)),
        "batch shares {lo:?}..{hi:?}"
    );
    eprintln!("mixed-gpus progress: {p:?}");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(ctx.client.clone());
    let mut summaries = 0;
    for pod in worker_pods(&ctx, &ns, name).await? {
        // Every finished worker's summary: one average per 8 steps, not one allreduce a step.
        let log = log_of(&ctx, &pod)?;
        if let Some(line) = log.lines().find(|l| l.starts_with("allreduces ")) {
            let n: Vec<u64> = line
                .split_whitespace()
                .filter_map(|w| w.trim_end_matches(',').parse().ok())
                .collect();
            ensure!(
                n.len() >= 2 && n[0] * 8 <= n[1] + 8,
                "{}: {line}",
                pod.name_any()
            );
            summaries += 1;
        }
        let node = pod.spec.and_then(|s| s.node_name).context("unbound pod")?;
        let product = nodes
            .get(&node)
            .await?
            .labels()
            .get("nvidia.com/gpu.product")
            .cloned()
            .unwrap_or_default();
        ensure!(
            GPU_PRODUCTS.contains(&product.as_str()),
            "{node}: {product}"
        );
    }
    ensure!(summaries >= 3, "{summaries} workers printed their summary");
    Ok(())
}

async fn deleted_and_evicted_pods_are_counted_with_their_cause(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let g1 = submit(&ctx, &ns, &training_job("digits", 4, 4000, json!({})), 4).await?;
    progress_until(&ctx, &ns, "digits", "training", |p| p.step > 0).await?;
    run_ok(ctx.cp.kubectl().args([
        "-n",
        &ns,
        "delete",
        "pod",
        "digits-worker-1",
        "--wait=false",
    ]))?;
    let g2 = running_ring(&ctx, &ns, "digits", 4, g1).await?;
    ensure!(
        g2.members.iter().any(|m| m.pod == "digits-worker-1-1"),
        "no replacement in {g2:?}"
    );
    let st = job_status(&ctx.client, &ns, "digits")
        .await?
        .status
        .unwrap();
    ensure!(
        st.progress.as_ref().is_some_and(|p| p.step < 4000),
        "finished before the eviction: {:?}",
        st.progress
    );
    pods(&ctx, &ns)
        .evict("digits-worker-2", &EvictParams::default())
        .await?;
    let g3 = running_ring(&ctx, &ns, "digits", 4, g2.generation).await?;
    ensure!(
        g3.members.iter().any(|m| m.pod == "digits-worker-2-1"),
        "no replacement in {g3:?}"
    );
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.repairs.total == 2
            && st.repairs.by_cause.get("PodDeleted") == Some(&1)
            && st.repairs.by_cause.get("Evicted") == Some(&1),
        "{:?}",
        st.repairs
    );
    // The deletion is the job's own failure; the eviction a disruption (issue 12 case 6).
    ensure!(
        st.failures.total == 1
            && st.failures.by_cause.get("PodDeleted") == Some(&1)
            && st.disruptions.total == 1
            && st.disruptions.by_cause.get("Evicted") == Some(&1),
        "failures {:?}, disruptions {:?}",
        st.failures,
        st.disruptions
    );
    let last = st.last_failure.context("no lastFailure")?;
    ensure!(
        last.pod == "digits-worker-2"
            && last.cause == "Evicted"
            && last.reason == "EvictionByEvictionAPI",
        "{last:?}"
    );
    kept_their_process(&ctx, &ns, &["digits-worker-0", "digits-worker-3"]).await?;
    Ok(())
}

async fn a_hung_worker_is_detected_and_replaced(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let g1 = submit(&ctx, &ns, &training_job("digits", 4, 1500, json!({})), 4).await?;
    progress_until(&ctx, &ns, "digits", "training", |p| p.step > 0).await?;
    let pid = pid_of(&pods(&ctx, &ns).get("digits-worker-2").await?)?;
    signal(pid, libc::SIGSTOP);
    // Detected within detectionSeconds (bounded with slack for the 2-core machine).
    eventually(
        DETECTION_SECONDS * 3,
        "the frozen worker counted as Hung",
        async || {
            let st = job_status(&ctx.client, &ns, "digits").await?.status;
            Ok(st.is_some_and(|s| s.repairs.by_cause.get("Hung") == Some(&1)))
        },
    )
    .await?;
    let g2 = running_ring(&ctx, &ns, "digits", 4, g1).await?;
    ensure!(
        g2.members.iter().any(|m| m.pod == "digits-worker-2-1")
            && !g2.members.iter().any(|m| m.pod == "digits-worker-2"),
        "not replaced: {g2:?}"
    );
    eventually(30, "the frozen process gone", async || Ok(!alive(pid))).await?;
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.repairs.total == 1 && st.repairs.by_cause.get("Hung") == Some(&1),
        "{:?}",
        st.repairs
    );
    Ok(())
}

/// Slow is not hung: rank 0's steps take three times detectionSeconds longer than its peers'
/// (as a slow GPU, a data-loading stall or a large checkpoint would). Its neighbours wait for it
/// (its process answers their liveness probes): nothing is counted and the ring keeps its first
/// generation. Then a peer is killed while rank 0 is in a slow step: rank 0 reaches the new
/// generation a slow step late, catching up, and is not counted; only the kill is.
async fn a_slow_rank_is_waited_for_and_never_counted_hung(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    const DETECTION: u64 = 2;
    let mut job = JobManifest {
        detection_seconds: Some(DETECTION),
        ..JobManifest::training("digits", 3, 10, 1)
    };
    let delay_ms = (DETECTION * 3000).to_string();
    job.args.extend([
        "--step-delay-ms".into(),
        delay_ms,
        "--step-delay-rank=0".into(),
    ]);
    let g1 = start_job(&ctx, &ns, &job, 3).await?;
    let st = progress_until(&ctx, &ns, "digits", "three slow steps", |p| p.step >= 3).await?;
    ensure!(
        st.failures.total == 0 && st.ring.as_ref().map(|r| r.generation) == Some(1),
        "a slow rank was counted: {:?}, ring {:?}",
        st.failures,
        st.ring
    );
    // Rank 0 is in a slow step nearly all the time: kill another member now.
    let victim = pid_of(&pods(&ctx, &ns).get(&g1.members[2].pod).await?)?;
    signal(victim, libc::SIGKILL);
    let st = succeeded(&ctx, &ns, "digits", 240).await?;
    ensure!(
        st.failures.total == 1 && st.failures.by_cause.get("ProcessExit") == Some(&1),
        "only the kill counts: {:?}",
        st.failures
    );
    kept_their_process(&ctx, &ns, &[&g1.members[0].pod]).await?;
    Ok(())
}

async fn an_unschedulable_scale_up_keeps_training_and_names_the_short_resource(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    // Whole-node workers: 3 fit on the 3 nodes, a 4th cannot be scheduled.
    let extra = json!({"spec": {
        "gpusPerWorker": GPUS_PER_NODE,
        "elastic": {"minReplicas": 2, "maxReplicas": 4},
    }});
    let g1 = submit(&ctx, &ns, &training_job("digits", 2, 4000, extra), 2).await?;
    progress_until(&ctx, &ns, "digits", "training", |p| p.step > 0).await?;
    run_ok(
        ctx.cp
            .kubectl()
            .args(["-n", &ns, "scale", "dpj", "digits", "--replicas=4"]),
    )?;
    let mut st = None;
    eventually(
        60,
        "a ring of 3 that names the short resource",
        async || {
            st = job_status(&ctx.client, &ns, "digits").await?.status;
            let r = ring(&ctx.client, &ns, "digits").await?;
            Ok(r.is_some_and(|r| r.generation > g1 && r.members.len() == 3)
                && st
                    .as_ref()
                    .and_then(|s| s.waiting.as_deref())
                    .is_some_and(|w| w.contains("nvidia.com/gpu")))
        },
    )
    .await
    .with_context(|| format!("status {st:?}"))?;
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.failures.total == 0 && st.repairs.total == 0,
        "{:?} {:?}",
        st.failures,
        st.repairs
    );
    ensure!(
        st.progress.as_ref().map(|p| p.step) == Some(4000),
        "{:?}",
        st.progress
    );
    // cleanPodPolicy Running: the pending worker is deleted, the finished ones stay.
    eventually(30, "the pending worker deleted", async || {
        Ok(worker_pods(&ctx, &ns, "digits")
            .await?
            .iter()
            .all(|p| exit_code(p) == Some(0)))
    })
    .await?;
    Ok(())
}

/// Workers that fail before training: the data file does not exist (exit code 1).
fn failing_job(extra: Value) -> JobManifest {
    JobManifest {
        args: ["train", "--data", "/nonexistent/digits.csv.gz"]
            .map(String::from)
            .to_vec(),
        ..training_job("digits", 1, 100, extra)
    }
}

async fn a_non_retryable_exit_fails_the_job(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    kubectl_apply(&ctx, &ns, &failing_job(json!({})).to_string())?;
    let st = finished(&ctx, &ns, "digits", 60).await?;
    ensure!(st.phase == Some(Phase::Failed), "{st:?}");
    ensure!(
        condition_true(&st, "Failed")
            && condition_reason(&st, "Failed") == Some("NonRetryableExit"),
        "{:?}",
        st.conditions
    );
    let last = st.last_failure.context("no lastFailure")?;
    ensure!(
        last.pod == "digits-worker-0"
            && last.exit_code == Some(1)
            && last.cause == "ProcessExit"
            && last.reason == "Error",
        "{last:?}"
    );
    ensure!(st.failures.total == 1, "{:?}", st.failures);
    let names: Vec<String> = worker_pods(&ctx, &ns, "digits")
        .await?
        .iter()
        .map(|p| p.name_any())
        .collect();
    ensure!(names == ["digits-worker-0"], "replaced anyway: {names:?}");
    Ok(())
}

async fn a_crash_loop_spends_the_backoff_limit_and_stays_failed(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let extra = json!({"spec": {
        "runPolicy": {"backoffLimit": 2},
        "faultTolerance": {"restartOnExitCodes": [1]},
    }});
    kubectl_apply(&ctx, &ns, &failing_job(extra).to_string())?;
    let st = finished(&ctx, &ns, "digits", 90).await?;
    ensure!(
        st.phase == Some(Phase::Failed)
            && condition_reason(&st, "Failed") == Some("BackoffLimitExceeded"),
        "{st:?}"
    );
    ensure!(
        st.failures.total == 3 && st.failures.by_cause.get("ProcessExit") == Some(&3),
        "{:?}",
        st.failures
    );
    ensure!(
        st.last_failure.as_ref().map(|f| f.pod.as_str()) == Some("digits-worker-0-2"),
        "{:?}",
        st.last_failure
    );
    // The older attempts are pruned (their deletion may still be under way when the job shows
    // Failed); the last failed one stays for its logs.
    let attempts = |list: Vec<Pod>| -> Vec<String> { list.iter().map(|p| p.name_any()).collect() };
    let mut before = vec![];
    eventually(30, "the older attempts pruned", async || {
        before = attempts(worker_pods(&ctx, &ns, "digits").await?);
        Ok(before == ["digits-worker-0-2"])
    })
    .await
    .with_context(|| format!("{before:?}"))?;
    // Stays Failed: a later reconcile changes nothing.
    let again = reconciled(&ctx.client, &ns, "digits").await?;
    ensure!(
        again.phase == Some(Phase::Failed)
            && again.failures == st.failures
            && again.completion_time == st.completion_time,
        "changed after failing: {again:?}"
    );
    let after = attempts(worker_pods(&ctx, &ns, "digits").await?);
    ensure!(after == before, "new workers after failing: {after:?}");
    Ok(())
}

async fn suspend_deletes_the_workers_and_resume_continues_from_the_checkpoint(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const STEPS: u64 = 4000;
    let (extra, dir) = with_checkpoints(&ctx, &ns, 100)?;
    let g1 = submit(&ctx, &ns, &training_job("digits", 4, STEPS, extra), 4).await?;
    progress_until(&ctx, &ns, "digits", "a checkpoint", |p| {
        p.last_checkpoint_step.is_some_and(|s| s >= 100)
    })
    .await?;
    patch_spec(&ctx, &ns, "digits", json!({"runPolicy": {"suspend": true}})).await?;
    let mut st = None;
    eventually(60, "Suspended without workers", async || {
        st = job_status(&ctx.client, &ns, "digits").await?.status;
        Ok(st.as_ref().and_then(|s| s.phase) == Some(Phase::Suspended)
            && worker_pods(&ctx, &ns, "digits").await?.is_empty())
    })
    .await?;
    let st = st.unwrap();
    ensure!(condition_true(&st, "Suspended"), "{:?}", st.conditions);
    let dir = own_checkpoints(&ctx, &ns, "digits", &dir).await?;
    let newest = *checkpoint_steps(&dir)?.last().context("no checkpoint")?;
    ensure!(newest < STEPS, "finished before the suspension");

    patch_spec(
        &ctx,
        &ns,
        "digits",
        json!({"runPolicy": {"suspend": false}}),
    )
    .await?;
    let g2 = running_ring(&ctx, &ns, "digits", 4, g1).await?;
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.failures.total == 0 && st.repairs.total == 0,
        "suspension counted: {:?} {:?}",
        st.failures,
        st.repairs
    );
    ensure!(!condition_true(&st, "Suspended"), "{:?}", st.conditions);
    let rank0 = pods(&ctx, &ns).get(&g2.members[0].pod).await?;
    let log = log_of(&ctx, &rank0)?;
    ensure!(
        log.contains(&format!("at step {newest}")),
        "the resumed rank 0 did not start from step {newest}:\n{}",
        log.lines().take(5).collect::<Vec<_>>().join("\n")
    );
    Ok(())
}

async fn active_deadline_fails_a_running_job(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    const DEADLINE: i64 = 8;
    let extra = json!({"spec": {"runPolicy": {"activeDeadlineSeconds": DEADLINE}}});
    submit(&ctx, &ns, &training_job("digits", 2, 1_000_000, extra), 2).await?;
    let st = finished(&ctx, &ns, "digits", 60).await?;
    ensure!(
        st.phase == Some(Phase::Failed)
            && condition_reason(&st, "Failed") == Some("DeadlineExceeded"),
        "{st:?}"
    );
    let start: jiff::Timestamp = st.start_time.as_deref().context("no startTime")?.parse()?;
    let end: jiff::Timestamp = st
        .completion_time
        .as_deref()
        .context("no completionTime")?
        .parse()?;
    ensure!(
        end.duration_since(start) >= jiff::SignedDuration::from_secs(DEADLINE),
        "failed before its deadline: {start} .. {end}"
    );
    ensure!(st.failures.total == 0, "{:?}", st.failures);
    // cleanPodPolicy Running: the running workers are deleted.
    eventually(30, "the running workers deleted", async || {
        Ok(worker_pods(&ctx, &ns, "digits").await?.is_empty())
    })
    .await?;
    Ok(())
}

async fn ttl_deletes_a_finished_job_and_its_children(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let extra = json!({"spec": {"runPolicy": {"ttlSecondsAfterFinished": 2}}});
    submit(&ctx, &ns, &training_job("digits", 2, 200, extra), 2).await?;
    // Succeeded first (the TTL only starts then); then the job goes, and what it owned.
    eventually(120, "digits Succeeded or deleted after it", async || {
        let j = jobs(&ctx, &ns).get_opt("digits").await?;
        Ok(match j {
            Some(j) => phase_of(&j) == Some(Phase::Succeeded),
            None => true,
        })
    })
    .await?;
    eventually(30, "the job deleted", async || {
        Ok(jobs(&ctx, &ns).get_opt("digits").await?.is_none())
    })
    .await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    eventually(60, "its pods and ConfigMaps collected", async || {
        Ok(worker_pods(&ctx, &ns, "digits").await?.is_empty()
            && configmaps.get_opt("digits-ring").await?.is_none()
            && configmaps.get_opt("digits-heartbeat").await?.is_none())
    })
    .await?;
    Ok(())
}

async fn a_job_that_loses_every_worker_resumes_from_its_newest_checkpoint(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const EVERY: u64 = 50;
    // Enough steps that the job is still training when its workers are killed (digits runs at
    // about 200 steps/s here, and progress reaches the status seconds late).
    const STEPS: u64 = 4000;
    let (extra, dir) = with_checkpoints(&ctx, &ns, EVERY)?;
    let g1 = submit(&ctx, &ns, &training_job("digits", 4, STEPS, extra), 4).await?;
    progress_until(&ctx, &ns, "digits", "two checkpoints", |p| {
        p.last_checkpoint_step
            .is_some_and(|s| s >= 2 * EVERY as i64)
    })
    .await?;
    let ring1 = ring(&ctx.client, &ns, "digits").await?.context("no ring")?;
    let old = worker_pods(&ctx, &ns, "digits").await?;
    let pids = old.iter().map(pid_of).collect::<Result<Vec<_>, _>>()?;
    for pid in &pids {
        signal(*pid, libc::SIGKILL);
    }
    eventually(10, "every worker process gone", async || {
        Ok(pids.iter().all(|p| !alive(*p)))
    })
    .await?;
    let dir = own_checkpoints(&ctx, &ns, "digits", &dir).await?;
    let newest = *checkpoint_steps(&dir)?.last().context("no checkpoint")?;
    let old_rank0 = old
        .iter()
        .find(|p| p.name_any() == ring1.members[0].pod)
        .context("rank 0 pod")?;
    let reached = last_logged_step(&log_of(&ctx, old_rank0)?).context("rank 0 logged no step")?;
    ensure!(
        newest <= reached && reached - newest <= EVERY,
        "newest checkpoint {newest}, rank 0 had reached step {reached}"
    );

    let g2 = running_ring(&ctx, &ns, "digits", 4, g1).await?;
    ensure!(
        g2.members.iter().all(|m| m.pod.ends_with("-1")),
        "not all replaced: {g2:?}"
    );
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        st.repairs.by_cause.get("ProcessExit") == Some(&4),
        "{:?}",
        st.repairs
    );
    ensure!(
        st.progress.as_ref().map(|p| p.step) == Some(STEPS as i64),
        "{:?}",
        st.progress
    );
    for m in &g2.members {
        let p = pods(&ctx, &ns).get(&m.pod).await?;
        let log = log_of(&ctx, &p)?;
        ensure!(
            log.contains(&format!("at step {newest}")),
            "{} did not resume from step {newest}:\n{}",
            m.pod,
            log.lines().take(3).collect::<Vec<_>>().join("\n")
        );
    }
    println!(
        "whole job lost at step {reached}: resumed from checkpoint {newest}, {} steps repeated",
        reached - newest
    );
    Ok(())
}

/// The chart-installed operator's process is killed with SIGKILL mid-training: the Deployment's
/// pod restarts it in place, and the restarted operator adopts the job as it is — no duplicate or
/// replaced worker, no repair, no new generation — and the job completes.
async fn the_operator_pod_killed_mid_job_restarts_without_duplicates(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    ensure!(
        ctx.mode == OperatorMode::Chart,
        "needs the chart's operator pod"
    );
    // Enough steps that the job is still training when the restarted operator adopts it (digits
    // runs at about 200 steps/s here): checked below, so the test cannot pass vacuously.
    let job = training_job("digits", 3, 6000, json!({}));
    let g1 = submit(&ctx, &ns, &job, 3).await?;
    progress_until(&ctx, &ns, "digits", "step 100", |p| p.step >= 100).await?;
    let before: Vec<(String, Option<String>)> = worker_pods(&ctx, &ns, "digits")
        .await?
        .iter()
        .map(|p| (p.name_any(), p.uid()))
        .collect();

    let operator_pod = || operator_pod(&ctx);
    let op = operator_pod().await?;
    let pid = pid_of(&op)?;
    signal(pid, libc::SIGKILL);
    eventually(60, "the operator restarted in its pod", async || {
        let p = operator_pod().await?;
        Ok(restarts(&p) >= 1 && pid_of(&p).is_ok_and(|new| new != pid && alive(new)))
    })
    .await?;
    let st = job_status(&ctx.client, &ns, "digits").await?.status;
    ensure!(
        st.as_ref()
            .and_then(|s| s.completion_time.as_ref())
            .is_none(),
        "the job finished before the operator restarted: give it more steps"
    );

    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    let after: Vec<(String, Option<String>)> = worker_pods(&ctx, &ns, "digits")
        .await?
        .iter()
        .map(|p| (p.name_any(), p.uid()))
        .collect();
    ensure!(
        after == before,
        "workers before {before:?}, after {after:?}"
    );
    ensure!(
        st.repairs.total == 0 && st.ring.as_ref().map(|r| r.generation) == Some(g1 as i64),
        "{:?} {:?}",
        st.repairs,
        st.ring
    );
    let names: Vec<&str> = before.iter().map(|(n, _)| n.as_str()).collect();
    kept_their_process(&ctx, &ns, &names).await
}

/// The chart-installed operator's `diphoma_operator_worker_failures_total` by cause, from its
/// `/metrics` on its pod IP.
async fn operator_failures_metric(ctx: &Ctx) -> Result<std::collections::BTreeMap<String, i64>> {
    let ip = operator_pod(ctx)
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .context("operator pod IP")?;
    let addr = std::net::SocketAddr::new(ip.parse()?, 8080);
    let (status, body) = diphoma_e2e::cluster::http_get(addr, "/metrics").await?;
    ensure!(status.contains("200"), "{status}");
    let prefix = "diphoma_operator_worker_failures_total{cause=\"";
    Ok(body
        .lines()
        .filter_map(|l| {
            let (cause, n) = l.strip_prefix(prefix)?.split_once("\"} ")?;
            Some((cause.to_owned(), n.trim().parse().ok()?))
        })
        .filter(|(_, n)| *n > 0)
        .collect())
}

/// Six CPU workers (elastic 2-6); two running workers, chosen at random, killed with SIGKILL
/// every 3 s for a minute, and (`operator_kills`) the operator's process killed that many times
/// meanwhile. Once the ring is whole again, each kill is counted once, as `ProcessExit`, and no
/// live worker is counted at all (a member a generation behind, joining, or waiting on a dead
/// peer is not silent). Returns (kills, the job's status).
async fn churn(ctx: &Ctx, ns: &str, operator_kills: usize) -> Result<(usize, DiphomaJobStatus)> {
    let mut job = quick_job(
        ("stress", 6, 1_000_000),
        1000,
        DETECTION_SECONDS,
        json!({"spec": {"elastic": {"minReplicas": 2, "maxReplicas": 6},
            "runPolicy": {"backoffLimit": 1000}}}),
    );
    job.gpus_per_worker = 0;
    submit(ctx, ns, &job, 6).await?;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        | 1;
    eprintln!("churn seed {seed}");
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut killed: std::collections::BTreeSet<String> = Default::default();
    let rounds = 20;
    let operator_every = (rounds / (operator_kills + 1)).max(1);
    for round in 0..rounds {
        let mut running: Vec<(String, u32)> = worker_pods(ctx, ns, "stress")
            .await?
            .iter()
            .filter(|p| phase(p) == "Running" && p.metadata.deletion_timestamp.is_none())
            .filter(|p| !killed.contains(&p.name_any()))
            .filter_map(|p| Some((p.name_any(), pid_of(p).ok().filter(|pid| alive(*pid))?)))
            .collect();
        for _ in 0..2 {
            if running.is_empty() {
                break;
            }
            let (pod, pid) = running.remove((next() as usize) % running.len());
            signal(pid, libc::SIGKILL);
            killed.insert(pod);
        }
        if operator_kills > 0
            && round % operator_every == operator_every - 1
            && let Ok(pid) = pid_of(&operator_pod(ctx).await?)
        {
            signal(pid, libc::SIGKILL);
        }
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    }
    // The ring whole again: six live members, every one of them never killed.
    let mut st = DiphomaJobStatus::default();
    let whole = eventually(120, "the ring whole again", async || {
        st = status(ctx, ns, "stress").await?;
        let members: Vec<String> = st
            .ring
            .iter()
            .flat_map(|r| r.members.iter().map(|m| m.pod.clone()))
            .collect();
        Ok(st.phase == Some(Phase::Running)
            && members.len() == 6
            && members.iter().all(|m| !killed.contains(m)))
    })
    .await;
    whole.with_context(|| format!("{} killed; status {st:?}", killed.len()))?;
    // How often the operator found a blamed member alive (its log; timing decides how often).
    let op = operator_pod(ctx).await?;
    let vouched = ctx
        .kubelet
        .log_text(&op, "operator")
        .map(|l| {
            l.matches("answer their liveness ping or have exited")
                .count()
        })
        .unwrap_or(0);
    println!(
        "\n{} workers killed; blamed members found alive by the operator: {vouched} times",
        killed.len()
    );
    let counted = st.failures.total + st.disruptions.total;
    ensure!(
        counted as usize == killed.len()
            && st.failures.by_cause.get("ProcessExit").copied() == Some(killed.len() as i32),
        "{} workers killed ({killed:?}), status counts {:?} {:?} (last {:?})",
        killed.len(),
        st.failures,
        st.disruptions,
        st.last_failure
    );
    Ok((killed.len(), st))
}

/// Churn without operator kills: the counts are exact, and the operator's failures metric says
/// what the status says, cause by cause.
async fn under_churn_only_killed_workers_are_counted_and_the_metric_agrees(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let before = operator_failures_metric(&ctx).await?;
    let (_, st) = churn(&ctx, &ns, 0).await?;
    let after = operator_failures_metric(&ctx).await?;
    let rise: std::collections::BTreeMap<String, i64> = after
        .iter()
        .map(|(c, n)| (c.clone(), n - before.get(c).copied().unwrap_or(0)))
        .filter(|(_, n)| *n != 0)
        .collect();
    let mut counted: std::collections::BTreeMap<String, i64> = Default::default();
    for (c, n) in st.failures.by_cause.iter().chain(&st.disruptions.by_cause) {
        *counted.entry(c.clone()).or_default() += i64::from(*n);
    }
    ensure!(
        rise == counted,
        "the metric rose by {rise:?}, the status counts {counted:?}"
    );
    Ok(())
}

/// Churn with the operator's process killed three times meanwhile: still only the killed workers
/// are counted, each once.
async fn under_churn_with_the_operator_killed_only_killed_workers_are_counted(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    ensure!(
        ctx.mode == OperatorMode::Chart,
        "needs the chart's operator pod"
    );
    churn(&ctx, &ns, 3).await?;
    Ok(())
}

/// The `nvidia.com/gpu` limit and the env of worker pod `p`'s first container.
fn gpus_and_env(p: &Pod) -> (Option<String>, Vec<String>) {
    let c = p.spec.as_ref().and_then(|s| s.containers.first());
    let gpus = c
        .and_then(|c| {
            c.resources
                .as_ref()?
                .limits
                .as_ref()?
                .get("nvidia.com/gpu")
                .cloned()
        })
        .map(|q| q.0);
    let env = c
        .and_then(|c| c.env.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|e| format!("{}={}", e.name, e.value.unwrap_or_default()))
        .collect();
    (gpus, env)
}

/// Edits under a running ring: `gpusPerWorker` 1 -> 2, then an env var added to the template. A
/// ring never mixes specs: each edit replaces every worker at once (no failure counted), every
/// generation published is of one spec, the job says `SpecChanged`, and the new ring resumes
/// from the last checkpoint and trains to Succeeded.
async fn a_spec_edit_replaces_the_whole_ring_and_never_mixes_two_specs(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const STEPS: u64 = 8000;
    let (extra, _) = with_checkpoints(&ctx, &ns, 100)?;
    let job = training_job("digits", 4, STEPS, extra);
    let g1 = submit(&ctx, &ns, &job, 4).await?;
    // A merge patch replaces the container list: the same container, with an env var added.
    let mut containers = job.build()["spec"]["template"]["spec"]["containers"].clone();
    containers[0]["env"] = json!([{"name": "EXTRA_SETTING", "value": "1"}]);
    let edits = [
        json!({"spec": {"gpusPerWorker": 2}}),
        json!({"spec": {"template": {"spec": {"containers": containers}}}}),
    ];
    let mut generation = g1;
    for (n, edit) in edits.into_iter().enumerate() {
        progress_until(&ctx, &ns, "digits", "a checkpoint", |p| {
            p.last_checkpoint_step.is_some_and(|s| s >= 100)
        })
        .await?;
        let before: Vec<String> = worker_pods(&ctx, &ns, "digits")
            .await?
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && phase(p) == "Running")
            .map(|p| p.name_any())
            .collect();
        let what = format!("edit {n}: {edit}");
        jobs(&ctx, &ns)
            .patch("digits", &PatchParams::default(), &Patch::Merge(&edit))
            .await?;
        // Every generation seen until the ring is of new workers only is of one spec.
        eventually(120, "a ring of new workers only", async || {
            let Some(r) = ring(&ctx.client, &ns, "digits").await? else {
                return Ok(false);
            };
            let mut specs = std::collections::BTreeSet::new();
            for m in &r.members {
                if let Ok(p) = pods(&ctx, &ns).get(&m.pod).await {
                    specs.insert(gpus_and_env(&p));
                }
            }
            ensure!(
                specs.len() <= 1,
                "generation {} mixes specs: {specs:?} ({:?})",
                r.generation,
                r.members
            );
            Ok(r.generation > generation && r.members.iter().all(|m| !before.contains(&m.pod)))
        })
        .await
        .with_context(|| what.clone())?;
        generation = ring(&ctx.client, &ns, "digits")
            .await?
            .map_or(0, |r| r.generation);
        let reasons = event_reasons(&ctx, &ns, "digits").await?;
        ensure!(reasons.iter().any(|r| r == "SpecChanged"), "{reasons:?}");
    }
    let st = succeeded(&ctx, &ns, "digits", 240).await?;
    ensure!(
        st.failures.total == 0 && st.repairs.total == 0,
        "spec edits counted: {:?} {:?}",
        st.failures,
        st.repairs
    );
    let last = worker_pods(&ctx, &ns, "digits").await?;
    let rank0 = last
        .iter()
        .find(|p| {
            p.labels()
                .get(diphoma_contract::LABEL_RANK)
                .map(String::as_str)
                == Some("0")
        })
        .context("no rank 0")?;
    ensure!(
        gpus_and_env(rank0).0.as_deref() == Some("2")
            && gpus_and_env(rank0).1.iter().any(|e| e == "EXTRA_SETTING=1"),
        "{:?}",
        gpus_and_env(rank0)
    );
    ensure!(
        log_of(&ctx, rank0)?.contains("at step"),
        "the last ring did not resume from a checkpoint"
    );
    Ok(())
}

/// `kubectl delete dpj --cascade=orphan`, then the same manifest applied again: the new job's
/// ring is its own pods, its orphaned key Secret is re-keyed and its heartbeat ConfigMap emptied
/// and both taken over (owned by the new job), its reports arrive (`status.progress`, `Reporting`
/// True) and it trains to Succeeded; the orphaned workers' records are not taken for its own.
async fn a_job_applied_again_after_an_orphaning_delete_takes_over_its_children(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    let job = training_job("digits", 2, 4000, json!({}));
    submit(&ctx, &ns, &job, 2).await?;
    progress_until(&ctx, &ns, "digits", "step 50", |p| p.step >= 50).await?;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let key = |s: &Secret| s.data.clone().unwrap_or_default().into_values().next();
    let old_key = key(&secrets.get("digits-key").await?);
    let orphans: Vec<String> = worker_pods(&ctx, &ns, "digits")
        .await?
        .iter()
        .map(|p| p.name_any())
        .collect();
    jobs(&ctx, &ns)
        .delete(
            "digits",
            &kube::api::DeleteParams {
                propagation_policy: Some(kube::api::PropagationPolicy::Orphan),
                ..Default::default()
            },
        )
        .await?;
    eventually(30, "the job gone", async || {
        Ok(jobs(&ctx, &ns).get_opt("digits").await?.is_none())
    })
    .await?;
    let out = kubectl_apply(&ctx, &ns, &job.to_string())?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let uid = jobs(&ctx, &ns)
        .get("digits")
        .await?
        .uid()
        .unwrap_or_default();
    let owned = |refs: Option<
        Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    >| { refs.unwrap_or_default().iter().any(|o| o.uid == uid) };
    let configmaps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    eventually(
        60,
        "the key Secret and heartbeat ConfigMap taken over",
        async || {
            let s = secrets.get("digits-key").await?;
            let cm = configmaps.get("digits-heartbeat").await?;
            Ok(owned(s.metadata.owner_references.clone())
                && owned(cm.metadata.owner_references.clone()))
        },
    )
    .await?;
    ensure!(
        key(&secrets.get("digits-key").await?) != old_key,
        "the orphaned key was trusted, not re-keyed"
    );
    let ring = running_ring(&ctx, &ns, "digits", 2, 0).await?;
    ensure!(
        ring.members.iter().all(|m| !orphans.contains(&m.pod)),
        "{ring:?} holds orphans {orphans:?}"
    );
    let st = progress_until(&ctx, &ns, "digits", "the new job's progress", |p| {
        p.step > 0
    })
    .await?;
    ensure!(
        condition_reason(&st, "Reporting") == Some("ReportsArriving"),
        "{:?}",
        st.conditions
    );
    let st = succeeded(&ctx, &ns, "digits", 240).await?;
    ensure!(st.failures.total == 0, "{:?}", st.failures);
    // The orphaned workers are the user's now: stop them.
    for name in orphans {
        let _ = pods(&ctx, &ns)
            .delete(&name, &kube::api::DeleteParams::default())
            .await;
    }
    Ok(())
}

/// The chart-installed operator's one pod.
async fn operator_pod(ctx: &Ctx) -> Result<Pod> {
    let list = operator_pods(&ctx.client).await?;
    ensure!(list.len() == 1, "{} operator pods", list.len());
    Ok(list.into_iter().next().unwrap())
}

/// A node that stops heartbeating with its processes frozen (not the operator's node): its
/// worker is declared lost within detectionSeconds (plus the Lease renewal period and a
/// reconcile), counted once, replaced on another node, and the job completes.
async fn a_lost_node_is_detected_and_its_worker_moves(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    // Enough steps that the job is still training when the node freezes (digits runs at about
    // 200 steps/s here, and progress reaches the status seconds late).
    let job = training_job("digits", 3, 4000, json!({}));
    submit(&ctx, &ns, &job, 3).await?;
    progress_until(&ctx, &ns, "digits", "step 100", |p| p.step >= 100).await?;
    let node_of = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
    let operator_node = node_of(&operator_pod(&ctx).await?);
    let victim = worker_pods(&ctx, &ns, "digits")
        .await?
        .into_iter()
        .find(|p| node_of(p).is_some() && node_of(p) != operator_node)
        .context("a worker off the operator's node")?;
    let node = node_of(&victim).unwrap();
    ctx.kubelet
        .fail_node(&node, diphoma_e2e::kubelet::FailMode::Freeze)?;
    let st = job_status(&ctx.client, &ns, "digits").await?.status;
    ensure!(
        st.as_ref()
            .and_then(|s| s.completion_time.as_ref())
            .is_none(),
        "the job finished before its node froze: give it more steps"
    );
    // NodeLost: the Lease is stale, or late when the neighbours' timed-out collectives blame the
    // silent worker (a disruption). Hung if those reports are judged before a whole renewal is
    // missed (a renewal just before the freeze; the job's own failure).
    let lost = |s: &DiphomaJobStatus| {
        s.failures.total + s.disruptions.total == 1
            && (s.disruptions.by_cause.get("NodeLost") == Some(&1)
                || s.failures.by_cause.get("Hung") == Some(&1))
    };
    // detectionSeconds, plus the Lease renewal period (2 s), plus reconciles on a loaded machine.
    eventually(
        DETECTION_SECONDS + 6,
        "the worker on the frozen node counted lost",
        async || {
            let st = job_status(&ctx.client, &ns, "digits").await?.status;
            Ok(st.as_ref().is_some_and(lost))
        },
    )
    .await
    .with_context(|| format!("frozen node {node}"))?;
    let st = succeeded(&ctx, &ns, "digits", 180).await?;
    ensure!(
        lost(&st) && st.repairs.total == 1,
        "{:?} {:?} {:?}",
        st.failures,
        st.disruptions,
        st.repairs
    );
    let index = victim
        .labels()
        .get(diphoma_contract::LABEL_REPLICA_INDEX)
        .cloned();
    let replacement = worker_pods(&ctx, &ns, "digits")
        .await?
        .into_iter()
        .find(|p| {
            p.labels().get(diphoma_contract::LABEL_REPLICA_INDEX) == index.as_ref()
                && p.name_any() != victim.name_any()
        })
        .context("no replacement worker")?;
    ensure!(
        node_of(&replacement).is_some_and(|n| n != node),
        "the replacement runs on {:?}, the lost node is {node}",
        node_of(&replacement)
    );
    Ok(())
}
