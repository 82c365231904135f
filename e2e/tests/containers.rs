//! Container mode: the local kubelet runs every pod as a podman container of an image in the local
//! image store. The binary first builds the images (`images/build.sh debug`: the Containerfiles
//! of `make images`, from the binaries under test), then installs the chart with the local image
//! names and `imagePullPolicy: Never` into a namespace that enforces Pod Security "restricted".
//! Then: `helm test` against the operator's container, a training job whose worker container is
//! killed with SIGKILL (repaired; the survivors keep their containers; Succeeded), what a
//! container sees (env, a ConfigMap volume, its user, a read-only root, SIGTERM on deletion), and
//! an image that is not in the store (`ErrImageNeverPull` or `ImagePullBackOff`, with a message;
//! started once it is built).

mod common;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::kit::{JobManifest, pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::Phase;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;

/// The tag of every local image: the chart's appVersion.
fn tag() -> Result<String> {
    let chart = std::fs::read_to_string(chart().join("Chart.yaml"))?;
    let v = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .context("Chart.yaml has no appVersion")?;
    Ok(v.trim().trim_matches('"').to_owned())
}

fn main() -> Result<()> {
    let built = run_ok(
        std::process::Command::new("bash")
            .arg(repo_root().join("images/build.sh"))
            .arg("debug"),
    )
    .context("building the images (images/build.sh debug)")?;
    eprintln!("{built}");
    let nodes = (0..3)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 4))
        .collect();
    run_tests_in(
        Runtime::Podman,
        nodes,
        OperatorMode::Chart,
        tests![
            helm_test_reaches_the_operator_container,
            a_worker_container_killed_with_sigkill_is_repaired_and_the_job_succeeds,
            a_container_sees_its_env_volumes_user_and_a_read_only_root,
            an_image_missing_from_the_store_is_reported_not_run,
        ],
    )
}

async fn helm_test_reaches_the_operator_container(ctx: Arc<Ctx>, _ns: String) -> Result<()> {
    let out = helm_test(&ctx)?;
    ensure!(out.contains("Succeeded"), "helm test: {out}");
    let op = operator_pods(&ctx.client).await?;
    let image = op
        .first()
        .and_then(|p| p.spec.as_ref()?.containers.first()?.image.clone());
    ensure!(
        image == Some(format!("localhost/diphoma-operator:{}", tag()?)),
        "the operator runs {image:?}"
    );
    Ok(())
}

async fn a_worker_container_killed_with_sigkill_is_repaired_and_the_job_succeeds(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let mut job = JobManifest {
        detection_seconds: Some(2),
        ..JobManifest::training("digits", 3, 400, 1)
    };
    job.image = format!("localhost/diphoma-worker:{}", tag()?);
    let g1 = start_job(&ctx, &ns, &job, 3).await?.generation;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let survivors = ["digits-worker-0", "digits-worker-2"];
    let mut before = vec![];
    for name in survivors {
        before.push(pid_of(&pods.get(name).await?)?);
    }
    // The container's main process, as `kubectl debug` or a node's OOM killer would see it.
    signal(pid_of(&pods.get("digits-worker-1").await?)?, libc::SIGKILL);
    let g2 = running_ring(&ctx, &ns, "digits", 3, g1).await?;
    ensure!(g2.generation > g1, "no repair: {g2:?}");
    let st = finished(&ctx, &ns, "digits", 240).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(
        st.repairs.by_cause.get("ProcessExit") == Some(&1),
        "{:?}",
        st.repairs
    );
    for (name, pid) in survivors.iter().zip(before) {
        let p = pods.get(name).await?;
        let c = first_container(&p).context("no container status")?;
        ensure!(
            c.restart_count == 0 && terminated(&p).map(|t| t.0) == Some(0),
            "{name} did not keep its container (was pid {pid}): {:?}",
            c.state
        );
    }
    Ok(())
}

async fn a_container_sees_its_env_volumes_user_and_a_read_only_root(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(
            json!({"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}}),
        )?,
    )
    .await?;
    let image = format!("localhost/diphoma-probe:{}", tag()?);
    let pod = probe_pod(
        "seer",
        &[
            "--env",
            "--read",
            "/etc/cfg/greeting",
            "--read",
            "/proc/self/status",
            "--sleep",
            "300",
        ],
        json!({"spec": {
            "securityContext": {"runAsUser": 4321, "runAsGroup": 4321},
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                "env": [{"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg", "readOnly": true}]}],
            "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}]
        }}),
    );
    create(&ctx.client, &ns, &pod).await?;
    wait_pod(&ctx.client, &ns, "seer", 60, "Running", |p| {
        phase(p) == "Running"
    })
    .await?;
    let mut log = String::new();
    eventually(30, "the probe's output", async || {
        log = ctx.kubelet.log_text(
            &Api::<Pod>::namespaced(ctx.client.clone(), &ns)
                .get("seer")
                .await?,
            "main",
        )?;
        Ok(log.contains("Uid:"))
    })
    .await
    .with_context(|| format!("log: {log}"))?;
    ensure!(
        log.contains("env MY_POD=seer"),
        "downward API env missing: {log}"
    );
    ensure!(
        log.contains("hello"),
        "the ConfigMap volume was not mounted: {log}"
    );
    ensure!(
        log.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["Uid:", "4321", "4321", "4321", "4321"]),
        "not running as runAsUser 4321: {log}"
    );
    ensure!(
        log.lines()
            .any(|l| l.starts_with("CapEff:") && l.ends_with("0000000000000000")),
        "capabilities were not dropped: {log}"
    );
    // SIGTERM on deletion reaches the container's process (`--sleep` exits 0 on it), well
    // before the grace period's SIGKILL (which would read 137).
    let (client, ns2) = (ctx.client.clone(), ns.clone());
    let exited = tokio::spawn(async move {
        wait_pod(&client, &ns2, "seer", 60, "terminated", |p| {
            terminated(p).is_some()
        })
        .await
    });
    Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .delete("seer", &DeleteParams::default())
        .await?;
    let p = exited.await??;
    ensure!(
        terminated(&p).map(|t| t.0) == Some(0),
        "SIGTERM did not end it cleanly: {:?}",
        terminated(&p)
    );
    Ok(())
}

async fn an_image_missing_from_the_store_is_reported_not_run(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    // An image built after the pod was created is found at the next periodic sync, as a real
    // kubelet's pull retries would (a tag of the probe image stands in for the build).
    let late = "localhost/diphoma-built-late:1";
    let podman = |args: &[&str]| {
        std::process::Command::new("podman")
            .args(["--storage-driver", "vfs"])
            .args(args)
            .status()
    };
    let pod = probe_pod(
        "late",
        &[],
        json!({"spec": {"containers": [{"name": "main", "image": late, "imagePullPolicy": "Never"}]}}),
    );
    create(&ctx.client, &ns, &pod).await?;
    wait_pod(&ctx.client, &ns, "late", 60, "ErrImageNeverPull", |p| {
        first_container(p)
            .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone())
            .as_deref()
            == Some("ErrImageNeverPull")
    })
    .await?;
    ensure!(podman(&["tag", &format!("localhost/diphoma-probe:{}", tag()?), late])?.success());
    let started = wait_pod(&ctx.client, &ns, "late", 60, "Succeeded", |p| {
        phase(p) == "Succeeded"
    })
    .await;
    podman(&["untag", late])?;
    started?;

    for (name, policy, reason) in [
        ("never", "Never", "ErrImageNeverPull"),
        ("ifnotpresent", "IfNotPresent", "ImagePullBackOff"),
    ] {
        let pod = probe_pod(
            name,
            &[],
            json!({"spec": {"containers": [{"name": "main",
                "image": "ghcr.io/diphoma/not-built:0.0.1", "imagePullPolicy": policy}]}}),
        );
        create(&ctx.client, &ns, &pod).await?;
        let p = wait_pod(&ctx.client, &ns, name, 60, reason, |p| {
            first_container(p)
                .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone())
                .as_deref()
                == Some(reason)
        })
        .await?;
        let msg = first_container(&p)
            .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.message.clone())
            .unwrap_or_default();
        ensure!(
            msg.contains("ghcr.io/diphoma/not-built:0.0.1") && msg.contains("make images"),
            "the message does not name the image and the fix: {msg}"
        );
    }
    Ok(())
}
