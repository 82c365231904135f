//! The standalone membership follower: a ring directory on the local file system stands in for
//! the job's two ConfigMaps, so elastic training runs without Kubernetes (`python -m
//! diphoma.run --elastic`). A launcher writes `membership.json` (the contract's [`Membership`],
//! replaced atomically by rename) whenever a rank dies or joins; each rank follows it as a
//! [`RingSource`] and writes its heartbeat records next to it: rank 0's `progress.json` and a
//! failure report `report.<member>`, the keys of the heartbeat ConfigMap.
//!
//! The decisions are those of [`crate::k8s`] ([`decide`], a newer generation aborts the
//! collective in flight, one failure report per generation, [`REJOIN_WAIT`] for a newer
//! generation before re-forming the newest known one). The membership file is polled every
//! [`POLL`] by a thread of its own, stopped when the [`FileRing`] is dropped. It must not train.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use diphoma_contract::{self as contract, MEMBERSHIP_KEY, Membership, ProgressReport};

use crate::k8s::{Decision, REJOIN_WAIT, decide};
use crate::source::{Control, Generation, Progress, RingSource, failure_report};
use crate::{AbortHandle, CommError, Config};

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

/// Follows `<dir>/membership.json` for member `name` (see the module doc).
#[derive(Debug)]
pub struct FileRing {
    dir: PathBuf,
    name: String,
    key: Vec<u8>,
    op_timeout: Duration,
    rx: mpsc::Receiver<Membership>,
    latest: Option<Membership>,
    current: Option<Membership>,
    in_flight: Arc<Mutex<Option<(u64, AbortHandle)>>>,
    stop: Arc<AtomicBool>,
    last_progress: Option<Instant>,
    last_report: Option<ProgressReport>,
    reported: Option<u64>,
    removed: bool,
}

impl Drop for FileRing {
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

impl FileRing {
    /// Starts following `dir` as member `name`, authenticating with `key`; each collective and
    /// connect is bounded by `op_timeout`.
    pub fn start(dir: PathBuf, name: String, key: Vec<u8>, op_timeout: Duration) -> FileRing {
        let (tx, rx) = mpsc::channel();
        let in_flight: Arc<Mutex<Option<(u64, AbortHandle)>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (slot, halt, path) = (in_flight.clone(), stop.clone(), dir.join(MEMBERSHIP_KEY));
        std::thread::spawn(move || {
            let mut seen = None;
            while !halt.load(Ordering::SeqCst) {
                if let Some(m) = read_newer(&path, &mut seen) {
                    if let Some((g, h)) = slot.lock().expect("slot").as_ref()
                        && m.generation > *g
                    {
                        h.abort();
                    }
                    if tx.send(m).is_err() {
                        return;
                    }
                }
                std::thread::sleep(POLL);
            }
        });
        FileRing {
            dir,
            name,
            key,
            op_timeout,
            rx,
            latest: None,
            current: None,
            in_flight,
            stop,
            last_progress: None,
            last_report: None,
            reported: None,
            removed: false,
        }
    }

    /// True once the newest generation no longer lists this member.
    pub fn removed(&self) -> bool {
        self.removed
    }

    /// Waits up to `wait` for a membership newer than `than` (any, when `None`).
    fn wait_newer(&mut self, than: Option<u64>, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            while let Ok(m) = self.rx.try_recv() {
                self.latest = Some(m); // the thread sends increasing generations only
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if self
                .latest
                .as_ref()
                .is_some_and(|l| than.is_none_or(|t| l.generation > t))
                || left.is_zero()
            {
                return;
            }
            if let Ok(m) = self.rx.recv_timeout(left.min(POLL)) {
                self.latest = Some(m);
            }
        }
    }

    /// Binds this member's address and builds generation `m` for rank `rank`.
    fn join(&mut self, m: Membership, rank: usize) -> Option<Generation> {
        let addr = m.addresses()[rank];
        let listener = TcpListener::bind(addr)
            .map_err(|e| tracing::error!("binding {addr}: {e}"))
            .ok()?;
        let mut config = Config::new(
            rank,
            m.members.len(),
            m.addresses(),
            m.generation,
            m.job_uid.clone(),
            self.key.clone(),
        );
        config.timeout = self.op_timeout;
        self.current = Some(m);
        Some(Generation { config, listener })
    }

    /// Blocks until a generation lists this member (waiting at most `wait`), and returns it.
    pub fn first_generation(&mut self, wait: Duration) -> Option<Generation> {
        let deadline = Instant::now() + wait;
        let mut seen = None;
        while Instant::now() < deadline {
            self.wait_newer(seen, deadline.saturating_duration_since(Instant::now()));
            let m = self.latest.clone()?;
            if let Some(r) = m.rank_of(&self.name) {
                return self.join(m, r);
            }
            seen = Some(m.generation);
        }
        None
    }

    fn write(&self, key: &str, json: String) {
        let path = self.dir.join(key);
        if let Err(e) = write_atomic(&path, json.as_bytes()) {
            tracing::warn!("writing {}: {e}", path.display());
        }
    }

    /// Rank 0 writes `p` as `progress.json` when it is the last step or [`crate::k8s::PROGRESS_EVERY`] has
    /// passed since its previous write (the rule of [`crate::k8s::KubeRing`]).
    pub fn publish_progress(&mut self, p: &Progress) {
        let Some(report) = p.record(self.last_progress, jiff::Timestamp::now().to_string(), None)
        else {
            return;
        };
        self.last_progress = Some(Instant::now());
        self.write(
            contract::PROGRESS_KEY,
            serde_json::to_string(&report).expect("serializable"),
        );
        self.last_report = Some(report);
    }

    /// Rank 0's last word: its last progress record again, with the test accuracy (in [0, 1]).
    pub fn report_test_accuracy(&mut self, accuracy: f64) {
        if let Some(mut report) = self.last_report.take() {
            report.test_accuracy = Some(accuracy);
            report.time = jiff::Timestamp::now().to_string();
            self.write(
                contract::PROGRESS_KEY,
                serde_json::to_string(&report).expect("serializable"),
            );
        }
    }
}

impl RingSource for FileRing {
    fn connected(&mut self, generation: u64, _rank: usize, abort: AbortHandle) {
        *self.in_flight.lock().expect("slot") = Some((generation, abort));
    }

    fn after_commit(&mut self, p: &Progress) -> Control {
        self.publish_progress(p);
        self.wait_newer(None, Duration::ZERO);
        let cur = self.current.as_ref().map(|m| m.generation);
        let Some(m) = self.latest.clone() else {
            return Control::Continue;
        };
        match decide(cur, &m, &self.name) {
            Decision::Stay => Control::Continue,
            Decision::NotMember => {
                self.removed = true;
                Control::Leave
            }
            Decision::Join(r) => self.join(m, r).map_or(Control::Leave, Control::Switch),
        }
    }

    fn after_failure(&mut self, err: &CommError) -> Option<Generation> {
        tracing::warn!("collective failed: {err}");
        let cur = self.current.as_ref().map(|m| m.generation);
        self.report_failure(err);
        self.wait_newer(cur, REJOIN_WAIT);
        let m = self.latest.clone()?;
        let Some(r) = m.rank_of(&self.name) else {
            self.removed = true;
            return None;
        };
        self.join(m, r)
    }

    fn report_failure(&mut self, err: &CommError) {
        let current = self.current.as_ref();
        if let Some(report) = failure_report(err, current, self.reported, &self.name, None) {
            self.reported = current.map(|m| m.generation);
            self.write(
                &format!("{}{}", contract::REPORT_KEY_PREFIX, self.name),
                serde_json::to_string(&report).expect("serializable"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Communicator;
    use diphoma_contract::Member;

    fn membership(generation: u64, members: &[(&str, u16)]) -> String {
        let m = Membership {
            generation,
            job_uid: "file-test".into(),
            members: members
                .iter()
                .enumerate()
                .map(|(i, (pod, port))| Member {
                    rank: i as u32,
                    pod: pod.to_string(),
                    address: "127.0.0.1".parse().unwrap(),
                    port: *port,
                })
                .collect(),
        };
        serde_json::to_string(&m).unwrap()
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Three members over real TCP: a newer generation without `c` aborts the collective in
    /// flight of `a` and `b`, which re-form at generation 2 and reduce again; `c` learns it was
    /// removed. Rank 0 writes its progress record into the directory.
    #[test]
    fn a_newer_generation_aborts_the_collective_and_the_ring_reforms() {
        let dir = std::env::temp_dir().join(format!("diphoma-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ports = [free_port(), free_port(), free_port()];
        let path = dir.join(MEMBERSHIP_KEY);
        write_atomic(
            &path,
            membership(1, &[("a", ports[0]), ("b", ports[1]), ("c", ports[2])]).as_bytes(),
        )
        .unwrap();
        let threads: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|name| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    let mut src =
                        FileRing::start(dir, name.into(), vec![7; 32], Duration::from_secs(20));
                    let g = src.first_generation(Duration::from_secs(10)).unwrap();
                    let mut comm = Communicator::connect(g.config, g.listener).unwrap();
                    src.connected(1, comm.rank(), comm.abort_handle());
                    if name == "c" {
                        // c stops taking part: the others block until generation 2 aborts them.
                        let p = Progress {
                            step: 1,
                            total_steps: Some(5),
                            generation: 1,
                            rank: comm.rank(),
                            loss: 0.0,
                            samples_per_second: 0.0,
                            last_checkpoint: None,
                            allreduce_seconds: 0.0,
                            allreduce_bytes: 0,
                            shares: Vec::new(),
                        };
                        while !matches!(src.after_commit(&p), Control::Leave) {
                            std::thread::sleep(POLL);
                        }
                        return (src.removed(), 0.0);
                    }
                    let err = comm
                        .allreduce(&mut [1.0f32; 4], crate::ReduceOp::Sum)
                        .unwrap_err();
                    let g = src.after_failure(&err).unwrap();
                    assert_eq!(g.config.generation, 2);
                    let mut comm = Communicator::connect(g.config, g.listener).unwrap();
                    let mut v = [1.0f32; 4];
                    comm.allreduce(&mut v, crate::ReduceOp::Sum).unwrap();
                    let p = Progress {
                        step: 5,
                        total_steps: Some(5),
                        generation: 2,
                        rank: comm.rank(),
                        loss: 0.5,
                        samples_per_second: 1.0,
                        last_checkpoint: None,
                        allreduce_seconds: 0.0,
                        allreduce_bytes: 0,
                        shares: Vec::new(),
                    };
                    src.publish_progress(&p);
                    (src.removed(), v[0])
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        write_atomic(
            &path,
            membership(2, &[("a", ports[0]), ("b", ports[1])]).as_bytes(),
        )
        .unwrap();
        let out: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(out, vec![(false, 2.0), (false, 2.0), (true, 0.0)]);
        let progress: ProgressReport = serde_json::from_str(
            &std::fs::read_to_string(dir.join(contract::PROGRESS_KEY)).unwrap(),
        )
        .unwrap();
        assert_eq!((progress.generation, progress.step), (2, 5));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
