//! A real Prometheus for the dashboard tests: Debian's `prometheus` binary (unpacked by
//! `cluster/fetch-prometheus.sh`), started on 127.0.0.1, queried over its HTTP API (with `curl`),
//! stopped when dropped. Debian builds it without Kubernetes service discovery, so the tests
//! discover the pods themselves and hand them over as `file_sd` target groups
//! ([`file_sd_groups`]) with the labels that `docs/prometheus-scrape.yaml` gives on a cluster.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::Error;
use crate::cluster::env_or_script;
use crate::kubelet::process::{Launch, signal_group, spawn};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// The prometheus binary: `$DIPHOMA_PROMETHEUS`, else what `fetch-prometheus.sh` unpacks.
///
/// Errors: [`Error::Script`] when the package cannot be fetched.
pub fn prometheus_bin() -> Result<PathBuf, Error> {
    env_or_script("DIPHOMA_PROMETHEUS", "fetch-prometheus.sh")
}

/// The promtool binary of the same package: the file `promtool` beside [`prometheus_bin`] (so
/// `$DIPHOMA_PROMETHEUS` must name a prometheus with its promtool beside it).
///
/// Errors: [`Error::Script`] when the package cannot be fetched.
pub fn promtool_bin() -> Result<PathBuf, Error> {
    Ok(prometheus_bin()?.with_file_name("promtool"))
}

/// A running Prometheus server (its process group is killed on drop).
#[derive(Debug)]
pub struct Prometheus {
    child: tokio::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Its work directory: configuration, TSDB, `prometheus.log`.
    pub dir: PathBuf,
}

impl Prometheus {
    /// Starts the server on a free port of 127.0.0.1 with its TSDB in `dir`, scraping every
    /// second one job per name in `scrape_jobs`, whose targets come from `<dir>/<job>.json`
    /// ([`write_targets`]); waits (at most 30 s) for `/-/ready`.
    ///
    /// Errors: [`Error::Io`] when it cannot be started, [`Error::Wait`] (with the end of its
    /// log) when it does not become ready.
    pub async fn start(bin: &Path, dir: &Path, scrape_jobs: &[&str]) -> Result<Self, Error> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| Error::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let jobs: Vec<serde_json::Value> = scrape_jobs
            .iter()
            .map(|j| {
                let file = dir.join(format!("{j}.json"));
                serde_json::json!({"job_name": j, "file_sd_configs": [{"files": [file], "refresh_interval": "1s"}]})
            })
            .collect();
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": jobs,
        });
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config.to_string()).map_err(io(&file))?;
        let port = crate::kit::free_addr().map_err(io(dir))?.port();
        let log = dir.join("prometheus.log");
        let out = std::fs::File::create(&log).map_err(io(&log))?;
        let err = out.try_clone().map_err(io(&log))?;
        let launch = Launch {
            program: bin.to_owned(),
            args: vec![
                format!("--config.file={}", file.display()),
                format!("--storage.tsdb.path={}", dir.join("data").display()),
                format!("--web.listen-address=127.0.0.1:{port}"),
                "--log.level=warn".into(),
            ],
            env: vec![],
            cwd: dir.to_owned(),
            hostname: "prometheus".into(),
            container: None,
        };
        let child = spawn(&launch, out.into(), err.into())?;
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir: dir.to_owned(),
        };
        for _ in 0..150 {
            if p.get("/-/ready", &[]).is_ok() {
                return Ok(p);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(Error::Wait(format!(
            "prometheus not ready: {}",
            p.log_tail()
        )))
    }

    /// `GET path` with URL-encoded `params`; the body when the status is 2xx.
    ///
    /// Errors: [`Error::Script`] (curl's exit status and stderr) otherwise.
    pub fn get(&self, path: &str, params: &[(&str, &str)]) -> Result<String, Error> {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--fail-with-body", "--max-time", "10", "-G"]);
        for (k, v) in params {
            cmd.arg("--data-urlencode").arg(format!("{k}={v}"));
        }
        let out = cmd
            .arg(format!("{}{path}", self.url))
            .output()
            .map_err(|source| Error::Io {
                path: "curl".into(),
                source,
            })?;
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(Error::Script {
                script: format!("curl {}{path}", self.url).into(),
                status: out.status.to_string(),
                stderr: format!("{body}{}", String::from_utf8_lossy(&out.stderr)),
            });
        }
        Ok(body)
    }

    /// `/api/v1/query_range` of `expr` over `[start, end]` (Unix seconds) every `step_s`: the
    /// `data.result` array (one entry per series, each with its `values`).
    ///
    /// Errors: [`Error::Script`] for an HTTP error (a bad expression names itself in the body),
    /// [`Error::Config`] when the answer is not the API's JSON.
    pub fn query_range(
        &self,
        expr: &str,
        start: f64,
        end: f64,
        step_s: f64,
    ) -> Result<Vec<serde_json::Value>, Error> {
        let (start, end, step) = (start.to_string(), end.to_string(), step_s.to_string());
        let body = self.get(
            "/api/v1/query_range",
            &[
                ("query", expr),
                ("start", &start),
                ("end", &end),
                ("step", &step),
            ],
        )?;
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| Error::Config {
            field: format!("query_range {expr:?}"),
            message: format!("{e}: {body}"),
        })?;
        match v["data"]["result"].as_array() {
            Some(r) => Ok(r.clone()),
            None => Err(Error::Config {
                field: format!("query_range {expr:?}"),
                message: body,
            }),
        }
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            signal_group(pid, libc::SIGKILL);
        }
        let _ = self.child.try_wait();
    }
}

/// Replaces the targets of `scrape_job` of the Prometheus in `dir` with those of `pods`
/// ([`file_sd_groups`]), atomically (Prometheus watches the file).
///
/// Errors: [`Error::Io`] naming the file.
pub fn write_targets(
    dir: &Path,
    scrape_job: &str,
    pods: &[Pod],
    job_label: &str,
) -> Result<(), Error> {
    let file = dir.join(format!("{scrape_job}.json"));
    let tmp = file.with_extension("tmp");
    let io = |source| Error::Io {
        path: file.clone(),
        source,
    };
    std::fs::write(&tmp, file_sd_groups(pods, job_label).to_string()).map_err(io)?;
    std::fs::rename(&tmp, &file).map_err(io)
}

/// Prometheus `file_sd` target groups for `pods`: for each Running pod, its container port named
/// `metrics` at the pod IP, labelled `namespace`, `pod` and, for pods with the label `job_label`
/// (the contract's `diphoma.io/job-name`), `diphoma_job` — what `docs/prometheus-scrape.yaml`
/// relabels to.
pub fn file_sd_groups(pods: &[Pod], job_label: &str) -> serde_json::Value {
    let groups: Vec<serde_json::Value> = pods
        .iter()
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            (status.phase.as_deref() == Some("Running")).then_some(())?;
            let ip = status.pod_ip.as_deref()?;
            let port = p
                .spec
                .as_ref()?
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find(|port| port.name.as_deref() == Some("metrics"))?
                .container_port;
            let mut labels = serde_json::json!({
                "namespace": p.metadata.namespace,
                "pod": p.metadata.name,
            });
            if let Some(job) = p.labels().get(job_label) {
                labels["diphoma_job"] = job.as_str().into();
            }
            Some(serde_json::json!({"targets": [format!("{ip}:{port}")], "labels": labels}))
        })
        .collect();
    groups.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_pods_with_a_metrics_port_become_labelled_targets() {
        let pod = |name: &str, phase: &str, port: &str, job: Option<&str>| -> Pod {
            let labels = job.map(|j| serde_json::json!({"diphoma.io/job-name": j}));
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ml", "labels": labels},
                "spec": {"containers": [{"name": "c", "ports": [
                    {"name": "ring", "containerPort": 29500},
                    {"name": port, "containerPort": 9400}]}]},
                "status": {"phase": phase, "podIP": "127.0.0.7"}
            }))
            .unwrap()
        };
        let groups = file_sd_groups(
            &[
                pod("w-0", "Running", "metrics", Some("digits")),
                pod("w-1", "Succeeded", "metrics", Some("digits")),
                pod("other", "Running", "http", None),
                pod("op", "Running", "metrics", None),
            ],
            "diphoma.io/job-name",
        );
        assert_eq!(
            groups,
            serde_json::json!([
                {"targets": ["127.0.0.7:9400"], "labels": {"namespace": "ml", "pod": "w-0", "diphoma_job": "digits"}},
                {"targets": ["127.0.0.7:9400"], "labels": {"namespace": "ml", "pod": "op"}}
            ])
        );
    }
}
