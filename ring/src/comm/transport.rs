//! The transport of one collective step: non-blocking `writev`/`readv` on the step's two
//! sockets, spinning briefly and then sleeping in `poll(2)` until a socket is ready or the
//! deadline passes.
//!
//! Owns framing a step's payload into data frames, checking each received header against the
//! step (kind, sequence, length), driving each frame's [`Seal`] (the tag after each frame: fed
//! incrementally as bytes arrive under integrity, through the stage buffer under encryption),
//! reducing or copying received data through the scratch segment, and the socket options of
//! data connections. It must not choose schedules or block past the collective's deadline.
//!
//! Under integrity, received bytes land (and a segment may be reduced) before the frame's tag
//! is checked at its end; a step completes only when every frame verified, so unverified data
//! never leaves this rank and a failed collective's buffer is unspecified anyway.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;

use super::{overlaps, timeout_err};
use crate::error::CommError;
use crate::frame::{
    HEADER_LEN, Header, Kind, MAX_DATA_PAYLOAD, Protection, ProtocolError, TAG_LEN,
};
use crate::reduce::{self, Element, ReduceOp};
use crate::schedule::{Action, Step};
use crate::seal::{FrameMac, Seal};

/// Requests `bytes` of send and receive buffer on `s` (`SO_SNDBUF`/`SO_RCVBUF`). Best effort: a
/// refused request leaves the kernel's default, which only costs speed.
pub(super) fn set_buffers(s: &TcpStream, bytes: usize) {
    let v = bytes.min(i32::MAX as usize);
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(s, v);
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(s, v);
}

/// Sleeps in `poll(2)` until `out` is writable, `inp` readable (either may be absent), or
/// `timeout` (rounded to whole milliseconds, 1 ms to 1 s) passes. An interrupted sleep returns
/// `Ok` early: callers loop and check their deadline.
///
/// # Errors
/// The OS error of `poll`.
pub(super) fn wait_ready(
    out: Option<BorrowedFd<'_>>,
    inp: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> std::io::Result<()> {
    let ms = timeout.as_millis().clamp(1, 1000) as i64;
    let ts = Timespec {
        tv_sec: ms / 1000,
        tv_nsec: (ms % 1000) * 1_000_000,
    };
    let w = out.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::OUT));
    let r = inp.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN));
    let rc = match (w, r) {
        (Some(w), Some(r)) => poll(&mut [w, r], Some(&ts)),
        (Some(f), None) | (None, Some(f)) => poll(&mut [f], Some(&ts)),
        (None, None) => return Ok(()),
    };
    match rc {
        Ok(_) | Err(Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn reduce_scratch(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 → u8 view of the same memory; any byte pattern is a valid u64.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

/// The reduction of one dtype, on byte slices whose offsets are multiples of the element size
/// (and whose base is element-aligned: user buffers and the u64-backed scratch).
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    pub(super) esize: usize,
    reduce: fn(&mut [u8], &[u8], Option<f32>),
}

impl Kernel {
    /// The kernel of `op` on `T`: the sum kernel (scaled at the last reduction for an average),
    /// or the maximum or minimum.
    pub(super) fn of<T: Element>(op: ReduceOp) -> Kernel {
        /// Views the byte slices as `T`s.
        fn typed<'a, T: Element>(d: &'a mut [u8], s: &'a [u8]) -> (&'a mut [T], &'a [T]) {
            let n = d.len() / std::mem::size_of::<T>();
            debug_assert_eq!(d.as_ptr() as usize % std::mem::align_of::<T>(), 0);
            debug_assert_eq!(s.as_ptr() as usize % std::mem::align_of::<T>(), 0);
            // SAFETY: both slices are element-aligned (see `Kernel`), hold n whole elements,
            // do not overlap (scratch vs user buffer), and every bit pattern is a valid T.
            unsafe {
                (
                    std::slice::from_raw_parts_mut(d.as_mut_ptr().cast::<T>(), n),
                    std::slice::from_raw_parts(s.as_ptr().cast::<T>(), n),
                )
            }
        }
        fn sum<T: Element>(d: &mut [u8], s: &[u8], k: Option<f32>) {
            let (d, s) = typed::<T>(d, s);
            T::reduce(d, s, k);
        }
        fn max<T: Element>(d: &mut [u8], s: &[u8], _: Option<f32>) {
            let (d, s) = typed::<T>(d, s);
            reduce::extreme(d, s, true);
        }
        fn min<T: Element>(d: &mut [u8], s: &[u8], _: Option<f32>) {
            let (d, s) = typed::<T>(d, s);
            reduce::extreme(d, s, false);
        }
        Kernel {
            esize: std::mem::size_of::<T>(),
            reduce: match op {
                ReduceOp::Sum | ReduceOp::Avg => sum::<T>,
                ReduceOp::Max => max::<T>,
                ReduceOp::Min => min::<T>,
            },
        }
    }
    pub(super) fn bytes() -> Kernel {
        fn never(_: &mut [u8], _: &[u8], _: Option<f32>) {
            unreachable!("byte plans only copy")
        }
        Kernel {
            esize: 1,
            reduce: never,
        }
    }
}

/// One step of one collective in flight: the connections, the scratch segment, the bounds.
pub(super) struct StepCtx<'a> {
    pub(super) links: &'a [Option<TcpStream>],
    pub(super) tx_seals: &'a mut [Seal],
    pub(super) rx_seals: &'a mut [Seal],
    /// Ciphertext of one frame each way under encryption (2 × `MAX_DATA_PAYLOAD`), else empty.
    pub(super) stage: &'a mut [u8],
    pub(super) scratch: &'a mut [u8],
    pub(super) segment: usize,
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) start: Instant,
    /// When the wait ends (pushed back a window each time the silent peer proves alive).
    pub(super) deadline: &'a mut Instant,
    pub(super) liveness: Option<&'a super::Liveness>,
    pub(super) spin: Duration,
    pub(super) yield_spin: bool,
    pub(super) kern: Kernel,
    pub(super) scale: Option<f32>,
}

fn link_err(e: std::io::Error, peer: usize, op: &'static str) -> CommError {
    use std::io::ErrorKind::*;
    match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof | NotConnected => {
            CommError::PeerLost { rank: peer, op }
        }
        _ => CommError::Io { op, source: e },
    }
}

/// Sending half of a step: `data` in frames of at most `MAX_DATA_PAYLOAD` bytes, each written
/// as header ‖ payload ‖ tag (no tag without protection; the payload from `stage` under
/// encryption). Under integrity the tag is fed with the payload bytes as they are written (so
/// hashing overlaps the transfer instead of delaying the frame), and written once complete.
struct Tx<'a> {
    s: &'a TcpStream,
    peer: usize,
    data: *const u8,
    len: usize,
    /// Start of the current frame's payload in `data`, and its length.
    pos: usize,
    flen: usize,
    /// Bytes of the current frame (header, payload, tag) written so far.
    off: usize,
    hdr: [u8; HEADER_LEN],
    tag: [u8; TAG_LEN],
    seal: &'a mut Seal,
    /// The current frame's tag in progress (integrity), until its payload is all written.
    mac: Option<FrameMac>,
    stage: &'a mut [u8],
    started: bool,
    done: bool,
}

impl Tx<'_> {
    fn frame_bytes(&self) -> usize {
        HEADER_LEN + self.flen + self.seal.mode().tag_len()
    }

    fn progress(&mut self, seq: u64, op: &'static str) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        if !self.started || self.off == self.frame_bytes() {
            self.pos += self.flen;
            self.flen = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
            self.hdr = Header {
                kind: Kind::Data,
                len: self.flen as u32,
                seq,
            }
            .encode();
            // SAFETY: data..data+len is the step's send range of the caller's buffer, alive and
            // not written during the step (writes go to disjoint ranges or to scratch).
            let payload = unsafe { std::slice::from_raw_parts(self.data.add(self.pos), self.flen) };
            match self.seal.mode() {
                Protection::Integrity => self.mac = Some(self.seal.begin(&self.hdr)),
                _ => self.tag = self.seal.seal(&self.hdr, payload, self.stage),
            }
            self.off = 0;
            self.started = true;
        }
        let payload = if self.seal.mode() == Protection::Encryption {
            &self.stage[..self.flen]
        } else {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(self.data.add(self.pos), self.flen) }
        };
        let tl = self.seal.mode().tag_len();
        let (h, p) = (
            self.off.min(HEADER_LEN),
            (self.off.max(HEADER_LEN) - HEADER_LEN).min(self.flen),
        );
        let t = (self.off.max(HEADER_LEN + self.flen) - HEADER_LEN - self.flen).min(tl);
        // the tag only once computed (under integrity: when the payload is all written)
        let t_end = if self.mac.is_some() { t } else { tl };
        let bufs = [
            IoSlice::new(&self.hdr[h..]),
            IoSlice::new(&payload[p..]),
            IoSlice::new(&self.tag[t..t_end]),
        ];
        match (&mut &*self.s).write_vectored(&bufs) {
            Ok(0) => Err(CommError::PeerLost {
                rank: self.peer,
                op,
            }),
            Ok(n) => {
                self.off += n;
                let p_end = (self.off.max(HEADER_LEN) - HEADER_LEN).min(self.flen);
                if let Some(m) = self.mac.as_mut() {
                    m.update(&payload[p..p_end]);
                    if p_end == self.flen {
                        self.tag = m.tag();
                        self.mac = None;
                    }
                }
                if self.off == self.frame_bytes() && self.pos + self.flen == self.len {
                    self.done = true;
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(link_err(e, self.peer, op)),
        }
    }
}

/// Where received payload goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// Straight into the user's buffer (copy, no overlap with the send).
    Direct,
    /// Through the scratch segment, reduced when each segment fills.
    Segmented,
    /// All into scratch, applied after the step's send completes (exchange steps).
    Deferred,
}

/// Receiving half of a step: per frame, a header, its payload, then its tag (when protected).
struct Rx<'a> {
    s: &'a TcpStream,
    peer: usize,
    dst: *mut u8,
    len: usize,
    /// Payload bytes delivered to their destination.
    pos: usize,
    /// The current frame's payload length, and how much of it is still to be read.
    flen: usize,
    frame_left: usize,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    tag: [u8; TAG_LEN],
    tag_off: usize,
    seal: &'a mut Seal,
    /// The current frame's tag in progress (integrity).
    mac: Option<FrameMac>,
    /// The current frame's ciphertext (encryption), else empty.
    stage: &'a mut [u8],
    sink: Sink,
    seg_start: usize,
    action: Action,
    done: bool,
}

impl Rx<'_> {
    /// Where the next payload bytes go, at most `max` of them: the user's buffer or scratch.
    fn target<'s>(&self, scratch: &'s mut [u8], segment: usize, max: usize) -> &'s mut [u8] {
        match self.sink {
            // SAFETY: dst..dst+len is the step's receive range of the caller's buffer, not
            // read by the send half (Direct is used only without overlap).
            Sink::Direct => unsafe { std::slice::from_raw_parts_mut(self.dst.add(self.pos), max) },
            Sink::Segmented => {
                let seg_len = segment.min(self.len - self.seg_start);
                let room = (self.seg_start + seg_len - self.pos).min(max);
                let off = self.pos - self.seg_start;
                &mut scratch[off..off + room]
            }
            Sink::Deferred => &mut scratch[self.pos..self.pos + max],
        }
    }

    /// Accounts `n` payload bytes written by `target`, reducing a segment once it is full.
    fn advance(&mut self, c: &mut StepCtx<'_>, n: usize) {
        self.pos += n;
        if n > 0 && self.sink == Sink::Segmented {
            let seg_len = c.segment.min(self.len - self.seg_start);
            if self.pos == self.seg_start + seg_len {
                // SAFETY: as for Direct; the segment lies inside the receive range.
                let d = unsafe {
                    std::slice::from_raw_parts_mut(self.dst.add(self.seg_start), seg_len)
                };
                self.apply(c, d, 0, seg_len);
                self.seg_start = self.pos;
            }
        }
    }

    /// Checks a complete header against the step and starts its frame.
    fn start_frame(&mut self, c: &StepCtx<'_>, want: usize) -> Result<(), CommError> {
        let h = Header::decode(&self.hdr)?;
        if h.kind != Kind::Data {
            return Err(ProtocolError::Unexpected {
                got: h.kind,
                expected: Kind::Data,
            }
            .into());
        }
        if h.seq != c.seq || h.len as usize != want {
            return Err(ProtocolError::OutOfStep {
                seq: h.seq,
                len: h.len,
                want_seq: c.seq,
                want_len: want as u32,
            }
            .into());
        }
        (self.flen, self.frame_left, self.tag_off) = (want, want, 0);
        self.mac = (self.seal.mode() == Protection::Integrity).then(|| self.seal.begin(&self.hdr));
        Ok(())
    }

    /// Ends a frame whose payload and tag are all read: checks the tag (under encryption,
    /// decrypts and delivers the payload), then expects the next header or is done.
    fn finish_frame(&mut self, c: &mut StepCtx<'_>) -> Result<(), CommError> {
        let refused = || CommError::IntegrityFailed {
            rank: self.peer,
            op: c.op,
        };
        match self.seal.mode() {
            Protection::None => {}
            Protection::Integrity => {
                if !self.mac.take().is_some_and(|m| m.verify(&self.tag)) {
                    return Err(refused());
                }
            }
            Protection::Encryption => {
                let (hdr, tag, flen) = (self.hdr, self.tag, self.flen);
                if !self.seal.open(&hdr, &mut self.stage[..flen], &tag) {
                    return Err(refused());
                }
                let mut off = 0;
                while off < flen {
                    let t = self.target(c.scratch, c.segment, flen - off);
                    let n = t.len();
                    t.copy_from_slice(&self.stage[off..off + n]);
                    self.advance(c, n);
                    off += n;
                }
            }
        }
        if self.pos == self.len {
            self.done = true;
        } else {
            self.hdr_off = 0;
        }
        Ok(())
    }

    fn progress(&mut self, c: &mut StepCtx<'_>) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        let tl = self.seal.mode().tag_len();
        let in_header = self.hdr_off < HEADER_LEN;
        if !in_header && self.frame_left == 0 {
            // the tag
            let r = (&mut &*self.s).read(&mut self.tag[self.tag_off..tl]);
            let Some(n) = self.read_result(r, c.op)? else {
                return Ok(false);
            };
            self.tag_off += n;
            if self.tag_off == tl {
                self.finish_frame(c)?;
            }
            return Ok(true);
        }
        // While a header is incomplete, read it together with the payload that should follow
        // (one readv instead of two reads: the header's length is checked before any of those
        // payload bytes are accounted, and they land only where the expected frame may go).
        let want = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
        let frame_left = if in_header { want } else { self.frame_left };
        let encrypted = self.seal.mode() == Protection::Encryption;
        let stage = std::mem::take(&mut self.stage);
        let dst: &mut [u8] = if encrypted {
            let got = if in_header { 0 } else { self.flen - frame_left };
            &mut stage[got..got + frame_left]
        } else {
            self.target(c.scratch, c.segment, frame_left)
        };
        let r = if in_header {
            let mut bufs = [
                IoSliceMut::new(&mut self.hdr[self.hdr_off..]),
                IoSliceMut::new(dst),
            ];
            (&mut &*self.s).read_vectored(&mut bufs)
        } else {
            (&mut &*self.s).read(dst)
        };
        let n = self.read_result(r, c.op);
        let n = match n {
            Ok(Some(n)) => n,
            other => {
                self.stage = stage;
                return other.map(|_| false);
            }
        };
        let mut payload = n;
        if in_header {
            let h = n.min(HEADER_LEN - self.hdr_off);
            self.hdr_off += h;
            payload -= h;
            if self.hdr_off < HEADER_LEN {
                self.stage = stage;
                return Ok(true);
            }
            if let Err(e) = self.start_frame(c, want) {
                self.stage = stage;
                return Err(e);
            }
        }
        if let Some(mut m) = self.mac.take() {
            // the bytes `read` just wrote: `target` names the same place until `advance`
            m.update(self.target(c.scratch, c.segment, payload));
            self.mac = Some(m);
        }
        self.stage = stage;
        self.frame_left -= payload;
        if !encrypted {
            self.advance(c, payload);
        }
        if self.frame_left == 0 && tl == 0 {
            self.finish_frame(c)?;
        }
        Ok(true)
    }

    /// The outcome of a read: `Some(n)` bytes, `None` when the socket has nothing now.
    fn read_result(
        &self,
        r: std::io::Result<usize>,
        op: &'static str,
    ) -> Result<Option<usize>, CommError> {
        match r {
            Ok(0) => Err(CommError::PeerLost {
                rank: self.peer,
                op,
            }),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(Some(0)),
            Err(e) => Err(link_err(e, self.peer, op)),
        }
    }

    /// Applies the action to `d` from `scratch[from..from+len]`.
    fn apply(&self, c: &mut StepCtx<'_>, d: &mut [u8], from: usize, len: usize) {
        let src = &c.scratch[from..from + len];
        match self.action {
            Action::Copy => d.copy_from_slice(src),
            Action::Reduce { finalize } => {
                (c.kern.reduce)(d, src, if finalize { c.scale } else { None })
            }
        }
    }
}

fn link(links: &[Option<TcpStream>], peer: usize) -> Result<&TcpStream, CommError> {
    links[peer]
        .as_ref()
        .ok_or_else(|| CommError::Config(format!("no connection to rank {peer}")))
}

impl StepCtx<'_> {
    pub(super) fn run(mut self, buf: &mut [u8], step: &Step) -> Result<(), CommError> {
        let e = self.kern.esize;
        let base = buf.as_mut_ptr();
        let deferred = overlaps(step);
        let links = self.links;
        let (tx_seals, rx_seals) = (
            std::mem::take(&mut self.tx_seals),
            std::mem::take(&mut self.rx_seals),
        );
        let stage = std::mem::take(&mut self.stage);
        let (tx_stage, rx_stage) = stage.split_at_mut(stage.len() / 2);
        let mut tx = match &step.send {
            Some(t) => Some(Tx {
                s: link(links, t.peer)?,
                peer: t.peer,
                // SAFETY: the range lies inside `buf` (plans only produce ranges within len).
                data: unsafe { base.add(t.range.start * e) },
                len: t.range.len() * e,
                pos: 0,
                flen: 0,
                off: 0,
                hdr: [0; HEADER_LEN],
                tag: [0; TAG_LEN],
                seal: &mut tx_seals[t.peer],
                mac: None,
                stage: tx_stage,
                started: false,
                done: false,
            }),
            None => None,
        };
        let mut rx = match &step.recv {
            Some((t, action)) => Some(Rx {
                s: link(links, t.peer)?,
                peer: t.peer,
                // SAFETY: as above.
                dst: unsafe { base.add(t.range.start * e) },
                len: t.range.len() * e,
                pos: 0,
                flen: 0,
                frame_left: 0,
                hdr: [0; HEADER_LEN],
                hdr_off: 0,
                tag: [0; TAG_LEN],
                tag_off: 0,
                seal: &mut rx_seals[t.peer],
                mac: None,
                stage: rx_stage,
                sink: match (deferred, action) {
                    (true, _) => Sink::Deferred,
                    (false, Action::Copy) => Sink::Direct,
                    (false, Action::Reduce { .. }) => Sink::Segmented,
                },
                seg_start: 0,
                action: *action,
                done: false,
            }),
            None => None,
        };
        debug_assert!(
            step.send
                .as_ref()
                .is_none_or(|t| t.range.end * e <= buf.len())
        );
        debug_assert!(
            step.recv
                .as_ref()
                .is_none_or(|(t, _)| t.range.end * e <= buf.len())
        );
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut progress = false;
            if let Some(tx) = tx.as_mut() {
                progress |= tx.progress(self.seq, self.op)?;
            }
            if let Some(rx) = rx.as_mut() {
                progress |= rx.progress(&mut self)?;
            }
            let tx_done = tx.as_ref().is_none_or(|t| t.done);
            let rx_done = rx.as_ref().is_none_or(|r| r.done);
            if tx_done && rx_done {
                break;
            }
            if progress {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now >= *self.deadline {
                // Blame the peer we wait on: the one whose data is missing, else the one that
                // does not read what we send; unless its process answers (slow, not hung).
                let silent = rx
                    .as_ref()
                    .filter(|r| !r.done)
                    .map(|r| r.peer)
                    .or(tx.as_ref().filter(|t| !t.done).map(|t| t.peer));
                if let (Some(p), Some(l)) = (silent, self.liveness)
                    && l.alive(p)
                {
                    *self.deadline = Instant::now() + l.window;
                    continue;
                }
                return Err(timeout_err(self.op, self.start, silent));
            }
            match idle_since {
                None => {
                    idle_since = Some(now);
                    continue;
                }
                Some(t) if now - t < self.spin => {
                    if self.yield_spin {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                _ => {}
            }
            let out = tx.as_ref().filter(|t| !t.done).map(|t| t.s.as_fd());
            let inp = rx.as_ref().filter(|r| !r.done).map(|r| r.s.as_fd());
            let left = self.deadline.saturating_duration_since(now);
            wait_ready(out, inp, left).map_err(|source| CommError::Io {
                op: self.op,
                source,
            })?;
        }
        if let Some(rx) = rx.as_ref().filter(|r| r.sink == Sink::Deferred) {
            // SAFETY: the send half is done; the receive range is ours to write.
            let d = unsafe { std::slice::from_raw_parts_mut(rx.dst, rx.len) };
            rx.apply(&mut self, d, 0, rx.len);
        }
        Ok(())
    }
}
