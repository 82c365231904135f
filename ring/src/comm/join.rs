//! Joining one ring generation: connecting to the lower-ranked peers a rank needs, accepting
//! the higher-ranked ones, and the handshake (`auth.rs`) on each connection.
//!
//! Owns the blocking connect/accept phase of [`Communicator::connect`](super::Communicator::connect)
//! (an accept thread next to the connecting one, both bounded by the config's deadline) and hands
//! back the connections ready for the transport (non-blocking, `TCP_NODELAY`, socket buffers)
//! with the frame keys their handshakes derived.
//! It must not run collectives.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::transport::{set_buffers, wait_ready};
use super::{Config, timeout_err};
use crate::auth::{self, AuthParams, RefusalCounters};
use crate::error::CommError;
use crate::frame::ProtocolError;
use crate::schedule;
use crate::seal::FrameKeys;

/// A joined connection: the peer's rank, the stream, and its frame keys.
type Joined = (usize, TcpStream, FrameKeys);

/// Bound on each blocking handshake read or write (and each connect attempt).
const HANDSHAKE_MAX: Duration = Duration::from_secs(5);

/// The socket timeout of one handshake I/O: what is left until `deadline`, 1 ms to
/// [`HANDSHAKE_MAX`].
fn clamp_timeout(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    Some(left.clamp(Duration::from_millis(1), HANDSHAKE_MAX))
}

/// Connects and authenticates every peer `config.rank` needs within `config.timeout`, and
/// returns the connections indexed by rank (`None` for ranks it needs no connection to), each
/// non-blocking with `TCP_NODELAY` and the requested socket buffers, with its frame keys.
///
/// # Errors
/// As [`Communicator::connect`](super::Communicator::connect).
pub(super) fn join(
    config: &Config,
    listener: TcpListener,
) -> Result<Vec<Option<(TcpStream, FrameKeys)>>, CommError> {
    let start = Instant::now();
    let deadline = start + config.timeout;
    let (rank, world) = (config.rank, config.world);
    let peers = schedule::peers(world, rank);
    let (lower, higher): (Vec<usize>, Vec<usize>) = peers.iter().partition(|&&p| p < rank);
    let params = AuthParams {
        key: &config.key,
        job_uid: &config.job_uid,
        generation: config.generation,
        world: world as u32,
        protection: config.protection,
    };
    let stop = AtomicBool::new(false);
    let counters = &config.counters;
    let (acc, con) = std::thread::scope(|sc| {
        let acc = sc.spawn(|| {
            let r = accept_peers(
                &listener, &params, rank, &higher, start, deadline, &stop, counters,
            );
            if r.is_err() {
                stop.store(true, Ordering::SeqCst);
            }
            r
        });
        let con = connect_peers(config, &params, &lower, start, deadline, &stop, counters);
        if con.is_err() {
            stop.store(true, Ordering::SeqCst);
        }
        (
            acc.join()
                .unwrap_or(Err(CommError::Config("accept thread panicked".into()))),
            con,
        )
    });
    // Whichever half failed first stopped the other (which then says `Aborted` or
    // `Timeout`): report the first failure.
    let con = match con {
        Err(CommError::Aborted) => return Err(acc.err().unwrap_or(CommError::Aborted)),
        c => c?,
    };
    let mut links: Vec<Option<(TcpStream, FrameKeys)>> = (0..world).map(|_| None).collect();
    for (p, s, keys) in con.into_iter().chain(acc?) {
        s.set_nodelay(true).map_err(|source| CommError::Io {
            op: "connect",
            source,
        })?;
        s.set_nonblocking(true).map_err(|source| CommError::Io {
            op: "connect",
            source,
        })?;
        if config.socket_buffer > 0 {
            set_buffers(&s, config.socket_buffer);
        }
        links[p] = Some((s, keys));
    }
    Ok(links)
}

#[allow(clippy::too_many_arguments)]
fn accept_peers(
    listener: &TcpListener,
    params: &AuthParams<'_>,
    rank: usize,
    higher: &[usize],
    start: Instant,
    deadline: Instant,
    stop: &AtomicBool,
    counters: &RefusalCounters,
) -> Result<Vec<Joined>, CommError> {
    let mut got: Vec<Joined> = Vec::new();
    if higher.is_empty() {
        return Ok(got);
    }
    listener
        .set_nonblocking(true)
        .map_err(|source| CommError::Io {
            op: "connect",
            source,
        })?;
    while got.len() < higher.len() {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            return Err(timeout_err("connect", start, None));
        }
        let (mut s, _) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Interrupted or failed: the loop checks the deadline and tries again.
                let _ = wait_ready(None, Some(listener.as_fd()), Duration::from_millis(20));
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(source) => {
                return Err(CommError::Io {
                    op: "connect",
                    source,
                });
            }
        };
        let prepared = s
            .set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(clamp_timeout(deadline)))
            .and_then(|_| s.set_write_timeout(clamp_timeout(deadline)));
        if prepared.is_err() {
            continue;
        }
        match auth::accept(&mut s, params, rank as u32, |f| {
            higher.contains(&(f as usize))
        }) {
            Ok((from, keys)) => {
                got.retain(|(p, _, _)| *p != from as usize);
                got.push((from as usize, s, keys));
            }
            // An authenticated peer is at a newer generation: ours will never form.
            Err(e @ CommError::StaleGeneration { ours, theirs }) if theirs > ours => {
                counters.record(&e);
                return Err(e);
            }
            // An authenticated peer protects frames another way: no ring can form.
            Err(e @ CommError::ProtectionMismatch { .. }) => return Err(e),
            Err(e) => counters.record(&e),
        }
    }
    Ok(got)
}

fn connect_peers(
    config: &Config,
    params: &AuthParams<'_>,
    lower: &[usize],
    start: Instant,
    deadline: Instant,
    stop: &AtomicBool,
    counters: &RefusalCounters,
) -> Result<Vec<Joined>, CommError> {
    let mut out = Vec::new();
    for &p in lower {
        loop {
            if stop.load(Ordering::SeqCst) {
                return Err(CommError::Aborted);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout_err("connect", start, None));
            }
            let retry = || std::thread::sleep(Duration::from_millis(10).min(left));
            let mut s =
                match TcpStream::connect_timeout(&config.addresses[p], left.min(HANDSHAKE_MAX)) {
                    Ok(s) => s,
                    Err(_) => {
                        retry();
                        continue;
                    }
                };
            let prepared = s
                .set_read_timeout(clamp_timeout(deadline))
                .and_then(|_| s.set_write_timeout(clamp_timeout(deadline)))
                .and_then(|_| s.set_nodelay(true));
            if prepared.is_err() {
                retry();
                continue;
            }
            match auth::initiate(&mut s, params, config.rank as u32, p as u32) {
                Ok(keys) => {
                    out.push((p, s, keys));
                    break;
                }
                // The peer has not reached our generation yet: it will.
                Err(CommError::StaleGeneration { ours, theirs }) if theirs < ours => retry(),
                Err(CommError::Io { .. } | CommError::Timeout { .. }) => retry(),
                Err(CommError::Protocol(ProtocolError::Truncated { .. })) => retry(),
                Err(e) => {
                    counters.record(&e);
                    return Err(e);
                }
            }
        }
    }
    Ok(out)
}
