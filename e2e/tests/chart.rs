//! The Helm chart on the local control plane. The binary installs the chart into a namespace that
//! enforces the Pod Security "restricted" profile, so the operator runs as a pod (the process
//! kubelet maps its image to the built binary) under exactly the chart's RBAC. Then: lint,
//! schema and `manifests/install.yaml` freshness, the packaged chart rendering as the source, the
//! alert rules under `promtool test rules` (and their plain copy fresh), server-side dry runs of
//! every manifest, the RBAC checked with `kubectl auth can-i` (the operator's, and users' through
//! the aggregated `edit` and `view` roles), `helm test`, a training job run by that operator while
//! a real Prometheus (Debian's package) scrapes it and every dashboard query returns data, and
//! `helm upgrade` to two replicas (with a PodDisruptionBudget) and `helm uninstall`, which
//! leaves only the CRD behind (`helm.sh/resource-policy: keep`); last, an upgrade from the
//! previous chart release (0.1.0, its package kept in e2e/fixtures/) with a job running: the CRD
//! is adopted and upgraded, the job and its workers are left alone.

mod common;

use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use common::*;
use diphoma_e2e::kit::{JobManifest, alive, pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::prometheus::{Prometheus, promtool_bin};
use diphoma_operator::api::Phase;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};

/// `helm template` at the oldest Kubernetes the chart declares (Chart.yaml's kubeVersion): a
/// helm built without its Kubernetes version in the ldflags (e2e/cluster/build-bins.sh) assumes
/// v1.20, which the chart refuses.
const KUBE_VERSION: &str = "--kube-version=1.30.0";
const SELECT_RELEASE: &str = "app.kubernetes.io/instance=diphoma-operator";
/// Every optional part of the chart switched on.
const ALL_ON: [&str; 5] = [
    "--set=replicaCount=2",
    "--set=serviceMonitor.enabled=true",
    "--set=podMonitor.enabled=true",
    "--set=networkPolicy.enabled=true",
    "--set=prometheusRule.enabled=true",
];

fn main() -> Result<()> {
    let nodes = (0..3)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 4))
        .collect();
    run_tests(
        nodes,
        OperatorMode::Chart,
        tests![
            chart_lints_validates_values_and_install_yaml_is_fresh,
            the_packaged_chart_renders_as_the_source,
            alert_rules_pass_promtool_and_their_plain_copy_is_fresh,
            every_manifest_passes_a_server_side_dry_run,
            the_operator_runs_as_a_pod_under_exactly_its_chart_rbac,
            users_bound_to_edit_and_view_get_diphomajobs_through_aggregation,
            helm_test_finds_the_operator_answering,
            a_job_run_by_the_chart_operator_feeds_every_dashboard_query,
            helm_upgrade_to_two_replicas_then_uninstall_leaves_only_the_crd,
            upgrade_from_chart_0_1_0_upgrades_the_crd_and_leaves_a_running_job_alone,
        ],
    )
}

async fn chart_lints_validates_values_and_install_yaml_is_fresh(
    ctx: Arc<Ctx>,
    _ns: String,
) -> Result<()> {
    let helm = || ctx.cp.helm();
    run_ok(helm().args(["lint", "--strict"]).arg(chart()))?;
    // Every optional part renders and lints too.
    run_ok(helm().args(["lint", "--strict"]).arg(chart()).args(ALL_ON))?;
    let rendered = run_ok(
        helm()
            .args(["template", KUBE_VERSION, RELEASE])
            .arg(chart())
            .args(ALL_ON),
    )?;
    ensure!(
        !rendered.contains("type: Recreate"),
        "leader-elected replicas roll over"
    );
    let single = run_ok(
        helm()
            .args(["template", KUBE_VERSION, RELEASE])
            .arg(chart()),
    )?;
    ensure!(
        single.contains("type: Recreate"),
        "without leader election the old operator must stop before the new one starts"
    );
    ensure!(
        !single.contains("kind: PodDisruptionBudget"),
        "one replica has no PodDisruptionBudget (it would block every drain)"
    );
    for kind in [
        "kind: ServiceMonitor",
        "kind: PodMonitor",
        "kind: Lease",
        "kind: PrometheusRule",
        "kind: PodDisruptionBudget",
        "DIPHOMA_LEADER_ELECT",
        "DIPHOMA_NETWORK_POLICY",
        "verbs: [list, watch, delete, create, patch]",
    ] {
        ensure!(
            rendered.contains(kind),
            "{kind} missing with every option on"
        );
    }
    // values.schema.json refuses bad values and names them.
    let long_name = format!("fullnameOverride={}", "x".repeat(48));
    for (set, named) in [
        ("replicaCount=-1", "replicaCount"),
        (long_name.as_str(), "fullnameOverride"),
        ("metrics.port=70000", "metrics/port"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("replicas=2", "replicas"),
        ("prometheusRule.ringWaitingFor=soon", "ringWaitingFor"),
    ] {
        let out = helm()
            .args(["template", KUBE_VERSION, RELEASE])
            .arg(chart())
            .args(["--set", set])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && err.contains(named),
            "--set {set}: expected a schema error naming {named}, got {}: {err}",
            out.status
        );
    }
    // As a dependency of another chart: Helm passes the parent's `global` (helm/helm#10392).
    run_ok(
        helm()
            .args(["lint", "--strict"])
            .arg(chart())
            .args(["--set", "global.x=1,global.registry.url=r.example"]),
    )?;
    // The CRD is a template (upgraded by `helm upgrade`), kept on uninstall; both switchable.
    let crd_of = |set: &[&str]| -> Result<String> {
        let all = run_ok(
            helm()
                .args(["template", KUBE_VERSION, RELEASE])
                .arg(chart())
                .args(set),
        )?;
        Ok(all
            .split("\n---")
            .find(|d| d.contains("\nkind: CustomResourceDefinition"))
            .unwrap_or_default()
            .to_owned())
    };
    let crd = crd_of(&[])?;
    for want in [
        "name: diphomajobs.diphoma.io",
        "helm.sh/resource-policy: keep",
        "helm.sh/chart: diphoma-operator-",
    ] {
        ensure!(crd.contains(want), "the CRD template lacks {want:?}: {crd}");
    }
    ensure!(
        !crd_of(&["--set", "crds.keep=false"])?.contains("resource-policy"),
        "crds.keep=false still keeps the CRD"
    );
    ensure!(
        crd_of(&["--set", "crds.enabled=false"])?.is_empty(),
        "crds.enabled=false still renders the CRD"
    );
    // The chart's README is what helm-docs makes of Chart.yaml, values.yaml and README.md.gotmpl.
    let helm_docs = run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/tools.sh"))
            .arg("helm-docs"),
    )?;
    let fresh = run_ok(
        Command::new(helm_docs.trim())
            .args(["--dry-run", "--log-level", "error", "--chart-search-root"])
            .arg(chart()),
    )?;
    let committed = std::fs::read_to_string(chart().join("README.md"))?;
    ensure!(
        fresh == committed,
        "charts/diphoma-operator/README.md is stale: run `make generate`"
    );
    // manifests/install.yaml is the chart rendered by scripts/render-install.sh.
    let fresh = run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/render-install.sh"))
            .arg(ctx.cp.bin_dir.join("helm")),
    )?;
    let committed = std::fs::read_to_string(repo_root().join("manifests/install.yaml"))?;
    ensure!(
        fresh == committed,
        "manifests/install.yaml is stale: run `make generate`"
    );
    Ok(())
}

async fn the_packaged_chart_renders_as_the_source(ctx: Arc<Ctx>, _ns: String) -> Result<()> {
    let helm = || ctx.cp.helm();
    let dir = ctx.cp.dir.join("helm-package");
    let out = run_ok(helm().arg("package").arg(chart()).arg("-d").arg(&dir))?;
    let package = std::fs::read_dir(&dir)?
        .next()
        .context("helm package wrote nothing")??
        .path();
    ensure!(
        package.extension().is_some_and(|e| e == "tgz"),
        "helm package: {out}"
    );
    let render = |from: &std::path::Path, set: &[&str]| {
        run_ok(
            helm()
                .args([
                    "template",
                    KUBE_VERSION,
                    RELEASE,
                    "--include-crds",
                    "-n",
                    OPERATOR_NS,
                ])
                .arg(from)
                .args(set),
        )
    };
    for set in [&[][..], &ALL_ON[..]] {
        ensure!(
            render(&package, set)? == render(&chart(), set)?,
            "the packaged chart {package:?} renders differently from the source with {set:?}"
        );
    }
    Ok(())
}

async fn alert_rules_pass_promtool_and_their_plain_copy_is_fresh(
    ctx: Arc<Ctx>,
    _ns: String,
) -> Result<()> {
    // docs/prometheus-rules.yaml is the chart's PrometheusRule spec rendered by
    // scripts/render-rules.sh: what is tested below is what the chart installs.
    let fresh = run_ok(
        Command::new("bash")
            .arg(repo_root().join("scripts/render-rules.sh"))
            .arg(ctx.cp.bin_dir.join("helm")),
    )?;
    let docs = repo_root().join("docs");
    let committed = std::fs::read_to_string(docs.join("prometheus-rules.yaml"))?;
    ensure!(
        fresh == committed,
        "docs/prometheus-rules.yaml is stale: run `make generate`"
    );
    let promtool = promtool_bin()?;
    let check = run_ok(
        Command::new(&promtool)
            .args(["check", "rules"])
            .arg(docs.join("prometheus-rules.yaml")),
    )?;
    ensure!(check.contains("5 rules found"), "promtool check: {check}");
    run_ok(
        Command::new(&promtool)
            .args(["test", "rules"])
            .arg(docs.join("prometheus-rules.test.yaml")),
    )
    .context("promtool test rules docs/prometheus-rules.test.yaml")?;
    Ok(())
}

async fn every_manifest_passes_a_server_side_dry_run(ctx: Arc<Ctx>, ns: String) -> Result<()> {
    let install = repo_root().join("manifests/install.yaml");
    run_ok(
        ctx.cp
            .kubectl()
            .args(["apply", "--dry-run=server", "-f"])
            .arg(&install),
    )?;
    let examples = repo_root().join("manifests/examples");
    let mut n = 0;
    for e in std::fs::read_dir(&examples)? {
        let path = e?.path();
        run_ok(
            ctx.cp
                .kubectl()
                .args(["apply", "--dry-run=server", "-n", &ns, "-f"])
                .arg(&path),
        )?;
        n += 1;
    }
    ensure!(n >= 3, "expected at least 3 examples in {examples:?}");
    Ok(())
}

async fn the_operator_runs_as_a_pod_under_exactly_its_chart_rbac(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let pods = operator_pods(&ctx.client).await?;
    ensure!(
        pods.len() == 1,
        "expected one operator pod, got {}",
        pods.len()
    );
    let pid = pid_of(&pods[0])?;
    ensure!(alive(pid), "the operator process {pid} is not running");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
    ensure!(
        exe.ends_with("diphoma-operator"),
        "the pod runs {exe:?}, not the operator binary"
    );

    let sa = format!("system:serviceaccount:{OPERATOR_NS}:{RELEASE}");
    let can = |args: &[&str]| can_i(&ctx, &sa, args);
    let n = ["-n", ns.as_str()];
    let in_ns = |v: &[&'static str]| [v, &n[..]].concat();
    // What operator/src/controller.rs calls.
    let allowed: Vec<Vec<&str>> = vec![
        vec!["list", "diphomajobs.diphoma.io", "-A"],
        vec!["watch", "diphomajobs.diphoma.io", "-A"],
        in_ns(&["delete", "diphomajobs.diphoma.io"]),
        in_ns(&["patch", "diphomajobs.diphoma.io", "--subresource=status"]),
        vec!["watch", "pods", "-A"],
        in_ns(&["create", "pods"]),
        in_ns(&["patch", "pods"]),
        in_ns(&["delete", "pods"]),
        in_ns(&["get", "configmaps"]),
        in_ns(&["create", "configmaps"]),
        in_ns(&["patch", "configmaps"]),
        in_ns(&["create", "secrets"]),
        // An orphaned key Secret of a job of the same name is re-keyed and taken over.
        in_ns(&["update", "secrets"]),
        in_ns(&["patch", "services"]),
        in_ns(&["patch", "serviceaccounts"]),
        in_ns(&["patch", "roles.rbac.authorization.k8s.io"]),
        in_ns(&["patch", "rolebindings.rbac.authorization.k8s.io"]),
        // Watched (metadata), so that a deleted child is restored; pods and ConfigMaps whole:
        // the operator reads them from its caches.
        vec!["watch", "configmaps", "-A"],
        vec!["list", "secrets", "-A"],
        vec!["watch", "secrets", "-A"],
        vec!["watch", "services", "-A"],
        vec!["watch", "serviceaccounts", "-A"],
        vec!["watch", "roles.rbac.authorization.k8s.io", "-A"],
        vec!["watch", "rolebindings.rbac.authorization.k8s.io", "-A"],
        vec!["watch", "networkpolicies.networking.k8s.io", "-A"],
        // A child no longer built for the job is pruned (not the key Secret: always built).
        in_ns(&["delete", "services"]),
        in_ns(&["delete", "serviceaccounts"]),
        in_ns(&["delete", "roles.rbac.authorization.k8s.io"]),
        in_ns(&["delete", "rolebindings.rbac.authorization.k8s.io"]),
        in_ns(&["delete", "networkpolicies.networking.k8s.io"]),
        in_ns(&["create", "events.events.k8s.io"]),
        vec!["list", "nodes"],
        vec!["watch", "nodes"],
        vec![
            "list",
            "leases.coordination.k8s.io",
            "-n",
            "kube-node-lease",
        ],
        vec![
            "watch",
            "leases.coordination.k8s.io",
            "-n",
            "kube-node-lease",
        ],
    ];
    // Beyond it: secrets are never fetched (only their metadata is watched), nothing is
    // escalated, nodes and the job spec are never written, nothing is fetched one by one (the
    // watch caches have it), no leader Lease with one replica, no NetworkPolicies unless enabled.
    let denied: Vec<Vec<&str>> = vec![
        in_ns(&["get", "secrets"]),
        vec!["get", "nodes"],
        vec!["get", "leases.coordination.k8s.io", "-n", "kube-node-lease"],
        in_ns(&["delete", "configmaps"]),
        in_ns(&["delete", "secrets"]),
        in_ns(&["update", "pods"]),
        in_ns(&["create", "pods", "--subresource=exec"]),
        in_ns(&["patch", "diphomajobs.diphoma.io"]),
        in_ns(&["get", "diphomajobs.diphoma.io"]),
        in_ns(&["create", "deployments.apps"]),
        in_ns(&["escalate", "roles.rbac.authorization.k8s.io"]),
        vec!["bind", "clusterroles.rbac.authorization.k8s.io"],
        vec!["create", "clusterrolebindings.rbac.authorization.k8s.io"],
        vec!["patch", "nodes"],
        vec!["delete", "namespaces"],
        vec!["get", "leases.coordination.k8s.io", "-n", OPERATOR_NS],
        vec![
            "create",
            "leases.coordination.k8s.io",
            "-n",
            "kube-node-lease",
        ],
        in_ns(&["create", "networkpolicies.networking.k8s.io"]),
    ];
    let mut wrong = vec![];
    for a in &allowed {
        if !can(a)? {
            wrong.push(format!("denied but needed: {}", a.join(" ")));
        }
    }
    for d in &denied {
        if can(d)? {
            wrong.push(format!("allowed but not needed: {}", d.join(" ")));
        }
    }
    ensure!(wrong.is_empty(), "RBAC: {wrong:#?}");
    Ok(())
}

/// `kubectl auth can-i ARGS --as=USER`.
fn can_i(ctx: &Ctx, user: &str, args: &[&str]) -> Result<bool> {
    let out = ctx
        .cp
        .kubectl()
        .args(["auth", "can-i", &format!("--as={user}")])
        .args(args)
        .output()?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => bail!("can-i {args:?}: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

async fn users_bound_to_edit_and_view_get_diphomajobs_through_aggregation(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    // Users bound to the built-in roles only: what they may do with DiphomaJobs comes from the
    // chart's diphoma-edit and diphoma-view, aggregated by the controller-manager.
    for (user, role) in [("alice", "edit"), ("bob", "view"), ("carol", "admin")] {
        run_ok(ctx.cp.kubectl().args([
            "-n",
            &ns,
            "create",
            "rolebinding",
            &format!("{user}-{role}"),
            &format!("--clusterrole={role}"),
            &format!("--user={user}"),
        ]))?;
    }
    let n = ["-n", ns.as_str()];
    let (scale, status) = ("--subresource=scale", "--subresource=status");
    let verb = |v: &'static str, sub: &[&'static str]| {
        [&[v, "diphomajobs.diphoma.io"][..], sub, &n[..]].concat()
    };
    let reads = [
        verb("get", &[]),
        verb("list", &[]),
        verb("watch", &[]),
        verb("get", &[scale]),
        verb("get", &[status]),
    ];
    let writes = [
        verb("create", &[]),
        verb("patch", &[]),
        verb("delete", &[]),
        verb("update", &[scale]),
        verb("patch", &[scale]),
    ];
    let status_write = verb("patch", &[status]);
    let mut expected: Vec<(&str, &Vec<&str>, bool)> = vec![];
    for user in ["alice", "carol"] {
        expected.extend(reads.iter().chain(&writes).map(|a| (user, a, true)));
        expected.push((user, &status_write, false));
    }
    expected.extend(reads.iter().map(|a| ("bob", a, true)));
    expected.extend(writes.iter().map(|a| ("bob", a, false)));
    expected.push(("bob", &status_write, false));
    // The aggregation controller fills the built-in roles asynchronously.
    let mut wrong = vec![];
    eventually(60, "the aggregated roles grant what they say", async || {
        wrong = vec![];
        for (user, args, want) in &expected {
            if can_i(&ctx, user, args)? != *want {
                wrong.push(format!("{user} {}: expected {want}", args.join(" ")));
            }
        }
        Ok(wrong.is_empty())
    })
    .await
    .with_context(|| format!("{wrong:#?}"))?;
    Ok(())
}

async fn helm_test_finds_the_operator_answering(ctx: Arc<Ctx>, _ns: String) -> Result<()> {
    // The probe exits 0 only when some operator pod answered and both /healthz and /readyz
    // answered 200 on every one (diphoma-probe --pods). No `--logs`: the passed Pod is deleted.
    let out = helm_test(&ctx)?;
    ensure!(
        out.contains("diphoma-operator-test") && out.contains("Succeeded"),
        "helm test: {out}"
    );
    // The passed test leaves nothing behind (hook-succeeded).
    let left = run_ok(ctx.cp.kubectl().args([
        "-n",
        OPERATOR_NS,
        "get",
        "pods,serviceaccounts,roles,rolebindings",
        "-l",
        "app.kubernetes.io/name=diphoma-operator-test",
        "-o",
        "name",
    ]))?;
    ensure!(left.trim().is_empty(), "left by helm test: {left}");
    Ok(())
}

/// The dashboard's conventions: `${DS_PROMETHEUS}`, variables namespace and job, a unit and a
/// description on every panel. Returns what is missing.
fn dashboard_conventions(name: &str, board: &serde_json::Value) -> Vec<String> {
    let mut missing = vec![];
    let vars: Vec<&str> = board["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for v in ["DS_PROMETHEUS", "namespace", "job"] {
        if !vars.contains(&v) {
            missing.push(format!("{name}: variable {v}"));
        }
    }
    for p in board["panels"].as_array().into_iter().flatten() {
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap_or("?");
        if p["description"].as_str().is_none_or(str::is_empty) {
            missing.push(format!("{name}/{title}: description"));
        }
        if p["fieldConfig"]["defaults"]["unit"]
            .as_str()
            .is_none_or(str::is_empty)
        {
            missing.push(format!("{name}/{title}: unit"));
        }
        if p["datasource"]["uid"] != "${DS_PROMETHEUS}" {
            missing.push(format!("{name}/{title}: datasource ${{DS_PROMETHEUS}}"));
        }
    }
    missing
}

async fn a_job_run_by_the_chart_operator_feeds_every_dashboard_query(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let scraped = Scraped::start(&ctx, &ns).await?;
    train_and_query(&ctx, &ns, &scraped.prom).await
}

async fn train_and_query(ctx: &Ctx, ns: &str, prom: &Prometheus) -> Result<()> {
    let start = jiff::Timestamp::now().as_second() as f64;
    let job = "digits";
    let yaml = JobManifest {
        detection_seconds: Some(5),
        extra: serde_json::json!({"metadata": {"namespace": ns}}),
        ..JobManifest::training(job, 3, 2500, 500)
    };
    let manifest = ctx.cp.dir.join(format!("{ns}-{job}.yaml"));
    std::fs::write(&manifest, yaml.to_string())?;
    run_ok(ctx.cp.kubectl().args(["apply", "-f"]).arg(&manifest))?;
    let field = |path: &str| -> Result<String> {
        run_ok(ctx.cp.kubectl().args([
            "-n",
            ns,
            "get",
            "dpj",
            job,
            "-o",
            &format!("jsonpath={{{path}}}"),
        ]))
    };
    // Training, and Prometheus scrapes the workers: then one worker is killed for a repair.
    eventually(120, "workers scraped while training", async || {
        let up = prom.query_range(
            &format!(
                "up{{job=\"diphoma-workers\", diphoma_job=\"{job}\", namespace=\"{ns}\"}} == 1"
            ),
            jiff::Timestamp::now().as_second() as f64 - 1.0,
            jiff::Timestamp::now().as_second() as f64,
            1.0,
        )?;
        let step: i64 = field(".status.progress.step")?.parse().unwrap_or(0);
        Ok(up.len() == 3 && step >= 200)
    })
    .await?;
    let victim: Pod = Api::namespaced(ctx.client.clone(), ns)
        .get(&format!("{job}-worker-1"))
        .await?;
    signal(pid_of(&victim)?, libc::SIGKILL);
    eventually(120, "the job Succeeded after a repair", async || {
        let phase = field(".status.phase")?;
        ensure!(phase != "Failed", "the job failed: {}", field(".status")?);
        Ok(phase == "Succeeded" && field(".status.ring.generation")?.parse::<i64>()? >= 2)
    })
    .await?;
    let accuracy: f64 = field(".status.progress.testAccuracy")?
        .parse()
        .context("status.progress.testAccuracy")?;
    ensure!(accuracy >= 0.9, "test accuracy {accuracy} in the status");
    // A few more scrapes of the operator after the end (one a second): 2 s of them.
    let succeeded = jiff::Timestamp::now().as_second() as f64;
    eventually(30, "the operator scraped after the job's end", async || {
        Ok(last_scrape(prom, "diphoma-operator")?.is_some_and(|t| t >= succeeded + 2.0))
    })
    .await?;
    let end = jiff::Timestamp::now().as_second() as f64;

    let mut missing = vec![];
    for (file, namespace, scrape_job) in [
        ("diphoma-operator.json", OPERATOR_NS, "diphoma-operator"),
        ("diphoma-training.json", ns, job),
    ] {
        let text = std::fs::read_to_string(chart().join("dashboards").join(file))?;
        let board: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("dashboards/{file}"))?;
        missing.extend(dashboard_conventions(file, &board));
        missing.extend(dashboard_gaps(
            prom,
            file,
            &board,
            (namespace, scrape_job),
            (start, end),
        )?);
    }
    ensure!(
        missing.is_empty(),
        "dashboards: {missing:#?}\nprometheus log:\n{}",
        prom.log_tail()
    );
    Ok(())
}

async fn helm_upgrade_to_two_replicas_then_uninstall_leaves_only_the_crd(
    ctx: Arc<Ctx>,
    _ns: String,
) -> Result<()> {
    run_ok(ctx.cp.helm().args(["upgrade", RELEASE]).arg(chart()).args([
        "-n",
        OPERATOR_NS,
        "--set",
        "replicaCount=2",
        "--wait",
        "--timeout",
        "120s",
    ]))?;
    // Two replicas: one holds the chart's Lease.
    eventually(60, "two operator pods, one leading", async || {
        let pods = operator_pods(&ctx.client).await?;
        let names: Vec<String> = pods
            .iter()
            .filter(|p| phase(p) == "Running")
            .map(|p| p.name_any())
            .collect();
        let holder = run_ok(ctx.cp.kubectl().args([
            "-n",
            OPERATOR_NS,
            "get",
            "lease",
            RELEASE,
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ]))
        .unwrap_or_default();
        Ok(names.len() == 2 && names.contains(&holder))
    })
    .await?;
    let min_available = run_ok(ctx.cp.kubectl().args([
        "-n",
        OPERATOR_NS,
        "get",
        "poddisruptionbudget",
        RELEASE,
        "-o",
        "jsonpath={.spec.minAvailable}",
    ]))?;
    ensure!(
        min_available == "1",
        "two replicas: PodDisruptionBudget minAvailable {min_available:?}"
    );

    run_ok(
        ctx.cp
            .helm()
            .args(["uninstall", RELEASE, "-n", OPERATOR_NS, "--wait"]),
    )?;
    let kinds = "deployments,replicasets,pods,services,serviceaccounts,configmaps,secrets,leases,roles,rolebindings,clusterroles,clusterrolebindings,poddisruptionbudgets";
    eventually(60, "nothing of the release left", async || {
        let left = run_ok(ctx.cp.kubectl().args([
            "get",
            kinds,
            "-A",
            "-l",
            SELECT_RELEASE,
            "-o",
            "name",
        ]))?;
        Ok(left.trim().is_empty())
    })
    .await?;
    let left =
        run_ok(
            ctx.cp
                .kubectl()
                .args(["get", "pods,leases", "-n", OPERATOR_NS, "-o", "name"]),
        )?;
    ensure!(left.trim().is_empty(), "left in {OPERATOR_NS}: {left}");
    run_ok(
        ctx.cp
            .kubectl()
            .args(["get", "crd", "diphomajobs.diphoma.io"]),
    )
    .context("helm keeps the CRD by design")?;
    Ok(())
}

/// The previous chart release, as users installed it: 0.1.0 shipped the CRD in `crds/`, which
/// Helm installs once and never upgrades nor owns. Upgrading to this chart, with a job training:
/// refused until Helm may adopt the CRD (`--take-ownership`, as the chart's README says), then
/// the CRD carries this chart's labels and the keep policy, and the job keeps its uid, its
/// workers (same pods, same processes, no restart) and its ring generation, and succeeds.
async fn upgrade_from_chart_0_1_0_upgrades_the_crd_and_leaves_a_running_job_alone(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    let kubectl = || ctx.cp.kubectl();
    let old = repo_root().join("e2e/fixtures/diphoma-operator-0.1.0.tgz");
    // A cluster as 0.1.0 left it: the CRD from its crds/, unowned. (The release of the
    // harness is gone after the test before; when this test runs alone, it goes here.)
    run_ok(ctx.cp.helm().args([
        "uninstall",
        RELEASE,
        "-n",
        OPERATOR_NS,
        "--ignore-not-found",
        "--wait",
    ]))?;
    run_ok(kubectl().args([
        "delete",
        "crd",
        "diphomajobs.diphoma.io",
        "--ignore-not-found",
        "--wait",
    ]))?;
    run_ok(ctx.cp.helm().args(["install", RELEASE]).arg(&old).args([
        "-n",
        OPERATOR_NS,
        "--wait",
        "--timeout",
        "180s",
    ]))?;
    let crd_meta = |path: &str| {
        run_ok(kubectl().args([
            "get",
            "crd",
            "diphomajobs.diphoma.io",
            "-o",
            &format!("jsonpath={{.metadata.{path}}}"),
        ]))
    };
    ensure!(
        crd_meta("labels")?.is_empty(),
        "chart 0.1.0's CRD carries labels: {}",
        crd_meta("labels")?
    );

    let job = JobManifest {
        extra: serde_json::json!({"metadata": {"namespace": ns}}),
        ..JobManifest::training("digits", 3, 6000, 500)
    };
    let ring = start_job(&ctx, &ns, &job, 3).await?;
    let jobs = jobs(&ctx, &ns);
    let uid = jobs.get("digits").await?.metadata.uid;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let mut workers = vec![];
    for i in 0..3 {
        let p = pods.get(&format!("digits-worker-{i}")).await?;
        workers.push((p.name_any(), p.metadata.uid.clone(), pid_of(&p)?));
    }

    let upgrade = |extra: &[&str]| {
        ctx.cp
            .helm()
            .args(["upgrade", RELEASE])
            .arg(chart())
            .args(["-n", OPERATOR_NS, "--wait", "--timeout", "180s"])
            .args(extra)
            .output()
    };
    let refused = upgrade(&[])?;
    let err = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success() && err.contains("diphomajobs.diphoma.io"),
        "upgrading over 0.1.0's unowned CRD without --take-ownership: {}: {err}",
        refused.status
    );
    let adopted = upgrade(&["--take-ownership"])?;
    ensure!(
        adopted.status.success(),
        "helm upgrade --take-ownership: {}",
        String::from_utf8_lossy(&adopted.stderr)
    );
    // The job was there all along, training: the upgrade happened under it.
    let during = status(&ctx, &ns, "digits").await?;
    ensure!(
        during.phase == Some(Phase::Running),
        "the job is not running right after the upgrade (too few steps to span it?): {during:?}"
    );
    let version = run_ok(
        ctx.cp
            .helm()
            .args(["list", "-n", OPERATOR_NS, "-o", "json"]),
    )?;
    let chart_yaml = std::fs::read_to_string(chart().join("Chart.yaml"))?;
    let new = chart_yaml
        .lines()
        .find_map(|l| l.strip_prefix("version:"))
        .context("Chart.yaml has no version")?
        .trim()
        .to_owned();
    ensure!(
        new != "0.1.0",
        "the chart's version was not bumped past 0.1.0"
    );
    ensure!(
        version.contains(&format!("diphoma-operator-{new}")),
        "release after the upgrade: {version}"
    );
    // The CRD is now the new chart's: its labels, Helm's ownership, the keep policy.
    let labels = crd_meta("labels")?;
    let annotations = crd_meta("annotations")?;
    ensure!(
        labels.contains(&format!("diphoma-operator-{new}")),
        "the CRD was not upgraded: labels {labels}"
    );
    ensure!(
        annotations.contains("\"helm.sh/resource-policy\":\"keep\"")
            && annotations.contains(&format!("\"meta.helm.sh/release-name\":\"{RELEASE}\"")),
        "the CRD's annotations after the upgrade: {annotations}"
    );
    // The operator is the new chart's (its Deployment, ready: --wait); it runs the job on.
    let deployment = run_ok(kubectl().args([
        "-n",
        OPERATOR_NS,
        "get",
        "deployment",
        RELEASE,
        "-o",
        "jsonpath={.metadata.labels.helm\\.sh/chart}",
    ]))?;
    ensure!(
        deployment == format!("diphoma-operator-{new}"),
        "the operator's Deployment after the upgrade: chart {deployment:?}"
    );
    let st = finished(&ctx, &ns, "digits", 300).await?;
    ensure!(
        st.phase == Some(Phase::Succeeded),
        "after the upgrade: {st:?}"
    );
    ensure!(
        jobs.get("digits").await?.metadata.uid == uid,
        "the job was recreated"
    );
    ensure!(
        st.ring.as_ref().map(|r| r.generation) == Some(ring.generation as _),
        "the ring was re-formed across the upgrade: {:?} (was generation {})",
        st.ring,
        ring.generation
    );
    for (name, pod_uid, pid) in workers {
        let p = pods.get(&name).await?;
        let restarts = first_container(&p).map(|c| c.restart_count);
        ensure!(
            p.metadata.uid == pod_uid && restarts == Some(0),
            "{name} was replaced or restarted (was pid {pid}): uid {:?}, restarts {restarts:?}",
            p.metadata.uid
        );
    }
    Ok(())
}
