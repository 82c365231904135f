//! The kubelet's HTTPS API, as far as `kubectl logs` needs it: `GET
//! /containerLogs/{namespace}/{pod}/{container}` on each node's InternalIP and the port its Node
//! announces (`status.daemonEndpoints.kubeletEndpoint.port`). The serving certificate is issued
//! at start by the cluster CA (`openssl`, next to the CA that the API server's
//! `--kubelet-certificate-authority` names), for every node IP; a client must present a
//! certificate of that CA (the API server's `--kubelet-client-certificate`). There is no
//! authorization beyond that (a real kubelet also asks the API server with a SubjectAccessReview).
//!
//! What to serve is [`super::logs`]'s; this module owns TLS, the route and the pod lookup.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig, crypto};

use super::logs::{self, LiveLogs, LogQuery};
use crate::Error;

/// The kubelet port a real node uses; a node falls back to a free port when it is taken.
pub const KUBELET_PORT: u16 = 10250;

/// What the log endpoint reads: the API (pods' UIDs and containers), the kubelet's root and the
/// runs still being written.
#[derive(Clone)]
pub struct LogSource {
    /// A client of the API server.
    pub client: Client,
    /// The kubelet's root directory (`logs/` below it).
    pub root: PathBuf,
    /// Runs still being written (for `follow`).
    pub live: Arc<LiveLogs>,
}

/// Issues a serving certificate for `ips` signed by the CA `ca_crt` (its key is `ca.key` next to
/// it) into `dir/kubelet.crt` and `dir/kubelet.key`; returns their paths.
///
/// Errors: [`Error::Io`] when `openssl` cannot run, [`Error::Script`] when it fails (its stderr).
pub async fn issue_serving_cert(
    ca_crt: &Path,
    dir: &Path,
    ips: &[String],
) -> Result<(PathBuf, PathBuf), Error> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
    let (crt, key) = (dir.join("kubelet.crt"), dir.join("kubelet.key"));
    let sans: Vec<String> = ips.iter().map(|ip| format!("IP:{ip}")).collect();
    let out = tokio::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args([
            "-nodes",
            "-days",
            "365",
            "-subj",
            "/CN=diphoma-process-kubelet",
        ])
        .arg("-CA")
        .arg(ca_crt)
        .arg("-CAkey")
        .arg(ca_crt.with_file_name("ca.key"))
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .args(["-addext", &format!("subjectAltName={}", sans.join(","))])
        .args(["-addext", "extendedKeyUsage=serverAuth"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .args(["-addext", "keyUsage=critical,digitalSignature"])
        .output()
        .await
        .map_err(io(Path::new("openssl")))?;
    if !out.status.success() {
        return Err(Error::Script {
            script: "openssl req -x509 (kubelet serving certificate)".into(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok((crt, key))
}

/// TLS settings: the serving certificate, HTTP/1.1, and client certificates required and
/// verified against `ca_crt`. Errors: [`Error::Tls`] naming the file or what was refused.
pub fn tls_config(crt: &Path, key: &Path, ca_crt: &Path) -> Result<Arc<ServerConfig>, Error> {
    let tls = |what: &Path, e: &dyn std::fmt::Display| Error::Tls {
        what: what.to_owned(),
        message: e.to_string(),
    };
    let certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>, Error> {
        CertificateDer::pem_file_iter(p)
            .and_then(|i| i.collect())
            .map_err(|e| tls(p, &e))
    };
    let provider = Arc::new(crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in certs(ca_crt)? {
        roots.add(c).map_err(|e| tls(ca_crt, &e))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| tls(ca_crt, &e))?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| tls(key, &e))?;
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls(crt, &e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(crt)?, key_der)
        .map_err(|e| tls(crt, &e))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Binds `ip` on [`KUBELET_PORT`], or on a free port when another kubelet holds it.
///
/// Errors: [`Error::Io`] when neither can be bound.
pub async fn bind(ip: &str) -> Result<TcpListener, Error> {
    match TcpListener::bind((ip, KUBELET_PORT)).await {
        Ok(l) => Ok(l),
        Err(_) => TcpListener::bind((ip, 0))
            .await
            .map_err(|source| Error::Io {
                path: format!("{ip}:0").into(),
                source,
            }),
    }
}

/// The kubelet API's routes.
pub fn router(src: LogSource) -> Router {
    Router::new()
        .route(
            "/containerLogs/{namespace}/{pod}/{container}",
            get(container_logs),
        )
        .with_state(src)
}

/// Serves `app` over TLS on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    mut shutdown: watch::Receiver<bool>,
) {
    let acceptor = TlsAcceptor::from(tls);
    while !*shutdown.borrow() {
        let tcp = tokio::select! {
            c = listener.accept() => match c { Ok((tcp, _)) => tcp, Err(_) => continue },
            _ = shutdown.changed() => continue,
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(tcp).await else {
                return;
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "kubelet API connection");
            }
        });
    }
}

fn plain(status: StatusCode, msg: String) -> Response {
    (status, msg).into_response()
}

/// `GET /containerLogs/{namespace}/{pod}/{container}`: the pod's current (or `previous`) run of
/// the container, per [`LogQuery`]; 400 for a bad query, an unknown container or a missing
/// run, 404 for an unknown pod.
async fn container_logs(
    State(src): State<LogSource>,
    UrlPath((ns, name, container)): UrlPath<(String, String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let q = match LogQuery::parse(query.as_deref().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return plain(StatusCode::BAD_REQUEST, e),
    };
    let pod = match Api::<Pod>::namespaced(src.client.clone(), &ns)
        .get_opt(&name)
        .await
    {
        Ok(Some(p)) => p,
        Ok(None) => return plain(StatusCode::NOT_FOUND, format!("pod {ns}/{name} not found")),
        Err(e) => return plain(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let known = pod.spec.iter().flat_map(|s| &s.containers);
    if !known.into_iter().any(|c| c.name == container) {
        let msg = format!("container {container:?} is not valid for pod {name:?}");
        return plain(StatusCode::BAD_REQUEST, msg);
    }
    let uid = pod.metadata.uid.unwrap_or_default();
    let mut runs = logs::runs(&logs::container_dir(
        &src.root, &ns, &name, &uid, &container,
    ));
    let run = if q.previous {
        runs.pop();
        runs.pop().ok_or(format!(
            "previous terminated container {container:?} in pod {name:?} not found"
        ))
    } else {
        runs.pop().ok_or(format!(
            "container {container:?} in pod {name:?} is waiting to start"
        ))
    };
    let run = match run {
        Ok(r) => r,
        Err(msg) => return plain(StatusCode::BAD_REQUEST, msg),
    };
    let (tx, rx) = mpsc::channel::<String>(16);
    tokio::spawn(logs::follow(run, q, src.live.clone(), tx));
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|s| (Ok::<_, std::convert::Infallible>(s), rx))
    });
    (
        [(header::CONTENT_TYPE, "text/plain")],
        Body::from_stream(body),
    )
        .into_response()
}
