//! Container processes: spawn one in its own process group with its output in a log file, and
//! signal the whole group. A process dies with the kubelet thread that started it
//! (`PR_SET_PDEATHSIG`), so a crashed test binary never leaves pods running.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
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
    /// File that receives stdout and stderr (appended, so restarts keep earlier output).
    pub log: PathBuf,
    /// The pod's name, for `HOSTNAME`.
    pub hostname: String,
}

/// Starts the process. Errors: [`Error::Io`] naming the log file or the program.
pub fn spawn(l: &Launch) -> Result<Child, Error> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    if let Some(dir) = l.log.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&l.log)
        .map_err(io(&l.log))?;
    let err = out.try_clone().map_err(io(&l.log))?;
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
    cmd.spawn().map_err(io(&l.program))
}

/// Sends `signal` to the process group led by `pid` (the container's process and its children).
/// A group that is already gone is not an error.
pub fn signal_group(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}
