//! `diphoma-operator`: `crd` prints the CustomResourceDefinition; `run` runs the reconciler.

use clap::{Parser, Subcommand};

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
    Crd,
    /// Run the controller with the in-cluster or `$KUBECONFIG` credentials.
    Run,
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
        Cmd::Crd => print!("{}", diphoma_operator::crd_yaml()),
        Cmd::Run => {
            let client = match kube::Client::try_default().await {
                Ok(c) => c,
                Err(e) => {
                    eprintln!(
                        "diphoma-operator: no Kubernetes credentials (in-cluster or $KUBECONFIG): {e}"
                    );
                    std::process::exit(1);
                }
            };
            tracing::info!("diphoma-operator running");
            diphoma_operator::controller::run(client, async {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            })
            .await;
        }
    }
}
