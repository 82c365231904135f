//! Queues and suspension on the local control plane, with real Kueue (v0.17, started by
//! `e2e/cluster/start-kueue.sh` with DiphomaJob as an external framework) and real
//! `diphoma-worker train` workers under the in-process operator: suspension semantics
//! (`activeDeadlineSeconds` does not run while suspended), `spec.managedBy`, admission behind a
//! LocalQueue whose quota fits one job, preemption by a higher-priority job, and all-or-nothing
//! admission (`waitForPodsReady`, on for the whole suite: the operator writes `PodsReady`), and
//! scaling through Kueue's workload slices (`ElasticJobsViaWorkloadSlices` on). Prints the
//! admission latency (Workload admitted → ring formed) and the time a preempted job takes to
//! resume.

mod common;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_contract::Membership;
use diphoma_e2e::kit::JobManifest;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJobStatus, Phase};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

/// GPUs per node (2 nodes: 4 GPUs); every ClusterQueue here has a quota of [`QUOTA`].
const GPUS_PER_NODE: u32 = 2;
/// `nvidia.com/gpu` quota of each test's ClusterQueue: one 2-worker job.
const QUOTA: usize = 2;

fn main() -> Result<()> {
    init_tracing();
    let nodes = (0..2)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), GPUS_PER_NODE))
        .collect();
    let rt = runtime()?;
    // Kueue first (its Workload API must be served when the operator starts), then the operator.
    let ctx = Ctx::start(
        &rt,
        nodes,
        OperatorMode::None,
        diphoma_e2e::kubelet::Runtime::Process,
    )?;
    ctx.cp.install_crd()?;
    ctx.cp.start_kueue()?;
    rt.block_on(async { ctx.start_operator() });
    let list = tests![
        a_suspended_job_whose_deadline_is_shorter_than_its_suspension_still_runs,
        a_job_managed_by_another_controller_is_left_alone_and_managed_by_is_immutable,
        two_jobs_behind_a_quota_for_one_run_one_after_the_other_never_over_quota,
        a_preempted_job_is_suspended_and_resumes_from_its_checkpoint_with_its_counters,
        a_refused_workload_shows_in_the_job_status_and_is_created_once_allowed,
        suspending_an_admitted_job_releases_its_quota_to_the_next,
        under_wait_for_pods_ready_a_job_that_cannot_recover_is_requeued_and_the_queue_moves_on,
        an_admission_checks_pod_set_updates_reach_the_workers,
        an_admitted_elastic_job_scales_through_workload_slices_without_stopping_its_workers,
    ];
    let trials = trials(&rt, &ctx, |c: &Ctx| &c.client, list);
    let conclusion = libtest_mimic::run(&sequential_args(), trials);
    ctx.shutdown(&rt)?;
    conclusion.exit()
}

/// A digits training job of `replicas` workers (1 GPU each) for `steps` steps.
fn training_job(name: &str, replicas: i32, steps: u64, extra: Value) -> JobManifest {
    quick_job((name, replicas, steps), 10, 4, extra)
}

fn kueue(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    )
}

/// A ResourceFlavor `gpu` (the GPU nodes' product label), a ClusterQueue named after the test's
/// namespace with a quota of [`QUOTA`] GPUs (preemption of lower priorities within it), a
/// LocalQueue `team` in the namespace, and WorkloadPriorityClasses `low` and `high`.
fn queues(ctx: &Ctx, ns: &str) -> Result<()> {
    let docs = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "gpu"},
         "spec": {"nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": ns},
         "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
           "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
             {"name": "gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": QUOTA}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": ns}, "spec": {"clusterQueue": ns}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
         "metadata": {"name": "low"}, "value": 10},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
         "metadata": {"name": "high"}, "value": 1000},
    ]});
    apply_json(ctx, ns, &docs)
}

/// The manifest fragment that queues a job in LocalQueue `team`, with a priority class.
fn queued(priority: &str) -> Value {
    json!({"metadata": {"labels": {
        "kueue.x-k8s.io/queue-name": "team",
        "kueue.x-k8s.io/priority-class": priority,
    }}})
}

fn merge(mut a: Value, b: Value) -> Value {
    diphoma_e2e::kit::merge(&mut a, b);
    a
}

/// The job's Workload, if any.
async fn workload(ctx: &Ctx, ns: &str, job: &str) -> Result<Option<DynamicObject>> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), ns, &kueue("Workload", "workloads"));
    Ok(api.get_opt(&format!("diphomajob-{job}")).await?)
}

fn workload_condition(w: &DynamicObject, type_: &str) -> Option<(String, String)> {
    w.data
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_ && c["status"] == "True")
        .map(|c| {
            (
                c["reason"].as_str().unwrap_or_default().to_owned(),
                c["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

fn condition(st: &DiphomaJobStatus, type_: &str) -> Option<(String, String, String)> {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// The job's status and its Workload, for a failure message.
fn last_words(ctx: &Ctx, ns: &str, job: &str) -> String {
    let (ctx, ns, job) = (ctx.cp.kubectl(), ns.to_owned(), job.to_owned());
    let mut ctx = ctx;
    let out = ctx
        .args(["-n", &ns, "get", "diphomajob", &job, "-o", "json"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let v: Value = serde_json::from_str(&out).unwrap_or_default();
    let w = std::process::Command::new(ctx.get_program())
        .envs(ctx.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .args(["-n", &ns, "get", "workloads.kueue.x-k8s.io", "-o", "json"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let w: Value = serde_json::from_str(&w).unwrap_or_default();
    format!(
        "status {} workloads {}",
        v["status"],
        w["items"]
            .as_array()
            .map(|a| a
                .iter()
                .map(|i| json!({"name": i["metadata"]["name"], "status": i["status"]}))
                .collect::<Vec<_>>())
            .unwrap_or_default()
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// The last lines of Kueue's log that name `job`'s Workload, for a failure message.
fn kueue_says(ctx: &Ctx, job: &str) -> String {
    let log = std::fs::read_to_string(ctx.cp.dir.join("logs/kueue.log")).unwrap_or_default();
    let name = format!("diphomajob-{job}");
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(&name)).collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

/// Worker pods of `ns` that hold GPUs now (not finished), by job.
async fn gpu_holders(ctx: &Ctx, ns: &str) -> Result<Vec<String>> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().labels("diphoma.io/job-name"))
        .await?
        .items;
    Ok(pods
        .into_iter()
        .filter(|p| !matches!(phase(p), "Succeeded" | "Failed"))
        .map(|p| p.name_any())
        .collect())
}

/// A checkpoint directory for the jobs of `ns` (a hostPath on this machine) and the manifest
/// fragment that checkpoints into it every 50 steps.
fn checkpoints(ctx: &Ctx, ns: &str) -> Result<(std::path::PathBuf, Value)> {
    let dir = ctx.cp.dir.join("checkpoints").join(ns);
    std::fs::create_dir_all(&dir)?;
    let ckpt = json!({"spec": {
        "checkpoint": {"volume": "ckpt", "everySteps": 50},
        "template": {"spec": {"volumes": [{"name": "ckpt", "hostPath": {"path": dir}}]}},
    }});
    Ok((dir, ckpt))
}

/// Waits until `job` reports a checkpoint at step `step` or later.
async fn checkpointed(ctx: &Ctx, ns: &str, job: &str, step: i64) -> Result<()> {
    eventually(90, &format!("a checkpoint of {job}"), async || {
        let st = status(ctx, ns, job).await?;
        Ok(st
            .progress
            .and_then(|p| p.last_checkpoint_step)
            .is_some_and(|s| s >= step))
    })
    .await
}

/// The step of `job`'s newest checkpoint file in `dir` ([`checkpoints`]).
async fn newest_checkpoint(ctx: &Ctx, dir: &std::path::Path, ns: &str, job: &str) -> Result<u64> {
    let uid = jobs(ctx, ns).get(job).await?.uid().context("no uid")?;
    std::fs::read_dir(dir.join(ns).join(job).join(uid))?
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("ckpt-")?
                .strip_suffix(".safetensors")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .context("no checkpoint")
}

/// Checks that rank 0 of `ring` started training from step `step` (its first log lines).
async fn resumed_from(ctx: &Ctx, ns: &str, ring: &Membership, step: u64) -> Result<()> {
    let rank0 = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .get(&ring.members[0].pod)
        .await?;
    let mut log = String::new();
    eventually(30, "the resumed rank 0's first log lines", async || {
        log = ctx.kubelet.log_text(&rank0, "worker")?;
        Ok(log.contains(" at step "))
    })
    .await?;
    ensure!(
        log.contains(&format!("at step {step}")),
        "the resumed rank 0 did not start from step {step}:\n{}",
        log.lines().take(5).collect::<Vec<_>>().join("\n")
    );
    Ok(())
}

/// The job's Workload's `PodsReady` condition (status, reason), if any.
fn pods_ready(w: &DynamicObject) -> Option<(String, String)> {
    let c = w
        .data
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodsReady")?;
    let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some((s("status"), s("reason")))
}

/// An admission check (as a ProvisioningRequest or a custom controller runs one) whose
/// controller is this test: the ClusterQueue of `ns` requires it; once the job's Workload has
/// its quota reserved, the test marks the check Ready with `podSetUpdates` (a label, an
/// annotation, a node selector, a toleration), Kueue admits the Workload, and the workers the
/// operator creates carry all four.
async fn an_admission_checks_pod_set_updates_reach_the_workers(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    let check = format!("{ns}-check");
    let checks = Api::<DynamicObject>::all_with(
        ctx.client.clone(),
        &kueue("AdmissionCheck", "admissionchecks"),
    );
    let ac = json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
        "metadata": {"name": check}, "spec": {"controllerName": "diphoma.io/e2e-check"}});
    checks
        .create(&Default::default(), &serde_json::from_value(ac)?)
        .await?;
    let active = json!({"status": {"conditions": [{"type": "Active", "status": "True",
        "reason": "Active", "message": "the e2e test runs it", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    checks
        .patch_status(&check, &PatchParams::default(), &Patch::Merge(active))
        .await?;
    let cqs =
        Api::<DynamicObject>::all_with(ctx.client.clone(), &kueue("ClusterQueue", "clusterqueues"));
    let strategy =
        json!({"spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": check}]}}});
    cqs.patch(&ns, &PatchParams::default(), &Patch::Merge(strategy))
        .await?;
    let job = training_job("checked", 2, 200, queued("low"));
    apply_json(&ctx, &ns, &job.build())?;
    let workloads = Api::<DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &ns,
        &kueue("Workload", "workloads"),
    );
    eventually(
        60,
        "the Workload's quota reserved, its check pending",
        async || {
            let Some(w) = workload(&ctx, &ns, "checked").await? else {
                return Ok(false);
            };
            Ok(workload_condition(&w, "QuotaReserved").is_some()
                && w.data.pointer("/status/admissionChecks/0/state") == Some(&json!("Pending")))
        },
    )
    .await
    .with_context(|| last_words(&ctx, &ns, "checked"))?;
    let ready = json!({"status": {"admissionChecks": [{"name": check, "state": "Ready",
        "message": "provisioned", "lastTransitionTime": "2026-01-01T00:00:00Z",
        "podSetUpdates": [{"name": "workers",
            "labels": {"provisioned-by": "e2e-check"},
            "annotations": {"e2e.diphoma.io/request": "pr-1"},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "e2e.diphoma.io/reserved", "operator": "Exists", "effect": "NoSchedule"}]}]}]}});
    workloads
        .patch_status(
            "diphomajob-checked",
            &PatchParams::default(),
            &Patch::Merge(ready),
        )
        .await?;
    let ring = running_ring(&ctx, &ns, "checked", 2, 0).await?;
    for m in &ring.members {
        let pod = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
            .get(&m.pod)
            .await?;
        let label = pod.labels().get("provisioned-by").cloned();
        let note = pod.annotations().get("e2e.diphoma.io/request").cloned();
        let spec = pod.spec.unwrap_or_default();
        let selector = spec.node_selector.unwrap_or_default();
        let tolerated = spec
            .tolerations
            .unwrap_or_default()
            .iter()
            .any(|t| t.key.as_deref() == Some("e2e.diphoma.io/reserved"));
        ensure!(
            label.as_deref() == Some("e2e-check")
                && note.as_deref() == Some("pr-1")
                && selector.get("nvidia.com/gpu.present").map(String::as_str) == Some("true")
                && tolerated,
            "{}: label {label:?}, annotation {note:?}, node selector {selector:?}, tolerated {tolerated}",
            m.pod
        );
    }
    let st = finished(&ctx, &ns, "checked", 120).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    checks.delete(&check, &Default::default()).await?;
    Ok(())
}

/// Marks both nodes (un)schedulable.
async fn cordon(ctx: &Ctx, unschedulable: bool) -> Result<()> {
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone());
    for i in 0..2 {
        let body = json!({"spec": {"unschedulable": unschedulable}});
        let node = format!("gpu-{i}");
        nodes
            .patch(&node, &PatchParams::default(), &Patch::Merge(body))
            .await?;
    }
    Ok(())
}

/// Kueue's all-or-nothing admission (`waitForPodsReady`, configured by start-kueue.sh:
/// `recoveryTimeout` 20 s, `blockAdmission`): the operator writes the Workload's `PodsReady`
/// from the ring (True `Started` once both workers are ring members). A worker lost while both
/// nodes are cordoned cannot be replaced: `PodsReady` turns False (`WaitForRecovery`), and at the
/// recovery timeout Kueue evicts the job, which is suspended, its workers gone, and requeued.
/// The queue is not blocked behind it: a second job (tolerating the cordon) is admitted and
/// succeeds. Once the nodes are schedulable again the first is admitted again and resumes from
/// its checkpoint.
async fn under_wait_for_pods_ready_a_job_that_cannot_recover_is_requeued_and_the_queue_moves_on(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let r = cannot_recover(&ctx, &ns).await;
    cordon(&ctx, false).await?; // the nodes are shared with the suite's other tests
    r
}

async fn cannot_recover(ctx: &Ctx, ns: &str) -> Result<()> {
    queues(ctx, ns)?;
    let (dir, ckpt) = checkpoints(ctx, ns)?;
    let first = training_job("first", 2, 100_000, merge(queued("low"), ckpt));
    apply_json(ctx, ns, &first.build())?;
    let g1 = running_ring(ctx, ns, "first", 2, 0).await?;
    eventually(60, "first's Workload PodsReady", async || {
        let w = workload(ctx, ns, "first").await?.context("no Workload")?;
        Ok(pods_ready(&w) == Some(("True".into(), "Started".into())))
    })
    .await
    .with_context(|| last_words(ctx, ns, "first"))?;
    checkpointed(ctx, ns, "first", 50).await?;
    // A worker lost, its replacement unschedulable: PodsReady False, waiting for recovery.
    cordon(ctx, true).await?;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns);
    pods.delete(&g1.members[1].pod, &Default::default()).await?;
    eventually(60, "first's Workload waiting for recovery", async || {
        let w = workload(ctx, ns, "first").await?.context("no Workload")?;
        Ok(pods_ready(&w) == Some(("False".into(), "WaitForRecovery".into())))
    })
    .await
    .with_context(|| last_words(ctx, ns, "first"))?;
    let tolerant = json!({"spec": {"placement": {"tolerations": [
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}]}}});
    let second = training_job("second", 2, 200, merge(queued("low"), tolerant));
    apply_json(ctx, ns, &second.build())?;
    // Evicted at the recovery timeout, suspended with Kueue's reason; its workers go.
    let mut evicted = None;
    eventually(90, "first evicted and suspended", async || {
        let st = status(ctx, ns, "first").await?;
        if st.phase == Some(Phase::Suspended) {
            evicted = condition(&st, "Suspended");
        }
        Ok(evicted.is_some())
    })
    .await
    .with_context(|| {
        format!(
            "{}\nKueue: {}",
            last_words(ctx, ns, "first"),
            kueue_says(ctx, "first")
        )
    })?;
    let (_, reason, message) = evicted.unwrap();
    ensure!(
        reason == "PodsReadyTimeout",
        "suspended with {reason}: {message}"
    );
    // The queue moves on: second is admitted on the quota first released, and succeeds.
    let st = finished(ctx, ns, "second", 150)
        .await
        .with_context(|| last_words(ctx, ns, "second"))?;
    ensure!(st.phase == Some(Phase::Succeeded), "second: {st:?}");
    let newest = newest_checkpoint(ctx, &dir, ns, "first").await?;
    cordon(ctx, false).await?;
    let g2 = running_ring(ctx, ns, "first", 2, g1.generation).await?;
    resumed_from(ctx, ns, &g2, newest).await?;
    Ok(())
}

async fn a_suspended_job_whose_deadline_is_shorter_than_its_suspension_still_runs(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const DEADLINE: i64 = 4;
    let extra =
        json!({"spec": {"runPolicy": {"suspend": true, "activeDeadlineSeconds": DEADLINE}}});
    apply_json(
        &ctx,
        &ns,
        &training_job("digits", 2, 100_000, extra).build(),
    )?;
    // Suspended for longer than its deadline: never DeadlineExceeded, no start time, no worker.
    let mut st = DiphomaJobStatus::default();
    eventually(30, "digits Suspended", async || {
        st = status(&ctx, &ns, "digits").await?;
        Ok(st.phase == Some(Phase::Suspended))
    })
    .await?;
    tokio::time::sleep(std::time::Duration::from_secs(DEADLINE as u64 * 2)).await;
    let st = status(&ctx, &ns, "digits").await?;
    ensure!(
        st.phase == Some(Phase::Suspended) && st.start_time.is_none(),
        "while suspended: {st:?}"
    );
    ensure!(
        gpu_holders(&ctx, &ns).await?.is_empty(),
        "workers while suspended"
    );
    let resumed = jiff::Timestamp::now();
    jobs(&ctx, &ns)
        .patch(
            "digits",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runPolicy": {"suspend": false}}})),
        )
        .await?;
    running_ring(&ctx, &ns, "digits", 2, 0).await?;
    let st = status(&ctx, &ns, "digits").await?;
    let start: jiff::Timestamp = st.start_time.as_deref().context("no startTime")?.parse()?;
    ensure!(
        start >= resumed - jiff::SignedDuration::from_secs(1),
        "startTime {start} is not the resumption ({resumed})"
    );
    // And the deadline then runs from the resumption: it fails DeadlineExceeded, after it.
    let st = finished(&ctx, &ns, "digits", 60).await?;
    ensure!(
        st.phase == Some(Phase::Failed)
            && condition(&st, "Failed").is_some_and(|c| c.1 == "DeadlineExceeded"),
        "{st:?}"
    );
    Ok(())
}

async fn a_job_managed_by_another_controller_is_left_alone_and_managed_by_is_immutable(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let other = json!({"spec": {"managedBy": "kueue.x-k8s.io/multikueue"}});
    apply_json(&ctx, &ns, &training_job("remote", 2, 100, other).build())?;
    // A job of this operator's, created after it: once it runs, the operator has seen both.
    start_job(&ctx, &ns, &training_job("local", 2, 100_000, json!({})), 2).await?;
    let remote = jobs(&ctx, &ns).get("remote").await?;
    ensure!(
        remote.status.is_none(),
        "status written: {:?}",
        remote.status
    );
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default().labels("diphoma.io/job-name=remote"))
        .await?;
    ensure!(
        pods.items.is_empty(),
        "workers created for a job managed elsewhere"
    );
    let svc = Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .get_opt("remote")
        .await?;
    ensure!(
        svc.is_none(),
        "a Service created for a job managed elsewhere"
    );
    // Immutable: changing, removing or adding managedBy is refused by the API server.
    let attempts = [
        (
            "remote",
            json!({"spec": {"managedBy": "diphoma.io/operator"}}),
        ),
        ("remote", json!({"spec": {"managedBy": null}})),
        (
            "local",
            json!({"spec": {"managedBy": "kueue.x-k8s.io/multikueue"}}),
        ),
    ];
    for (job, patch) in attempts {
        let r = jobs(&ctx, &ns)
            .patch(job, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        let err = r
            .err()
            .with_context(|| format!("{job}: {patch} was accepted"))?;
        ensure!(err.to_string().contains("managedBy is immutable"), "{err}");
    }
    // Writing the default explicitly (this operator's name) changes nothing, and is accepted.
    let same = json!({"spec": {"managedBy": diphoma_operator::api::CONTROLLER_NAME}});
    jobs(&ctx, &ns)
        .patch("local", &PatchParams::default(), &Patch::Merge(&same))
        .await
        .context("managedBy: the default written explicitly was refused")?;
    Ok(())
}

async fn two_jobs_behind_a_quota_for_one_run_one_after_the_other_never_over_quota(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    let first = training_job("first", 2, 300, queued("low"));
    let second = training_job("second", 2, 300, queued("low"));
    let t0 = Instant::now();
    apply_json(&ctx, &ns, &first.build())?;
    // Admission latency: the Workload admitted → the ring formed (this test's polls, 200 ms).
    let (mut admitted, mut formed) = (None, None);
    eventually(90, "first admitted and running", async || {
        if admitted.is_none()
            && let Some(w) = workload(&ctx, &ns, "first").await?
            && workload_condition(&w, "Admitted").is_some()
        {
            admitted = Some(Instant::now());
        }
        let j = job_status(&ctx.client, &ns, "first").await?;
        if admitted.is_some() && phase_of(&j) == Some(Phase::Running) {
            formed = Some(Instant::now());
        }
        Ok(formed.is_some())
    })
    .await
    .with_context(|| format!("first: {:?}", last_words(&ctx, &ns, "first")))?;
    apply_json(&ctx, &ns, &second.build())?;
    // The second waits, suspended, with Kueue's reason; the quota is never exceeded.
    let mut max_holders = 0;
    let mut waited_with = None;
    let mut first_done = None;
    eventually(200, "second Succeeded after first", async || {
        let holders = gpu_holders(&ctx, &ns).await?;
        max_holders = max_holders.max(holders.len());
        ensure!(holders.len() <= QUOTA, "over quota: {holders:?}");
        let f = status(&ctx, &ns, "first").await?;
        let s = status(&ctx, &ns, "second").await?;
        if first_done.is_none() && f.phase.is_some_and(Phase::is_terminal) {
            first_done = Some(f.clone());
        }
        if first_done.is_none() {
            ensure!(
                !holders.iter().any(|p| p.starts_with("second-")),
                "second runs while first does: {holders:?}"
            );
            if s.phase == Some(Phase::Suspended) {
                waited_with = condition(&s, "Suspended");
            }
        }
        Ok(s.phase == Some(Phase::Succeeded))
    })
    .await?;
    let f = first_done.context("first never finished")?;
    ensure!(f.phase == Some(Phase::Succeeded), "first: {f:?}");
    let (st, reason, message) = waited_with.context("second was never seen suspended")?;
    ensure!(
        st == "True" && reason == "Pending" && message.contains("insufficient unused quota"),
        "second waited with {reason}: {message}"
    );
    let w = workload(&ctx, &ns, "first").await?.context("no Workload")?;
    ensure!(
        workload_condition(&w, "Finished").is_some(),
        "first's Workload not Finished"
    );
    let latency = formed.unwrap() - admitted.unwrap();
    println!(
        "\nKueue admission latency (Workload admitted → ring formed, 2 workers): {:.2} s; \
         created → running {:.2} s; most GPU workers at once {max_holders} (quota {QUOTA})",
        latency.as_secs_f64(),
        (formed.unwrap() - t0).as_secs_f64()
    );
    Ok(())
}

async fn a_preempted_job_is_suspended_and_resumes_from_its_checkpoint_with_its_counters(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    let (dir, ckpt) = checkpoints(&ctx, &ns)?;
    let low = training_job("low", 2, 100_000, merge(queued("low"), ckpt));
    apply_json(&ctx, &ns, &low.build())?;
    let g1 = running_ring(&ctx, &ns, "low", 2, 0).await?.generation;
    checkpointed(&ctx, &ns, "low", 50).await?;
    let before = status(&ctx, &ns, "low").await?;
    let high = training_job("high", 2, 200, queued("high"));
    let t_high = Instant::now();
    apply_json(&ctx, &ns, &high.build())?;
    // Preempted: low is suspended with Kueue's reason, its workers go; high runs.
    let mut suspended = None;
    eventually(90, "low suspended by a preemption", async || {
        let st = status(&ctx, &ns, "low").await?;
        let holders = gpu_holders(&ctx, &ns).await?;
        ensure!(holders.len() <= QUOTA, "over quota: {holders:?}");
        if st.phase == Some(Phase::Suspended) {
            suspended = condition(&st, "Suspended");
        }
        Ok(suspended.is_some())
    })
    .await?;
    let t_suspended = Instant::now();
    let (_, reason, message) = suspended.unwrap();
    ensure!(reason == "Preempted", "suspended with {reason}: {message}");
    // The newest checkpoint once low's workers are gone (rank 0 may write one more as it stops).
    eventually(30, "low's workers gone", async || {
        Ok(!gpu_holders(&ctx, &ns)
            .await?
            .iter()
            .any(|p| p.starts_with("low-")))
    })
    .await?;
    let newest = newest_checkpoint(&ctx, &dir, &ns, "low").await?;
    let mut high_done = None;
    eventually(150, "high Succeeded", async || {
        let holders = gpu_holders(&ctx, &ns).await?;
        ensure!(holders.len() <= QUOTA, "over quota: {holders:?}");
        let st = status(&ctx, &ns, "high").await?;
        if st.phase.is_some_and(Phase::is_terminal) {
            high_done = Some(st);
        }
        Ok(high_done.is_some())
    })
    .await?;
    ensure!(
        high_done.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded),
        "{high_done:?}"
    );
    let t_high_done = Instant::now();
    // Low is admitted again and resumes from its checkpoint, its counters unchanged.
    let g2 = running_ring(&ctx, &ns, "low", 2, g1).await?;
    let t_resumed = Instant::now();
    let after = status(&ctx, &ns, "low").await?;
    ensure!(
        after.failures == before.failures
            && after.repairs == before.repairs
            && after.disruptions == before.disruptions,
        "counters changed by the preemption: {:?} {:?} {:?} → {:?} {:?} {:?}",
        before.failures,
        before.repairs,
        before.disruptions,
        after.failures,
        after.repairs,
        after.disruptions
    );
    resumed_from(&ctx, &ns, &g2, newest).await?;
    println!(
        "\nKueue preemption: high submitted → low suspended {:.2} s; high finished → low's \
         ring formed again {:.2} s (resumed from step {newest})",
        (t_suspended - t_high).as_secs_f64(),
        (t_resumed - t_high_done).as_secs_f64()
    );
    Ok(())
}

async fn a_refused_workload_shows_in_the_job_status_and_is_created_once_allowed(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    // A ResourceQuota of no Kueue Workload: the API server refuses the job's.
    let quota = json!({"apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "no-workloads"},
        "spec": {"hard": {"count/workloads.kueue.x-k8s.io": "0"}}});
    apply_json(&ctx, &ns, &quota)?;
    apply_json(
        &ctx,
        &ns,
        &training_job("refused", 2, 300, queued("low")).build(),
    )?;
    let mut said = None;
    eventually(60, "the refusal in the job's status", async || {
        let st = status(&ctx, &ns, "refused").await?;
        said = condition(&st, "Suspended").filter(|(s, reason, m)| {
            s == "True" && reason == "WorkloadRefused" && m.contains("quota")
        });
        Ok(said.is_some())
    })
    .await
    .with_context(|| last_words(&ctx, &ns, "refused"))?;
    ensure!(
        workload(&ctx, &ns, "refused").await?.is_none(),
        "a Workload despite the quota"
    );
    // Allowed again: the Workload is created (the reconcile retries with back-off), the job runs.
    Api::<k8s_openapi::api::core::v1::ResourceQuota>::namespaced(ctx.client.clone(), &ns)
        .delete("no-workloads", &Default::default())
        .await?;
    let st = finished(&ctx, &ns, "refused", 150).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    println!(
        "\nrefused Workload, as the job's status said: {:?}",
        said.unwrap().2
    );
    Ok(())
}

async fn suspending_an_admitted_job_releases_its_quota_to_the_next(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    apply_json(
        &ctx,
        &ns,
        &training_job("first", 2, 1_000_000, queued("low")).build(),
    )?;
    let g1 = running_ring(&ctx, &ns, "first", 2, 0).await?.generation;
    apply_json(
        &ctx,
        &ns,
        &training_job("second", 2, 300, queued("low")).build(),
    )?;
    eventually(60, "second queued behind first", async || {
        let st = status(&ctx, &ns, "second").await?;
        Ok(condition(&st, "Suspended").is_some_and(|c| c.0 == "True" && c.1 == "Pending"))
    })
    .await?;
    // The user suspends first: its Workload is deactivated, the quota goes to second.
    let t0 = Instant::now();
    jobs(&ctx, &ns)
        .patch(
            "first",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runPolicy": {"suspend": true}}})),
        )
        .await?;
    let st = finished(&ctx, &ns, "second", 150)
        .await
        .with_context(|| last_words(&ctx, &ns, "first"))?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    let ran = t0.elapsed();
    let w = workload(&ctx, &ns, "first").await?.context("no Workload")?;
    ensure!(
        w.data.pointer("/spec/active") == Some(&json!(false)),
        "first's Workload still active: {:?}",
        w.data.get("spec")
    );
    // Resumed: activated again, admitted, running.
    jobs(&ctx, &ns)
        .patch(
            "first",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runPolicy": {"suspend": false}}})),
        )
        .await?;
    running_ring(&ctx, &ns, "first", 2, g1).await?;
    println!(
        "\nfirst suspended by its user → second (queued) succeeded {:.2} s later",
        ran.as_secs_f64()
    );
    Ok(())
}

/// The job's Workloads (its slices) by name: (count, finished reason, admitted).
async fn slices_of(ctx: &Ctx, ns: &str) -> Result<Vec<(String, i64, Option<String>, bool)>> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), ns, &kueue("Workload", "workloads"));
    let mut out: Vec<_> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|w| {
            let count = w
                .data
                .pointer("/spec/podSets/0/count")
                .and_then(Value::as_i64);
            let finished = workload_condition(&w, "Finished").map(|(r, _)| r);
            let admitted = workload_condition(&w, "Admitted").is_some();
            (w.name_any(), count.unwrap_or_default(), finished, admitted)
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Kueue's workload slices (its `ElasticJobsViaWorkloadSlices`, on in this suite) for a job
/// annotated `kueue.x-k8s.io/elastic-job: "true"`, behind a quota of 2 GPUs: a scale-up of the
/// admitted job is a new slice that Kueue admits in place of the old one (finished
/// `WorkloadSliceReplaced`), a scale-down shrinks the admitted slice in place, and a scale-up
/// past the quota is a slice admitted partially (its `minCount` is `minReplicas`), which the
/// job's `status.waiting` says; a changed
/// `minReplicas` replaces the Workload (the workers stop) under a new name. Until then, worker 0
/// is never restarted (Kueue finishes the old slice before it admits the new one: the job is
/// not suspended in between), no failure is counted, the job is never suspended, and never
/// more than the quota holds GPUs.
/// On the old operator each scaling deleted the Workload and stopped every worker.
async fn an_admitted_elastic_job_scales_through_workload_slices_without_stopping_its_workers(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    queues(&ctx, &ns)?;
    let elastic = json!({
        "metadata": {"annotations": {"kueue.x-k8s.io/elastic-job": "true"}},
        "spec": {"elastic": {"minReplicas": 1, "maxReplicas": 3}},
    });
    let job = training_job("el", 1, 1_000_000, merge(queued("low"), elastic));
    apply_json(&ctx, &ns, &job.build())?;
    let mut g = running_ring(&ctx, &ns, "el", 1, 0).await?.generation;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns);
    let uid0 = pods.get("el-worker-0").await?.uid();
    let scale = async |n: i32| -> Result<()> {
        jobs(&ctx, &ns)
            .patch(
                "el",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": n}})),
            )
            .await?;
        Ok(())
    };
    // Never suspended, never over quota, worker 0 never replaced.
    let steady = async || -> Result<()> {
        let holders = gpu_holders(&ctx, &ns).await?;
        ensure!(holders.len() <= QUOTA, "over quota: {holders:?}");
        let st = status(&ctx, &ns, "el").await?;
        ensure!(
            st.phase != Some(Phase::Suspended),
            "suspended: {:?}",
            condition(&st, "Suspended")
        );
        ensure!(
            st.failures.total == 0,
            "failures counted: {:?}",
            st.failures
        );
        let now = pods.get_opt("el-worker-0").await?.and_then(|p| p.uid());
        ensure!(now == uid0, "el-worker-0 was replaced");
        Ok(())
    };
    // 1 → 2: a new slice, admitted in place of the first.
    scale(2).await?;
    let mut ring = None;
    eventually(90, "a ring of 2 on a second slice", async || {
        steady().await?;
        let s = slices_of(&ctx, &ns).await?;
        let replaced = s
            .iter()
            .any(|w| w.0 == "diphomajob-el" && w.2.as_deref() == Some("WorkloadSliceReplaced"));
        ring = ring_of(&ctx, &ns, 2, g).await?;
        Ok(replaced && ring.is_some())
    })
    .await
    .with_context(|| {
        format!(
            "{}\n{}",
            last_words(&ctx, &ns, "el"),
            kueue_says(&ctx, "el")
        )
    })?;
    g = ring.take().unwrap();
    let second = slices_of(&ctx, &ns).await?;
    let second: Vec<_> = second.iter().filter(|w| w.2.is_none()).collect();
    ensure!(
        second.len() == 1 && second[0].1 == 2 && second[0].3,
        "one admitted slice of 2: {second:?}"
    );
    let second = second[0].0.clone();
    // 2 → 1: that slice shrinks in place (no new one); worker 1 goes.
    scale(1).await?;
    eventually(90, "a ring of 1 on the shrunk slice", async || {
        steady().await?;
        let s = slices_of(&ctx, &ns).await?;
        let shrunk = s.iter().any(|w| w.0 == second && w.1 == 1 && w.2.is_none());
        ring = ring_of(&ctx, &ns, 1, g).await?;
        Ok(shrunk && ring.is_some() && s.len() == 2)
    })
    .await
    .with_context(|| last_words(&ctx, &ns, "el"))?;
    g = ring.take().unwrap();
    // 1 → 3: past the quota of 2. The new slice (minCount 1) is admitted partially, at 2, in
    // place of the shrunk one: the job runs 2 workers, worker 0 still the first.
    scale(3).await?;
    eventually(
        90,
        "a ring of 2 on a third slice admitted at 2",
        async || {
            steady().await?;
            let s = slices_of(&ctx, &ns).await?;
            let active: Vec<_> = s.iter().filter(|w| w.2.is_none()).collect();
            ring = ring_of(&ctx, &ns, 2, g).await?;
            // The status says the job runs fewer than asked, and why.
            let st = status(&ctx, &ns, "el").await?;
            let said = st
                .waiting
                .is_some_and(|w| w.starts_with("running 2 of 3 workers"));
            Ok(said
                && s.len() == 3
                && active.len() == 1
                && active[0].1 == 3
                && active[0].3
                && ring.is_some())
        },
    )
    .await
    .with_context(|| last_words(&ctx, &ns, "el"))?;
    g = ring.take().unwrap();
    // minReplicas changed on the admitted slice (immutable there): the Workload is replaced
    // as for a job without slices, under a new name (the first one's is still taken by the
    // finished first slice), and the job runs again once it is admitted.
    jobs(&ctx, &ns)
        .patch(
            "el",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"elastic": {"minReplicas": 2}}})),
        )
        .await?;
    eventually(120, "a ring of 2 on a new Workload", async || {
        let s = slices_of(&ctx, &ns).await?;
        let active: Vec<_> = s.iter().filter(|w| w.2.is_none()).collect();
        ring = ring_of(&ctx, &ns, 2, g).await?;
        Ok(active.len() == 1 && active[0].3 && !active[0].0.ends_with("-4") && ring.is_some())
    })
    .await
    .with_context(|| last_words(&ctx, &ns, "el"))?;
    println!("\nworkload slices: {:?}", slices_of(&ctx, &ns).await?);
    Ok(())
}

/// The generation of `el`'s ring when it runs with `size` members at a generation above
/// `after`, `Running`; none otherwise.
async fn ring_of(ctx: &Ctx, ns: &str, size: usize, after: u64) -> Result<Option<u64>> {
    let j = job_status(&ctx.client, ns, "el").await?;
    let r = ring(&ctx.client, ns, "el").await?;
    Ok(r.filter(|r| {
        phase_of(&j) == Some(Phase::Running) && r.members.len() == size && r.generation > after
    })
    .map(|r| r.generation))
}
