//! The transport of one collective step: non-blocking `writev`/`readv` on the step's two
//! sockets, spinning briefly and then sleeping in `poll(2)` until a socket is ready or the
//! deadline passes.
//!
//! Owns framing a step's payload into data frames, checking each received header against the
//! step (kind, sequence, length), reducing or copying received data through the scratch segment,
//! and the socket options of data connections. It must not choose schedules or block past the
//! collective's deadline.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;

use super::{overlaps, timeout_err};
use crate::error::CommError;
use crate::frame::{HEADER_LEN, Header, Kind, MAX_DATA_PAYLOAD, ProtocolError};
use crate::reduce::{self, Element, ReduceOp};
use crate::schedule::{Action, Step};

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

/// Sending half of a step: `data` in frames of at most `MAX_DATA_PAYLOAD` bytes.
struct Tx<'a> {
    s: &'a TcpStream,
    peer: usize,
    data: *const u8,
    len: usize,
    pos: usize,
    frame_end: usize,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    started: bool,
    done: bool,
}

impl Tx<'_> {
    fn progress(&mut self, seq: u64, op: &'static str) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        if self.hdr_off == HEADER_LEN && self.pos == self.frame_end {
            let flen = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
            self.hdr = Header {
                kind: Kind::Data,
                len: flen as u32,
                seq,
            }
            .encode();
            self.hdr_off = 0;
            self.frame_end = self.pos + flen;
            self.started = true;
        }
        // SAFETY: data..data+len is the step's send range of the caller's buffer, alive and not
        // written during the step (writes go to disjoint ranges or to scratch).
        let data = unsafe {
            std::slice::from_raw_parts(self.data.add(self.pos), self.frame_end - self.pos)
        };
        let r = if self.hdr_off < HEADER_LEN {
            let bufs = [IoSlice::new(&self.hdr[self.hdr_off..]), IoSlice::new(data)];
            (&mut &*self.s).write_vectored(&bufs)
        } else {
            (&mut &*self.s).write(data)
        };
        match r {
            Ok(0) => Err(CommError::PeerLost {
                rank: self.peer,
                op,
            }),
            Ok(mut n) => {
                let h = n.min(HEADER_LEN - self.hdr_off);
                self.hdr_off += h;
                n -= h;
                self.pos += n;
                if self.hdr_off == HEADER_LEN && self.pos == self.len && self.started {
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

/// Receiving half of a step.
struct Rx<'a> {
    s: &'a TcpStream,
    peer: usize,
    dst: *mut u8,
    len: usize,
    pos: usize,
    frame_left: usize,
    hdr: [u8; HEADER_LEN],
    hdr_off: usize,
    sink: Sink,
    seg_start: usize,
    action: Action,
    done: bool,
}

impl Rx<'_> {
    fn progress(&mut self, c: &mut StepCtx<'_>) -> Result<bool, CommError> {
        if self.done {
            return Ok(false);
        }
        // While a header is incomplete, read it together with the payload that should follow
        // (one readv instead of two reads: the header's length is checked before any of those
        // payload bytes are accounted, and they land only where the expected frame may go).
        let in_header = self.hdr_off < HEADER_LEN;
        let want = (self.len - self.pos).min(MAX_DATA_PAYLOAD);
        let frame_left = if in_header { want } else { self.frame_left };
        let room = match self.sink {
            Sink::Direct | Sink::Deferred => frame_left,
            Sink::Segmented => {
                let seg_len = c.segment.min(self.len - self.seg_start);
                (self.seg_start + seg_len - self.pos).min(frame_left)
            }
        };
        let dst: &mut [u8] = match self.sink {
            // SAFETY: dst..dst+len is the step's receive range of the caller's buffer, not
            // read by the send half (Direct is used only without overlap).
            Sink::Direct => unsafe { std::slice::from_raw_parts_mut(self.dst.add(self.pos), room) },
            Sink::Segmented => {
                let off = self.pos - self.seg_start;
                &mut c.scratch[off..off + room]
            }
            Sink::Deferred => &mut c.scratch[self.pos..self.pos + room],
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
        let mut n = match r {
            Ok(0) => {
                return Err(CommError::PeerLost {
                    rank: self.peer,
                    op: c.op,
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(true),
            Err(e) => return Err(link_err(e, self.peer, c.op)),
        };
        if in_header {
            let h = n.min(HEADER_LEN - self.hdr_off);
            self.hdr_off += h;
            n -= h;
            if self.hdr_off < HEADER_LEN {
                return Ok(true);
            }
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
            self.frame_left = want;
            if want == 0 {
                self.done = true;
                return Ok(true);
            }
        }
        self.pos += n;
        self.frame_left -= n;
        if self.sink == Sink::Segmented {
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
        if self.frame_left == 0 {
            if self.pos == self.len {
                self.done = true;
            } else {
                self.hdr_off = 0;
            }
        }
        Ok(true)
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
        let mut tx = match &step.send {
            Some(t) => Some(Tx {
                s: link(links, t.peer)?,
                peer: t.peer,
                // SAFETY: the range lies inside `buf` (plans only produce ranges within len).
                data: unsafe { base.add(t.range.start * e) },
                len: t.range.len() * e,
                pos: 0,
                frame_end: 0,
                hdr: [0; HEADER_LEN],
                hdr_off: HEADER_LEN,
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
                frame_left: 0,
                hdr: [0; HEADER_LEN],
                hdr_off: 0,
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
