//! `kubectl-diphoma`: a kubectl plugin for DiphomaJobs (`kubectl diphoma ring|logs|why|top JOB`,
//! `kubectl diphoma submit SCRIPT`).
//!
//! # Layout
//! - `main.rs` (this file): the CLI, the API calls (the job, its ring ConfigMap, its pods, events,
//!   logs) and the workers' `/metrics` (through the API server's pod proxy, or straight from the
//!   pod IP when it is a loopback address, as on the local cluster, whose API server refuses to
//!   proxy to loopback), errors and exit codes.
//! - [`report`]: what is printed, from the fetched objects. Pure.
//! - [`submit`]: the script's ConfigMap and the DiphomaJob `submit` creates. Pure.
//!
//! The job is read with the operator's own types (`diphoma_operator::api`, nothing else of that
//! crate) and the ring with the contract's `Membership`, so the plugin cannot drift from what the
//! operator writes. It only reads, but for `submit`, which creates a job and its script.
//!
//! Exit codes: 0 done, 1 the job (or the rank) does not exist, 2 bad usage (a bad argument, an
//! unreadable script), 3 no cluster (no kubeconfig, or the API server cannot be reached), 4 any
//! other API error, 5 `submit`: the job exists already.

mod report;
mod submit;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use diphoma_contract::membership::{MEMBERSHIP_KEY, Membership, membership_configmap_name};
use diphoma_contract::{DEFAULT_METRICS_PORT, LABEL_JOB_NAME, METRICS_PORT_NAME};
use diphoma_operator::api::DiphomaJob;
use futures::{AsyncBufReadExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod};
use kube::api::{ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use report::Samples;

#[derive(Parser)]
#[command(
    name = "kubectl diphoma",
    about = "Inspect Diphoma training jobs",
    version
)]
struct Cli {
    /// Namespace of the job (default: the kubeconfig context's namespace).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The ring: rank, pod, node, address, readiness, last step and loss per rank.
    Ring {
        /// The DiphomaJob.
        job: String,
    },
    /// The logs of the worker that holds a rank in the current ring generation.
    Logs {
        /// The DiphomaJob.
        job: String,
        /// The rank.
        #[arg(long)]
        rank: u32,
        /// Stream the logs as they are written.
        #[arg(short, long)]
        follow: bool,
        /// Only the last N lines.
        #[arg(long)]
        tail: Option<i64>,
    },
    /// Why the job waits, failed or was repaired, in plain words.
    Why {
        /// The DiphomaJob.
        job: String,
        /// How many recent events to show.
        #[arg(long, default_value_t = 10)]
        events: usize,
    },
    /// Samples/s, allreduce time and its share of wall time per rank, from the workers' metrics.
    Top {
        /// The DiphomaJob.
        job: String,
        /// Seconds between the two scrapes the allreduce share is measured over.
        #[arg(long, default_value_t = 2.0)]
        interval: f64,
    },
    /// Submit a PyTorch script: its ConfigMap (`NAME-script`, owned by the job) and a
    /// DiphomaJob running it, by default as an unchanged torchrun script
    /// (`python -m diphoma.run SCRIPT ARGS`, restarted in place at each ring generation).
    Submit {
        /// The training script (one file).
        script: std::path::PathBuf,
        /// The job's name (default: the script's file name, as a DNS label).
        #[arg(long)]
        name: Option<String>,
        /// Print the two objects (JSON) instead of creating them.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        options: submit::Options,
    },
}

/// Why a command failed; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
enum CliError {
    /// The job, or what it names, does not exist.
    #[error("{0}")]
    NotFound(String),
    /// No kubeconfig, or the API server does not answer.
    #[error("no cluster: {0}")]
    NoCluster(String),
    /// The API server refused a request.
    #[error("kubernetes API: {0}")]
    Api(#[source] kube::Error),
    /// A bad argument or an unreadable file, named.
    #[error("{0}")]
    Usage(String),
    /// `submit`: a job of that name exists.
    #[error("{0}")]
    Exists(String),
}

impl CliError {
    fn code(&self) -> u8 {
        match self {
            CliError::NotFound(_) => 1,
            CliError::NoCluster(_) => 3,
            CliError::Api(_) => 4,
            CliError::Usage(_) => 2,
            CliError::Exists(_) => 5,
        }
    }
}

impl From<kube::Error> for CliError {
    /// An API status is the server's answer; anything else (connect, TLS, timeout) means the
    /// cluster was not reached.
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(_) => CliError::Api(e),
            e => CliError::NoCluster(format!("the API server cannot be reached: {e}")),
        }
    }
}

/// The job and its current ring.
struct Target {
    client: Client,
    ns: String,
    job: DiphomaJob,
}

impl Target {
    /// Connects and reads the job. Errors: [`CliError::NoCluster`], [`CliError::NotFound`]
    /// ("diphomajob NS/NAME not found"), [`CliError::Api`].
    async fn open(ns: Option<String>, name: &str) -> Result<Self, CliError> {
        let client = Client::try_default()
            .await
            .map_err(|e| CliError::NoCluster(format!("no usable kubeconfig: {e}")))?;
        let ns = ns.unwrap_or_else(|| client.default_namespace().to_owned());
        let job = Api::<DiphomaJob>::namespaced(client.clone(), &ns)
            .get_opt(name)
            .await?
            .ok_or_else(|| CliError::NotFound(format!("diphomajob {ns}/{name} not found")))?;
        Ok(Target { client, ns, job })
    }

    fn name(&self) -> String {
        self.job.metadata.name.clone().unwrap_or_default()
    }

    /// The ring's current generation. Errors: [`CliError::NotFound`] when none is published (or
    /// the published one is another job's).
    async fn ring(&self) -> Result<Membership, CliError> {
        let cm_name = membership_configmap_name(&self.name());
        let cm = Api::<ConfigMap>::namespaced(self.client.clone(), &self.ns)
            .get_opt(&cm_name)
            .await?;
        let json = cm.and_then(|c| c.data?.remove(MEMBERSHIP_KEY));
        let none = || {
            let (ns, name) = (&self.ns, self.name());
            CliError::NotFound(format!(
                "diphomajob {ns}/{name} has no ring yet ({cm_name})"
            ))
        };
        let m = Membership::parse(&json.ok_or_else(none)?)
            .map_err(|e| CliError::NotFound(format!("{cm_name}: {e}")))?;
        // A ring left by a deleted job of the same name is not this job's.
        if m.job_uid == self.job.metadata.uid.clone().unwrap_or_default() {
            Ok(m)
        } else {
            Err(none())
        }
    }

    /// The job's worker pods (by its job-name label, and owned by the job: not those of a
    /// deleted job of the same name that still terminate), by name.
    async fn workers(&self) -> Result<BTreeMap<String, Pod>, CliError> {
        let lp = ListParams::default().labels(&format!("{LABEL_JOB_NAME}={}", self.name()));
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .list(&lp)
            .await?;
        let uid = self.job.metadata.uid.clone().unwrap_or_default();
        Ok(pods
            .items
            .into_iter()
            .filter(|p| {
                p.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == uid)
            })
            .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
            .collect())
    }

    /// Each reachable member's metrics, by pod name (members whose scrape fails are left out).
    async fn metrics(
        &self,
        ring: &Membership,
        pods: &BTreeMap<String, Pod>,
    ) -> BTreeMap<String, Samples> {
        let scrapes = ring.members.iter().filter_map(|m| {
            let pod = pods.get(&m.pod)?;
            Some(async move { Some((m.pod.clone(), self.scrape(pod).await?)) })
        });
        futures::future::join_all(scrapes)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// One worker's `/metrics`: from its IP when that is a loopback address (the local cluster),
    /// else through the API server's pod proxy; `None` when it does not answer.
    async fn scrape(&self, pod: &Pod) -> Option<Samples> {
        let port = metrics_port(pod);
        let ip = pod.status.as_ref()?.pod_ip.clone()?;
        let text = if ip.parse::<std::net::IpAddr>().ok()?.is_loopback() {
            http_get(&format!("http://{ip}:{port}/metrics")).await?
        } else {
            let name = pod.metadata.name.clone()?;
            let path = format!(
                "/api/v1/namespaces/{}/pods/{name}:{port}/proxy/metrics",
                self.ns
            );
            let req = http::Request::get(path).body(vec![]).ok()?;
            self.client.request_text(req).await.ok()?
        };
        Some(report::parse_samples(&text))
    }
}

/// The port of the pod's container port named `metrics`, else the contract's default.
fn metrics_port(pod: &Pod) -> i32 {
    pod.spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(METRICS_PORT_NAME))
        .map_or(DEFAULT_METRICS_PORT.into(), |p| p.container_port)
}

/// GET over plain HTTP with a 5 s limit; the body of a 2xx answer, else `None`.
async fn http_get(url: &str) -> Option<String> {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let get = async {
        let resp = client.get(url.parse().ok()?).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .ok()?
}

async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Submit {
            script,
            name,
            dry_run,
            options,
        } => {
            let text = std::fs::read_to_string(&script)
                .map_err(|e| CliError::Usage(format!("{}: {e}", script.display())))?;
            let file = script
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .ok_or_else(|| CliError::Usage(format!("{}: no file name", script.display())))?;
            let s = submit::Submission {
                name: name.unwrap_or_else(|| submit::default_name(&script)),
                script: (file, text),
                options,
            };
            submit_job(cli.namespace, &s, dry_run).await?;
        }
        Command::Ring { job } => {
            let t = Target::open(cli.namespace, &job).await?;
            let ring = t.ring().await?;
            let pods = t.workers().await?;
            let metrics = t.metrics(&ring, &pods).await;
            print!("{}", report::ring(&ring, &pods, &metrics));
        }
        Command::Logs {
            job,
            rank,
            follow,
            tail,
        } => {
            let t = Target::open(cli.namespace, &job).await?;
            let ring = t.ring().await?;
            let member = ring
                .members
                .iter()
                .find(|m| m.rank == rank)
                .ok_or_else(|| {
                    CliError::NotFound(format!(
                        "diphomajob {}/{job} has no rank {rank} in generation {} ({} ranks)",
                        t.ns,
                        ring.generation,
                        ring.members.len()
                    ))
                })?;
            let lp = LogParams {
                follow,
                tail_lines: tail,
                ..LogParams::default()
            };
            let stream = Api::<Pod>::namespaced(t.client.clone(), &t.ns)
                .log_stream(&member.pod, &lp)
                .await?;
            let mut lines = stream.lines();
            while let Some(line) = lines.try_next().await.map_err(|e| {
                CliError::NoCluster(format!("the log stream of {} broke: {e}", member.pod))
            })? {
                println!("{line}");
            }
        }
        Command::Why { job, events } => {
            let t = Target::open(cli.namespace, &job).await?;
            let workers = t.workers().await?;
            let all = Api::<Event>::namespaced(t.client.clone(), &t.ns)
                .list(&ListParams::default())
                .await?;
            let ours: Vec<Event> = all
                .items
                .into_iter()
                .filter(|e| {
                    let o = &e.involved_object;
                    let name = o.name.as_deref().unwrap_or("");
                    match o.kind.as_deref() {
                        Some("DiphomaJob") => name == job,
                        Some("Pod") => workers.contains_key(name),
                        _ => false,
                    }
                })
                .collect();
            let workers: Vec<Pod> = workers.into_values().collect();
            print!("{}", report::why(&t.job, &workers, &ours, events));
        }
        Command::Top { job, interval } => {
            let t = Target::open(cli.namespace, &job).await?;
            let ring = t.ring().await?;
            let pods = t.workers().await?;
            let t0 = std::time::Instant::now();
            let before = t.metrics(&ring, &pods).await;
            tokio::time::sleep(Duration::from_secs_f64(interval.max(0.1))).await;
            let elapsed = t0.elapsed().as_secs_f64();
            let after = t.metrics(&ring, &pods).await;
            print!("{}", report::top(&ring, &before, &after, elapsed));
        }
    }
    Ok(())
}

/// Creates the script's ConfigMap (never over an existing one) and the job (`dry_run`: prints
/// them, in the kubeconfig's namespace when there is one), then makes the job the ConfigMap's
/// owner so that deleting the job deletes it; a job the API server refuses takes its ConfigMap
/// back. Errors: [`CliError::Usage`] for a refused submission, [`CliError::Exists`] when the
/// job or the ConfigMap exists (nothing is changed), the API's otherwise.
async fn submit_job(
    ns: Option<String>,
    s: &submit::Submission,
    dry_run: bool,
) -> Result<(), CliError> {
    let objects = |ns: &str| {
        s.objects(ns)
            .map_err(|e| CliError::Usage(format!("submit: {e}")))
    };
    if dry_run {
        let inferred = kube::Config::infer()
            .await
            .ok()
            .map(|c| c.default_namespace);
        let (cm, job) = objects(ns.or(inferred).as_deref().unwrap_or("default"))?;
        println!("{cm:#}\n{job:#}");
        return Ok(());
    }
    let client = Client::try_default()
        .await
        .map_err(|e| CliError::NoCluster(format!("no usable kubeconfig: {e}")))?;
    let ns = ns.unwrap_or_else(|| client.default_namespace().to_owned());
    let (cm, job) = objects(&ns)?;
    let taken = |what: &str| {
        CliError::Exists(format!(
            "{what} exists: choose another --name, or delete it first"
        ))
    };
    let exists = |what: String| {
        move |e: kube::Error| match e {
            kube::Error::Api(a) if a.code == 409 => taken(&what),
            e => e.into(),
        }
    };
    let jobs = Api::<DiphomaJob>::namespaced(client.clone(), &ns);
    if jobs.get_opt(&s.name).await?.is_some() {
        return Err(taken(&format!("diphomajob {ns}/{}", s.name)));
    }
    let cm_name = format!("{}-script", s.name);
    let cm: ConfigMap = serde_json::from_value(cm)
        .map_err(|e| CliError::Usage(format!("submit: the ConfigMap does not decode: {e}")))?;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    cms.create(&PostParams::default(), &cm)
        .await
        .map_err(exists(format!("configmap {ns}/{cm_name}")))?;
    let job: DiphomaJob = serde_json::from_value(job)
        .map_err(|e| CliError::Usage(format!("submit: the job does not decode: {e}")))?;
    let created = match jobs.create(&PostParams::default(), &job).await {
        Ok(j) => j,
        Err(e) => {
            let _ = cms.delete(&cm_name, &Default::default()).await;
            return Err(exists(format!("diphomajob {ns}/{}", s.name))(e));
        }
    };
    let owner = serde_json::json!({"metadata": {"ownerReferences": [{
        "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "name": s.name,
        "uid": created.metadata.uid}]}});
    cms.patch(&cm_name, &PatchParams::default(), &Patch::Merge(&owner))
        .await?;
    println!(
        "diphomajob {ns}/{} submitted: {} worker(s) run {}; watch it with `kubectl get dpj {} -w` \
         and `kubectl diphoma logs {} --rank 0 -f`",
        s.name, s.options.workers, s.script.0, s.name, s.name
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.code())
        }
    }
}
