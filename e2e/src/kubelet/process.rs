//! Container processes: spawn one in its own process group with the output the caller chooses
//! (pipes for containers, handed to [`super::logs::capture`]), and signal the whole group. A process dies with the kubelet thread that started it
//! (`PR_SET_PDEATHSIG`), so a crashed test binary never leaves pods running. In container mode
//! the process spawned is `podman run` ([`super::container`]) and the one signalled is the
//! container's main process ([`main_pid`]).

use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};

use super::container::{self, ContainerRun};
use crate::Error;

/// `PATH` inside every container (the Debian default); the host's environment is not inherited.
const CONTAINER_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What to run for one container.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Executable.
    pub program: PathBuf,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// The complete environment (nothing else is inherited but `PATH`, `HOME`, `HOSTNAME`).
    pub env: Vec<(String, String)>,
    /// Working directory (the pod's directory).
    pub cwd: PathBuf,
    /// The pod's name, for `HOSTNAME`.
    pub hostname: String,
    /// Container mode: run `program`'s image instead (`program` is then `podman`).
    pub container: Option<ContainerRun>,
}

/// Starts the process with its stdout and stderr going to `out` and `err` (pipes for a
/// container, whose output [`super::logs::capture`] reads). Errors: [`Error::Io`] naming the
/// program.
pub fn spawn(l: &Launch, out: Stdio, err: Stdio) -> Result<Child, Error> {
    let mut cmd = Command::new(&l.program);
    cmd.env_clear();
    match &l.container {
        None => cmd
            .args(&l.args)
            .env("PATH", CONTAINER_PATH)
            .env("HOME", &l.cwd)
            .env("HOSTNAME", &l.hostname),
        Some(run) => {
            let _ = std::fs::remove_file(&run.pidfile); // a restart's: main_pid waits for a new one
            let names: Vec<&str> = l.env.iter().map(|(k, _)| k.as_str()).collect();
            let host_path = std::env::var_os("PATH").unwrap_or_else(|| CONTAINER_PATH.into());
            cmd.args(container::podman_args(run, &names, &l.hostname, &l.args))
                .env("PATH", host_path)
        }
    };
    cmd.envs(l.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&l.cwd)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // SAFETY: the closure only makes async-signal-safe syscalls (setpgid, prctl) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setpgid(0, 0) != 0 || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| Error::Io {
        path: l.program.clone(),
        source,
    })
}

/// The PID to signal for `child`: the process itself, or in container mode the container's main
/// process once podman has started it.
///
/// Errors: those of [`container::main_pid`].
pub async fn main_pid(l: &Launch, child: &mut Child) -> Result<u32, Error> {
    match &l.container {
        None => Ok(child.id().unwrap_or_default()),
        Some(run) => container::main_pid(child, run).await,
    }
}

/// Sends `signal` to the process group led by `pid` (the container's process and its children).
/// A group that is already gone is not an error.
pub fn signal_group(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}
