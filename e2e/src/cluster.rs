//! The local control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
//! 127.0.0.1, started and stopped by the scripts in `e2e/cluster/` (the single implementation that
//! `make cluster-up` uses too). This module only drives those scripts and reads what they write;
//! it never starts a Kubernetes component itself.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

use crate::Error;

/// Directory of the control-plane scripts (`build-bins.sh`, `start.sh`, `stop.sh`, `gen-pki.sh`).
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster")
}

/// Builds the pinned Kubernetes binaries if they are missing (`e2e/cluster/build-bins.sh`) and
/// returns the directory holding them. `DIPHOMA_K8S_BIN` short-circuits the build.
///
/// Errors: [`Error::Script`] when the build fails (its stderr is in the message).
pub fn k8s_bin_dir() -> Result<PathBuf, Error> {
    env_or_script("DIPHOMA_K8S_BIN", "build-bins.sh")
}

/// The path in `$var`, else the last line printed by `script` (in [`scripts_dir`]), which builds
/// or fetches what is missing.
pub(crate) fn env_or_script(var: &str, script: &str) -> Result<PathBuf, Error> {
    if let Ok(path) = std::env::var(var) {
        return Ok(PathBuf::from(path));
    }
    let out = run_script(&scripts_dir().join(script), &[], &[])?;
    Ok(PathBuf::from(out.lines().last().unwrap_or_default().trim()))
}

/// A running control plane. Dropping it stops every process it started (by recorded id) and
/// removes its work directory; a watchdog does the same if the owning process dies first.
#[derive(Debug)]
pub struct ControlPlane {
    /// Work directory: PKI, kubeconfig, logs, pid files, etcd data. Removed on drop.
    pub dir: PathBuf,
    /// Directory of kubectl, kube-apiserver, etcd and helm.
    pub bin_dir: PathBuf,
    /// Admin kubeconfig (O=system:masters).
    pub kubeconfig: PathBuf,
    /// The operator's kubeconfig: user `diphoma-operator`, O=system:masters, whose requests (and
    /// only theirs, with a chart-installed operator's) the API server writes to [`Self::audit_log`].
    pub operator_kubeconfig: PathBuf,
    /// The API server's audit log: one JSON object per line (`audit.k8s.io/v1` Event, level
    /// Metadata, stage ResponseComplete) for each request of the operator's identities.
    pub audit_log: PathBuf,
}

impl ControlPlane {
    /// Builds what is missing, then starts etcd, kube-apiserver (RBAC on), kube-controller-manager
    /// and kube-scheduler on 127.0.0.1 with free ports, each waited for on its health endpoint.
    ///
    /// Errors: [`Error::Script`] naming the script and carrying its stderr when a component does
    /// not come up (the logs stay in the reported directory only while the process lives).
    pub fn start() -> Result<Self, Error> {
        static N: AtomicU32 = AtomicU32::new(0);
        let bin_dir = k8s_bin_dir()?;
        let dir = std::env::temp_dir().join(format!(
            "diphoma-cp-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let pid = std::process::id().to_string();
        let dir_s = dir.to_string_lossy().into_owned();
        let bin_s = bin_dir.to_string_lossy().into_owned();
        let started = run_script(
            &scripts_dir().join("start.sh"),
            &[&bin_s, &dir_s],
            &[("OWNER_PID", &pid)],
        );
        let cp = ControlPlane {
            kubeconfig: dir.join("admin.kubeconfig"),
            operator_kubeconfig: dir.join("operator.kubeconfig"),
            audit_log: dir.join("logs/audit.log"),
            dir,
            bin_dir,
        };
        started.map(|_| cp)
    }

    /// A client authenticated as the cluster admin.
    pub async fn client(&self) -> Result<Client, Error> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// A client authenticated as the operator (user `diphoma-operator`, cluster admin), whose
    /// requests the audit log records.
    pub async fn operator_client(&self) -> Result<Client, Error> {
        client_from_kubeconfig(&self.operator_kubeconfig).await
    }

    /// `kubectl` with this control plane's admin kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// `helm` with `KUBECONFIG` set to the admin kubeconfig.
    pub fn helm(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("helm"));
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// The directory the process kubelet should use for pod directories and logs.
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = run_script(
            &scripts_dir().join("stop.sh"),
            &[&self.dir.to_string_lossy()],
            &[],
        );
    }
}

/// A client for the cluster a kubeconfig file points at.
///
/// Errors: [`Error::Kubeconfig`] naming the file when it cannot be read or used.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, Error> {
    let bad = |source: Box<dyn std::error::Error + Send + Sync>| Error::Kubeconfig {
        path: path.to_owned(),
        source,
    };
    let kc = Kubeconfig::read_from(path).map_err(|e| bad(e.into()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| bad(e.into()))?;
    Client::try_from(config).map_err(|e| bad(e.into()))
}

/// A namespace for one test, deleted (with everything in it) on [`TempNamespace::delete`].
pub struct TempNamespace {
    /// The namespace's name, `<prefix>-<random suffix>`.
    pub name: String,
    client: Client,
}

impl TempNamespace {
    /// Creates `<prefix>-xxxxx` and waits until its `default` ServiceAccount exists, so pods can
    /// be created in it right away.
    pub async fn create(client: &Client, prefix: &str) -> Result<Self, Error> {
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"generateName": format!("{prefix}-")}
        }))
        .expect("static namespace object");
        let ns = api.create(&PostParams::default(), &ns).await?;
        let name = ns.metadata.name.expect("server sets the name");
        let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
        kube::runtime::wait::await_condition(
            sa,
            "default",
            kube::runtime::conditions::is_created(),
        )
        .await
        .map_err(|e| Error::Wait(e.to_string()))?;
        Ok(TempNamespace {
            name,
            client: client.clone(),
        })
    }

    /// Deletes the namespace (background: the namespace controller removes its contents).
    pub async fn delete(self) -> Result<(), Error> {
        let api: Api<Namespace> = Api::all(self.client);
        api.delete(&self.name, &DeleteParams::background()).await?;
        Ok(())
    }
}

/// Runs a bash script, returning its stdout; a non-zero exit is [`Error::Script`] with stderr.
fn run_script(script: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, Error> {
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| Error::Io {
            path: script.to_owned(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Script {
            script: script.to_owned(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl ControlPlane {
    /// Applies the `DiphomaJob` CRD (`crds/diphomajob.yaml`) with kubectl and waits until it is
    /// established.
    ///
    /// Errors: [`Error::Script`] carrying kubectl's stderr; [`Error::Io`] when kubectl cannot run.
    pub fn install_crd(&self) -> Result<(), Error> {
        let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/diphomajob.yaml");
        let established = "--for=condition=Established";
        let steps: [&[&std::ffi::OsStr]; 2] = [
            &["apply".as_ref(), "-f".as_ref(), crd.as_os_str()],
            &[
                "wait".as_ref(),
                established.as_ref(),
                "crd/diphomajobs.diphoma.io".as_ref(),
                "--timeout=60s".as_ref(),
            ],
        ];
        for args in steps {
            let mut tries = 0;
            let out = loop {
                let out = self
                    .kubectl()
                    .args(args)
                    .output()
                    .map_err(|source| Error::Io {
                        path: self.bin_dir.join("kubectl"),
                        source,
                    })?;
                // `kubectl wait` on a CRD the API server has not yet given any condition fails at
                // once (".status.conditions accessor error: <nil>") instead of waiting: again.
                let early = String::from_utf8_lossy(&out.stderr)
                    .contains(".status.conditions accessor error");
                tries += 1;
                if !early || tries == 40 {
                    break out;
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
            };
            if !out.status.success() {
                return Err(Error::Script {
                    script: format!("kubectl {args:?}").into(),
                    status: out.status.to_string(),
                    stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
        }
        Ok(())
    }
}

impl ControlPlane {
    /// Starts Kueue (built by `e2e/cluster/build-kueue.sh`) against this control plane with
    /// `e2e/cluster/start-kueue.sh`: its CRDs, its webhooks on a loopback `url:`, DiphomaJob as
    /// an external framework. Stopped with the control plane (its pid file is in [`Self::dir`]).
    ///
    /// Errors: [`Error::Script`] carrying the script's stderr.
    pub fn start_kueue(&self) -> Result<(), Error> {
        run_script(
            &scripts_dir().join("start-kueue.sh"),
            &[&self.dir.to_string_lossy()],
            &[],
        )
        .map(|_| ())
    }

    /// Starts the scheduler-plugins scheduler (`e2e/cluster/start-coscheduling.sh`, built by
    /// `build-coscheduling.sh`) as a second scheduler named `scheduler_name` running the
    /// Coscheduling plugin, after installing its PodGroup CRD (`scheduling.x-k8s.io/v1alpha1`).
    /// Stopped with the control plane (its pid file is in [`Self::dir`]).
    ///
    /// Errors: [`Error::Script`] carrying the script's stderr.
    pub fn start_coscheduling(&self, scheduler_name: &str) -> Result<(), Error> {
        run_script(
            &scripts_dir().join("start-coscheduling.sh"),
            &[&self.dir.to_string_lossy(), scheduler_name],
            &[],
        )
        .map(|_| ())
    }
}

/// `GET http://addr/path` on loopback (a pod's or the operator's metrics and health endpoints);
/// returns the status line and the body (bytes that are not UTF-8 replaced).
///
/// Errors: the I/O error of the connection.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut raw = vec![];
    s.read_to_end(&mut raw).await?;
    let out = String::from_utf8_lossy(&raw);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    Ok((
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    ))
}
