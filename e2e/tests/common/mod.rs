//! Shared by the e2e test binaries: one control plane and one process kubelet per binary, pod
//! builders, and the waits on the API server (polls with a deadline, or `await_condition`). The
//! job manifests, process lookup and free ports are in `diphoma_e2e::kit`.
#![allow(dead_code, missing_docs)]

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use diphoma_contract::{MEMBERSHIP_KEY, Membership};
use diphoma_e2e::cluster::{ControlPlane, TempNamespace};
use diphoma_e2e::kit::{JobManifest, merge};
pub use diphoma_e2e::kubelet::Runtime;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::{Kubelet, KubeletConfig};
use diphoma_e2e::prometheus::{Prometheus, prometheus_bin, write_targets};
use diphoma_operator::api::{DiphomaJob, DiphomaJobStatus, Phase};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{ListParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, ResourceExt};
use libtest_mimic::{Arguments, Failed, Trial};
use tokio::sync::oneshot;

/// Directory of the workspace binaries (the test binary lives in `target/<profile>/deps`).
pub fn bin_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_BIN_EXE_diphoma-probe"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Image → executable mappings a test binary adds to its kubelet's table, set before
/// [`run_tests`] (the PyTorch tests map `diphoma-pytorch` to a venv's python).
pub static EXTRA_IMAGES: std::sync::OnceLock<Vec<(String, std::path::PathBuf)>> =
    std::sync::OnceLock::new();

/// Starts the process kubelet on `cp` with `nodes` and `runtime`; `diphoma-ghost` maps to a
/// missing binary, and [`EXTRA_IMAGES`] are added.
pub async fn start_kubelet(
    cp: &ControlPlane,
    client: &Client,
    nodes: Vec<NodeConfig>,
    runtime: Runtime,
) -> Result<Kubelet> {
    let mut cfg =
        KubeletConfig::from_kubeconfig(&cp.kubeconfig, nodes, &bin_dir(), cp.kubelet_root())?;
    cfg.runtime = runtime;
    cfg.images
        .insert("diphoma-ghost", "/nonexistent/diphoma-ghost".into());
    for (image, program) in EXTRA_IMAGES.get().into_iter().flatten() {
        cfg.images.insert(image, program.clone());
    }
    Ok(Kubelet::start(client.clone(), cfg).await?)
}

/// A pod running `diphoma-probe ARGS` with `restartPolicy: Never`, merged with `extra` (a JSON
/// object deep-merged into the pod: e.g. resources, volumes).
pub fn probe_pod(name: &str, args: &[&str], extra: serde_json::Value) -> Pod {
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": "diphoma-probe:dev", "args": args}]
        }
    });
    merge(&mut pod, extra);
    serde_json::from_value(pod).expect("valid pod")
}

pub async fn create(client: &Client, ns: &str, pod: &Pod) -> Result<Pod> {
    Ok(Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), pod)
        .await?)
}

/// Waits (at most `secs`) until `cond` holds for the pod; returns the pod then.
pub async fn wait_pod(
    client: &Client,
    ns: &str,
    name: &str,
    secs: u64,
    what: &str,
    cond: impl Fn(&Pod) -> bool,
) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let found = tokio::time::timeout(
        Duration::from_secs(secs),
        await_condition(api.clone(), name, move |p: Option<&Pod>| {
            p.is_some_and(&cond)
        }),
    )
    .await;
    match found {
        Ok(Ok(Some(p))) => Ok(p),
        Ok(Err(e)) => Err(e.into()),
        _ => {
            let now = api.get_opt(name).await?;
            bail!(
                "pod {ns}/{name}: not {what} after {secs} s; it is: {}",
                serde_json::to_string(&now.and_then(|p| p.status))?
            )
        }
    }
}

pub fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// The first container's status.
pub fn first_container(p: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    p.status.as_ref()?.container_statuses.as_ref()?.first()
}

/// Exit code and reason of the first container, once it has terminated.
pub fn terminated(p: &Pod) -> Option<(i32, String)> {
    let t = first_container(p)?.state.as_ref()?.terminated.as_ref()?;
    Some((t.exit_code, t.reason.clone().unwrap_or_default()))
}

/// Polls `f` every 200 ms for up to `secs` seconds.
pub async fn eventually<F: AsyncFnMut() -> Result<bool>>(
    secs: u64,
    what: &str,
    mut f: F,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("not {what} after {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One e2e test: takes the binary's shared context and a fresh namespace.
pub type TestFn<C> = fn(Arc<C>, String) -> Pin<Box<dyn Future<Output = Result<()>>>>;

/// `tests![a, b]`: the named async test functions as `(name, TestFn)` pairs.
#[macro_export]
macro_rules! tests {
    ($($name:ident),* $(,)?) => { vec![$((stringify!($name), (|c, ns| Box::pin($name(c, ns))) as $crate::common::TestFn<_>)),*] };
}

/// The command-line arguments, tests forced to run one at a time (they share one cluster).
pub fn sequential_args() -> Arguments {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    args
}

/// A multi-thread runtime for the whole test binary.
pub fn runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    Ok(Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    ))
}

/// The bound on one test: a guard against a hang only, above the sum of any test's own waits
/// (each `eventually` names what it waited for and what it saw; the guard can only say that
/// time ran out, as it did in the gang suite once, 240 s into a test whose waits add up to more).
pub const TEST_BOUND: Duration = Duration::from_secs(900);

/// Each test as a libtest-mimic trial: run on `rt` in a temp namespace (deleted afterwards),
/// bounded by [`TEST_BOUND`], its error chain as the failure message.
pub fn trials<C: Send + Sync + 'static>(
    rt: &Arc<tokio::runtime::Runtime>,
    ctx: &Arc<C>,
    client: fn(&C) -> &Client,
    list: Vec<(&'static str, TestFn<C>)>,
) -> Vec<Trial> {
    list.into_iter()
        .map(|(name, f)| {
            let (rt, ctx) = (rt.clone(), ctx.clone());
            Trial::test(name, move || {
                let prefix: String = name.chars().take(20).collect::<String>().replace('_', "-");
                rt.block_on(async {
                    let ns = TempNamespace::create(client(&ctx), &prefix).await?;
                    let r = tokio::time::timeout(TEST_BOUND, f(ctx.clone(), ns.name.clone())).await;
                    let _ = ns.delete().await;
                    r.map_err(|_| anyhow::anyhow!("timed out after {TEST_BOUND:?}"))?
                })
                .map_err(|e| Failed::from(format!("{e:#}")))
            })
        })
        .collect()
}

/// The in-process operator's safety-net resync ([`Ctx::start_operator`]): longer than any test.
pub const OPERATOR_RESYNC: Duration = Duration::from_secs(3600);

/// The name of the second scheduler (the scheduler-plugins coscheduling plugin) that the gang
/// suite starts ([`ControlPlane::start_coscheduling`]) and the in-process operator names in
/// coscheduled workers (not the operator's default, so that the option is what places them).
pub const COSCHEDULING_SCHEDULER: &str = "diphoma-coscheduling";

/// Where a test binary's operator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorMode {
    /// No operator and no CRD (the control-plane tests).
    None,
    /// In the test process (tests that stop, restart or re-configure it).
    InProcess,
    /// As a pod installed by the Helm chart (release [`RELEASE`] in [`OPERATOR_NS`], a namespace
    /// that enforces Pod Security "restricted"), under the chart's RBAC: what users run.
    Chart,
}

/// The Helm release of a chart-installed operator (as in install.yaml and install-operator.sh).
pub const RELEASE: &str = "diphoma-operator";
/// The namespace of a chart-installed operator.
pub const OPERATOR_NS: &str = "diphoma-system";

/// The repository root.
pub fn repo_root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The operator's Helm chart.
pub fn chart() -> std::path::PathBuf {
    repo_root().join("charts/diphoma-operator")
}

/// Runs `cmd`; its stdout when it succeeds, else an error with the command and its stderr.
pub fn run_ok(cmd: &mut std::process::Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The shared context of a test binary: the control plane, the process kubelet, and the
/// operator as [`OperatorMode`] says.
pub struct Ctx {
    pub client: Client,
    /// The in-process operator's client: its own identity, whose requests the audit log holds
    /// ([`ControlPlane::audit_log`]).
    pub operator_client: Client,
    pub kubelet: Kubelet,
    pub cp: ControlPlane,
    pub mode: OperatorMode,
    pub runtime: Runtime,
    operator: Mutex<Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>>,
}

impl Ctx {
    /// Starts the control plane and the kubelet with `nodes` and `runtime`, then the operator per
    /// `mode` (in container mode the chart runs the images of `images/build.sh debug`).
    pub fn start(
        rt: &tokio::runtime::Runtime,
        nodes: Vec<NodeConfig>,
        mode: OperatorMode,
        runtime: Runtime,
    ) -> Result<Arc<Ctx>> {
        let cp = ControlPlane::start()?;
        if mode == OperatorMode::InProcess {
            cp.install_crd()?;
        }
        rt.block_on(async {
            let client = cp.client().await?;
            let operator_client = cp.operator_client().await?;
            let kubelet = start_kubelet(&cp, &client, nodes, runtime).await?;
            let ctx = Arc::new(Ctx {
                client,
                operator_client,
                kubelet,
                cp,
                mode,
                runtime,
                operator: Mutex::new(None),
            });
            match mode {
                OperatorMode::None => {}
                OperatorMode::InProcess => ctx.start_operator(),
                OperatorMode::Chart => ctx.helm_install()?,
            }
            Ok(ctx)
        })
    }

    /// `helm install` of the chart (its CRD included) into [`OPERATOR_NS`], labelled to enforce
    /// Pod Security "restricted", by `e2e/cluster/install-operator.sh` (as `make demo` does);
    /// waits for the operator to be ready.
    fn helm_install(&self) -> Result<()> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![self.cp.bin_dir.clone()];
        dirs.extend(std::env::split_paths(&path));
        let images: &[&str] = match self.runtime {
            Runtime::Process => &[],
            Runtime::Podman => &LOCAL_IMAGES,
        };
        run_ok(
            std::process::Command::new("bash")
                .arg(repo_root().join("e2e/cluster/install-operator.sh"))
                .args(images)
                .env("KUBECONFIG", &self.cp.kubeconfig)
                .env("PATH", std::env::join_paths(dirs)?),
        )
        .context("installing the operator with its chart")?;
        Ok(())
    }

    /// Starts the operator in this process (one replica, no leader election), as its own user
    /// ([`Ctx::operator_client`]), with a safety-net resync of an hour ([`OPERATOR_RESYNC`]):
    /// whatever a test sees it do within a test's time was asked for by a watch event or a timer
    /// of the job's own.
    pub fn start_operator(&self) {
        let (tx, rx) = oneshot::channel::<()>();
        let client = self.operator_client.clone();
        let opts = diphoma_operator::controller::Options {
            resync: OPERATOR_RESYNC,
            coscheduling_scheduler_name: COSCHEDULING_SCHEDULER.into(),
            ..Default::default()
        };
        let task = tokio::spawn(async move {
            let stop = async move {
                let _ = rx.await;
            };
            if let Err(e) = diphoma_operator::controller::run(client, opts, None, stop).await {
                panic!("operator: {e}");
            }
        });
        *self.operator.lock().unwrap() = Some((tx, task));
    }

    /// Stops the in-process operator (if it runs).
    pub async fn stop_operator(&self) {
        let running = self.operator.lock().unwrap().take();
        if let Some((tx, task)) = running {
            let _ = tx.send(());
            let _ = task.await;
        }
    }

    /// Stops the operator and the kubelet (and with it every pod), then the control plane.
    pub fn shutdown(self: Arc<Ctx>, rt: &tokio::runtime::Runtime) -> Result<()> {
        let ctx = Arc::into_inner(self).context("tests still hold the context")?;
        rt.block_on(ctx.stop_operator());
        let Ctx { kubelet, cp, .. } = ctx;
        rt.block_on(kubelet.shutdown());
        drop(cp);
        Ok(())
    }
}

/// `helm test` of the chart's release (the probe pod calling every operator pod); its output.
pub fn helm_test(ctx: &Ctx) -> Result<String> {
    run_ok(
        ctx.cp
            .helm()
            .args(["test", RELEASE, "-n", OPERATOR_NS, "--timeout", "120s"]),
    )
}

/// The chart's values that run the images of the local image store (`make images`).
pub const LOCAL_IMAGES: [&str; 3] = [
    "--set=image.repository=localhost/diphoma-operator",
    "--set=image.pullPolicy=Never",
    "--set=helmTest.image.repository=localhost/diphoma-probe",
];

/// Runs a binary's tests one at a time on a cluster of `nodes` (process mode) with the operator
/// per `mode`, then tears everything down (also when tests fail).
pub fn run_tests(
    nodes: Vec<NodeConfig>,
    mode: OperatorMode,
    list: Vec<(&'static str, TestFn<Ctx>)>,
) -> Result<()> {
    run_tests_in(Runtime::Process, nodes, mode, list)
}

/// [`run_tests`] with the kubelet's `containers` runtime.
pub fn run_tests_in(
    containers: Runtime,
    nodes: Vec<NodeConfig>,
    mode: OperatorMode,
    list: Vec<(&'static str, TestFn<Ctx>)>,
) -> Result<()> {
    init_tracing();
    let args = sequential_args();
    let rt = runtime()?;
    let ctx = Ctx::start(&rt, nodes, mode, containers)?;
    let trials = trials(&rt, &ctx, |c: &Ctx| &c.client, list);
    let conclusion = libtest_mimic::run(&args, trials);
    ctx.shutdown(&rt)?;
    conclusion.exit()
}

pub fn kubectl_apply(ctx: &Ctx, ns: &str, yaml: &str) -> Result<std::process::Output> {
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

/// `kubectl apply` of the JSON document `doc` in `ns`; an error with kubectl's stderr if refused.
pub fn apply_json(ctx: &Ctx, ns: &str, doc: &serde_json::Value) -> Result<()> {
    let out = kubectl_apply(ctx, ns, &doc.to_string())?;
    ensure!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A digits job of `replicas` workers for `steps` steps, logging every `log_every`, as the fault,
/// queue and gang tests run it: silence detected after `detection_seconds`, a collective given up
/// after 1 s (`--op-timeout-s`), `extra` merged into the manifest.
pub fn quick_job(
    (name, replicas, steps): (&str, i32, u64),
    log_every: u64,
    detection_seconds: u64,
    extra: serde_json::Value,
) -> JobManifest {
    let mut job = JobManifest {
        detection_seconds: Some(detection_seconds),
        extra,
        ..JobManifest::training(name, replicas, steps, log_every)
    };
    job.args.extend(["--op-timeout-s".into(), "1".into()]);
    job
}

/// The DiphomaJobs of `ns`.
pub fn jobs(ctx: &Ctx, ns: &str) -> Api<DiphomaJob> {
    Api::namespaced(ctx.client.clone(), ns)
}

/// The status of job `job` in `ns` (empty before the operator wrote one).
pub async fn status(ctx: &Ctx, ns: &str, job: &str) -> Result<DiphomaJobStatus> {
    Ok(job_status(&ctx.client, ns, job)
        .await?
        .status
        .unwrap_or_default())
}

/// Applies `job` and waits for its first ring of `size` workers.
pub async fn start_job(ctx: &Ctx, ns: &str, job: &JobManifest, size: usize) -> Result<Membership> {
    let out = kubectl_apply(ctx, ns, &job.to_string())?;
    ensure!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    running_ring(ctx, ns, &job.name, size, 0).await
}

/// Changes the job's spec without changing what it does (an annotation of the pod template,
/// which only pods created later carry), so that its `metadata.generation` moves; returns the
/// new generation. Only a reconcile can then make `status.observedGeneration` follow.
pub async fn touch_spec(client: &Client, ns: &str, job: &str) -> Result<i64> {
    let nonce = jiff::Timestamp::now().as_nanosecond().to_string();
    let patch = serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
        "e2e.diphoma.io/touched": nonce
    }}}}});
    let j = Api::<DiphomaJob>::namespaced(client.clone(), ns)
        .patch(
            job,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await?;
    j.metadata.generation.context("no metadata.generation")
}

/// Waits until a reconcile has written the status of spec generation `generation` or a later
/// one; returns that status.
pub async fn observed(
    client: &Client,
    ns: &str,
    job: &str,
    generation: i64,
) -> Result<DiphomaJobStatus> {
    let mut st = None;
    eventually(
        60,
        &format!("{job}: status.observedGeneration {generation} (a reconcile)"),
        async || {
            st = job_status(client, ns, job).await?.status;
            Ok(st
                .as_ref()
                .and_then(|s| s.observed_generation)
                .is_some_and(|g| g >= generation))
        },
    )
    .await
    .with_context(|| format!("last status: {st:?}"))?;
    Ok(st.unwrap())
}

/// Makes the operator reconcile `job` once more and waits until it has ([`touch_spec`], then
/// [`observed`]); returns the status that reconcile wrote.
pub async fn reconciled(client: &Client, ns: &str, job: &str) -> Result<DiphomaJobStatus> {
    let generation = touch_spec(client, ns, job).await?;
    observed(client, ns, job, generation).await
}

/// The operator pods of the chart's release (not terminating).
pub async fn operator_pods(client: &Client) -> Result<Vec<Pod>> {
    Ok(Api::<Pod>::namespaced(client.clone(), OPERATOR_NS)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

/// The test accuracy a worker printed at the end (`test accuracy A …`), and how many times it
/// printed one.
pub fn accuracy(log: &str) -> (Option<f64>, usize) {
    let lines: Vec<f64> = log
        .lines()
        .filter_map(|l| {
            l.strip_prefix("test accuracy ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    (lines.last().copied(), lines.len())
}

/// The published ring of `job`, if any.
pub async fn ring(client: &Client, ns: &str, job: &str) -> Result<Option<Membership>> {
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

pub async fn job_status(client: &Client, ns: &str, name: &str) -> Result<DiphomaJob> {
    Ok(Api::<DiphomaJob>::namespaced(client.clone(), ns)
        .get(name)
        .await?)
}

pub fn phase_of(j: &DiphomaJob) -> Option<Phase> {
    j.status.as_ref().and_then(|s| s.phase)
}

/// One line per pod of `ns`: name, phase, node and why it waits (for failure messages).
pub async fn pod_states(client: &Client, ns: &str) -> Result<Vec<String>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items;
    Ok(pods
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
        .collect())
}

/// Waits for the job to run with a ring of `size` at a generation above `after`, published for
/// this job (its `jobUid`: not a ring ConfigMap orphaned by a deleted job of the same name, which
/// the job's first ring replaces a moment after its status says Running); returns it.
pub async fn running_ring(
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
                && found.as_ref().is_some_and(|r| {
                    r.members.len() == size
                        && r.generation > after
                        && j.metadata.uid.as_deref() == Some(r.job_uid.as_str())
                });
            last = j.status;
            Ok(done)
        },
    )
    .await;
    if let Err(e) = waited {
        let states = pod_states(&ctx.client, ns).await?;
        return Err(e.context(format!(
            "last status: {}; pods: {states:#?}",
            serde_json::to_string(&last).unwrap_or_default()
        )));
    }
    Ok(found.unwrap())
}

/// Waits up to `secs` for the job to reach a terminal phase; returns its status then.
pub async fn finished(ctx: &Ctx, ns: &str, name: &str, secs: u64) -> Result<DiphomaJobStatus> {
    let mut last = None;
    let waited = eventually(secs, &format!("{name} finished"), async || {
        last = job_status(&ctx.client, ns, name).await?.status;
        Ok(last
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(Phase::is_terminal))
    })
    .await;
    if let Err(e) = waited {
        let states = pod_states(&ctx.client, ns).await?;
        return Err(e.context(format!("last status: {last:?}; pods: {states:#?}")));
    }
    Ok(last.unwrap())
}

/// One API request of the operator, from the API server's audit log.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    /// The API verb: `get`, `list`, `watch`, `create`, `patch`, `update`, `delete`, ...
    pub verb: String,
    /// The resource (`pods`, `configmaps`, `leases`, ...), with `/subresource` if any.
    pub resource: String,
    /// The object's namespace (empty: cluster-scoped or all namespaces).
    pub namespace: String,
    /// The request's URI.
    pub uri: String,
}

/// The events in namespace `ns` with reason `reason`, in no particular order.
pub async fn events_of(
    ctx: &Ctx,
    ns: &str,
    reason: &str,
) -> Result<Vec<k8s_openapi::api::events::v1::Event>> {
    Ok(
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(ctx.client.clone(), ns)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .collect(),
    )
}

/// The audit log's length now: [`operator_requests`] from here reads what comes after.
pub fn audit_offset(cp: &ControlPlane) -> u64 {
    std::fs::metadata(&cp.audit_log).map_or(0, |m| m.len())
}

/// The in-process operator's requests (user `diphoma-operator`) that completed after byte `from`
/// of the audit log ([`ControlPlane::audit_log`]); a line cut short by a write in progress is
/// skipped.
pub fn operator_requests(cp: &ControlPlane, from: u64) -> Result<Vec<Request>> {
    use std::io::{Read, Seek};
    let mut f = std::fs::File::open(&cp.audit_log)
        .with_context(|| format!("audit log {}", cp.audit_log.display()))?;
    f.seek(std::io::SeekFrom::Start(from))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let mut out = vec![];
    for line in text.lines() {
        let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let s = |p: &str| ev.pointer(p).and_then(|v| v.as_str()).unwrap_or_default();
        if s("/user/username") != "diphoma-operator" || s("/stage") != "ResponseComplete" {
            continue;
        }
        let sub = s("/objectRef/subresource");
        out.push(Request {
            verb: s("/verb").to_owned(),
            resource: match sub {
                "" => s("/objectRef/resource").to_owned(),
                sub => format!("{}/{sub}", s("/objectRef/resource")),
            },
            namespace: s("/objectRef/namespace").to_owned(),
            uri: s("/requestURI").to_owned(),
        });
    }
    Ok(out)
}

/// `requests` counted by verb and resource, one `verb resource count` line each (for messages).
pub fn request_table(requests: &[Request]) -> String {
    let mut counts = std::collections::BTreeMap::<(&str, &str), usize>::new();
    for r in requests {
        *counts.entry((&r.verb, &r.resource)).or_default() += 1;
    }
    counts
        .iter()
        .map(|((v, r), n)| format!("{v} {r} {n}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Logs to stderr, filtered by `RUST_LOG` (errors only by default).
pub fn init_tracing() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// `kubectl diphoma ARGS` (kubectl finds the plugin on `PATH`); its output.
pub fn plugin(ctx: &Ctx, args: &[&str]) -> Result<std::process::Output> {
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
pub fn plugin_ok(ctx: &Ctx, args: &[&str]) -> Result<String> {
    let out = plugin(ctx, args)?;
    ensure!(
        out.status.success(),
        "kubectl diphoma {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// `kubectl diphoma top JOB -n NS --interval 1`: its text, and each rank's row split at
/// whitespace (after the generation line and the header).
pub fn top_rows(ctx: &Ctx, job: &str, ns: &str) -> Result<(String, Vec<Vec<String>>)> {
    let top = plugin_ok(ctx, &["top", job, "--interval", "1", "-n", ns])?;
    let rows = (top.lines().skip(2))
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect();
    Ok((top, rows))
}

/// Every PromQL expression of a dashboard: (panel or annotation title, expression).
pub fn dashboard_queries(board: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = vec![];
    for p in board["panels"].as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or_default();
            out.push((
                title.to_owned(),
                t["expr"].as_str().unwrap_or_default().to_owned(),
            ));
        }
    }
    for a in board["annotations"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(expr) = a["expr"].as_str() {
            let name = a["name"].as_str().unwrap_or_default();
            out.push((format!("annotation {name}"), expr.to_owned()));
        }
    }
    out
}

/// Grafana's variables and interval macros replaced for a query against Prometheus.
pub fn substitute(expr: &str, namespace: &str, job: &str) -> String {
    expr.replace("$namespace", namespace)
        .replace("$job", job)
        .replace("$__rate_interval", "10s")
        .replace("$__interval", "2s")
        .replace("$__range", "10m")
}

/// When (Unix seconds) Prometheus last scraped `scrape_job`; `None` before its first scrape.
pub fn last_scrape(prom: &Prometheus, scrape_job: &str) -> Result<Option<f64>> {
    let now = jiff::Timestamp::now().as_second() as f64;
    let expr = format!("max(timestamp(up{{job=\"{scrape_job}\"}}))");
    let result = prom.query_range(&expr, now, now, 1.0)?;
    Ok(result
        .first()
        .and_then(|s| s["values"][0][1].as_str()?.parse().ok()))
}

/// Whether a query_range answer has at least one finite sample.
pub fn has_data(result: &[serde_json::Value]) -> bool {
    result.iter().any(|s| {
        s["values"].as_array().into_iter().flatten().any(|v| {
            v[1].as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
    })
}

/// A real Prometheus (Debian's package) scraping the chart-installed operator's pods (scrape
/// job `diphoma-operator`) and namespace `ns`'s workers (`diphoma-workers`), their targets
/// re-discovered every second with the labels of docs/prometheus-scrape.yaml (Debian's
/// Prometheus has no Kubernetes service discovery). Stops both when dropped.
pub struct Scraped {
    /// The server.
    pub prom: Prometheus,
    discovery: tokio::task::JoinHandle<()>,
}

impl Scraped {
    /// Starts the server and the discovery (see the type).
    pub async fn start(ctx: &Ctx, ns: &str) -> Result<Scraped> {
        let prom = Prometheus::start(
            &prometheus_bin()?,
            &ctx.cp.dir.join(format!("prometheus-{ns}")),
            &["diphoma-operator", "diphoma-workers"],
        )
        .await?;
        let (client, prom_dir, ns) = (ctx.client.clone(), prom.dir.clone(), ns.to_owned());
        let discovery = tokio::spawn(async move {
            loop {
                for (scrape_job, namespace) in
                    [("diphoma-operator", OPERATOR_NS), ("diphoma-workers", &ns)]
                {
                    if let Ok(pods) = Api::<Pod>::namespaced(client.clone(), namespace)
                        .list(&ListParams::default())
                        .await
                    {
                        let _ = write_targets(
                            &prom_dir,
                            scrape_job,
                            &pods.items,
                            diphoma_contract::LABEL_JOB_NAME,
                        );
                    }
                }
                // Deliberate: re-discover every second (as the scrape interval), for as long as
                // the test runs.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        Ok(Scraped { prom, discovery })
    }
}

impl Drop for Scraped {
    fn drop(&mut self) {
        self.discovery.abort();
    }
}

/// The queries of dashboard `file` (`board`, the chart's JSON) that return no finite sample
/// between `start` and `end` (Unix seconds) for the namespace and scrape job `(namespace, job)`,
/// each named with its panel and query; an error when the board has fewer than 8 queries or
/// Prometheus refuses one.
pub fn dashboard_gaps(
    prom: &Prometheus,
    file: &str,
    board: &serde_json::Value,
    (namespace, job): (&str, &str),
    (start, end): (f64, f64),
) -> Result<Vec<String>> {
    let queries = dashboard_queries(board);
    ensure!(queries.len() >= 8, "{file}: only {} queries", queries.len());
    let mut missing = vec![];
    for (title, expr) in queries {
        let q = substitute(&expr, namespace, job);
        let result = prom
            .query_range(&q, start, end, 1.0)
            .with_context(|| format!("{file}/{title}"))?;
        if !has_data(&result) {
            missing.push(format!("{file}/{title}: no data for {q}"));
        }
    }
    Ok(missing)
}
