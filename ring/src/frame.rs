//! Wire format: length-prefixed frames with a fixed 16-byte header, and the handshake messages.
//!
//! Owns encoding and validation only, and [`ProtocolError`], what a decoder refuses; it never
//! touches a socket and imports nothing else of the crate. Decoding never panics and
//! never allocates: a header is validated (magic, version, kind, length ≤ the kind's limit)
//! before anyone reads or buffers its payload, so a malformed or oversized frame is a
//! [`ProtocolError`] and costs nothing.
//!
//! Header (all integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..2 | magic `b"DR"` |
//! | 2 | version ([`VERSION`]) |
//! | 3 | kind ([`Kind`]) |
//! | 4..8 | payload length in bytes (u32) |
//! | 8..16 | sequence number (u64; the collective's number for `Data`, 0 in the handshake) |
//!
//! Under [`Protection::Integrity`] or [`Protection::Encryption`] every `Data` frame is followed
//! by a [`TAG_LEN`]-byte tag that covers its header and payload (see `comm/transport.rs`); the
//! header's length counts the payload only.

use diphoma_contract::MAX_JOB_UID;

/// Frame magic, the first two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"DR";
/// Protocol version carried in every header.
pub const VERSION: u8 = 2;
/// Header length in bytes.
pub const HEADER_LEN: usize = 16;
/// Largest payload of a handshake frame, in bytes.
pub const MAX_HANDSHAKE_PAYLOAD: usize = 256;
/// Largest payload of one data frame, in bytes (a collective step's payload is split into
/// frames of at most this size).
pub const MAX_DATA_PAYLOAD: usize = 1 << 20;
/// Nonce length in bytes.
pub const NONCE_LEN: usize = 32;
/// HMAC-SHA256 tag length in bytes.
pub const MAC_LEN: usize = 32;
/// Length in bytes of the tag after each protected `Data` frame (an HMAC-SHA256 tag truncated
/// to 128 bits as RFC 2104 §5 allows, or an AEAD's 128-bit tag).
pub const TAG_LEN: usize = 16;

/// How the data frames of a connection are protected after the handshake; both ends must
/// agree (it is part of the handshake transcript, and a mismatch is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Protection {
    /// Plain frames: no tag (the default: gloo's and NCCL's frames carry none either; the
    /// handshake still authenticates every connection). See `docs/design/protection.md`.
    #[default]
    None = 0,
    /// Each frame carries a keyed BLAKE3 tag over its header, payload and the implicit
    /// per-direction frame counter (tampering, replay and reordering are refused).
    Integrity = 1,
    /// Each frame's payload is sealed with AES-256-GCM (header and counter authenticated as
    /// associated data, the counter as the nonce): integrity plus confidentiality.
    Encryption = 2,
}

impl Protection {
    fn from_u8(b: u8) -> Result<Protection, ProtocolError> {
        Ok(match b {
            0 => Protection::None,
            1 => Protection::Integrity,
            2 => Protection::Encryption,
            _ => return Err(ProtocolError::Malformed("protection mode")),
        })
    }

    /// The mode's name, as written in the contract (`none`, `integrity`, `encryption`).
    pub fn as_str(self) -> &'static str {
        match self {
            Protection::None => "none",
            Protection::Integrity => "integrity",
            Protection::Encryption => "encryption",
        }
    }

    /// Bytes added after each data frame's payload: 0 or [`TAG_LEN`].
    pub fn tag_len(self) -> usize {
        match self {
            Protection::None => 0,
            _ => TAG_LEN,
        }
    }
}

impl std::fmt::Display for Protection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Protection {
    type Err = String;
    /// Parses `none`, `integrity` or `encryption`.
    fn from_str(s: &str) -> Result<Protection, String> {
        [
            Protection::None,
            Protection::Integrity,
            Protection::Encryption,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not one of none, integrity, encryption"))
    }
}

/// What was wrong with a frame or a handshake message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The first bytes are not the frame magic: not a Diphoma peer, or garbage.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// Unsupported protocol version.
    #[error("unsupported version {0}")]
    BadVersion(u8),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// Declared payload larger than allowed for its kind.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    Oversized {
        /// Declared payload length.
        len: u64,
        /// Limit for that frame kind.
        max: u64,
    },
    /// The input ended inside a frame.
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A frame of another kind than the protocol step expects.
    #[error("unexpected frame kind {got:?}, expected {expected:?}")]
    Unexpected {
        /// Kind received.
        got: Kind,
        /// Kind expected.
        expected: Kind,
    },
    /// A data frame with the wrong sequence number or length.
    #[error("data frame out of step: seq {seq} len {len}, expected seq {want_seq} len {want_len}")]
    OutOfStep {
        /// Sequence received.
        seq: u64,
        /// Length received.
        len: u32,
        /// Sequence expected.
        want_seq: u64,
        /// Length expected.
        want_len: u32,
    },
    /// A handshake payload whose fields do not parse.
    #[error("malformed {0} message")]
    Malformed(&'static str),
}

/// The kind of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Initiator → acceptor: who I am and my nonce ([`Hello`]).
    Hello = 1,
    /// Acceptor → initiator: its nonce and its proof ([`Challenge`]).
    Challenge = 2,
    /// Initiator → acceptor: the initiator's proof ([`Proof`]).
    Proof = 3,
    /// Acceptor → initiator: the connection is accepted (empty payload).
    Accept = 4,
    /// Either side: the connection is refused ([`Reject`]).
    Reject = 5,
    /// A slice of a collective's payload.
    Data = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Result<Kind, ProtocolError> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Proof,
            4 => Kind::Accept,
            5 => Kind::Reject,
            6 => Kind::Data,
            other => return Err(ProtocolError::BadKind(other)),
        })
    }

    /// Largest payload allowed for this kind, in bytes.
    pub fn max_payload(self) -> usize {
        match self {
            Kind::Data => MAX_DATA_PAYLOAD,
            _ => MAX_HANDSHAKE_PAYLOAD,
        }
    }
}

/// A decoded and validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Payload length in bytes, already checked against `kind.max_payload()`.
    pub len: u32,
    /// Sequence number.
    pub seq: u64,
}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..2].copy_from_slice(&MAGIC);
        h[2] = VERSION;
        h[3] = self.kind as u8;
        h[4..8].copy_from_slice(&self.len.to_le_bytes());
        h[8..16].copy_from_slice(&self.seq.to_le_bytes());
        h
    }

    /// Decodes and validates a header.
    ///
    /// # Errors
    /// [`ProtocolError::BadMagic`], `BadVersion`, `BadKind`, or `Oversized` when the declared
    /// length exceeds the kind's limit.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Header, ProtocolError> {
        if h[0..2] != MAGIC {
            return Err(ProtocolError::BadMagic([h[0], h[1]]));
        }
        if h[2] != VERSION {
            return Err(ProtocolError::BadVersion(h[2]));
        }
        let kind = Kind::from_u8(h[3])?;
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if len as usize > kind.max_payload() {
            return Err(ProtocolError::Oversized {
                len: len as u64,
                max: kind.max_payload() as u64,
            });
        }
        let seq = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        Ok(Header { kind, len, seq })
    }
}

/// Decodes one whole frame from the front of `bytes`: its header, its payload (borrowed) and the
/// number of bytes consumed. Used for handshake frames and by the fuzzer.
///
/// # Errors
/// Any header error, or [`ProtocolError::Truncated`] when `bytes` ends inside the frame.
pub fn decode_frame(bytes: &[u8]) -> Result<(Header, &[u8], usize), ProtocolError> {
    let Some(h) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(ProtocolError::Truncated {
            need: HEADER_LEN,
            have: bytes.len(),
        });
    };
    let header = Header::decode(h)?;
    let end = HEADER_LEN + header.len as usize;
    if bytes.len() < end {
        return Err(ProtocolError::Truncated {
            need: end,
            have: bytes.len(),
        });
    }
    Ok((header, &bytes[HEADER_LEN..end], end))
}

/// A small, fixed-capacity frame being built (handshake frames only; no heap).
pub struct SmallFrame {
    buf: [u8; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD],
    len: usize,
}

impl SmallFrame {
    fn new(kind: Kind) -> SmallFrame {
        let mut f = SmallFrame {
            buf: [0; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD],
            len: HEADER_LEN,
        };
        f.buf[..HEADER_LEN].copy_from_slice(
            &Header {
                kind,
                len: 0,
                seq: 0,
            }
            .encode(),
        );
        f
    }
    fn put(&mut self, b: &[u8]) {
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
    fn finish(mut self) -> SmallFrame {
        let plen = (self.len - HEADER_LEN) as u32;
        self.buf[4..8].copy_from_slice(&plen.to_le_bytes());
        self
    }
    /// The encoded frame (header and payload).
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Reads fixed-size fields off a payload, failing with `Malformed(what)` instead of panicking.
struct Reader<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.b.len() < n {
            return Err(ProtocolError::Malformed(self.what));
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn end(self) -> Result<(), ProtocolError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::Malformed(self.what))
        }
    }
}

/// Initiator → acceptor, first message of the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The initiator's job UID (at most [`MAX_JOB_UID`] bytes of UTF-8).
    pub job_uid: &'a str,
    /// The initiator's ring generation.
    pub generation: u64,
    /// The initiator's world size.
    pub world: u32,
    /// The initiator's rank.
    pub from: u32,
    /// The rank the initiator wants to reach.
    pub to: u32,
    /// The initiator's data-frame protection.
    pub protection: Protection,
    /// The initiator's fresh nonce.
    pub nonce: [u8; NONCE_LEN],
}

impl<'a> Hello<'a> {
    /// Encodes the message as a frame. The job UID must be at most [`MAX_JOB_UID`] bytes
    /// (checked by the communicator's config validation); longer ones are truncated here.
    pub fn encode(&self) -> SmallFrame {
        let uid = &self.job_uid.as_bytes()[..self.job_uid.len().min(MAX_JOB_UID)];
        let mut f = SmallFrame::new(Kind::Hello);
        f.put(&[uid.len() as u8]);
        f.put(uid);
        f.put(&self.generation.to_le_bytes());
        f.put(&self.world.to_le_bytes());
        f.put(&self.from.to_le_bytes());
        f.put(&self.to.to_le_bytes());
        f.put(&[self.protection as u8]);
        f.put(&self.nonce);
        f.finish()
    }

    /// Parses a `Hello` payload.
    ///
    /// # Errors
    /// [`ProtocolError::Malformed`] on a short, long or non-UTF-8 payload.
    pub fn decode(p: &'a [u8]) -> Result<Hello<'a>, ProtocolError> {
        let mut r = Reader {
            b: p,
            what: "hello",
        };
        let n = r.array::<1>()?[0] as usize;
        if n > MAX_JOB_UID {
            return Err(ProtocolError::Malformed("hello"));
        }
        let job_uid =
            std::str::from_utf8(r.take(n)?).map_err(|_| ProtocolError::Malformed("hello"))?;
        let generation = r.u64()?;
        let world = r.u32()?;
        let from = r.u32()?;
        let to = r.u32()?;
        let protection = Protection::from_u8(r.array::<1>()?[0])?;
        let nonce = r.array()?;
        r.end()?;
        Ok(Hello {
            job_uid,
            generation,
            world,
            from,
            to,
            protection,
            nonce,
        })
    }
}

/// Acceptor → initiator: the acceptor's nonce and its proof of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The acceptor's fresh nonce.
    pub nonce: [u8; NONCE_LEN],
    /// HMAC-SHA256 tag of the transcript with role `A`.
    pub mac: [u8; MAC_LEN],
}

impl Challenge {
    /// Encodes the message as a frame.
    pub fn encode(&self) -> SmallFrame {
        let mut f = SmallFrame::new(Kind::Challenge);
        f.put(&self.nonce);
        f.put(&self.mac);
        f.finish()
    }
    /// Parses a `Challenge` payload.
    ///
    /// # Errors
    /// [`ProtocolError::Malformed`] unless the payload is exactly 64 bytes.
    pub fn decode(p: &[u8]) -> Result<Challenge, ProtocolError> {
        let mut r = Reader {
            b: p,
            what: "challenge",
        };
        let c = Challenge {
            nonce: r.array()?,
            mac: r.array()?,
        };
        r.end()?;
        Ok(c)
    }
}

/// Initiator → acceptor: the initiator's proof of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    /// HMAC-SHA256 tag of the transcript with role `I`.
    pub mac: [u8; MAC_LEN],
}

impl Proof {
    /// Encodes the message as a frame.
    pub fn encode(&self) -> SmallFrame {
        let mut f = SmallFrame::new(Kind::Proof);
        f.put(&self.mac);
        f.finish()
    }
    /// Parses a `Proof` payload.
    ///
    /// # Errors
    /// [`ProtocolError::Malformed`] unless the payload is exactly 32 bytes.
    pub fn decode(p: &[u8]) -> Result<Proof, ProtocolError> {
        let mut r = Reader {
            b: p,
            what: "proof",
        };
        let m = Proof { mac: r.array()? };
        r.end()?;
        Ok(m)
    }
}

/// Why a connection was refused (carried in a `Reject` frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    /// A proof did not verify.
    Auth = 1,
    /// Different job UID.
    WrongJob = 2,
    /// Different generation.
    Generation = 3,
    /// Ranks or world size do not fit the ring, or a malformed message.
    Protocol = 4,
    /// Different data-frame protection.
    Protection = 5,
}

/// Either side: the connection is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Why.
    pub reason: RejectReason,
    /// The refusing side's generation.
    pub generation: u64,
    /// The refusing side's data-frame protection.
    pub protection: Protection,
}

impl Reject {
    /// Encodes the message as a frame.
    pub fn encode(&self) -> SmallFrame {
        let mut f = SmallFrame::new(Kind::Reject);
        f.put(&[self.reason as u8]);
        f.put(&self.generation.to_le_bytes());
        f.put(&[self.protection as u8]);
        f.finish()
    }
    /// Parses a `Reject` payload.
    ///
    /// # Errors
    /// [`ProtocolError::Malformed`] on a bad length or an unknown reason.
    pub fn decode(p: &[u8]) -> Result<Reject, ProtocolError> {
        let mut r = Reader {
            b: p,
            what: "reject",
        };
        let reason = match r.array::<1>()?[0] {
            1 => RejectReason::Auth,
            2 => RejectReason::WrongJob,
            3 => RejectReason::Generation,
            4 => RejectReason::Protocol,
            5 => RejectReason::Protection,
            _ => return Err(ProtocolError::Malformed("reject")),
        };
        let generation = r.u64()?;
        let protection = Protection::from_u8(r.array::<1>()?[0])?;
        r.end()?;
        Ok(Reject {
            reason,
            generation,
            protection,
        })
    }
}

/// An empty `Accept` frame.
pub fn accept_frame() -> SmallFrame {
    SmallFrame::new(Kind::Accept).finish()
}

/// Decodes any frame and, for handshake kinds, its message: the whole decoder surface an
/// attacker can reach. Returns the bytes consumed. Used by the fuzz target and the tests.
///
/// # Errors
/// Any [`ProtocolError`].
pub fn decode_any(bytes: &[u8]) -> Result<usize, ProtocolError> {
    let (h, payload, used) = decode_frame(bytes)?;
    match h.kind {
        Kind::Hello => {
            Hello::decode(payload)?;
        }
        Kind::Challenge => {
            Challenge::decode(payload)?;
        }
        Kind::Proof => {
            Proof::decode(payload)?;
        }
        Kind::Reject => {
            Reject::decode(payload)?;
        }
        Kind::Accept if !payload.is_empty() => return Err(ProtocolError::Malformed("accept")),
        Kind::Accept | Kind::Data => {}
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_roundtrip() {
        let h = Header {
            kind: Kind::Data,
            len: 12345,
            seq: 987654321,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn oversized_and_garbage_are_refused() {
        let mut h = Header {
            kind: Kind::Hello,
            len: 0,
            seq: 0,
        }
        .encode();
        h[4..8].copy_from_slice(&(MAX_HANDSHAKE_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(
            Header::decode(&h),
            Err(ProtocolError::Oversized { .. })
        ));
        let mut d = Header {
            kind: Kind::Data,
            len: 0,
            seq: 0,
        }
        .encode();
        d[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Header::decode(&d),
            Err(ProtocolError::Oversized { .. })
        ));
        assert!(matches!(
            Header::decode(b"GET / HTTP/1.1\r\n"),
            Err(ProtocolError::BadMagic(_))
        ));
        let mut k = h;
        k[3] = 99;
        assert!(matches!(
            Header::decode(&k),
            Err(ProtocolError::BadKind(99))
        ));
        let mut v = h;
        v[2] = 7;
        assert!(matches!(
            Header::decode(&v),
            Err(ProtocolError::BadVersion(7))
        ));
    }

    #[test]
    fn messages_roundtrip() {
        let hello = Hello {
            job_uid: "uid-1",
            generation: 7,
            world: 4,
            from: 3,
            to: 2,
            protection: Protection::Encryption,
            nonce: [9; 32],
        };
        let f = hello.encode();
        let (h, p, used) = decode_frame(f.as_bytes()).unwrap();
        assert_eq!((h.kind, used), (Kind::Hello, f.as_bytes().len()));
        assert_eq!(Hello::decode(p).unwrap(), hello);
        let c = Challenge {
            nonce: [1; 32],
            mac: [2; 32],
        };
        let f = c.encode();
        assert_eq!(
            Challenge::decode(decode_frame(f.as_bytes()).unwrap().1).unwrap(),
            c
        );
        let r = Reject {
            reason: RejectReason::Generation,
            generation: 5,
            protection: Protection::Integrity,
        };
        let f = r.encode();
        assert_eq!(
            Reject::decode(decode_frame(f.as_bytes()).unwrap().1).unwrap(),
            r
        );
        // every truncation of a valid frame is an error, never a panic
        let f = hello.encode();
        for cut in 0..f.as_bytes().len() {
            assert!(decode_any(&f.as_bytes()[..cut]).is_err(), "cut {cut}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        /// The fuzz target's body as a property: arbitrary bytes never panic, and whatever is
        /// accepted was a whole frame within the limits.
        #[test]
        fn decoder_survives_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(used) = decode_any(&bytes) {
                prop_assert!(used >= HEADER_LEN && used <= bytes.len());
            }
        }

        /// Arbitrary bytes behind a valid header (the likelier attack: a well-formed prefix).
        #[test]
        fn decoder_survives_valid_headers(kind in 1u8..=6, body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut b = Header { kind: Kind::from_u8(kind).unwrap(), len: body.len() as u32, seq: 0 }.encode().to_vec();
            b.extend_from_slice(&body);
            let _ = decode_any(&b);
        }
    }
}
