//! `diphoma-probe`: a small program the e2e tests run as a pod image (`diphoma-probe`). Each flag
//! is one observation or action, printed as one line on stdout, in this order:
//! `--env` prints `env NAME=VALUE` for every variable; `--read FILE` prints `read FILE <content>`;
//! `--get PATH` calls the API server (with `$KUBECONFIG`) and prints `get PATH <http status>`;
//! `--serve ADDR` answers HTTP probes while it sleeps (`GET /ready`: 200 while the
//! `--ready-file` exists, else 503; `GET /healthz`: 500 while the `--sick-file` exists, else 200;
//! each answer printed as `answered PATH <status>`);
//! `--pods SELECTOR` (in `--namespace`, listed through the API server) calls `GET <pod IP>:<--port>
//! <PATH>` on each pod for every `--http PATH`, prints `http POD PATH <status line>`, and exits 1
//! unless some pod answered and every answer was 200 (the chart's `helm test`);
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
    /// Label selector of the pods to call over HTTP (`--http`).
    #[arg(long)]
    pods: Option<String>,
    /// Namespace of `--pods`.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Port of `--pods` to call.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Paths to GET on each of `--pods`.
    #[arg(long)]
    http: Vec<String>,
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
    if let Some(selector) = &cli.pods
        && !pods_answer(&cli.namespace, selector, cli.port, &cli.http).await
    {
        std::process::exit(1);
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

/// Calls every path on every pod matching `selector` in `namespace` (at its pod IP and `port`),
/// printing one line per answer; true when some pod answered and every answer was 200.
async fn pods_answer(namespace: &str, selector: &str, port: u16, paths: &[String]) -> bool {
    use k8s_openapi::api::core::v1::Pod;
    let pods = match kube::Client::try_default().await {
        Ok(c) => kube::Api::<Pod>::namespaced(c, namespace)
            .list(&kube::api::ListParams::default().labels(selector))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let pods = match pods {
        Ok(list) => list.items,
        Err(e) => {
            println!("pods {selector} error: {e}");
            return false;
        }
    };
    let mut ok = 0;
    let mut failed = 0;
    for pod in &pods {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else {
            println!("http {name} no pod IP");
            failed += 1;
            continue;
        };
        let Ok(ip) = ip.parse::<std::net::IpAddr>() else {
            println!("http {name} bad pod IP {ip}");
            failed += 1;
            continue;
        };
        for path in paths {
            let status = diphoma_e2e::cluster::http_get((ip, port).into(), path)
                .await
                .map_or_else(|e| format!("error: {e}"), |(status, _)| status);
            println!("http {name} {path} {status}");
            match status.split(' ').nth(1) {
                Some("200") => ok += 1,
                _ => failed += 1,
            }
        }
    }
    ok > 0 && failed == 0
}
