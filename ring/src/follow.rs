//! The membership follower, written once: a [`Follower`] is the [`RingSource`] of a rank whose
//! generations a membership document announces, over a [`Backend`] that only binds, watches and
//! writes (the ring ConfigMap of `crate::k8s`, with the feature `kube`; the ring directory of
//! [`crate::file`]).
//!
//! Its rules: what a membership means to a member ([`decide`]); a newer generation aborts the
//! collective in flight (the watcher hands each membership to a [`Feed`], which aborts before it
//! delivers); one failure report per failure ([`failure_report`]: the failed re-connects that
//! follow do not overwrite it; a committed step ends the failure); after a failure it waits
//! [`REJOIN_WAIT`] for a newer generation, else re-forms the newest it knows; rank 0 writes its
//! progress record every [`PROGRESS_EVERY`] and at the last step ([`Progress::record`]); a
//! generation without this member means it was removed (scale-down).
//!
//! It must not train, and does no I/O of its own beyond binding through its backend.

use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use diphoma_contract::{self as contract, Membership, ProgressReport};

use crate::source::{Control, Generation, Progress, RingSource, failure_report};
use crate::{AbortHandle, CommError, Config};

/// How often rank 0 writes its progress record.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long a member whose collective failed waits for a newer generation before it re-joins
/// the newest one it knows (which may be the same generation, re-formed).
pub const REJOIN_WAIT: Duration = Duration::from_secs(1);
/// The longest a [`Follower::first_generation`] waits between two looks at
/// [`Backend::terminating`].
const TERMINATING_POLL: Duration = Duration::from_millis(500);

/// What a member does on seeing membership `m` while in generation `current` (`None`: not yet
/// in any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing new: stay where it is.
    Stay,
    /// Join generation `m.generation` as this rank.
    Join(usize),
    /// The newer generation does not include this member: leave.
    NotMember,
}

/// See [`Decision`]: a generation not newer than `current` changes nothing.
pub fn decide(current: Option<u64>, m: &Membership, member: &str) -> Decision {
    if current.is_some_and(|c| m.generation <= c) {
        return Decision::Stay;
    }
    match m.rank_of(member) {
        Some(r) => Decision::Join(r),
        None => Decision::NotMember,
    }
}

/// The collective in flight: its generation and the handle that aborts it.
pub type InFlight = Arc<Mutex<Option<(u64, AbortHandle)>>>;

/// The follower dropped its [`Memberships`]: the watcher may stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the follower is gone")]
pub struct Closed;

/// The watcher's side of a follower's memberships (a thread polling a file, a task watching a
/// ConfigMap): [`Feed::send`] each valid membership as it is seen.
#[derive(Debug, Clone)]
pub struct Feed {
    tx: mpsc::Sender<Membership>,
    in_flight: Option<InFlight>,
}

impl Feed {
    /// Aborts the collective in flight when `m` is newer than its generation, then hands `m`
    /// to the follower.
    ///
    /// # Errors
    /// [`Closed`] once the receiving [`Memberships`] is dropped.
    pub fn send(&self, m: Membership) -> Result<(), Closed> {
        if let Some(slot) = &self.in_flight
            && let Some((g, h)) = slot.lock().unwrap_or_else(|p| p.into_inner()).as_ref()
            && m.generation > *g
        {
            h.abort();
        }
        self.tx.send(m).map_err(|_| Closed)
    }
}

/// The memberships a [`Feed`] delivered, as the follower takes them: the newest one kept.
#[derive(Debug)]
pub struct Memberships {
    rx: mpsc::Receiver<Membership>,
    latest: Option<Membership>,
}

impl Memberships {
    /// A feed and its receiving side; with `in_flight`, a membership newer than the slot's
    /// generation aborts the collective there (a follower's), without it the feed only delivers
    /// (a launcher's view, which runs no collective).
    pub fn channel(in_flight: Option<InFlight>) -> (Feed, Memberships) {
        let (tx, rx) = mpsc::channel();
        (Feed { tx, in_flight }, Memberships { rx, latest: None })
    }

    /// The newest membership taken so far.
    pub fn latest(&self) -> Option<&Membership> {
        self.latest.as_ref()
    }

    /// Takes every membership delivered so far; keeps the newest.
    pub fn drain(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            self.take(m);
        }
    }

    fn take(&mut self, m: Membership) {
        if self
            .latest
            .as_ref()
            .is_none_or(|l| m.generation >= l.generation)
        {
            self.latest = Some(m);
        }
    }

    /// Waits up to `wait` for a membership newer than `than` (or any, when `None`), and
    /// returns the newest taken (which is not newer than `than` when none came in time).
    pub fn wait_newer(&mut self, than: Option<u64>, wait: Duration) -> Option<&Membership> {
        let deadline = Instant::now() + wait;
        loop {
            self.drain();
            if self
                .latest
                .as_ref()
                .is_some_and(|l| than.is_none_or(|t| l.generation > t))
            {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(m) => self.take(m),
                Err(_) => break,
            }
        }
        self.latest.as_ref()
    }
}

/// What a [`Follower`] needs of where its memberships come from: binding, the records it
/// writes, and a stop signal. The backend's watcher delivers memberships to the [`Feed`] the
/// follower hands it at the start ([`Follower::with_backend`]).
pub trait Backend {
    /// Why a generation cannot be joined (a port that cannot be bound).
    type Error: std::error::Error;

    /// Binds this member's ring listener for rank `rank` of `m` and completes `config` (built
    /// from `m`, the key and the connect timeout) with what the backend decides beyond them
    /// (liveness window, protection).
    ///
    /// # Errors
    /// The backend's error, which the follower logs and reports as "nothing to join".
    fn listen(
        &mut self,
        m: &Membership,
        rank: usize,
        config: &mut Config,
    ) -> Result<std::net::TcpListener, Self::Error>;

    /// Writes rank 0's progress record, `json` (the contract's [`ProgressReport`]); `last`:
    /// the last write before the process may exit (wait for it). Failures are logged.
    fn write_progress(&mut self, json: String, last: bool);

    /// Writes a failure report, `json` (the contract's [`contract::FailureReport`]), under
    /// `key` (`report.<member>`), before the member re-joins. Failures are logged.
    fn write_report(&mut self, key: String, json: String);

    /// True once this member was told to leave (SIGTERM in a pod): it leaves at the next step
    /// boundary and re-forms nothing.
    fn terminating(&self) -> bool {
        false
    }
}

/// The membership follower of one member over backend `B` (see the module docs).
#[derive(Debug)]
pub struct Follower<B> {
    backend: B,
    /// This member's name in the memberships (a pod's name).
    name: String,
    /// This process's place in its pod: each pod member of a membership is
    /// `local.processes` ring ranks ([`Membership::per_process`]).
    local: contract::Local,
    /// The job UID its records carry (`None`: none).
    job_uid: Option<String>,
    key: Vec<u8>,
    op_timeout: Duration,
    memberships: Memberships,
    current: Option<Membership>,
    in_flight: InFlight,
    last_progress: Option<Instant>,
    last_report: Option<ProgressReport>,
    /// The generation whose failure this member reported since its last committed step.
    reported: Option<u64>,
    removed: bool,
}

impl<B: Backend> Follower<B> {
    /// Follows the memberships that the backend `start` builds delivers to the [`Feed`] it is
    /// given, as member `name`, authenticating with `key`; each connect is bounded by
    /// `op_timeout`; `job_uid` goes into the records (`None`: left out).
    ///
    /// # Errors
    /// `start`'s.
    pub fn with_backend<E>(
        name: String,
        job_uid: Option<String>,
        key: Vec<u8>,
        op_timeout: Duration,
        start: impl FnOnce(Feed) -> Result<B, E>,
    ) -> Result<Follower<B>, E> {
        let in_flight = InFlight::default();
        let (feed, memberships) = Memberships::channel(Some(in_flight.clone()));
        Ok(Follower {
            backend: start(feed)?,
            name,
            local: contract::Local::default(),
            job_uid,
            key,
            op_timeout,
            memberships,
            current: None,
            in_flight,
            last_progress: None,
            last_report: None,
            reported: None,
            removed: false,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Sets the bound on each connect (and, where the backend sets no liveness window, on each
    /// collective).
    pub fn set_op_timeout(&mut self, t: Duration) {
        self.op_timeout = t;
    }

    /// Makes this follower local rank `local.rank` of the `local.processes` training processes
    /// of its pod (default: the pod's only one): every generation it joins is the pods'
    /// membership expanded per process ([`Membership::per_process`]), this process at ring rank
    /// [`contract::Local::ring_rank`] and port [`contract::process_port`].
    pub fn set_local(&mut self, local: contract::Local) {
        self.local = local;
    }

    /// True once the newest generation no longer lists this member.
    pub fn removed(&self) -> bool {
        self.removed
    }

    /// True when this member should stop and exit 0: told to leave
    /// ([`Backend::terminating`]), or the newest generation no longer lists it.
    pub fn done(&self) -> bool {
        self.backend.terminating() || self.removed
    }

    /// Blocks until a generation lists this member (at most `wait`; `None`: no bound), and
    /// returns it; `Ok(None)` when the wait ends first or the backend is terminating.
    ///
    /// # Errors
    /// The backend's when it cannot bind for the generation.
    pub fn first_generation(
        &mut self,
        wait: Option<Duration>,
    ) -> Result<Option<Generation>, B::Error> {
        let deadline = wait.map(|w| Instant::now() + w);
        let mut seen = None;
        while !self.backend.terminating() {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                break;
            }
            let chunk = left.map_or(TERMINATING_POLL, |l| l.min(TERMINATING_POLL));
            let Some(m) = self.memberships.wait_newer(seen, chunk).cloned() else {
                continue;
            };
            if m.rank_of(&self.name).is_some() {
                return self.join(m).map(Some);
            }
            // Not (yet) a member: wait for the next generation.
            seen = Some(m.generation);
        }
        Ok(None)
    }

    /// Binds this process's address and builds generation `m` (of pods, which lists this
    /// member) for its ring rank in the per-process view.
    fn join(&mut self, m: Membership) -> Result<Generation, B::Error> {
        let rank = self
            .local
            .ring_rank(&m, &self.name)
            .expect("join is only called for a generation that lists this member");
        let m = m.per_process(self.local.processes);
        let mut config = Config::new(
            rank,
            m.members.len(),
            m.addresses(),
            m.generation,
            m.job_uid.clone(),
            self.key.clone(),
        );
        config.timeout = self.op_timeout;
        let listener = self.backend.listen(&m, rank, &mut config)?;
        self.current = Some(m);
        Ok(Generation { config, listener })
    }

    /// [`Follower::join`], a failure logged.
    fn join_logged(&mut self, m: Membership) -> Option<Generation> {
        self.join(m)
            .map_err(|e| tracing::error!("joining generation: {e}"))
            .ok()
    }

    fn write_progress(&mut self, report: &ProgressReport, last: bool) {
        let json = serde_json::to_string(report).expect("serializable");
        self.backend.write_progress(json, last);
    }
}

impl<B: Backend> RingSource for Follower<B> {
    fn connected(&mut self, generation: u64, _rank: usize, abort: AbortHandle) {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some((generation, abort));
    }

    fn after_commit(&mut self, p: &Progress) -> Control {
        if self.backend.terminating() {
            return Control::Leave;
        }
        self.publish_progress(p);
        // The ring recovered: a later failure at this generation is a new one, reported again.
        self.reported = None;
        self.memberships.drain();
        let cur = self.current.as_ref().map(|m| m.generation);
        let Some(m) = self.memberships.latest().cloned() else {
            return Control::Continue;
        };
        match decide(cur, &m, &self.name) {
            Decision::Stay => Control::Continue,
            Decision::NotMember => {
                self.removed = true;
                Control::Leave
            }
            Decision::Join(_) => self.join_logged(m).map_or(Control::Leave, Control::Switch),
        }
    }

    fn after_failure(&mut self, err: &CommError) -> Option<Generation> {
        tracing::warn!("collective failed: {err}");
        if self.backend.terminating() {
            return None;
        }
        let cur = self.current.as_ref().map(|m| m.generation);
        self.report_failure(err);
        // Prefer a newer generation; else re-form the newest known one (possibly the same).
        // Not a member of it: give up (this member was removed).
        let m = self.memberships.wait_newer(cur, REJOIN_WAIT).cloned()?;
        if m.rank_of(&self.name).is_none() {
            self.removed = true;
            return None;
        }
        self.join_logged(m)
    }

    fn report_failure(&mut self, err: &CommError) {
        let current = self.current.as_ref();
        let uid = self.job_uid.clone();
        if let Some(report) = failure_report(err, current, self.reported, &self.name, uid) {
            self.reported = current.map(|m| m.generation);
            self.backend.write_report(
                format!("{}{}", contract::REPORT_KEY_PREFIX, self.name),
                serde_json::to_string(&report).expect("serializable"),
            );
        }
    }

    fn publish_progress(&mut self, p: &Progress) {
        let now = jiff::Timestamp::now().to_string();
        if let Some(report) = p.record(self.last_progress, now, self.job_uid.clone()) {
            self.last_progress = Some(Instant::now());
            self.write_progress(&report, p.is_last());
            self.last_report = Some(report);
        }
    }

    fn report_test_accuracy(&mut self, accuracy: f64) {
        if let Some(mut report) = self.last_report.take() {
            report.test_accuracy = Some(accuracy);
            report.time = jiff::Timestamp::now().to_string();
            self.write_progress(&report, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::net::TcpListener;
    use std::path::PathBuf;

    use diphoma_contract::{MEMBERSHIP_KEY, Member};

    #[cfg(feature = "kube")]
    use crate::Protection;
    use crate::file::{FileRing, POLL, RingDir, write_atomic};
    #[cfg(feature = "kube")]
    use crate::k8s::{KubeRing, RingConfigMap, WorkerEnv};
    use crate::{Communicator, ReduceOp};

    /// One backend under test: followers of its memberships, and the records they wrote.
    trait Rig: Sync {
        type B: Backend + Send + 'static;
        /// A follower for member `name`, listed at `port` when listed.
        fn follower(&self, name: &str, port: u16) -> Follower<Self::B>;
        /// Publishes `m` as the newest membership.
        fn publish(&self, m: &Membership);
        /// The records written since the last call (key → JSON, the last write of each key).
        fn take_records(&self) -> BTreeMap<String, String>;
    }

    /// The ring directory, as the standalone launcher writes it.
    struct Dir(PathBuf);

    impl Rig for Dir {
        type B = RingDir;
        fn follower(&self, name: &str, _port: u16) -> FileRing {
            FileRing::start(
                self.0.clone(),
                name.into(),
                vec![7; 32],
                crate::Protection::Integrity,
                Duration::from_secs(20),
            )
        }
        fn publish(&self, m: &Membership) {
            let json = serde_json::to_string(m).unwrap();
            write_atomic(&self.0.join(MEMBERSHIP_KEY), json.as_bytes()).unwrap();
        }
        fn take_records(&self) -> BTreeMap<String, String> {
            let mut out = BTreeMap::new();
            for e in std::fs::read_dir(&self.0).unwrap() {
                let path = e.unwrap().path();
                let key = path.file_name().unwrap().to_string_lossy().into_owned();
                if key != MEMBERSHIP_KEY && !key.contains(".tmp") {
                    out.insert(key, std::fs::read_to_string(&path).unwrap());
                    std::fs::remove_file(&path).unwrap();
                }
            }
            out
        }
    }

    /// The ring ConfigMap: memberships fed as its watch would, heartbeat patches answered by a
    /// mocked API server (tower-test) and kept.
    #[cfg(feature = "kube")]
    #[derive(Default)]
    struct Pods {
        /// Every follower's feed, and the newest membership (what a new watch lists first).
        watches: Mutex<(Vec<Feed>, Option<Membership>)>,
        patches: Arc<Mutex<Vec<serde_json::Value>>>,
    }

    #[cfg(feature = "kube")]
    impl Rig for Pods {
        type B = RingConfigMap;
        fn follower(&self, name: &str, port: u16) -> KubeRing {
            let lookup = |v: &str| {
                Some(match v {
                    contract::ENV_POD_NAME => name.to_string(),
                    contract::ENV_POD_IP => "127.0.0.1".into(),
                    contract::ENV_RING_PORT => port.to_string(),
                    contract::ENV_DETECTION_SECONDS => "20".into(),
                    contract::ENV_RING_PROTECTION
                    | contract::ENV_LOCAL_RANK
                    | contract::ENV_PROCESSES_PER_WORKER => return None,
                    _ => "x".into(),
                })
            };
            let env = WorkerEnv::from_lookup(lookup).unwrap();
            assert_eq!(env.protection, Protection::None, "the default when unset");
            let key = vec![7u8; 32];
            let udp = std::net::UdpSocket::bind(("127.0.0.1", port)).unwrap();
            let responder = crate::liveness::Responder::spawn(udp, key.clone()).unwrap();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let (svc, mut handle) = tower_test::mock::pair::<
                http::Request<kube::client::Body>,
                http::Response<kube::client::Body>,
            >();
            let patches = self.patches.clone();
            rt.spawn(async move {
                while let Some((req, send)) = handle.next_request().await {
                    let body = req.into_body().collect_bytes().await.unwrap_or_default();
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    patches.lock().unwrap().push(v.clone());
                    let reply =
                        serde_json::json!({"metadata": {"name": "x-heartbeat"}, "data": {}});
                    let body = kube::client::Body::from(serde_json::to_vec(&reply).unwrap());
                    send.send_response(http::Response::new(body));
                }
            });
            let client = {
                let _in = rt.enter();
                kube::Client::new(svc, "x")
            };
            let stop = Arc::default();
            let start = |feed: Feed| {
                let mut w = self.watches.lock().unwrap();
                if let Some(m) = &w.1 {
                    feed.send(m.clone()).unwrap();
                }
                w.0.push(feed);
                Ok::<_, std::convert::Infallible>(RingConfigMap::new(
                    env, rt, client, stop, responder,
                ))
            };
            let Ok(f) = Follower::with_backend(
                name.into(),
                Some("u".into()),
                key,
                Duration::from_secs(20),
                start,
            );
            f
        }
        fn publish(&self, m: &Membership) {
            let mut w = self.watches.lock().unwrap();
            w.1 = Some(m.clone());
            for feed in &w.0 {
                let _ = feed.send(m.clone()); // a follower dropped: nobody listens
            }
        }
        fn take_records(&self) -> BTreeMap<String, String> {
            // Progress is patched in the background: let it land.
            std::thread::sleep(Duration::from_millis(300));
            let mut out = BTreeMap::new();
            for p in self.patches.lock().unwrap().drain(..) {
                for (k, v) in p["data"].as_object().unwrap() {
                    out.insert(k.clone(), v.as_str().unwrap().to_string());
                }
            }
            out
        }
    }

    fn membership(generation: u64, members: &[(&str, u16)]) -> Membership {
        Membership {
            generation,
            job_uid: "follow-test".into(),
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
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn progress(step: u64, generation: u64, rank: usize) -> Progress {
        Progress {
            step,
            total_steps: Some(5),
            generation,
            rank,
            loss: 0.5,
            samples_per_second: 1.0,
            last_checkpoint: None,
            allreduce_seconds: 0.0,
            allreduce_bytes: 0,
            shares: Vec::new(),
        }
    }

    /// Three members over real TCP: a newer generation without `c` aborts the collective in
    /// flight of `a` and `b`, which re-form at generation 2 and
    /// reduce again; `c` learns it was removed. Rank 0's progress is written at its first
    /// commit and the last step, not in between; a lost peer is reported once until a commit.
    fn rules<R: Rig>(rig: &R) {
        let ports = [free_port(), free_port(), free_port()];
        rig.publish(&membership(
            1,
            &[("a", ports[0]), ("b", ports[1]), ("c", ports[2])],
        ));
        let out: Vec<_> = std::thread::scope(|s| {
            let threads: Vec<_> = ["a", "b", "c"]
                .into_iter()
                .zip(ports)
                .map(|(name, port)| {
                    s.spawn(move || {
                        let mut src = rig.follower(name, port);
                        let g = src.first_generation(Some(Duration::from_secs(10)));
                        let g = g.unwrap().unwrap();
                        let mut comm = Communicator::connect(g.config, g.listener).unwrap();
                        src.connected(1, comm.rank(), comm.abort_handle());
                        if name == "c" {
                            // c stops taking part: the others block until generation 2.
                            let p = progress(1, 1, comm.rank());
                            while !matches!(src.after_commit(&p), Control::Leave) {
                                std::thread::sleep(POLL);
                            }
                            return (src.removed(), 0.0);
                        }
                        let err = comm.allreduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err();
                        let g = src.after_failure(&err).unwrap();
                        assert_eq!(g.config.generation, 2);
                        let mut comm = Communicator::connect(g.config, g.listener).unwrap();
                        let mut v = [1.0f32; 4];
                        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                        (src.removed(), v[0])
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(500));
            rig.publish(&membership(2, &[("a", ports[0]), ("b", ports[1])]));
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(out, vec![(false, 2.0), (false, 2.0), (true, 0.0)]);
        // An abort is not reported (`c` leaving may break the links first: that is).
        let records = rig.take_records();
        let written: Vec<_> = records.keys().map(String::as_str).collect();
        assert!(
            written.iter().all(|k| ["report.a", "report.b"].contains(k)),
            "{written:?}"
        );

        // Rank 0 of generation 3 alone: the cadence, and one report per failure.
        let port = free_port();
        rig.publish(&membership(3, &[("d", port)]));
        let mut d = rig.follower("d", port);
        let g = d
            .first_generation(Some(Duration::from_secs(10)))
            .unwrap()
            .unwrap();
        assert_eq!((g.config.generation, g.config.rank), (3, 0));
        drop(g);
        let keys = |r: &BTreeMap<String, String>| r.keys().cloned().collect::<Vec<_>>();
        let report = format!("{}d", contract::REPORT_KEY_PREFIX);
        let lost = CommError::PeerLost {
            rank: 0,
            op: "allreduce",
        };
        d.publish_progress(&progress(1, 3, 0));
        assert_eq!(
            keys(&rig.take_records()),
            [contract::PROGRESS_KEY],
            "the first one"
        );
        d.publish_progress(&progress(2, 3, 0));
        d.report_failure(&lost);
        d.report_failure(&lost);
        let r = rig.take_records();
        assert_eq!(keys(&r), vec![report.clone()], "not due; one report");
        let f: contract::FailureReport = serde_json::from_str(&r[&report]).unwrap();
        assert_eq!((f.generation, f.suspect.as_deref()), (3, Some("d")));
        assert!(matches!(
            d.after_commit(&progress(5, 3, 0)),
            Control::Continue
        ));
        d.report_failure(&lost);
        let r = rig.take_records();
        assert_eq!(
            keys(&r),
            [contract::PROGRESS_KEY.to_string(), report.clone()]
        );
        let p: ProgressReport = serde_json::from_str(&r[contract::PROGRESS_KEY]).unwrap();
        assert_eq!((p.generation, p.step, p.test_accuracy), (3, 5, None));
        d.report_test_accuracy(0.75);
        let r = rig.take_records();
        let p: ProgressReport = serde_json::from_str(&r[contract::PROGRESS_KEY]).unwrap();
        assert_eq!((p.step, p.test_accuracy), (5, Some(0.75)));
    }

    #[test]
    fn the_rules_over_the_ring_directory() {
        let dir = std::env::temp_dir().join(format!("diphoma-follow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        rules(&Dir(dir.clone()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A ring port whose local rank 1 port (+ 2) is free too.
    fn free_pod_port() -> u16 {
        loop {
            let p = free_port();
            if p < u16::MAX - 2 && TcpListener::bind(("127.0.0.1", p + 2)).is_ok() {
                return p;
            }
        }
    }

    /// Two pods of two processes each: the membership lists the pods, every process joins the
    /// per-process ring at rank pod·2 + local rank and its own port; a reduce over the four
    /// sums every rank's value; a failure blames the pod.
    #[test]
    fn pods_of_two_processes_form_a_ring_of_four() {
        let dir = std::env::temp_dir().join(format!("diphoma-follow-local-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rig = Dir(dir.clone());
        let ports = [free_pod_port(), free_pod_port()];
        rig.publish(&membership(1, &[("a", ports[0]), ("b", ports[1])]));
        let got: Vec<_> = std::thread::scope(|s| {
            let threads: Vec<_> = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
                .into_iter()
                .map(|(pod, l)| {
                    let rig = &rig;
                    s.spawn(move || {
                        let mut src = rig.follower(pod, 0);
                        src.set_local(contract::Local {
                            rank: l,
                            processes: 2,
                        });
                        let g = src.first_generation(Some(Duration::from_secs(10)));
                        let g = g.unwrap().unwrap();
                        let (rank, world) = (g.config.rank, g.config.world);
                        let port = g.listener.local_addr().unwrap().port();
                        let mut comm = Communicator::connect(g.config, g.listener).unwrap();
                        let mut v = [rank as f32; 3];
                        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                        let err = CommError::PeerLost {
                            rank: 3,
                            op: "allreduce",
                        };
                        let blamed = failure_report(&err, src.current.as_ref(), None, pod, None)
                            .and_then(|r| r.suspect);
                        (rank, world, port, v[0], blamed)
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let b = Some("b".to_string());
        assert_eq!(
            got,
            [
                (0, 4, ports[0], 6.0, b.clone()),
                (1, 4, ports[0] + 2, 6.0, b.clone()),
                (2, 4, ports[1], 6.0, b.clone()),
                (3, 4, ports[1] + 2, 6.0, b),
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(feature = "kube")]
    #[test]
    fn the_rules_over_the_ring_configmap() {
        rules(&Pods::default());
    }

    #[test]
    fn decisions() {
        let m = |g: u64, pods: &[&str]| Membership {
            generation: g,
            job_uid: "u".into(),
            members: pods
                .iter()
                .enumerate()
                .map(|(i, p)| contract::Member {
                    rank: i as u32,
                    pod: p.to_string(),
                    address: "127.0.0.1".parse().unwrap(),
                    port: 1,
                })
                .collect(),
        };
        assert_eq!(decide(None, &m(1, &["a", "b"]), "b"), Decision::Join(1));
        assert_eq!(decide(Some(1), &m(1, &["a", "b"]), "b"), Decision::Stay);
        assert_eq!(decide(Some(2), &m(1, &["a"]), "b"), Decision::Stay);
        assert_eq!(decide(Some(1), &m(2, &["b", "c"]), "b"), Decision::Join(0));
        assert_eq!(
            decide(Some(1), &m(2, &["a", "c"]), "b"),
            Decision::NotMember
        );
    }
}
