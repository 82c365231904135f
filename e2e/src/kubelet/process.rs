//! Container processes: spawn one in its own process group with the output the caller chooses
//! (pipes for containers, handed to [`super::logs::capture`]), and signal the whole group. A process dies with the kubelet thread that started it
//! (`PR_SET_PDEATHSIG`), so a crashed test binary never leaves pods running.

use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};

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
}

/// Starts the process with its stdout and stderr going to `out` and `err` (pipes for a
/// container, whose output [`super::logs::capture`] reads). Errors: [`Error::Io`] naming the
/// program.
pub fn spawn(l: &Launch, out: Stdio, err: Stdio) -> Result<Child, Error> {
    let mut cmd = Command::new(&l.program);
    cmd.args(&l.args)
        .env_clear()
        .env("PATH", CONTAINER_PATH)
        .env("HOME", &l.cwd)
        .env("HOSTNAME", &l.hostname)
        .envs(l.env.iter().map(|(k, v)| (k, v)))
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

/// Sends `signal` to the process group led by `pid` (the container's process and its children).
/// A group that is already gone is not an error.
pub fn signal_group(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}
