//! `kubectl diphoma submit SCRIPT`: a PyTorch script and its DiphomaJob, as `ray job submit`
//! sends a script with its job. Pure: builds the two objects; `main.rs` creates them.

use std::path::Path;

use serde_json::{Value, json};

/// Where the script's ConfigMap is mounted in the workers.
pub const SCRIPT_DIR: &str = "/scripts";

/// How the job runs the script: `submit`'s flags.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct Options {
    /// Workers (`spec.replicas`).
    #[arg(long, default_value_t = 2)]
    pub workers: i32,
    /// Elastic: the fewest workers to train with (`spec.elastic.minReplicas`, with `--max`).
    #[arg(long)]
    pub min: Option<i32>,
    /// Elastic: the most workers (`spec.elastic.maxReplicas`, with `--min`).
    #[arg(long)]
    pub max: Option<i32>,
    /// GPUs per worker (`spec.gpusPerWorker`).
    #[arg(long, default_value_t = 0)]
    pub gpus: i32,
    /// The worker image: Python with torch and the `diphoma` wheel.
    #[arg(long, default_value = concat!("ghcr.io/diphoma/diphoma-pytorch:", env!("CARGO_PKG_VERSION")))]
    pub image: String,
    /// The script is a `diphoma.torch.elastic` one: run it as `python SCRIPT` (its process
    /// re-forms in place) instead of under `python -m diphoma.run` (an unchanged torchrun
    /// script, restarted in place at each ring generation).
    #[arg(long)]
    pub elastic: bool,
    /// A worker environment variable, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_parser = env_var)]
    pub env: Vec<(String, String)>,
    /// The script's arguments (after `--`).
    #[arg(last = true)]
    pub args: Vec<String>,
}

/// What `submit` was asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Submission {
    /// The job's name (also `<name>-script`, the script's ConfigMap).
    pub name: String,
    /// The script's file name and text.
    pub script: (String, String),
    /// How the job runs it.
    pub options: Options,
}

/// Why a submission is refused; the message names the argument.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    /// `--name` (or the script's file name it defaults to) is no DNS label.
    #[error(
        "job name {0:?} (--name, default: the script's file name) is not a DNS label: lowercase letters, digits and '-', at most {max} characters",
        max = diphoma_operator::api::MAX_NAME_LEN
    )]
    Name(String),
    /// The sizes do not hold together.
    #[error("{0}")]
    Sizes(String),
    /// `--env` is not `NAME=VALUE`.
    #[error("--env {0:?} is not NAME=VALUE")]
    Env(String),
}

/// The job name a script gets by default: its file stem, lowercased, with every character a DNS
/// label does not allow replaced by '-' (`train_ddp.py` → `train-ddp`).
pub fn default_name(script: &Path) -> String {
    let stem = script
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .collect();
    name.trim_matches('-').to_owned()
}

/// Parses `NAME=VALUE`.
///
/// # Errors
/// [`SubmitError::Env`] without a `=` or with an empty name.
pub fn env_var(s: &str) -> Result<(String, String), SubmitError> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(SubmitError::Env(s.to_owned())),
    }
}

impl Submission {
    /// The script's ConfigMap and the DiphomaJob that runs it, in namespace `ns`.
    ///
    /// # Errors
    /// [`SubmitError::Name`] for a name that is no DNS label of at most
    /// [`diphoma_operator::api::MAX_NAME_LEN`]; [`SubmitError::Sizes`] when `workers` is not
    /// positive, `min` or `max` is set alone, or `min ≤ workers ≤ max` does not hold.
    pub fn objects(&self, ns: &str) -> Result<(Value, Value), SubmitError> {
        let (n, o) = (&self.name, &self.options);
        let label = !n.is_empty()
            && n.len() <= diphoma_operator::api::MAX_NAME_LEN
            && n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !n.starts_with('-')
            && !n.ends_with('-');
        if !label {
            return Err(SubmitError::Name(n.clone()));
        }
        if o.workers < 1 {
            return Err(SubmitError::Sizes(format!(
                "--workers {}: at least 1",
                o.workers
            )));
        }
        let elastic = match (o.min, o.max) {
            (None, None) => None,
            (Some(min), Some(max)) if 1 <= min && min <= o.workers && o.workers <= max => {
                Some(json!({"minReplicas": min, "maxReplicas": max}))
            }
            (Some(min), Some(max)) => {
                return Err(SubmitError::Sizes(format!(
                    "--min {min} --workers {} --max {max}: needs 1 <= min <= workers <= max",
                    o.workers
                )));
            }
            _ => {
                return Err(SubmitError::Sizes(
                    "--min and --max go together (an elastic job's bounds)".into(),
                ));
            }
        };
        let (file, text) = &self.script;
        let path = format!("{SCRIPT_DIR}/{file}");
        let mut command: Vec<String> = if o.elastic {
            vec!["python".into(), path]
        } else {
            vec!["python".into(), "-m".into(), "diphoma.run".into(), path]
        };
        command.extend(o.args.iter().cloned());
        let script_cm = format!("{n}-script");
        let env: Vec<Value> = o
            .env
            .iter()
            .map(|(k, v)| json!({"name": k, "value": v}))
            .collect();
        let configmap = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": script_cm, "namespace": ns,
                         "labels": {diphoma_contract::LABEL_JOB_NAME: n}},
            "data": {file: text},
        });
        let mut spec = json!({
            "replicas": o.workers,
            "gpusPerWorker": o.gpus,
            "template": {"spec": {"containers": [{
                "name": "worker", "image": o.image, "command": command, "env": env,
                "volumeMounts": [{"name": "script", "mountPath": SCRIPT_DIR}]}],
                "volumes": [{"name": "script", "configMap": {"name": script_cm}}]}},
        });
        if let Some(e) = elastic {
            spec["elastic"] = e;
        }
        let job = json!({
            "apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob",
            "metadata": {"name": n, "namespace": ns}, "spec": spec,
        });
        Ok((configmap, job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub() -> Submission {
        with(Options {
            args: vec!["--epochs".into(), "3".into()],
            workers: 4,
            min: Some(2),
            max: Some(6),
            gpus: 1,
            image: "ghcr.io/diphoma/diphoma-pytorch:0.1.0".into(),
            elastic: false,
            env: vec![("STEPS".into(), "10".into())],
        })
    }

    fn with(options: Options) -> Submission {
        Submission {
            name: "train-ddp".into(),
            script: ("train_ddp.py".into(), "print(1)\n".into()),
            options,
        }
    }

    #[test]
    fn a_script_becomes_its_configmap_and_a_job_that_runs_it_under_the_launcher() {
        let (cm, job) = sub().objects("ml").unwrap();
        assert_eq!(cm["metadata"]["name"], "train-ddp-script");
        assert_eq!(cm["data"]["train_ddp.py"], "print(1)\n");
        let spec = &job["spec"];
        assert_eq!(
            (spec["replicas"].clone(), spec["gpusPerWorker"].clone()),
            (json!(4), json!(1))
        );
        assert_eq!(spec["elastic"], json!({"minReplicas": 2, "maxReplicas": 6}));
        let c = &spec["template"]["spec"]["containers"][0];
        assert_eq!(
            c["command"],
            json!([
                "python",
                "-m",
                "diphoma.run",
                "/scripts/train_ddp.py",
                "--epochs",
                "3"
            ])
        );
        assert_eq!(c["env"], json!([{"name": "STEPS", "value": "10"}]));
        assert_eq!(
            spec["template"]["spec"]["volumes"][0]["configMap"]["name"],
            "train-ddp-script"
        );
        let job: diphoma_operator::api::DiphomaJob =
            serde_json::from_value(job).expect("the operator's own types read it");
        assert_eq!(job.spec.replicas, 4);
        let elastic = with(Options {
            elastic: true,
            min: None,
            max: None,
            ..sub().options
        });
        let (_, job) = elastic.objects("ml").unwrap();
        assert_eq!(
            job["spec"]["template"]["spec"]["containers"][0]["command"],
            json!(["python", "/scripts/train_ddp.py", "--epochs", "3"])
        );
        assert!(job["spec"].get("elastic").is_none(), "fixed size");
    }

    #[test]
    fn bad_arguments_are_refused_naming_them() {
        assert_eq!(
            default_name(Path::new("dir/Train_DDP.v2.py")),
            "train-ddp-v2"
        );
        let bad_name = Submission {
            name: "Train".into(),
            ..sub()
        };
        assert!(matches!(bad_name.objects("ml"), Err(SubmitError::Name(_))));
        let bad_sizes = with(Options {
            min: Some(5),
            ..sub().options
        });
        assert!(
            bad_sizes
                .objects("ml")
                .unwrap_err()
                .to_string()
                .contains("--min 5 --workers 4 --max 6")
        );
        let alone = with(Options {
            max: None,
            ..sub().options
        });
        assert!(matches!(alone.objects("ml"), Err(SubmitError::Sizes(_))));
        assert_eq!(env_var("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(env_var("=x"), Err(SubmitError::Env("=x".into())));
    }
}
