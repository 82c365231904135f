//! Container logs as the real kubelet keeps them: one file per container run,
//! `<root>/logs/<namespace>_<pod>_<uid>/<container>/<restartCount>.log`, each line in the CRI
//! format `<RFC 3339 time> <stdout|stderr> F <text>`, written by the kubelet from the process's
//! pipes; and the selection that `GET /containerLogs` serves from them (`previous`, `tailLines`,
//! `sinceSeconds`/`sinceTime`, `timestamps`, `follow`).
//!
//! Pure parts: [`cri_line`], [`parse_cri`], [`LogQuery::select`], [`run_of`]. I/O: [`capture`]
//! (pipes → file), [`runs`], [`read_text`] and [`follow`]. This module never talks to the API
//! server; the HTTP side is [`super::server`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use jiff::Timestamp;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Child;
use tokio::sync::{mpsc, watch};

use crate::Error;

/// The directory of one container's runs: `<root>/logs/<namespace>_<pod>_<uid>/<container>`.
pub fn container_dir(
    root: &Path,
    namespace: &str,
    pod: &str,
    uid: &str,
    container: &str,
) -> PathBuf {
    root.join("logs")
        .join(format!("{namespace}_{pod}_{uid}"))
        .join(container)
}

/// The file of run `restart` (the container's `restartCount` when it started) in `dir`.
pub fn run_file(dir: &Path, restart: i32) -> PathBuf {
    dir.join(format!("{restart}.log"))
}

/// The run number of a file named `<n>.log`, or `None` for any other name.
pub fn run_of(path: &Path) -> Option<i32> {
    path.file_name()?
        .to_str()?
        .strip_suffix(".log")?
        .parse()
        .ok()
}

/// The runs in a container's directory, oldest first (empty when it has none).
pub fn runs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<(i32, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((run_of(&e.path())?, e.path())))
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// One CRI log line (newline included) for `text` (without its newline) read from `stream`.
pub fn cri_line(at: Timestamp, stream: &str, text: &str) -> String {
    format!("{at} {stream} F {text}\n")
}

/// Splits a CRI log line (without its newline) into its time and text; `None` for a line in
/// another format.
pub fn parse_cri(line: &str) -> Option<(Timestamp, &str)> {
    let mut parts = line.splitn(4, ' ');
    let at = parts.next()?.parse().ok()?;
    let _stream = parts.next()?;
    let _tag = parts.next()?;
    Some((at, parts.next().unwrap_or("")))
}

/// The query of `GET /containerLogs/{namespace}/{pod}/{container}`, with the kubelet's names
/// (what the API server forwards from `kubectl logs -f --tail --since --since-time -p
/// --timestamps`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogQuery {
    /// Keep streaming until the run ends.
    pub follow: bool,
    /// The previous run instead of the current one.
    pub previous: bool,
    /// Only the last N lines (before following).
    pub tail_lines: Option<usize>,
    /// Only lines written in the last N seconds.
    pub since_seconds: Option<i64>,
    /// Only lines written at or after this time (RFC 3339).
    pub since_time: Option<Timestamp>,
    /// Prefix each line with its RFC 3339 time.
    pub timestamps: bool,
}

impl LogQuery {
    /// Parses a URL query (`follow=true&tailLines=3&sinceTime=2026-01-01T00%3A00%3A00Z`);
    /// unknown parameters are ignored, as the kubelet does. Errors: the parameter whose value
    /// does not parse.
    pub fn parse(query: &str) -> Result<Self, String> {
        fn val<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
            v.parse().map_err(|_| format!("invalid {k}: {v:?}"))
        }
        let mut q = LogQuery::default();
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match &*k {
                "follow" => q.follow = val(&k, &v)?,
                "previous" => q.previous = val(&k, &v)?,
                "timestamps" => q.timestamps = val(&k, &v)?,
                "tailLines" => q.tail_lines = Some(val(&k, &v)?),
                "sinceSeconds" => q.since_seconds = Some(val(&k, &v)?),
                "sinceTime" => q.since_time = Some(val(&k, &v)?),
                _ => {}
            }
        }
        Ok(q)
    }

    /// The earliest time a line may carry to be served, as of `now`.
    fn since(&self, now: Timestamp) -> Option<Timestamp> {
        let by_seconds = self
            .since_seconds
            .and_then(|s| now.checked_sub(jiff::SignedDuration::from_secs(s)).ok());
        by_seconds.max(self.since_time)
    }

    /// The text to serve from `content` (a run's CRI lines): lines at or after `since`, the last
    /// `tail_lines` of them, each as `text\n` or `time text\n`. Lines in another format are
    /// served as they are (with no time to filter on).
    pub fn select(&self, content: &str, now: Timestamp) -> String {
        let since = self.since(now);
        let lines: Vec<String> = content
            .lines()
            .filter_map(|l| match parse_cri(l) {
                Some((at, _)) if since.is_some_and(|s| at < s) => None,
                Some((at, text)) if self.timestamps => Some(format!("{at} {text}\n")),
                Some((_, text)) => Some(format!("{text}\n")),
                None => Some(format!("{l}\n")),
            })
            .collect();
        let skip = self.tail_lines.map_or(0, |n| lines.len().saturating_sub(n));
        lines[skip..].concat()
    }
}

/// The runs whose output is still being written, each with a signal that changes on every
/// appended line and closes when the run's output ends (followers wait on it).
#[derive(Default)]
pub struct LiveLogs(Mutex<HashMap<PathBuf, watch::Receiver<()>>>);

impl LiveLogs {
    /// The signal of a run still being written, `None` once it has ended.
    pub fn get(&self, path: &Path) -> Option<watch::Receiver<()>> {
        self.0.lock().unwrap().get(path).cloned()
    }
}

/// Creates (or opens for appending) a run's log file and its directory.
///
/// Errors: [`Error::Io`] naming `path`.
pub fn open_run(path: &Path) -> Result<std::fs::File, Error> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)
}

/// Takes the child's stdout and stderr pipes and appends their lines to `file` (the run at
/// `path`, from [`open_run`]) in CRI format until both close (the process and its children are
/// gone); `live` knows the run meanwhile.
pub fn capture(child: &mut Child, file: std::fs::File, path: &Path, live: &Arc<LiveLogs>) {
    let (tx, rx) = mpsc::unbounded_channel::<(&'static str, String)>();
    if let Some(out) = child.stdout.take() {
        tokio::spawn(read_lines(out, "stdout", tx.clone()));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(read_lines(err, "stderr", tx));
    }
    let (changed, signal) = watch::channel(());
    live.0.lock().unwrap().insert(path.to_owned(), signal);
    tokio::spawn(write_lines(
        file,
        rx,
        changed,
        path.to_owned(),
        live.clone(),
    ));
}

/// Sends each line (lossy UTF-8, newline dropped) of `r` until it closes.
async fn read_lines(
    r: impl AsyncRead + Unpin,
    stream: &'static str,
    tx: mpsc::UnboundedSender<(&'static str, String)>,
) {
    let mut r = BufReader::new(r);
    let mut buf = Vec::new();
    while r.read_until(b'\n', &mut buf).await.is_ok_and(|n| n > 0) {
        let text = String::from_utf8_lossy(&buf);
        let text = text.strip_suffix('\n').unwrap_or(&text);
        if tx.send((stream, text.to_owned())).is_err() {
            return;
        }
        buf.clear();
    }
}

/// Appends every received line to the file, signalling followers, until both streams close;
/// then the run is no longer live.
async fn write_lines(
    mut file: std::fs::File,
    mut rx: mpsc::UnboundedReceiver<(&'static str, String)>,
    changed: watch::Sender<()>,
    path: PathBuf,
    live: Arc<LiveLogs>,
) {
    use std::io::Write;
    while let Some((stream, text)) = rx.recv().await {
        if let Err(e) = file.write_all(cri_line(Timestamp::now(), stream, &text).as_bytes()) {
            tracing::warn!(path = %path.display(), error = %e, "container log write failed");
        }
        changed.send_replace(());
    }
    live.0.lock().unwrap().remove(&path);
}

/// The lines the kubelet keeps of a run's log `content` (CRI lines) as a failed container's
/// termination message under `FallbackToLogsOnError`: its last 80 lines, of those the last
/// 2048 bytes (cut at a character boundary), as `pkg/kubelet/kuberuntime` does.
pub fn termination_message(content: &str) -> String {
    let text = LogQuery {
        tail_lines: Some(80),
        ..LogQuery::default()
    }
    .select(content, Timestamp::now());
    diphoma_contract::tail(&text, diphoma_contract::TERMINATION_MESSAGE_BYTES).to_owned()
}

/// Every run's text in order (CRI prefixes removed), as one string: what a container printed
/// across its restarts. Errors: [`Error::Io`] naming a run that cannot be read.
pub fn read_text(dir: &Path) -> Result<String, Error> {
    let all = LogQuery::default();
    runs(dir)
        .iter()
        .map(|p| {
            let content = std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.clone(),
                source,
            })?;
            Ok(all.select(&content, Timestamp::now()))
        })
        .collect()
}

/// Streams run `path` per `q` into `tx`: the selected lines present now, then (with
/// `q.follow`) each line as it is written, until the run ends or the receiver is dropped.
pub async fn follow(path: PathBuf, q: LogQuery, live: Arc<LiveLogs>, tx: mpsc::Sender<String>) {
    let mut signal = live.get(&path);
    let content = tokio::fs::read_to_string(&path).await.unwrap_or_default();
    // Only whole lines: a line being written is served once its newline is there.
    let mut offset = content.rfind('\n').map_or(0, |i| i + 1);
    if tx
        .send(q.select(&content[..offset], Timestamp::now()))
        .await
        .is_err()
        || !q.follow
    {
        return;
    }
    let rest = LogQuery {
        tail_lines: None,
        ..q
    };
    loop {
        let ended = match signal.as_mut() {
            Some(s) => s.changed().await.is_err(),
            None => true,
        };
        let content = tokio::fs::read_to_string(&path).await.unwrap_or_default();
        let end = content.rfind('\n').map_or(0, |i| i + 1).max(offset);
        let new = rest.select(&content[offset..end], Timestamp::now());
        offset = end;
        if (!new.is_empty() && tx.send(new).await.is_err()) || ended {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn content() -> String {
        [
            cri_line(at("2026-01-01T00:00:00Z"), "stdout", "one"),
            cri_line(at("2026-01-01T00:00:10Z"), "stderr", "two"),
            cri_line(at("2026-01-01T00:00:20.5Z"), "stdout", "three words here"),
        ]
        .concat()
    }

    #[test]
    fn cri_lines_round_trip() {
        let l = cri_line(at("2026-01-01T00:00:20.5Z"), "stdout", "a b  c");
        assert_eq!(l, "2026-01-01T00:00:20.5Z stdout F a b  c\n");
        assert_eq!(
            parse_cri(l.trim_end()),
            Some((at("2026-01-01T00:00:20.5Z"), "a b  c"))
        );
        assert_eq!(parse_cri("plain text"), None);
    }

    #[test]
    fn a_termination_message_is_the_logs_last_80_lines_within_2048_bytes() {
        let t = at("2026-01-01T00:00:00Z");
        let lines: String = (0..100)
            .map(|i| cri_line(t, "stderr", &format!("line {i}")))
            .collect();
        let m = termination_message(&lines);
        assert!(
            m.starts_with("line 20\n") && m.ends_with("line 99\n"),
            "{m}"
        );
        let long =
            cri_line(t, "stderr", &"é".repeat(2000)) + &cri_line(t, "stderr", "ValueError: x");
        let m = termination_message(&long);
        assert!(m.len() <= 2048 && m.ends_with("ValueError: x\n"));
    }

    #[test]
    fn select_tails_filters_by_time_and_adds_timestamps() {
        let now = at("2026-01-01T00:00:25Z");
        let all = LogQuery::default();
        assert_eq!(all.select(&content(), now), "one\ntwo\nthree words here\n");
        let tail = LogQuery {
            tail_lines: Some(2),
            ..all.clone()
        };
        assert_eq!(tail.select(&content(), now), "two\nthree words here\n");
        let since = LogQuery {
            since_seconds: Some(15),
            ..all.clone()
        };
        assert_eq!(since.select(&content(), now), "two\nthree words here\n");
        let since_time = LogQuery {
            since_time: Some(at("2026-01-01T00:00:20Z")),
            timestamps: true,
            ..all
        };
        assert_eq!(
            since_time.select(&content(), now),
            "2026-01-01T00:00:20.5Z three words here\n"
        );
    }

    #[test]
    fn the_query_reads_the_kubelet_parameter_names() {
        let q = LogQuery::parse(
            "follow=true&previous=true&tailLines=3&sinceSeconds=5&timestamps=true&limitBytes=9\
             &sinceTime=2026-01-01T00%3A00%3A20Z",
        )
        .unwrap();
        assert!(q.follow && q.previous && q.timestamps);
        assert_eq!((q.tail_lines, q.since_seconds), (Some(3), Some(5)));
        assert_eq!(q.since_time, Some(at("2026-01-01T00:00:20Z")));
        assert_eq!(
            LogQuery::parse("tailLines=x").unwrap_err(),
            "invalid tailLines: \"x\""
        );
    }

    #[test]
    fn runs_are_ordered_by_number() {
        let d = std::env::temp_dir().join(format!("diphoma-runs-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        for n in [10, 2, 0] {
            std::fs::write(run_file(&d, n), "").unwrap();
        }
        std::fs::write(d.join("other"), "").unwrap();
        let got: Vec<_> = runs(&d).iter().filter_map(|p| run_of(p)).collect();
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(got, vec![0, 2, 10]);
    }
}
