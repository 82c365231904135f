//! Container mode: the local kubelet runs every pod as a podman container of an image in the local
//! image store. The binary first builds the images (`images/build.sh debug`: the Containerfiles
//! of `make images`, from the binaries under test), then installs the chart with the local image
//! names and `imagePullPolicy: Never` into a namespace that enforces Pod Security "restricted".
//! Then: `helm test` against the operator's container, a training job whose worker container is
//! killed with SIGKILL (repaired; the survivors keep their containers; Succeeded), what a
//! container sees (env, a ConfigMap volume, its user, a read-only root, SIGTERM on deletion), and
//! an image that is not in the store (`ErrImageNeverPull` or `ImagePullBackOff`, with a message;
//! started once it is built).
//!
//! The images come from a release directory (`scripts/release.sh --profile debug`, into
//! target/e2e-release/: the images built as above and saved as OCI archives, the chart packaged,
//! the wheel, the plugin tarball and its krew manifest, notices, SHA256SUMS), checked by
//! `scripts/check-release.sh`. The last test installs from that directory alone: the release
//! installed by the harness uninstalled, the images loaded from their archives under names of
//! their own, the chart from its package, the plugin from its tarball checked against the krew
//! manifest's sha256, and a job trained to Succeeded.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};

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

/// The release directory built by `main` (target/e2e-release/VERSION).
static RELEASE_DIR: OnceLock<PathBuf> = OnceLock::new();

fn main() -> Result<()> {
    // The images (images/build.sh debug, through the release script) and the release around them.
    let dir = run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/release.sh"))
            .args(["--profile", "debug", "--out"])
            .arg(repo_root().join("target/e2e-release")),
    )
    .context("building a debug release (scripts/release.sh --profile debug)")?;
    let dir = PathBuf::from(dir.trim());
    let checked = run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/check-release.sh"))
            .arg(&dir),
    )
    .context("checking the release directory (scripts/check-release.sh)")?;
    eprintln!("{checked}");
    RELEASE_DIR.set(dir).expect("set once");
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
            check_release_names_what_is_wrong_in_a_tampered_directory,
            a_release_directory_alone_installs_the_operator_plugin_and_a_job,
        ],
    )
}

async fn helm_test_reaches_the_operator_container(ctx: Arc<Ctx>, _ns: String) -> Result<()> {
    helm_test_reaches_operator_image(&ctx, &format!("localhost/diphoma-operator:{}", tag()?)).await
}

/// `helm test` succeeds, and the operator pod runs `image`.
async fn helm_test_reaches_operator_image(ctx: &Ctx, image: &str) -> Result<()> {
    let out = helm_test(ctx)?;
    ensure!(out.contains("Succeeded"), "helm test: {out}");
    let op = operator_pods(&ctx.client).await?;
    let runs = op
        .first()
        .and_then(|p| p.spec.as_ref()?.containers.first()?.image.clone());
    ensure!(runs.as_deref() == Some(image), "the operator runs {runs:?}");
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

/// Names the release test gives the images it loads from the archives; untagged when dropped
/// (also when the test fails), so the image store keeps only what the builds made.
struct LoadedImages(Vec<String>);

impl Drop for LoadedImages {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = Command::new("podman")
                .args(["--storage-driver", "vfs", "untag", name])
                .status();
        }
    }
}

async fn a_release_directory_alone_installs_the_operator_plugin_and_a_job(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let dir = RELEASE_DIR.get().context("no release directory")?;
    let version = tag()?;
    // The harness's release (chart and images from the source tree) goes; the CRD stays (keep).
    run_ok(
        ctx.cp
            .helm()
            .args(["uninstall", RELEASE, "-n", OPERATOR_NS, "--wait"]),
    )?;
    eventually(60, "the harness's operator gone", async || {
        Ok(operator_pods(&ctx.client).await?.is_empty())
    })
    .await?;

    // The images, from their archives, under names no build writes.
    let mut loaded = LoadedImages(vec![]);
    for image in ["operator", "worker", "probe"] {
        let archive = dir.join(format!("images/diphoma-{image}-{version}.oci.tar"));
        let id = run_ok(
            Command::new("buildah")
                .args(["--storage-driver", "vfs", "pull", "--quiet"])
                .arg(format!("oci-archive:{}", archive.display())),
        )
        .with_context(|| format!("loading {archive:?}"))?;
        let name = format!("localhost/diphoma-release/diphoma-{image}:{version}");
        run_ok(Command::new("podman").args(["--storage-driver", "vfs", "tag", id.trim(), &name]))?;
        loaded.0.push(name);
    }

    // The chart from its package, running those images.
    let package = std::fs::read_dir(dir)?
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("diphoma-operator-") && n.ends_with(".tgz"))
        })
        .context("no chart package in the release")?;
    run_ok(
        ctx.cp
            .helm()
            .args(["install", RELEASE])
            .arg(&package)
            .args([
                "-n",
                OPERATOR_NS,
                "--wait",
                "--timeout",
                "180s",
                "--set=image.repository=localhost/diphoma-release/diphoma-operator",
                "--set=image.pullPolicy=Never",
                "--set=helmTest.image.repository=localhost/diphoma-release/diphoma-probe",
            ]),
    )?;
    let image = format!("localhost/diphoma-release/diphoma-operator:{version}");
    helm_test_reaches_operator_image(&ctx, &image).await?;

    // The plugin: the tarball the krew manifest names, only if its sha256 is the manifest's.
    let krew = run_ok(Command::new("python3").arg("-c").arg(
        "import sys, yaml; p = yaml.safe_load(open(sys.argv[1]))['spec']['platforms']; \
         l = [x for x in p if x['selector']['matchLabels'] == {'os': 'linux', 'arch': 'amd64'}][0]; \
         print(l['uri'].rsplit('/', 1)[-1], l['sha256'], l['bin'])",
    ).arg(dir.join("diphoma.yaml")))?;
    let [tarball, sha, bin] = krew.split_whitespace().collect::<Vec<_>>()[..] else {
        anyhow::bail!("diphoma.yaml: linux/amd64 platform: {krew}");
    };
    let actual = run_ok(Command::new("sha256sum").arg(dir.join(tarball)))?;
    ensure!(
        actual.split_whitespace().next() == Some(sha),
        "{tarball}: sha256 {actual}, the krew manifest says {sha}"
    );
    let plugin_dir = ctx.cp.dir.join("release-plugin");
    std::fs::create_dir_all(&plugin_dir)?;
    run_ok(
        Command::new("tar")
            .arg("-xzf")
            .arg(dir.join(tarball))
            .arg("-C")
            .arg(&plugin_dir),
    )?;
    let path = std::env::join_paths(std::iter::once(plugin_dir.clone()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    ensure!(plugin_dir.join(bin).exists(), "{tarball} has no {bin}");

    // A job on the released worker image, seen through the released plugin, to Succeeded.
    let mut job = JobManifest::training("digits", 2, 400, 1);
    job.image = format!("localhost/diphoma-release/diphoma-worker:{version}");
    start_job(&ctx, &ns, &job, 2).await?;
    let ring = run_ok(
        ctx.cp
            .kubectl()
            .args(["diphoma", "ring", "digits", "-n", &ns])
            .env("PATH", &path),
    )?;
    ensure!(
        ring.contains("digits-worker-0") && ring.contains("digits-worker-1"),
        "kubectl diphoma ring (the released plugin): {ring}"
    );
    let st = finished(&ctx, &ns, "digits", 240).await?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let worker_image = pods
        .get("digits-worker-0")
        .await?
        .spec
        .and_then(|s| s.containers[0].image.clone());
    ensure!(
        worker_image.as_deref() == Some(job.image.as_str()),
        "the worker ran {worker_image:?}"
    );
    drop(loaded);
    Ok(())
}

/// Replaces `path` by a new file (never writing through a hard link into the release it was
/// linked from) with what `edit` makes of its text.
fn rewrite(path: &std::path::Path, edit: impl Fn(String) -> String) -> Result<()> {
    let text = std::fs::read_to_string(path)?;
    std::fs::remove_file(path)?;
    std::fs::write(path, edit(text))?;
    Ok(())
}

/// SHA256SUMS made again over the directory, so that only the check under test can fail.
fn resum(dir: &std::path::Path) -> Result<()> {
    let listed = run_ok(Command::new("bash").current_dir(dir).args([
        "-c",
        "find . -type f ! -name SHA256SUMS -printf '%P\\n' | LC_ALL=C sort | xargs sha256sum",
    ]))?;
    std::fs::remove_file(dir.join("SHA256SUMS"))?;
    std::fs::write(dir.join("SHA256SUMS"), listed)?;
    Ok(())
}

async fn check_release_names_what_is_wrong_in_a_tampered_directory(
    _ctx: Arc<Ctx>,
    _ns: String,
) -> Result<()> {
    let dir = RELEASE_DIR.get().context("no release directory")?;
    let version = tag()?;
    type Tamper = fn(&std::path::Path) -> Result<()>;
    let cases: [(&str, Tamper, &str); 5] = [
        (
            "krew-sha",
            |d| {
                rewrite(&d.join("diphoma.yaml"), |t| {
                    let sha = t
                        .split("sha256: ")
                        .nth(1)
                        .unwrap_or("")
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    t.replace(&sha, &"0".repeat(64))
                })?;
                resum(d)
            },
            "diphoma.yaml: platform",
        ),
        (
            "altered",
            |d| rewrite(&d.join("install.yaml"), |t| t + "# changed\n"),
            "SHA256SUMS: a sum does not match",
        ),
        (
            "unlisted",
            |d| Ok(std::fs::write(d.join("extra.txt"), "x")?),
            "SHA256SUMS does not list exactly the files",
        ),
        (
            "missing",
            |d| {
                std::fs::remove_file(d.join("diphomajob-crd.yaml"))?;
                resum(d)
            },
            "diphomajob-crd.yaml is missing",
        ),
        (
            "other-crd",
            |d| {
                rewrite(&d.join("diphomajob-crd.yaml"), |t| {
                    t.replacen("description:", "description: changed", 1)
                })?;
                resum(d)
            },
            "its CRD is not diphomajob-crd.yaml's",
        ),
    ];
    let root = repo_root().join("target/e2e-release-tampered");
    let _ = std::fs::remove_dir_all(&root);
    for (case, tamper, named) in cases {
        let copy = root.join(case).join(&version);
        std::fs::create_dir_all(copy.parent().unwrap())?;
        // Hard links: the archives are not copied; every tampered file is replaced, not written.
        run_ok(Command::new("cp").arg("-al").arg(dir).arg(&copy))?;
        tamper(&copy)?;
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/check-release.sh"))
            .arg(&copy)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && err.contains(named),
            "{case}: check-release.sh should fail naming {named:?}: {}: {err}",
            out.status
        );
    }
    std::fs::remove_dir_all(&root)?;
    // The release itself is untouched (the copies were of links).
    run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/check-release.sh"))
            .arg(dir),
    )?;
    Ok(())
}
