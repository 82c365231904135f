//! Acceptance tests of the local control plane and the process kubelet (issue: "Local Kubernetes
//! control plane and a process kubelet"). One real control plane for the whole binary, one temp
//! namespace per test; tests run one at a time (the node-failure test runs last, since it takes a
//! node away for good). The control plane and every pod process are stopped even when a test fails.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use common::*;
use diphoma_e2e::kit::{alive, pid_of, proc_state, signal};
use diphoma_e2e::kubelet::FailMode;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::status::is_ready;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams};
use serde_json::json;

fn main() -> Result<()> {
    let nodes = vec![
        NodeConfig::gpu("gpu-small", 1),
        NodeConfig::gpu("gpu-big-0", 4),
        NodeConfig::gpu("gpu-big-1", 4),
        NodeConfig::gpu("gpu-doomed", 2),
    ];
    run_tests(
        nodes,
        OperatorMode::None,
        tests![
            gpu_pod_is_bound_to_a_node_with_room_and_reports_its_exit_code,
            a_finished_pods_gpu_is_free_for_the_next_pod,
            pod_asking_for_more_gpus_than_any_node_has_stays_pending,
            deployment_gets_pods_from_the_controller_manager_and_replicaset_deletion_collects_them,
            pod_sees_env_downward_api_volumes_and_only_its_serviceaccount_permissions,
            restart_policy_and_graceful_deletion_are_honoured,
            readiness_and_liveness_probes_gate_ready_and_restart_the_container,
            bad_requests_name_what_is_wrong,
            kubectl_logs_reaches_the_kubelet_over_tls_with_follow_tail_and_previous,
            failed_node_turns_notready_while_its_pods_stay_running,
            a_scheduler_that_dies_is_restarted_and_places_the_next_pod,
        ],
    )
}

fn log(ctx: &Ctx, pod: &Pod) -> Result<String> {
    let container = &pod.spec.as_ref().context("pod without spec")?.containers[0].name;
    Ok(ctx.kubelet.log_text(pod, container)?)
}

async fn gpu_pod_is_bound_to_a_node_with_room_and_reports_its_exit_code(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let gpus =
        json!({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}]}});
    create(&ctx.client, &ns, &probe_pod("ok", &["--env"], gpus.clone())).await?;
    create(
        &ctx.client,
        &ns,
        &probe_pod("fails", &["--exit", "3"], gpus),
    )
    .await?;

    let ok = wait_pod(&ctx.client, &ns, "ok", 60, "Succeeded", |p| {
        phase(p) == "Succeeded"
    })
    .await?;
    let node = ok
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    ensure!(
        node.starts_with("gpu-big") || node == "gpu-doomed",
        "2 GPUs need a node with room, got {node}"
    );
    ensure!(
        terminated(&ok) == Some((0, "Completed".into())),
        "{:?}",
        terminated(&ok)
    );
    let log = log(&ctx, &ok)?;
    let cuda = log
        .lines()
        .find_map(|l| l.strip_prefix("env CUDA_VISIBLE_DEVICES="))
        .context("no CUDA_VISIBLE_DEVICES")?;
    ensure!(cuda.split(',').count() == 2, "CUDA_VISIBLE_DEVICES={cuda}");

    let failed = wait_pod(&ctx.client, &ns, "fails", 60, "Failed", |p| {
        phase(p) == "Failed"
    })
    .await?;
    ensure!(
        terminated(&failed) == Some((3, "Error".into())),
        "{:?}",
        terminated(&failed)
    );
    Ok(())
}

/// A pod that has finished (and stays in the API, as Succeeded) no longer holds its GPU: the next
/// pod on the 1-GPU node gets it at once (found by trying the local cluster as a user: a finished
/// job's pods kept the node full until they were deleted).
async fn a_finished_pods_gpu_is_free_for_the_next_pod(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let on_small = json!({"spec": {"nodeName": "gpu-small",
        "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    for name in ["first", "second"] {
        create(
            &ctx.client,
            &ns,
            &probe_pod(name, &["--env"], on_small.clone()),
        )
        .await?;
        let p = wait_pod(&ctx.client, &ns, name, 20, "Succeeded", |p| {
            phase(p) == "Succeeded"
        })
        .await?;
        let log = log(&ctx, &p)?;
        ensure!(
            log.contains("env CUDA_VISIBLE_DEVICES=0"),
            "{name} did not get the node's GPU: {log}"
        );
    }
    Ok(())
}

async fn pod_asking_for_more_gpus_than_any_node_has_stays_pending(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let huge =
        json!({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "16"}}}]}});
    create(&ctx.client, &ns, &probe_pod("huge", &[], huge)).await?;
    let p = wait_pod(&ctx.client, &ns, "huge", 60, "Unschedulable", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "PodScheduled" && c.reason.as_deref() == Some("Unschedulable"))
    })
    .await?;
    let cond = p
        .status
        .as_ref()
        .unwrap()
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "PodScheduled")
        .unwrap();
    let msg = cond.message.clone().unwrap_or_default();
    ensure!(
        msg.contains("Insufficient nvidia.com/gpu"),
        "scheduler message: {msg}"
    );
    ensure!(phase(&p) == "Pending" && p.spec.as_ref().unwrap().node_name.is_none());
    Ok(())
}

async fn deployment_gets_pods_from_the_controller_manager_and_replicaset_deletion_collects_them(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let out = ctx
        .cp
        .kubectl()
        .args([
            "-n",
            &ns,
            "create",
            "deployment",
            "web",
            "--image=diphoma-probe:dev",
            "--replicas=2",
            "--",
            "diphoma-probe",
            "--sleep",
            "3600",
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "kubectl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let running = |list: &[Pod]| list.iter().filter(|p| phase(p) == "Running").count();
    let mut first = vec![];
    eventually(90, "2 pods Running", async || {
        first = pods
            .list(&ListParams::default().labels("app=web"))
            .await?
            .items;
        Ok(running(&first) == 2)
    })
    .await?;
    let uids: BTreeSet<String> = first
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    let pids: Vec<u32> = first.iter().map(pid_of).collect::<Result<_, _>>()?;
    ensure!(
        pids.iter().all(|&p| alive(p)),
        "pod processes are not running"
    );

    let rs = first[0]
        .metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.first())
        .context("pod without owner")?
        .name
        .clone();
    let out = ctx
        .cp
        .kubectl()
        .args(["-n", &ns, "delete", "replicaset", &rs, "--wait=false"])
        .output()?;
    ensure!(
        out.status.success(),
        "kubectl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(90, "the ReplicaSet's pods garbage-collected", async || {
        let now = pods.list(&ListParams::default()).await?.items;
        Ok(!now
            .iter()
            .any(|p| uids.contains(p.metadata.uid.as_deref().unwrap_or_default())))
    })
    .await?;
    eventually(10, "their processes gone", async || {
        Ok(pids.iter().all(|&p| !alive(p)))
    })
    .await?;
    for p in &first {
        ensure!(
            log(&ctx, p)?.contains("sigterm"),
            "pod {:?} was not sent SIGTERM",
            p.metadata.name
        );
    }
    Ok(())
}

async fn pod_sees_env_downward_api_volumes_and_only_its_serviceaccount_permissions(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let host_dir = ctx.cp.dir.join(format!("host-{ns}"));
    std::fs::create_dir_all(&host_dir)?;
    std::fs::write(host_dir.join("marker"), "from-host")?;
    let pv_dir = ctx.cp.dir.join(format!("pv-{ns}"));
    std::fs::create_dir_all(&pv_dir)?;
    std::fs::write(pv_dir.join("marker"), "from-pv")?;
    let objects = json!([
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"greeting": "hello"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"token": "s3cret"}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read-cfg"},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["cfg"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "read-cfg"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-cfg"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": format!("pv-{ns}")},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                  "hostPath": {"path": pv_dir}, "claimRef": {"namespace": ns, "name": "data"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": format!("pv-{ns}"),
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]);
    let yaml: String = objects
        .as_array()
        .unwrap()
        .iter()
        .map(|o| format!("{o}\n---\n"))
        .collect();
    let out = kubectl_apply(&ctx, &ns, &yaml)?;
    ensure!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let cm_path = format!("/api/v1/namespaces/{ns}/configmaps/cfg");
    let pods_path = format!("/api/v1/namespaces/{ns}/pods");
    let args = [
        "--env",
        "--read",
        "/etc/cfg/greeting",
        "--read",
        "/etc/sec/token",
        "--read",
        "/host/marker",
        "--read",
        "/data/marker",
        "--read",
        "/podinfo/labels-app",
        "--get",
        &cm_path,
        "--get",
        &pods_path,
    ];
    let spec = json!({
        "metadata": {"labels": {"app": "probe"}},
        "spec": {
            "serviceAccountName": "reader",
            "containers": [{
                "env": [
                    {"name": "PLAIN", "value": "v"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
                    {"name": "SCRATCH", "value": "/scratch/x"}
                ],
                "volumeMounts": [
                    {"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "sec", "mountPath": "/etc/sec"},
                    {"name": "host", "mountPath": "/host"}, {"name": "data", "mountPath": "/data"},
                    {"name": "scratch", "mountPath": "/scratch"}, {"name": "podinfo", "mountPath": "/podinfo"}
                ]
            }],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "sec", "secret": {"secretName": "sec"}},
                {"name": "host", "hostPath": {"path": host_dir, "type": "Directory"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels-app", "fieldRef": {"fieldPath": "metadata.labels['app']"}}]}}
            ]
        }
    });
    create(&ctx.client, &ns, &probe_pod("probe", &args, spec)).await?;
    let p = wait_pod(&ctx.client, &ns, "probe", 90, "Succeeded", |p| {
        phase(p) == "Succeeded"
    })
    .await?;
    let log = log(&ctx, &p)?;
    let has = |line: &str| log.lines().any(|l| l == line);
    let ip = p
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    ensure!(
        ip.starts_with("127.") && ip != "127.0.0.1",
        "pod IP {ip} is not its own loopback address"
    );
    let node = p
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    for want in [
        "env PLAIN=v".to_owned(),
        "env POD_NAME=probe".to_owned(),
        format!("env POD_NAMESPACE={ns}"),
        format!("env POD_IP={ip}"),
        format!("env NODE_NAME={node}"),
        "env GREETING=hello".to_owned(),
        "env TOKEN=s3cret".to_owned(),
        format!("get {cm_path} 200"),
        format!("get {pods_path} 403"),
    ] {
        ensure!(has(&want), "missing {want:?} in the pod's output:\n{log}");
    }
    // Mount paths are rewritten to the volume directories: match the file name and content.
    for (file, content) in [
        ("greeting", "hello"),
        ("token", "s3cret"),
        ("marker", "from-host"),
        ("marker", "from-pv"),
        ("labels-app", "probe"),
    ] {
        let found = log
            .lines()
            .filter_map(|l| l.strip_prefix("read "))
            .any(|l| {
                l.split_once(' ')
                    .is_some_and(|(path, c)| path.ends_with(&format!("/{file}")) && c == content)
            });
        ensure!(
            found,
            "no read of {file} with {content:?} in the pod's output:\n{log}"
        );
    }
    let scratch = log
        .lines()
        .find_map(|l| l.strip_prefix("env SCRATCH="))
        .context("no SCRATCH")?;
    ensure!(
        scratch.ends_with("/volumes/scratch/x"),
        "emptyDir mount path not rewritten: {scratch}"
    );
    ensure!(
        !log.contains("env KUBERNETES_SERVICE_HOST="),
        "a ClusterIP service host leaked into the pod"
    );
    Ok(())
}

async fn restart_policy_and_graceful_deletion_are_honoured(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let on_failure = json!({"spec": {"restartPolicy": "OnFailure"}});
    create(
        &ctx.client,
        &ns,
        &probe_pod("crashy", &["--exit", "7"], on_failure),
    )
    .await?;
    let p = wait_pod(&ctx.client, &ns, "crashy", 60, "restarted twice", |p| {
        first_container(p).is_some_and(|c| c.restart_count >= 2)
    })
    .await?;
    let last = first_container(&p)
        .and_then(|c| c.last_state.as_ref()?.terminated.as_ref())
        .context("no lastState.terminated")?;
    ensure!(
        last.exit_code == 7,
        "lastState exit code {}",
        last.exit_code
    );
    ensure!(phase(&p) == "Running", "OnFailure pod phase {}", phase(&p));

    create(
        &ctx.client,
        &ns,
        &probe_pod("sleeper", &["--sleep", "3600"], json!({})),
    )
    .await?;
    let p = wait_pod(&ctx.client, &ns, "sleeper", 60, "Running", |p| {
        phase(p) == "Running"
    })
    .await?;
    let pid = pid_of(&p)?;
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    api.delete("sleeper", &DeleteParams::default()).await?;
    eventually(30, "deleted", async || {
        Ok(api.get_opt("sleeper").await?.is_none())
    })
    .await?;
    ensure!(!alive(pid), "process {pid} outlived its pod");
    ensure!(
        log(&ctx, &p)?.contains("sigterm"),
        "the process did not get SIGTERM first"
    );
    Ok(())
}

/// `kubectl ARGS` in `ns`; its stdout, or an error with its stderr.
fn kubectl(ctx: &Ctx, ns: &str, args: &[&str]) -> Result<String> {
    let out = ctx.cp.kubectl().args(["-n", ns]).args(args).output()?;
    ensure!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// `kubectl logs` through the API server to the kubelet's `/containerLogs` (TLS both ways):
/// plain, `-c`, `--tail`, `--timestamps`, `--since-time`, `-f` (lines as they are written), and `--previous`
/// after a `kill -9` of a container that restarted in place.
async fn kubectl_logs_reaches_the_kubelet_over_tls_with_follow_tail_and_previous(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    // /flag/run is missing in the first run and says "second" in the next one.
    let flag_dir = ctx.cp.dir.join(format!("logs-{ns}"));
    std::fs::create_dir_all(&flag_dir)?;
    let args = [
        "--read",
        "/flag/run",
        "--serve",
        "$(POD_IP):8080",
        "--sleep",
        "3600",
    ];
    // Each readiness probe makes the container print a line: output that goes on.
    let talker = json!({"spec": {"restartPolicy": "Always",
        "volumes": [{"name": "flag", "hostPath": {"path": flag_dir, "type": "Directory"}}],
        "containers": [{
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [{"name": "flag", "mountPath": "/flag"}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 1},
    }]}});
    create(&ctx.client, &ns, &probe_pod("talker", &args, talker)).await?;
    let p = wait_pod(&ctx.client, &ns, "talker", 60, "Running", |p| {
        phase(p) == "Running"
    })
    .await?;
    eventually(30, "two probes answered", async || {
        Ok(kubectl(&ctx, &ns, &["logs", "talker"])?
            .matches("answered /ready")
            .count()
            >= 2)
    })
    .await?;
    let plain = kubectl(&ctx, &ns, &["logs", "talker", "-c", "main"])?;
    let first = plain.lines().next().unwrap_or_default();
    ensure!(
        first.starts_with("read ") && first.contains("error"),
        "{plain}"
    );
    let tail = kubectl(
        &ctx,
        &ns,
        &["logs", "talker", "--tail", "1", "--timestamps"],
    )?;
    let (at, text) = tail.trim_end().split_once(' ').context("no timestamp")?;
    ensure!(
        tail.lines().count() == 1 && text.starts_with("answered /ready"),
        "{tail}"
    );
    at.parse::<jiff::Timestamp>()
        .with_context(|| format!("timestamp {at:?}"))?;
    // --since-time (whole seconds on the wire) at the newest line's second: the first line, a
    // few probes (one a second) older, is left out; the newest line is kept.
    eventually(30, "four probes answered", async || {
        Ok(kubectl(&ctx, &ns, &["logs", "talker"])?
            .matches("answered /ready")
            .count()
            >= 4)
    })
    .await?;
    let newest = kubectl(
        &ctx,
        &ns,
        &["logs", "talker", "--tail", "1", "--timestamps"],
    )?;
    let (newest_at, newest_text) = newest.trim_end().split_once(' ').context("no timestamp")?;
    let second = newest_at
        .parse::<jiff::Timestamp>()?
        .strftime("%Y-%m-%dT%H:%M:%SZ");
    let since = kubectl(
        &ctx,
        &ns,
        &["logs", "talker", &format!("--since-time={second}")],
    )?;
    ensure!(
        !since.contains("read ") && since.contains(newest_text),
        "--since-time={second}:\n{since}"
    );

    // -f with --tail 0: only lines written after it started, as they come; then stop it.
    let mut follow = tokio::process::Command::from(ctx.cp.kubectl());
    follow.args(["-n", &ns, "logs", "-f", "--tail", "0", "talker"]);
    let mut child = follow
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let mut seen = vec![];
    // The deadline only guards against a hang: lines come about once a second.
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while seen.len() < 3 {
            match lines.next_line().await? {
                Some(l) => seen.push(l),
                None => bail!("kubectl logs -f ended after {seen:?}"),
            }
        }
        Ok(())
    })
    .await
    .context("kubectl logs -f printed fewer than 3 lines in 60 s")??;
    child.start_kill()?;
    child.wait().await?;
    ensure!(
        seen.iter().all(|l| l.starts_with("answered /ready")),
        "{seen:?}"
    );

    // kill -9, restart in place: --previous is the first run, the plain log the second.
    std::fs::write(flag_dir.join("run"), "second")?;
    signal(pid_of(&p)?, libc::SIGKILL);
    wait_pod(
        &ctx.client,
        &ns,
        "talker",
        60,
        "restarted and running",
        |p| {
            first_container(p).is_some_and(|c| {
                c.restart_count == 1 && c.state.as_ref().is_some_and(|s| s.running.is_some())
            })
        },
    )
    .await?;
    eventually(30, "the second run's first line", async || {
        Ok(kubectl(&ctx, &ns, &["logs", "talker"])?.starts_with("read "))
    })
    .await?;
    let current = kubectl(&ctx, &ns, &["logs", "talker"])?;
    ensure!(
        current
            .lines()
            .next()
            .is_some_and(|l| l.ends_with(" second")),
        "{current}"
    );
    let previous = kubectl(&ctx, &ns, &["logs", "talker", "--previous"])?;
    ensure!(
        previous.starts_with(&plain) && !previous.contains(" second"),
        "--previous is not the first run:\n{previous}"
    );
    std::fs::remove_dir_all(&flag_dir)?;
    Ok(())
}

async fn readiness_and_liveness_probes_gate_ready_and_restart_the_container(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let dir = ctx.cp.dir.join(format!("probes-{ns}"));
    std::fs::create_dir_all(&dir)?;
    let (ready_file, sick_file) = (dir.join("ready"), dir.join("sick"));
    let args = [
        "--serve",
        "$(POD_IP):8080",
        "--ready-file",
        ready_file.to_str().unwrap(),
        "--sick-file",
        sick_file.to_str().unwrap(),
        "--sleep",
        "3600",
    ];
    let probes = json!({"spec": {"restartPolicy": "Always", "containers": [{
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1, "initialDelaySeconds": 5},
    }]}});
    create(&ctx.client, &ns, &probe_pod("probed", &args, probes)).await?;
    let p = wait_pod(&ctx.client, &ns, "probed", 60, "Running", |p| {
        phase(p) == "Running"
    })
    .await?;
    eventually(30, "serving", async || {
        Ok(log(&ctx, &p).is_ok_and(|l| l.contains("serve ")))
    })
    .await?;
    let pid = pid_of(&p)?;
    // Serving, but /ready answers 503: after three such probes it is still not Ready.
    eventually(30, "three readiness probes answered 503", async || {
        Ok(log(&ctx, &p)?.matches("answered /ready 503").count() >= 3)
    })
    .await?;
    let p = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .get("probed")
        .await?;
    ensure!(
        !is_ready(&p) && first_container(&p).is_some_and(|c| c.started == Some(true) && !c.ready),
        "Ready before its readiness probe passed: {:?}",
        p.status
    );
    std::fs::write(&ready_file, "")?;
    let p = wait_pod(&ctx.client, &ns, "probed", 30, "Ready", is_ready).await?;
    ensure!(
        pid_of(&p)? == pid,
        "restarted before its liveness probe failed: {:?}",
        p.status
    );
    std::fs::remove_file(&ready_file)?;
    wait_pod(&ctx.client, &ns, "probed", 30, "unready again", |p| {
        !is_ready(p)
    })
    .await?;
    std::fs::write(&sick_file, "")?;
    let p = wait_pod(&ctx.client, &ns, "probed", 30, "restarted", |p| {
        first_container(p).is_some_and(|c| c.restart_count == 1)
    })
    .await?;
    std::fs::remove_dir_all(&dir)?;
    let last = first_container(&p)
        .and_then(|c| c.last_state.as_ref()?.terminated.clone())
        .context("no lastState.terminated")?;
    ensure!(last.exit_code == 137, "killed with SIGKILL: {last:?}");
    ensure!(
        !alive(pid),
        "the process that failed its liveness probe still runs"
    );
    Ok(())
}

async fn bad_requests_name_what_is_wrong(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    for (name, image, needle) in [
        ("unknown-image", "busybox:1.36", "busybox:1.36"),
        (
            "missing-binary",
            "diphoma-ghost:1",
            "/nonexistent/diphoma-ghost",
        ),
    ] {
        let mut pod = probe_pod(name, &[], json!({}));
        pod.spec.as_mut().unwrap().containers[0].image = Some(image.into());
        create(&ctx.client, &ns, &pod).await?;
        let p = wait_pod(&ctx.client, &ns, name, 60, "ErrImagePull", |p| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c[0].state.clone())
                .and_then(|s| s.waiting)
                .is_some_and(|w| w.reason.as_deref() == Some("ErrImagePull"))
        })
        .await?;
        let msg = p.status.unwrap().container_statuses.unwrap()[0]
            .state
            .clone()
            .unwrap()
            .waiting
            .unwrap()
            .message
            .unwrap_or_default();
        ensure!(
            msg.contains(needle),
            "message {msg:?} does not name {needle}"
        );
    }
    let err = ctx
        .kubelet
        .fail_node("no-such-node", FailMode::Kill)
        .unwrap_err()
        .to_string();
    ensure!(
        err.contains("no-such-node") && err.contains("gpu-big-0"),
        "{err}"
    );
    let kc = ctx.cp.dir.join("missing.kubeconfig");
    match diphoma_e2e::cluster::client_from_kubeconfig(&kc).await {
        Ok(_) => bail!("a missing kubeconfig was accepted"),
        Err(e) => ensure!(e.to_string().contains("missing.kubeconfig"), "{e}"),
    }
    Ok(())
}

async fn failed_node_turns_notready_while_its_pods_stay_running(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let pin = json!({"spec": {"nodeSelector": {"kubernetes.io/hostname": "gpu-doomed"}}});
    create(
        &ctx.client,
        &ns,
        &probe_pod("victim", &["--sleep", "3600"], pin),
    )
    .await?;
    let p = wait_pod(&ctx.client, &ns, "victim", 60, "Running", |p| {
        phase(p) == "Running"
    })
    .await?;
    let pid = pid_of(&p)?;
    ctx.kubelet.fail_node("gpu-doomed", FailMode::Freeze)?;
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let ready = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status.clone())
    };
    eventually(60, "gpu-doomed NotReady", async || {
        Ok(ready(&nodes.get("gpu-doomed").await?).as_deref() != Some("True"))
    })
    .await?;
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let now = api.get("victim").await?;
    ensure!(
        phase(&now) == "Running",
        "pod phase {} on the lost node",
        phase(&now)
    );
    ensure!(
        proc_state(pid) == Some('T'),
        "process {pid} is not frozen: {:?}",
        proc_state(pid)
    );
    Ok(())
}

/// The kube-scheduler process of the local control plane: the one child of the supervisor whose
/// id `start.sh` recorded (`kube-scheduler.pid`); none while it is being restarted.
fn scheduler_process(ctx: &Ctx) -> Result<Option<u32>> {
    let supervisor = std::fs::read_to_string(ctx.cp.dir.join("kube-scheduler.pid"))?;
    let supervisor = supervisor.trim();
    let children =
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .with_context(|| format!("the scheduler's supervisor {supervisor}"))?;
    Ok(children.split_whitespace().find_map(|c| c.parse().ok()))
}

/// A kube-scheduler that dies (as v1.35.4's did on a race of its alpha gang plugin: README, "Gang
/// scheduling") is started again, as a kubelet restarts a static pod, and places the next pod.
/// Before, nothing was scheduled after it: the gang test waited 90 s for a replacement.
async fn a_scheduler_that_dies_is_restarted_and_places_the_next_pod(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let first = scheduler_process(&ctx)?.context("no kube-scheduler under its supervisor")?;
    signal(first, libc::SIGKILL);
    let mut again = None;
    eventually(30, "a new kube-scheduler process", async || {
        again = scheduler_process(&ctx)?.filter(|&p| p != first && alive(p));
        Ok(again.is_some())
    })
    .await?;
    let gpu = json!({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    create(&ctx.client, &ns, &probe_pod("after", &["--env"], gpu)).await?;
    wait_pod(&ctx.client, &ns, "after", 60, "Succeeded", |p| {
        phase(p) == "Succeeded"
    })
    .await?;
    let log = std::fs::read_to_string(ctx.cp.dir.join("logs/kube-scheduler.log"))?;
    ensure!(
        log.contains("--- kube-scheduler exited with status 137"),
        "the restart is not in the scheduler's log"
    );
    println!(
        "\nkube-scheduler {first} killed; {} placed the next pod",
        again.unwrap_or_default()
    );
    Ok(())
}
