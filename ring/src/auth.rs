//! Connection authentication: an HMAC-SHA256 challenge-response (HMAC: RFC 2104; SHA-256:
//! FIPS 180-4) that proves both ends hold the per-job key, for this job, this generation, these
//! two ranks and this data-frame protection mode, and derives the connection's frame keys.
//!
//! Owns the handshake over one already-connected byte stream, the derivation of the
//! per-direction frame keys and the refusal counters; it does not open or accept sockets (the
//! communicator does) and never sees collective data (`seal.rs` protects it).
//!
//! ```text
//! initiator (higher rank)                       acceptor (lower rank)
//!   Hello{job_uid, gen, world, from, to, P, Ni} → checks job (WrongJob), an older gen
//!                                                 (StaleGeneration), world and ranks (Protocol);
//!                                                 a newer gen, or another protection P, is
//!                                                 authenticated as announced, then refused
//!                                                 (StaleGeneration, ProtectionMismatch)
//!                                           ←   Challenge{Na, MAC(key, T ‖ "A")}
//!   verifies the acceptor's tag (AuthFailed)
//!   Proof{MAC(key, T ‖ "I")}                  →   verifies the initiator's tag (AuthFailed)
//!                                           ←   Accept
//! T = "diphoma-ring-auth-v2" ‖ len(job_uid) ‖ job_uid ‖ gen ‖ world ‖ from ‖ to ‖ P ‖ Ni ‖ Na
//! K(d) = HKDF-SHA256(salt = Ni ‖ Na, IKM = job key, info = "diphoma-ring-frames-v1" ‖ T' ‖ d)
//! ```
//!
//! where `T'` is `T` without its domain string and `d` is `"I>A"` or `"A>I"`: the key of the
//! frames from initiator to acceptor and back (HKDF: RFC 5869, extract-then-expand). Fresh
//! nonces on both sides make the keys unique per connection, so frame counters start at 0 and
//! a frame recorded on one connection verifies on no other.
//!
//! Both nonces are 32 fresh bytes from the OS-seeded CSPRNG (`rand::rng()`), so a recorded
//! handshake cannot be replayed, and the role byte keeps one side's tag from serving as the
//! other's. Tags are compared in constant time (`hmac::Mac::verify_slice`). Either side that
//! refuses sends a `Reject` with its reason before closing, so the other gets a typed error
//! rather than an EOF.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use hmac::{Hmac, Mac};
use rand::RngCore;
use ring::hkdf;
use sha2::Sha256;

use diphoma_contract::MAX_JOB_UID;

use crate::error::CommError;
use crate::frame::{
    self, Challenge, HEADER_LEN, Header, Hello, Kind, MAC_LEN, MAX_HANDSHAKE_PAYLOAD, NONCE_LEN,
    Proof, Protection, ProtocolError, Reject, RejectReason,
};
use crate::seal::{FrameKeys, KEY_LEN};

const DOMAIN: &[u8] = b"diphoma-ring-auth-v2";
const KEYS_DOMAIN: &[u8] = b"diphoma-ring-frames-v1";

/// What both ends of a ring connection must agree on.
#[derive(Clone, Copy)]
pub struct AuthParams<'a> {
    /// The per-job HMAC key.
    pub key: &'a [u8],
    /// The job's UID.
    pub job_uid: &'a str,
    /// The ring generation.
    pub generation: u64,
    /// The world size of the generation.
    pub world: u32,
    /// How data frames are protected after the handshake (both ends must agree).
    pub protection: Protection,
}

impl std::fmt::Debug for AuthParams<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthParams")
            .field("key", &"<redacted>")
            .field("job_uid", &self.job_uid)
            .field("generation", &self.generation)
            .field("world", &self.world)
            .field("protection", &self.protection)
            .finish()
    }
}

/// Counts of refused connections, by cause. Shared (`Arc`) between the communicator, its
/// listener and whoever exports metrics.
#[derive(Debug, Default)]
pub struct RefusalCounters {
    /// A proof did not verify (wrong key), on either side.
    pub auth_failed: AtomicU64,
    /// The peer announced another job UID.
    pub wrong_job: AtomicU64,
    /// The peer announced another generation.
    pub stale_generation: AtomicU64,
    /// Garbage, truncated or out-of-place frames, impossible ranks.
    pub protocol: AtomicU64,
}

impl RefusalCounters {
    /// Counts `err` under its cause (errors that are not refusals are not counted).
    pub fn record(&self, err: &CommError) {
        let c = match err {
            CommError::AuthFailed { .. } => &self.auth_failed,
            CommError::WrongJob { .. } => &self.wrong_job,
            CommError::StaleGeneration { .. } => &self.stale_generation,
            CommError::Protocol(_) => &self.protocol,
            _ => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Total refusals of every cause.
    pub fn total(&self) -> u64 {
        [
            &self.auth_failed,
            &self.wrong_job,
            &self.stale_generation,
            &self.protocol,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

/// The transcript `T` without its domain string (see the module docs).
fn transcript(p: &AuthParams<'_>, from: u32, to: u32, ni: &[u8], na: &[u8]) -> Vec<u8> {
    let uid = &p.job_uid.as_bytes()[..p.job_uid.len().min(MAX_JOB_UID)];
    let mut t = Vec::with_capacity(1 + uid.len() + 21 + ni.len() + na.len());
    t.push(uid.len() as u8);
    t.extend_from_slice(uid);
    t.extend_from_slice(&p.generation.to_le_bytes());
    t.extend_from_slice(&p.world.to_le_bytes());
    t.extend_from_slice(&from.to_le_bytes());
    t.extend_from_slice(&to.to_le_bytes());
    t.push(p.protection as u8);
    t.extend_from_slice(ni);
    t.extend_from_slice(na);
    t
}

fn tag(p: &AuthParams<'_>, from: u32, to: u32, ni: &[u8], na: &[u8], role: u8) -> Hmac<Sha256> {
    // HMAC accepts keys of any length (RFC 2104 §2), so this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(p.key).expect("HMAC takes any key length");
    m.update(DOMAIN);
    m.update(&transcript(p, from, to, ni, na));
    m.update(&[role]);
    m
}

/// The frame keys of the connection from initiator `from` to acceptor `to`, as seen by the
/// initiator (`send` is the `"I>A"` key); the acceptor swaps them.
fn frame_keys(p: &AuthParams<'_>, from: u32, to: u32, ni: &[u8], na: &[u8]) -> FrameKeys {
    let t = transcript(p, from, to, ni, na);
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[ni, na].concat()).extract(p.key);
    let expand = |dir: &[u8]| {
        let mut k = [0u8; KEY_LEN];
        prk.expand(&[KEYS_DOMAIN, &t, dir], hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut k))
            .expect("HKDF-SHA256 expands 32 bytes");
        k
    };
    FrameKeys {
        send: expand(b"I>A"),
        recv: expand(b"A>I"),
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut n);
    n
}

fn io_err(e: std::io::Error, have: usize, need: usize) -> CommError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            CommError::Protocol(ProtocolError::Truncated { need, have })
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Timeout {
            op: "handshake",
            after: std::time::Duration::ZERO,
            peer: None,
        },
        _ => CommError::Io {
            op: "handshake",
            source: e,
        },
    }
}

/// Reads one handshake frame into `buf`; returns its header and payload length.
fn read_frame<S: Read>(
    s: &mut S,
    buf: &mut [u8; MAX_HANDSHAKE_PAYLOAD],
) -> Result<(Header, usize), CommError> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(|e| io_err(e, 0, HEADER_LEN))?;
    let header = Header::decode(&h)?;
    if header.kind == Kind::Data {
        return Err(ProtocolError::Unexpected {
            got: Kind::Data,
            expected: Kind::Hello,
        }
        .into());
    }
    let n = header.len as usize; // ≤ MAX_HANDSHAKE_PAYLOAD, checked by decode
    s.read_exact(&mut buf[..n])
        .map_err(|e| io_err(e, HEADER_LEN, HEADER_LEN + n))?;
    Ok((header, n))
}

fn expect(got: Kind, expected: Kind) -> Result<(), CommError> {
    if got == expected {
        Ok(())
    } else {
        Err(ProtocolError::Unexpected { got, expected }.into())
    }
}

fn reject_error(r: &Reject, p: &AuthParams<'_>, peer: &str) -> CommError {
    match r.reason {
        RejectReason::Protection => CommError::ProtectionMismatch {
            peer: peer.into(),
            ours: p.protection,
            theirs: r.protection,
        },
        RejectReason::Auth => CommError::AuthFailed {
            peer: peer.into(),
            reason: "peer refused our proof",
        },
        RejectReason::WrongJob => CommError::WrongJob {
            theirs: "<refused by peer>".into(),
        },
        RejectReason::Generation => CommError::StaleGeneration {
            ours: p.generation,
            theirs: r.generation,
        },
        RejectReason::Protocol => ProtocolError::Malformed("peer refused our hello").into(),
    }
}

/// Runs the initiator's side on a connected stream: rank `from` reaching rank `to`. Returns
/// the connection's frame keys.
///
/// # Errors
/// [`CommError::AuthFailed`] when the acceptor's tag does not verify or it refused ours,
/// [`CommError::StaleGeneration`] / [`CommError::WrongJob`] when it refused our hello,
/// [`CommError::ProtectionMismatch`] when it runs another protection mode,
/// [`CommError::Protocol`] on malformed frames, `Timeout`/`Io` from the stream (whose read
/// timeout bounds each read).
pub fn initiate<S: Read + Write>(
    s: &mut S,
    p: &AuthParams<'_>,
    from: u32,
    to: u32,
) -> Result<FrameKeys, CommError> {
    let peer = format!("rank {to}");
    let ni = nonce();
    let hello = Hello {
        job_uid: p.job_uid,
        generation: p.generation,
        world: p.world,
        from,
        to,
        protection: p.protection,
        nonce: ni,
    };
    s.write_all(hello.encode().as_bytes())
        .map_err(|e| io_err(e, 0, 0))?;
    let mut buf = [0u8; MAX_HANDSHAKE_PAYLOAD];
    let (h, n) = read_frame(s, &mut buf)?;
    if h.kind == Kind::Reject {
        return Err(reject_error(&Reject::decode(&buf[..n])?, p, &peer));
    }
    expect(h.kind, Kind::Challenge)?;
    let ch = Challenge::decode(&buf[..n])?;
    if tag(p, from, to, &ni, &ch.nonce, b'A')
        .verify_slice(&ch.mac)
        .is_err()
    {
        let _ = s.write_all(
            Reject {
                reason: RejectReason::Auth,
                generation: p.generation,
                protection: p.protection,
            }
            .encode()
            .as_bytes(),
        );
        return Err(CommError::AuthFailed {
            peer,
            reason: "acceptor's proof does not verify",
        });
    }
    let mut mac = [0u8; MAC_LEN];
    mac.copy_from_slice(
        &tag(p, from, to, &ni, &ch.nonce, b'I')
            .finalize()
            .into_bytes(),
    );
    s.write_all(Proof { mac }.encode().as_bytes())
        .map_err(|e| io_err(e, 0, 0))?;
    let (h, n) = read_frame(s, &mut buf)?;
    if h.kind == Kind::Reject {
        return Err(reject_error(&Reject::decode(&buf[..n])?, p, &peer));
    }
    expect(h.kind, Kind::Accept)?;
    if n != 0 {
        return Err(ProtocolError::Malformed("accept").into());
    }
    Ok(frame_keys(p, from, to, &ni, &ch.nonce))
}

/// Runs the acceptor's side for rank `me`; `wanted(from)` says whether rank `from` is a peer
/// this rank still expects. Returns the authenticated peer's rank and the connection's frame
/// keys.
///
/// On refusal a `Reject` is sent (best effort) and the error returned; the caller counts it
/// ([`RefusalCounters::record`]) and keeps listening. A hello of an older generation is refused
/// at once. A hello of a *newer* generation means this rank's generation is stale: the peer is
/// first authenticated at its own generation and world (so a hello without the key cannot make
/// a ring give up), then refused with our generation, and
/// `StaleGeneration { ours, theirs }` with `theirs > ours` is returned so the caller can stop
/// joining a generation that will never form. A peer announcing another protection mode is
/// likewise authenticated first, then refused with [`CommError::ProtectionMismatch`] (a
/// configuration error: the ring cannot form).
///
/// # Errors
/// [`CommError::WrongJob`], [`CommError::StaleGeneration`], [`CommError::AuthFailed`],
/// [`CommError::ProtectionMismatch`],
/// [`CommError::Protocol`] (garbage, truncated frames, unexpected ranks), `Timeout`/`Io`.
pub fn accept<S: Read + Write>(
    s: &mut S,
    p: &AuthParams<'_>,
    me: u32,
    wanted: impl Fn(u32) -> bool,
) -> Result<(u32, FrameKeys), CommError> {
    let refuse = |s: &mut S, reason| {
        let _ = s.write_all(
            Reject {
                reason,
                generation: p.generation,
                protection: p.protection,
            }
            .encode()
            .as_bytes(),
        );
    };
    let mut buf = [0u8; MAX_HANDSHAKE_PAYLOAD];
    let (h, n) = read_frame(s, &mut buf)?;
    expect(h.kind, Kind::Hello)?;
    let hello = Hello::decode(&buf[..n])?;
    if hello.job_uid != p.job_uid {
        refuse(s, RejectReason::WrongJob);
        return Err(CommError::WrongJob {
            theirs: hello.job_uid.to_string(),
        });
    }
    if hello.generation < p.generation {
        refuse(s, RejectReason::Generation);
        return Err(CommError::StaleGeneration {
            ours: p.generation,
            theirs: hello.generation,
        });
    }
    // A peer of a newer generation means that ours is stale. It is authenticated at its own
    // generation (a hello alone proves nothing) before we believe it, then refused.
    let (newer, ours) = (hello.generation > p.generation, *p);
    let theirs = AuthParams {
        generation: hello.generation,
        world: hello.world,
        protection: hello.protection,
        ..*p
    };
    if !newer
        && (hello.world != p.world
            || hello.to != me
            || hello.from >= p.world
            || !wanted(hello.from))
    {
        refuse(s, RejectReason::Protocol);
        return Err(ProtocolError::Malformed("hello: ranks do not fit this ring").into());
    }
    let p = &theirs;
    let from = hello.from;
    let ni = hello.nonce;
    let na = nonce();
    let mut mac = [0u8; MAC_LEN];
    mac.copy_from_slice(&tag(p, from, me, &ni, &na, b'A').finalize().into_bytes());
    s.write_all(Challenge { nonce: na, mac }.encode().as_bytes())
        .map_err(|e| io_err(e, 0, 0))?;
    let (h, n) = read_frame(s, &mut buf)?;
    if h.kind == Kind::Reject {
        // The initiator could not verify our tag: it holds another key.
        return Err(CommError::AuthFailed {
            peer: format!("rank {from}"),
            reason: "initiator refused our proof",
        });
    }
    expect(h.kind, Kind::Proof)?;
    let proof = Proof::decode(&buf[..n])?;
    if tag(p, from, me, &ni, &na, b'I')
        .verify_slice(&proof.mac)
        .is_err()
    {
        refuse(s, RejectReason::Auth);
        return Err(CommError::AuthFailed {
            peer: format!("rank {from}"),
            reason: "initiator's proof does not verify",
        });
    }
    if newer {
        refuse(s, RejectReason::Generation);
        return Err(CommError::StaleGeneration {
            ours: ours.generation,
            theirs: p.generation,
        });
    }
    if p.protection != ours.protection {
        refuse(s, RejectReason::Protection);
        return Err(CommError::ProtectionMismatch {
            peer: format!("rank {from}"),
            ours: ours.protection,
            theirs: p.protection,
        });
    }
    s.write_all(frame::accept_frame().as_bytes())
        .map_err(|e| io_err(e, 0, 0))?;
    let k = frame_keys(p, from, me, &ni, &na);
    Ok((
        from,
        FrameKeys {
            send: k.recv,
            recv: k.send,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    fn run_pair(
        ip: AuthParams<'static>,
        ap: AuthParams<'static>,
    ) -> (
        Result<FrameKeys, CommError>,
        Result<(u32, FrameKeys), CommError>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            accept(&mut s, &ap, 0, |r| r == 1)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let i = initiate(&mut c, &ip, 1, 0);
        (i, t.join().unwrap())
    }

    const GOOD: AuthParams<'static> = AuthParams {
        key: b"0123456789abcdef0123456789abcdef",
        job_uid: "job-a",
        generation: 4,
        world: 2,
        protection: Protection::Integrity,
    };

    #[test]
    fn same_key_job_generation_succeeds_with_mirrored_fresh_keys() {
        let (i, a) = run_pair(GOOD, GOOD);
        let (i, (from, a)) = (i.unwrap(), a.unwrap());
        assert_eq!(from, 1);
        assert_eq!((i.send, i.recv), (a.recv, a.send));
        assert_ne!(i.send, i.recv);
        // fresh nonces: another connection of the same pair gets other keys
        let (i2, _) = run_pair(GOOD, GOOD);
        assert_ne!(i2.unwrap().send, i.send);
    }

    #[test]
    fn protection_mismatch_fails_the_handshake_on_both_sides() {
        let enc = AuthParams {
            protection: Protection::Encryption,
            ..GOOD
        };
        let (i, a) = run_pair(enc, GOOD);
        assert!(
            matches!(
                i,
                Err(CommError::ProtectionMismatch {
                    ours: Protection::Encryption,
                    theirs: Protection::Integrity,
                    ..
                })
            ),
            "{i:?}"
        );
        assert!(
            matches!(
                a,
                Err(CommError::ProtectionMismatch {
                    ours: Protection::Integrity,
                    theirs: Protection::Encryption,
                    ..
                })
            ),
            "{a:?}"
        );
        let msg = i.unwrap_err().to_string();
        assert!(
            msg.contains("encryption") && msg.contains("integrity"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_key_fails_on_both_sides() {
        let bad = AuthParams {
            key: b"another key, same length, 32 b!!",
            ..GOOD
        };
        let (i, a) = run_pair(bad, GOOD);
        assert!(matches!(i, Err(CommError::AuthFailed { .. })), "{i:?}");
        assert!(matches!(a, Err(CommError::AuthFailed { .. })), "{a:?}");
    }

    #[test]
    fn wrong_job_and_stale_generation_are_typed() {
        let (i, a) = run_pair(
            AuthParams {
                job_uid: "job-b",
                ..GOOD
            },
            GOOD,
        );
        assert!(matches!(i, Err(CommError::WrongJob { .. })), "{i:?}");
        assert!(
            matches!(a, Err(CommError::WrongJob { ref theirs }) if theirs == "job-b"),
            "{a:?}"
        );
        let (i, a) = run_pair(
            AuthParams {
                generation: 3,
                ..GOOD
            },
            GOOD,
        );
        assert!(
            matches!(i, Err(CommError::StaleGeneration { ours: 3, theirs: 4 })),
            "{i:?}"
        );
        assert!(
            matches!(a, Err(CommError::StaleGeneration { ours: 4, theirs: 3 })),
            "{a:?}"
        );
    }

    #[test]
    fn counters_count_by_cause() {
        let c = RefusalCounters::default();
        c.record(&CommError::WrongJob { theirs: "x".into() });
        c.record(&CommError::Poisoned);
        assert_eq!(c.wrong_job.load(Ordering::Relaxed), 1);
        assert_eq!(c.total(), 1);
    }
}
