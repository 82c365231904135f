//! The standalone membership backend: a ring directory on the local file system stands in for
//! the job's two ConfigMaps, so elastic training runs without Kubernetes (`python -m
//! diphoma.run --elastic`). A launcher writes `membership.json` (the contract's [`Membership`],
//! replaced atomically by rename) whenever a rank dies or joins; each rank follows it as a
//! [`FileRing`] (the [`Follower`] over [`RingDir`]) and writes its heartbeat records next to it:
//! rank 0's `progress.json` and a failure report `report.<member>`, the keys of the heartbeat
//! ConfigMap.
//!
//! The decisions are the [`Follower`]'s. The membership file is polled every [`POLL`] by a
//! thread of its own, stopped when the [`RingDir`] is dropped. It must not train.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diphoma_contract::{self as contract, MEMBERSHIP_KEY, Membership};

use crate::follow::{Backend, Feed, Follower, Memberships};
use crate::{Config, Protection};

/// Standalone env: the ring directory (`membership.json` in, heartbeat records out).
pub const ENV_RING_DIR: &str = "DIPHOMA_RING_DIR";
/// How often the membership file is read.
pub const POLL: Duration = Duration::from_millis(20);

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, then rename.
///
/// # Errors
/// The I/O error of the write or the rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Follows `<dir>/membership.json` (see the module doc).
pub type FileRing = Follower<RingDir>;

/// A ring directory as a [`Backend`]: a thread polls `membership.json`; records are files.
#[derive(Debug)]
pub struct RingDir {
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    /// The data-frame protection of every generation joined through it.
    protection: Protection,
}

impl Drop for RingDir {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Reads and parses the membership file; `None` while it is absent, unchanged or invalid.
fn read_newer(path: &Path, seen: &mut Option<u64>) -> Option<Membership> {
    let text = std::fs::read_to_string(path).ok()?;
    match Membership::parse(&text) {
        Ok(m) if seen.is_none_or(|g| m.generation > g) => {
            *seen = Some(m.generation);
            Some(m)
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("ignoring {}: {e}", path.display());
            None
        }
    }
}

impl RingDir {
    /// Starts polling `<dir>/membership.json` into `feed`, every [`POLL`] until dropped.
    pub fn start(dir: PathBuf, feed: Feed) -> RingDir {
        let stop = Arc::new(AtomicBool::new(false));
        let (halt, path) = (stop.clone(), dir.join(MEMBERSHIP_KEY));
        std::thread::spawn(move || {
            let mut seen = None;
            while !halt.load(Ordering::SeqCst) {
                if let Some(m) = read_newer(&path, &mut seen)
                    && feed.send(m).is_err()
                {
                    return;
                }
                std::thread::sleep(POLL);
            }
        });
        RingDir {
            dir,
            stop,
            protection: Protection::default(),
        }
    }

    fn write(&self, key: &str, json: &str) {
        let path = self.dir.join(key);
        if let Err(e) = write_atomic(&path, json.as_bytes()) {
            tracing::warn!("writing {}: {e}", path.display());
        }
    }
}

impl Backend for RingDir {
    type Error = std::io::Error;

    /// Binds the member's address as the membership lists it.
    fn listen(
        &mut self,
        m: &Membership,
        rank: usize,
        config: &mut Config,
    ) -> std::io::Result<TcpListener> {
        config.protection = self.protection;
        let addr = m.addresses()[rank];
        TcpListener::bind(addr)
            .map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))
    }

    fn write_progress(&mut self, json: String, _last: bool) {
        self.write(contract::PROGRESS_KEY, &json);
    }

    fn write_report(&mut self, key: String, json: String) {
        self.write(&key, &json);
    }
}

/// A ring directory as a pod's launcher sees it (the local stand-in of
/// [`crate::k8s::RingWatch`]): its memberships, read by a [`RingDir`] that binds nothing and
/// aborts nothing, and its records written as files on request.
#[derive(Debug)]
pub struct DirWatch {
    memberships: Memberships,
    dir: RingDir,
}

impl DirWatch {
    /// Starts polling `<dir>/membership.json`.
    pub fn start(dir: PathBuf) -> DirWatch {
        let (feed, memberships) = Memberships::channel(None);
        DirWatch {
            memberships,
            dir: RingDir::start(dir, feed),
        }
    }

    /// [`Memberships::wait_newer`]: waits up to `wait` for a generation newer than `than` (any,
    /// when `None`), and returns the newest seen.
    pub fn wait_newer(&mut self, than: Option<u64>, wait: Duration) -> Option<&Membership> {
        self.memberships.wait_newer(than, wait)
    }

    /// Writes `value` into `<dir>/<key>` (atomically); a failure is logged.
    pub fn write_record(&self, key: &str, value: &str) {
        self.dir.write(key, value);
    }
}

impl Follower<RingDir> {
    /// Starts following `dir` as member `name`, authenticating with `key` and protecting data
    /// frames by `protection` (every member must use the same); each collective and connect is
    /// bounded by `op_timeout`. Its records carry no job UID.
    pub fn start(
        dir: PathBuf,
        name: String,
        key: Vec<u8>,
        protection: Protection,
        op_timeout: Duration,
    ) -> FileRing {
        let Ok(f) = Follower::with_backend(name, None, key, op_timeout, |feed| {
            let mut ring = RingDir::start(dir, feed);
            ring.protection = protection;
            Ok::<_, std::convert::Infallible>(ring)
        });
        f
    }
}
