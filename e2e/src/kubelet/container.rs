//! Container mode: a pod's container runs as a podman container from the local image store
//! (root, no daemon) instead of as a process of a mapped binary. Host network (the process still
//! binds its pod's loopback IP), volumes as bind mounts at their `mountPath`, the pod's kubeconfig
//! mounted read-only at [`KUBECONFIG_PATH`], env passed by name from
//! podman's own environment (values never appear on a command line), the pod's
//! `runAsUser`/`runAsGroup`/`readOnlyRootFilesystem`. The container's main process is signalled
//! directly (its host PID from `--pidfile`), so SIGTERM, SIGKILL and SIGSTOP reach it as they
//! reach a process in process mode; `podman run` exits with its exit code (128 + signal when
//! killed) and `--rm` removes it. Every container carries the label [`LABEL`] = the kubelet's
//! root, so that `e2e/cluster/stop.sh` can remove what a crashed kubelet left.
//!
//! Settings that these machines need (see `images/env.sh`): the vfs storage driver, runc with
//! cgroupfs, explicit ulimits.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodSecurityContext, SecurityContext};
use tokio::process::{Child, Command};

use crate::Error;

/// Where a container finds its pod's kubeconfig (`$KUBECONFIG`; the CA is inline), the
/// ServiceAccount token's stand-in as in process mode.
pub const KUBECONFIG_PATH: &str = "/var/run/secrets/diphoma.io/kubeconfig";

/// The label naming the kubelet root a container belongs to.
pub const LABEL: &str = "io.diphoma.kubelet-root";

/// The podman options every command here starts with (the local image store's driver).
const STORE: [&str; 2] = ["--storage-driver", "vfs"];

/// How long `podman run` may take to start a container before the start counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// One bind mount: host path, container path, read-only.
pub type Mount = (PathBuf, String, bool);

/// What podman runs for one container, besides the process fields of [`super::process::Launch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerRun {
    /// Image reference in the local store.
    pub image: String,
    /// Container name (unique per pod UID, container and restart).
    pub name: String,
    /// The kubelet root, for [`LABEL`].
    pub root: PathBuf,
    /// File podman writes the container's main PID (on the host) into.
    pub pidfile: PathBuf,
    /// Bind mounts.
    pub mounts: Vec<Mount>,
    /// `--entrypoint` (the container's `command`), `$(VAR)`-expanded; none: the image's.
    pub entrypoint: Option<Vec<String>>,
    /// `uid[:gid]` from the security contexts; none: the image's user.
    pub user: Option<String>,
    /// podman flags of the container's security context ([`security_flags`]).
    pub security: Vec<String>,
    /// `RLIMIT_NOFILE` for the container (podman cannot raise it above the kubelet's hard limit
    /// here, so it is that limit).
    pub nofile: u64,
}

/// `uid[:gid]` from the container's security context, else the pod's; none when neither sets a
/// user.
pub fn user(pod: Option<&PodSecurityContext>, c: Option<&SecurityContext>) -> Option<String> {
    let uid = c.and_then(|c| c.run_as_user).or(pod?.run_as_user)?;
    let gid = c
        .and_then(|c| c.run_as_group)
        .or(pod.and_then(|p| p.run_as_group));
    Some(gid.map_or(uid.to_string(), |g| format!("{uid}:{g}")))
}

/// podman flags for a container's security context: `readOnlyRootFilesystem` (`--read-only`,
/// no writable tmpfs),
/// `allowPrivilegeEscalation: false` (`no-new-privileges`), `capabilities` drop and add. Pure.
pub fn security_flags(c: &Container) -> Vec<String> {
    let Some(sc) = &c.security_context else {
        return vec![];
    };
    let mut f = vec![];
    if sc.read_only_root_filesystem == Some(true) {
        // Without podman's writable /tmp, /var/tmp and /run: a real pod has none either.
        f.extend(["--read-only", "--read-only-tmpfs=false"].map(str::to_owned));
    }
    if sc.allow_privilege_escalation == Some(false) {
        f.push("--security-opt=no-new-privileges".to_owned());
    }
    let caps = sc.capabilities.as_ref();
    for (flag, list) in [
        ("drop", caps.and_then(|c| c.drop.as_ref())),
        ("add", caps.and_then(|c| c.add.as_ref())),
    ] {
        f.extend(
            list.into_iter()
                .flatten()
                .map(|cap| format!("--cap-{flag}={}", cap.to_lowercase())),
        );
    }
    f
}

/// The `podman` arguments that run `run` with `env_names` (values come from podman's
/// environment), `hostname` and `args` after the image. Pure.
pub fn podman_args(
    run: &ContainerRun,
    env_names: &[&str],
    hostname: &str,
    args: &[String],
) -> Vec<String> {
    let mut a: Vec<String> = STORE.iter().map(|s| s.to_string()).collect();
    let s = |v: &str| v.to_owned();
    a.extend(
        [
            "run",
            "--rm",
            "--replace",
            "--pull=never",
            "--log-driver=none",
            "--network=host",
            "--runtime=runc",
            "--cgroup-manager=cgroupfs",
            "--ulimit=nproc=32768:32768",
        ]
        .map(s),
    );
    a.push(format!("--ulimit=nofile={0}:{0}", run.nofile));
    a.push(format!("--name={}", run.name));
    a.push(format!("--label={LABEL}={}", run.root.display()));
    a.push(format!("--pidfile={}", run.pidfile.display()));
    a.push(format!("--hostname={hostname}"));
    if let Some(u) = &run.user {
        a.push(format!("--user={u}"));
    }
    a.extend(run.security.iter().cloned());
    for (host, path, ro) in &run.mounts {
        let opt = if *ro { ":ro" } else { "" };
        a.push(format!("--volume={}:{path}{opt}", host.display()));
    }
    a.extend(env_names.iter().map(|k| format!("--env={k}")));
    if let Some(ep) = &run.entrypoint {
        a.push(format!(
            "--entrypoint={}",
            serde_json::to_string(ep).expect("strings serialize")
        ));
    }
    a.push(run.image.clone());
    a.extend(args.iter().cloned());
    a
}

/// Whether `image` is in the local store (`podman image exists`).
///
/// Errors: [`Error::Io`] when podman cannot be run.
pub async fn image_present(image: &str) -> Result<bool, Error> {
    let st = Command::new("podman")
        .args(STORE)
        .args(["image", "exists", image])
        .status()
        .await
        .map_err(|source| Error::Io {
            path: "podman".into(),
            source,
        })?;
    Ok(st.success())
}

/// The container's main PID on the host, once `podman run` (`child`) has written `pidfile`.
///
/// Errors: [`Error::Unsupported`] naming the container when podman exits first (its message is
/// in the container's log) or takes longer than a minute.
pub async fn main_pid(child: &mut Child, run: &ContainerRun) -> Result<u32, Error> {
    let failed = |what: String| Error::Unsupported {
        pod: run.name.clone(),
        what,
    };
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        if let Some(pid) = read_pid(&run.pidfile) {
            return Ok(pid);
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(failed(format!(
                "podman run exited ({st}) before starting the container; see its log"
            )));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(failed("podman run did not start the container".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The kubelet's hard `RLIMIT_NOFILE`, the containers' `nofile` limit.
pub fn nofile_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit it is given and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    if ok { r.rlim_max.min(1 << 20) } else { 1024 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> ContainerRun {
        ContainerRun {
            image: "localhost/diphoma-worker:0.1.0".into(),
            name: "dpk-uid-worker-0".into(),
            root: "/k".into(),
            pidfile: "/k/pods/uid/worker.pid".into(),
            mounts: vec![
                ("/k/pods/uid/volumes/data".into(), "/data".into(), false),
                (
                    "/k/pods/uid/kubeconfig".into(),
                    "/k/pods/uid/kubeconfig".into(),
                    true,
                ),
            ],
            entrypoint: None,
            user: None,
            security: vec![],
            nofile: 20000,
        }
    }

    #[test]
    fn args_run_the_image_with_mounts_env_names_and_args_last() {
        let a = podman_args(&run(), &["RANK", "KUBECONFIG"], "pod-0", &["train".into()]);
        let at = |x: &str| a.iter().position(|y| y == x).unwrap();
        assert_eq!(&a[..3], ["--storage-driver", "vfs", "run"]);
        assert!(a.contains(&"--volume=/k/pods/uid/volumes/data:/data".into()));
        assert!(a.contains(&"--volume=/k/pods/uid/kubeconfig:/k/pods/uid/kubeconfig:ro".into()));
        assert!(
            a.contains(&"--env=RANK".into()),
            "names only, values stay in the env"
        );
        assert!(a.contains(&"--label=io.diphoma.kubelet-root=/k".into()));
        assert!(a.contains(&"--ulimit=nofile=20000:20000".into()));
        assert_eq!(at("localhost/diphoma-worker:0.1.0") + 1, at("train"));
        assert_eq!(a.last().unwrap(), "train");
        assert!(
            !a.iter()
                .any(|x| x.starts_with("--user") || x == "--read-only")
        );
    }

    #[test]
    fn entrypoint_user_and_read_only_are_passed() {
        let mut r = run();
        r.entrypoint = Some(vec!["diphoma-worker".into(), "--x".into()]);
        r.user = Some("1000:2000".into());
        r.security = vec!["--read-only".into()];
        let a = podman_args(&r, &[], "p", &[]);
        assert!(a.contains(&r#"--entrypoint=["diphoma-worker","--x"]"#.into()));
        assert!(a.contains(&"--user=1000:2000".into()));
        assert!(a.contains(&"--read-only".into()));
    }

    #[test]
    fn the_restricted_profile_maps_to_podman_flags() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "c",
            "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
        }))
        .unwrap();
        assert_eq!(
            security_flags(&c),
            [
                "--read-only",
                "--read-only-tmpfs=false",
                "--security-opt=no-new-privileges",
                "--cap-drop=all",
                "--cap-add=net_bind_service"
            ]
        );
        assert!(security_flags(&Container::default()).is_empty());
    }

    #[test]
    fn user_prefers_the_container_then_the_pod() {
        let pod = PodSecurityContext {
            run_as_user: Some(1),
            run_as_group: Some(2),
            ..Default::default()
        };
        let c = SecurityContext {
            run_as_user: Some(7),
            ..Default::default()
        };
        assert_eq!(user(Some(&pod), Some(&c)).as_deref(), Some("7:2"));
        assert_eq!(user(Some(&pod), None).as_deref(), Some("1:2"));
        assert_eq!(user(None, None), None);
        let only_group = PodSecurityContext {
            run_as_group: Some(2),
            ..Default::default()
        };
        assert_eq!(user(Some(&only_group), None), None);
    }
}
