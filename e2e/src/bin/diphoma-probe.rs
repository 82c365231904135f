//! `diphoma-probe`: a small program the e2e tests run as a pod image (`diphoma-probe`). Each flag
//! is one observation or action, printed as one line on stdout, in this order:
//! `--env` prints `env NAME=VALUE` for every variable; `--read FILE` prints `read FILE <content>`;
//! `--get PATH` calls the API server (with `$KUBECONFIG`) and prints `get PATH <http status>`;
//! `--serve ADDR` answers HTTP probes while it sleeps (`GET /ready`: 200 while the
//! `--ready-file` exists, else 503; `GET /healthz`: 500 while the `--sick-file` exists, else 200;
//! each answer printed as `answered PATH <status>`);
//! `--sleep SECS` sleeps (SIGTERM ends it with exit 0); `--exit CODE` exits with CODE.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Prints what a pod's process sees; used by the e2e tests")]
struct Cli {
    /// Print the environment.
    #[arg(long)]
    env: bool,
    /// Files to print.
    #[arg(long)]
    read: Vec<PathBuf>,
    /// API paths to GET (e.g. /api/v1/namespaces/ns/pods).
    #[arg(long)]
    get: Vec<String>,
    /// Address to answer HTTP probes on (the pod IP and a port).
    #[arg(long)]
    serve: Option<std::net::SocketAddr>,
    /// `/ready` answers 200 while this file exists.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// `/healthz` answers 500 while this file exists.
    #[arg(long)]
    sick_file: Option<PathBuf>,
    /// Seconds to sleep before exiting.
    #[arg(long, default_value_t = 0)]
    sleep: u64,
    /// Exit code.
    #[arg(long, default_value_t = 0)]
    exit: i32,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    if cli.env {
        for (k, v) in std::env::vars() {
            println!("env {k}={v}");
        }
    }
    for f in &cli.read {
        match std::fs::read_to_string(f) {
            Ok(s) => println!("read {} {}", f.display(), s.trim_end()),
            Err(e) => println!("read {} error: {e}", f.display()),
        }
    }
    for path in &cli.get {
        println!("get {path} {}", get(path).await);
    }
    if let Some(addr) = cli.serve {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind --serve");
        println!("serve {addr}");
        let app = probes(cli.ready_file.clone(), cli.sick_file.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    if cli.sleep > 0 {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(cli.sleep)) => {}
            _ = term.recv() => { println!("sigterm"); std::process::exit(0) }
        }
    }
    std::process::exit(cli.exit);
}

/// `/ready` and `/healthz`, each decided by whether its file exists now; each answer is printed
/// as `answered PATH <status>` (so a test can wait for probes that happened).
fn probes(ready: Option<PathBuf>, sick: Option<PathBuf>) -> axum::Router {
    use axum::http::StatusCode;
    let exists = |f: &Option<PathBuf>| f.as_ref().is_some_and(|f| f.exists());
    let answered = |path: &str, status: StatusCode| {
        println!("answered {path} {}", status.as_u16());
        status
    };
    axum::Router::new()
        .route(
            "/ready",
            axum::routing::get(async move || match exists(&ready) {
                true => answered("/ready", StatusCode::OK),
                false => answered("/ready", StatusCode::SERVICE_UNAVAILABLE),
            }),
        )
        .route(
            "/healthz",
            axum::routing::get(async move || match exists(&sick) {
                true => answered("/healthz", StatusCode::INTERNAL_SERVER_ERROR),
                false => answered("/healthz", StatusCode::OK),
            }),
        )
}

/// HTTP status of `GET path` as the pod's identity, or `error: …`.
async fn get(path: &str) -> String {
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => return format!("error: {e}"),
    };
    let req = http::Request::get(path)
        .body(Vec::new())
        .expect("static request");
    match client.request_text(req).await {
        Ok(_) => "200".into(),
        Err(kube::Error::Api(s)) => s.code.to_string(),
        Err(e) => format!("error: {e}"),
    }
}
