//! `diphoma-operator`: `crd` prints the CustomResourceDefinition; `run` runs the reconciler.

use clap::{Parser, Subcommand};
use diphoma_operator::controller::{LeaderElection, Options, run};

#[derive(Parser)]
#[command(
    version,
    about = "The Diphoma operator: reconciles DiphomaJobs into self-repairing rings of workers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log as JSON lines instead of text.
    #[arg(long, global = true, env = "DIPHOMA_LOG_JSON")]
    log_json: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the DiphomaJob CustomResourceDefinition (YAML).
    Crd {
        /// Print the field reference in Markdown instead (docs/crd-reference.md).
        #[arg(long)]
        markdown: bool,
    },
    /// Run the controller with the in-cluster or `$KUBECONFIG` credentials.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Address of `/metrics`, `/healthz` and `/readyz` (default: `$POD_IP`, else 127.0.0.1, on
    /// `--metrics-port`).
    #[arg(long, env = "DIPHOMA_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Port of the default metrics address.
    #[arg(long, env = "DIPHOMA_METRICS_PORT", default_value_t = 8080)]
    metrics_port: u16,
    /// Reconcile only while holding the leader Lease (for more than one replica).
    #[arg(long, env = "DIPHOMA_LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the leader Lease (default: `$POD_NAMESPACE`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, env = "DIPHOMA_LEASE_NAME", default_value = "diphoma-operator")]
    lease_name: String,
    /// This replica's identity in the Lease (default: `$POD_NAME`).
    #[arg(long, env = "POD_NAME", default_value = "diphoma-operator")]
    identity: String,
    /// Give each job a NetworkPolicy that opens its ring port only to its own workers.
    #[arg(long, env = "DIPHOMA_NETWORK_POLICY")]
    network_policy: bool,
    /// The safety net, in seconds: each job is reconciled at least this often even when no watch
    /// event and no timer of its own asks for it.
    #[arg(long, env = "DIPHOMA_RESYNC_SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    resync_seconds: u64,
    /// The `schedulerName` of the workers of jobs with `spec.gang.scheduler: Coscheduling`: the
    /// second scheduler that runs the scheduler-plugins coscheduling plugin.
    #[arg(long, env = "DIPHOMA_COSCHEDULING_SCHEDULER_NAME", default_value = diphoma_operator::controller::DEFAULT_COSCHEDULING_SCHEDULER_NAME)]
    coscheduling_scheduler_name: String,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if cli.log_json {
        fmt.json().init()
    } else {
        fmt.init()
    }
    match cli.cmd {
        Cmd::Crd { markdown: false } => print!("{}", diphoma_operator::crd_yaml()),
        Cmd::Crd { markdown: true } => print!("{}", diphoma_operator::crd_markdown()),
        Cmd::Run(args) => {
            let client = match kube::Client::try_default().await {
                Ok(c) => c,
                Err(e) => {
                    eprintln!(
                        "diphoma-operator: no Kubernetes credentials (in-cluster or $KUBECONFIG): {e}"
                    );
                    std::process::exit(1);
                }
            };
            let ip: std::net::IpAddr = std::env::var("POD_IP")
                .ok()
                .and_then(|ip| ip.parse().ok())
                .unwrap_or([127, 0, 0, 1].into());
            let metrics_addr = args.metrics_addr.unwrap_or((ip, args.metrics_port).into());
            let listener = match tokio::net::TcpListener::bind(metrics_addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("diphoma-operator: metrics address {metrics_addr}: {e}");
                    std::process::exit(1);
                }
            };
            let opts = Options {
                leader_election: args.leader_elect.then_some(LeaderElection {
                    namespace: args.lease_namespace,
                    lease_name: args.lease_name,
                    identity: args.identity,
                }),
                network_policy: args.network_policy,
                resync: std::time::Duration::from_secs(args.resync_seconds),
                coscheduling_scheduler_name: args.coscheduling_scheduler_name,
            };
            tracing::info!(metrics = %metrics_addr, leader_election = opts.leader_election.is_some(), "diphoma-operator running");
            let stop = async {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            };
            if let Err(e) = run(client, opts, Some(listener), stop).await {
                eprintln!("diphoma-operator: {e}");
                std::process::exit(1);
            }
        }
    }
}
