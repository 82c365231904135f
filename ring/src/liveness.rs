//! Liveness, kept apart from progress: whether a peer's *process* answers, whatever its training
//! step is doing. A collective that waits long for a silent peer asks it ([`probe`]); a slow
//! step (a slow GPU, a data-loading stall, rank 0 writing a large checkpoint, a member catching
//! up to a new generation) still answers and is waited for, while a stopped or frozen process
//! (SIGSTOP, a frozen node) cannot answer and is blamed.
//!
//! The [`Responder`] is a thread of its own, started once per process on a UDP socket at the
//! worker's ring address (the same IP and port number as the TCP ring listener), so it answers
//! between generations and during any step. Ping and pong are one datagram each, of
//! [`DATAGRAM_LEN`] bytes (no amplification):
//!
//! ```text
//! ping: "DPNG" ‖ nonce (16 fresh random bytes)
//! pong: "DPOG" ‖ HMAC-SHA256(key, "diphoma-liveness-v1" ‖ nonce)[..16]
//! ```
//!
//! The pong is keyed with the per-job key (HMAC: RFC 2104; truncation to 128 bits as its
//! section 5 allows), so only a holder of the key can claim that a silent peer is alive, and the
//! fresh nonce keeps a recorded pong from being replayed. Anything else received is ignored.
//!
//! Owns the ping/pong datagrams, the responder thread and the probe; it must not touch the TCP
//! ring or decide what a silent peer means (the transport does).

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// Length of a ping and of a pong, in bytes.
pub const DATAGRAM_LEN: usize = 20;
const PING: &[u8; 4] = b"DPNG";
const PONG: &[u8; 4] = b"DPOG";
const NONCE_LEN: usize = 16;
const DOMAIN: &[u8] = b"diphoma-liveness-v1";
/// A probe re-sends its ping this often (a lost datagram costs one interval), and notices an
/// abort within it.
const PING_EVERY: Duration = Duration::from_millis(50);
/// The responder notices its stop flag within this.
const STOP_POLL: Duration = Duration::from_millis(100);

/// The pong that answers `nonce` under `key`.
fn pong(key: &[u8], nonce: &[u8]) -> [u8; DATAGRAM_LEN] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(DOMAIN);
    m.update(nonce);
    let tag = m.finalize().into_bytes();
    let mut out = [0u8; DATAGRAM_LEN];
    out[..4].copy_from_slice(PONG);
    out[4..].copy_from_slice(&tag[..NONCE_LEN]);
    out
}

/// Answers every well-formed ping on its socket with the keyed pong, from a thread of its own,
/// until dropped.
#[derive(Debug)]
pub struct Responder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Responder {
    /// Starts answering pings on `socket` with pongs keyed by `key`.
    ///
    /// # Errors
    /// The OS error of reading the socket's address or setting its read timeout, or of
    /// spawning the thread.
    pub fn spawn(socket: UdpSocket, key: Vec<u8>) -> std::io::Result<Responder> {
        let addr = socket.local_addr()?;
        socket.set_read_timeout(Some(STOP_POLL))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("diphoma-liveness".into())
            .spawn(move || {
                let mut buf = [0u8; DATAGRAM_LEN + 1];
                while !flag.load(Ordering::SeqCst) {
                    // Timeouts, interruptions and ICMP errors of earlier replies: read on.
                    let Ok((n, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    if n == DATAGRAM_LEN && &buf[..4] == PING {
                        let _ = socket.send_to(&pong(&key, &buf[4..n]), from);
                    }
                }
            })?;
        Ok(Responder {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Starts answering pings at `addr` (UDP) with pongs keyed by `key`.
    ///
    /// # Errors
    /// The OS error of binding `addr` (in use: another responder answers there), as [`Responder::spawn`]'s.
    pub fn bind(addr: SocketAddr, key: Vec<u8>) -> std::io::Result<Responder> {
        Responder::spawn(UdpSocket::bind(addr)?, key)
    }

    /// The address it answers on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a probe heard from a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A pong: the process runs.
    Alive,
    /// Nothing is bound at its address any more (an ICMP port unreachable): the process exited.
    Gone,
    /// No answer within the window: a stopped or frozen process, or a node that went quiet.
    Silent,
}

/// Asks the process at `peer` (its ring address) whether it is alive: pings it from a socket on
/// `from` every 50 ms until a pong keyed by `key` answers the probe's nonce (`true`), `window`
/// passes, or `abort` is set (`false`). A live peer answers in about one round trip.
pub fn probe(
    from: IpAddr,
    peer: SocketAddr,
    key: &[u8],
    window: Duration,
    abort: &AtomicBool,
) -> bool {
    probe_with(from, peer, Some(key), window, abort) == Answer::Alive
}

/// [`probe`] by a prober that does not hold the key (the operator, which never reads the key
/// Secret): any pong-shaped datagram from `peer` is [`Answer::Alive`], its tag unchecked (so only
/// for a verdict that a forged answer can merely delay), and a refusal (nothing bound there) is
/// [`Answer::Gone`] at once.
pub fn probe_unkeyed(
    from: IpAddr,
    peer: SocketAddr,
    window: Duration,
    abort: &AtomicBool,
) -> Answer {
    probe_with(from, peer, None, window, abort)
}

fn probe_with(
    from: IpAddr,
    peer: SocketAddr,
    key: Option<&[u8]>,
    window: Duration,
    abort: &AtomicBool,
) -> Answer {
    let deadline = Instant::now() + window;
    let Ok(sock) = UdpSocket::bind(SocketAddr::new(from, 0)) else {
        return Answer::Silent;
    };
    // Unkeyed: connected, so that an ICMP port unreachable is heard (as `ConnectionRefused`).
    let connected = key.is_none() && sock.connect(peer).is_ok();
    let refused = |e: &std::io::Error| connected && e.kind() == ErrorKind::ConnectionRefused;
    let mut ping = [0u8; DATAGRAM_LEN];
    ping[..4].copy_from_slice(PING);
    rand::rng().fill_bytes(&mut ping[4..]);
    let want = key.map(|k| pong(k, &ping[4..]));
    let answers = |got: &[u8]| match &want {
        Some(w) => got == w,
        None => got.len() == DATAGRAM_LEN && got.starts_with(PONG),
    };
    let mut buf = [0u8; DATAGRAM_LEN + 1];
    loop {
        let now = Instant::now();
        if now >= deadline || abort.load(Ordering::SeqCst) {
            return Answer::Silent;
        }
        // A send that fails (no route yet) is retried with the next ping.
        let sent = if connected {
            sock.send(&ping)
        } else {
            sock.send_to(&ping, peer)
        };
        if sent.as_ref().is_err_and(refused) {
            return Answer::Gone;
        }
        let tick = (now + PING_EVERY).min(deadline);
        loop {
            let left = tick.saturating_duration_since(Instant::now());
            if left.is_zero() || sock.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match sock.recv_from(&mut buf) {
                Ok((n, src)) if src == peer && answers(&buf[..n]) => return Answer::Alive,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(e) if refused(&e) => return Answer::Gone,
                // ICMP errors (nothing bound there yet or any more), interruptions: go on.
                Err(_) => {}
            }
        }
    }
}

/// The liveness window of a job whose `faultTolerance.detectionSeconds` is `detection`: a
/// collective probes a peer it has waited on this long, and blames it when the probe gets no
/// answer within this long again ([`crate::comm::Config::liveness`]). A quarter, so that a hung peer is
/// reported within half of `detection`, and the operator's wait of another half for the other
/// reports (its `silent_members`) still ends within `detection`.
pub fn liveness_window(detection: Duration) -> Duration {
    detection / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"liveness-test-key-liveness-test!";
    const LOOPBACK: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn responder(key: &[u8]) -> Responder {
        Responder::spawn(UdpSocket::bind("127.0.0.1:0").unwrap(), key.to_vec()).unwrap()
    }

    #[test]
    fn a_running_responder_answers_and_only_to_its_key() {
        let r = responder(KEY);
        let no = AtomicBool::new(false);
        let window = Duration::from_secs(10);
        assert!(probe(LOOPBACK, r.local_addr(), KEY, window, &no));
        // A responder with another key cannot vouch for the peer.
        let other = responder(b"another-key-another-key-another!");
        let short = Duration::from_millis(300);
        assert!(!probe(LOOPBACK, other.local_addr(), KEY, short, &no));
    }

    #[test]
    fn an_unkeyed_probe_takes_any_pong_from_the_peer_and_hears_a_closed_port() {
        let no = AtomicBool::new(false);
        let short = Duration::from_millis(300);
        let r = responder(KEY);
        let long = Duration::from_secs(10);
        assert_eq!(
            probe_unkeyed(LOOPBACK, r.local_addr(), long, &no),
            Answer::Alive
        );
        // A bound socket nobody reads is silent; once closed, the port refuses: gone.
        let mute = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = mute.local_addr().unwrap();
        assert_eq!(probe_unkeyed(LOOPBACK, addr, short, &no), Answer::Silent);
        drop(mute);
        assert_eq!(probe_unkeyed(LOOPBACK, addr, long, &no), Answer::Gone);
        // A socket that echoes the ping back is no responder.
        let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = echo.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            echo.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            while let Ok((n, src)) = echo.recv_from(&mut b) {
                let _ = echo.send_to(&b[..n], src);
            }
        });
        assert_eq!(probe_unkeyed(LOOPBACK, addr, short, &no), Answer::Silent);
        t.join().unwrap();
    }

    #[test]
    fn nobody_answering_or_an_abort_is_silence() {
        // A bound socket nobody reads: a stopped process.
        let mute = UdpSocket::bind("127.0.0.1:0").unwrap();
        let no = AtomicBool::new(false);
        let addr = mute.local_addr().unwrap();
        assert!(!probe(LOOPBACK, addr, KEY, Duration::from_millis(300), &no));
        // Dropped: nothing bound there.
        drop(mute);
        assert!(!probe(LOOPBACK, addr, KEY, Duration::from_millis(300), &no));
        // An abort ends the probe of a live peer before it asks.
        let r = responder(KEY);
        let yes = AtomicBool::new(true);
        let window = Duration::from_secs(10);
        assert!(!probe(LOOPBACK, r.local_addr(), KEY, window, &yes));
    }
}
