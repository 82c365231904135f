//! The collective schedules: pure plans with no I/O.
//!
//! A plan is, for one rank, the ordered list of [`Step`]s it performs for one collective on a
//! buffer of `len` units (elements for allreduce, bytes for broadcast). Each step may send a
//! range of the buffer to one peer and receive a range from one peer; the transport runs both
//! halves of a step concurrently and starts the next step only when both are done. The send
//! half reads the buffer as it was at the start of the step (when a received range overlaps the
//! sent range, the transport defers the write until the send is complete).
//!
//! This module must not do I/O or know about sockets; the tests run every plan for all ranks in
//! memory and compare with a serial reduction.

use std::ops::Range;

/// Which allreduce schedule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Ring reduce-scatter then all-gather: `2(n−1)` steps moving `len/n` each, bandwidth-optimal.
    Ring,
    /// Recursive doubling (direct exchange for 2 ranks): `⌈log2 n⌉` exchanges of the whole buffer
    /// (plus a fold and an unfold when `n` is not a power of two), latency-optimal.
    RecursiveDoubling,
    /// Recursive halving reduce-scatter then recursive doubling all-gather (Rabenseifner):
    /// `2·log2 p` steps moving `2(p−1)/p` of the buffer like the ring, but in fewer, larger
    /// steps (plus a fold and an unfold of the whole buffer when `n` is not a power of two).
    Halving,
}

/// What to do with received units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `buf[range] = buf[range] ⊕ received`; when `finalize`, this is the last reduction of
    /// that range (an average scales here).
    Reduce {
        /// Last reduction of the range.
        finalize: bool,
    },
    /// `buf[range] = received`.
    Copy,
}

/// One transfer of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The peer rank.
    pub peer: usize,
    /// The range of the buffer, in units.
    pub range: Range<usize>,
}

/// One step of a plan: an optional send and an optional receive, run concurrently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Send `buf[range]` to `peer`.
    pub send: Option<Transfer>,
    /// Receive `range.len()` units from `peer` and apply the action to `buf[range]`.
    pub recv: Option<(Transfer, Action)>,
}

/// The `c`-th of `n` balanced chunks of `0..len` (sizes differ by at most one).
pub fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    let (q, r) = (len / n, len % n);
    let start = c * q + c.min(r);
    start..start + q + usize::from(c < r)
}

/// Appends rank `rank`'s allreduce plan (world `n`, buffer of `len` units) to `out`.
/// World size 1 gives no steps. Zero-length buffers still exchange (empty) messages, which is
/// how the barrier is built.
pub fn allreduce(alg: Algorithm, n: usize, rank: usize, len: usize, out: &mut Vec<Step>) {
    if n <= 1 {
        return;
    }
    match alg {
        Algorithm::Ring => ring(n, rank, len, out),
        Algorithm::RecursiveDoubling => recursive_doubling(n, rank, len, out),
        Algorithm::Halving => halving(n, rank, len, out),
    }
}

fn ring(n: usize, r: usize, len: usize, out: &mut Vec<Step>) {
    // Rank r ends the reduce-scatter owning chunk r+1 and starts the all-gather from it.
    ring_reduce_scatter(n, r, len, 1, out);
    ring_allgather(n, r, len, 1, out);
}

/// Ring reduce-scatter: after step k, chunk (r+shift−k−1) holds k+2 contributions; rank r ends
/// owning chunk (r+shift) fully reduced. `n − 1` steps.
fn ring_reduce_scatter(n: usize, r: usize, len: usize, shift: usize, out: &mut Vec<Step>) {
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    for k in 0..n - 1 {
        out.push(Step {
            send: Some(Transfer {
                peer: right,
                range: chunk(len, n, (r + shift + 2 * n - k - 1) % n),
            }),
            recv: Some((
                Transfer {
                    peer: left,
                    range: chunk(len, n, (r + shift + 2 * n - k - 2) % n),
                },
                Action::Reduce {
                    finalize: k == n - 2,
                },
            )),
        });
    }
}

/// Ring all-gather: rank r starts owning chunk (r+shift) and passes the chunks around the ring,
/// so that every rank ends with all of them. `n − 1` steps.
fn ring_allgather(n: usize, r: usize, len: usize, shift: usize, out: &mut Vec<Step>) {
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    for k in 0..n - 1 {
        out.push(Step {
            send: Some(Transfer {
                peer: right,
                range: chunk(len, n, (r + shift + n - k) % n),
            }),
            recv: Some((
                Transfer {
                    peer: left,
                    range: chunk(len, n, (r + shift + 2 * n - k - 1) % n),
                },
                Action::Copy,
            )),
        });
    }
}

/// Appends rank `rank`'s reduce-scatter plan (world `n`, buffer of `len` units) to `out`: the
/// ring's first half, after which `buf[chunk(len, n, rank)]` holds the reduction of that chunk
/// over every rank (the other chunks hold partial sums). World size 1 gives no steps.
pub fn reduce_scatter(n: usize, rank: usize, len: usize, out: &mut Vec<Step>) {
    if n > 1 {
        ring_reduce_scatter(n, rank, len, 0, out);
    }
}

/// Appends rank `rank`'s all-gather plan (world `n`, buffer of `len` units) to `out`: each rank
/// starts with its own `buf[chunk(len, n, rank)]` and ends with every rank's chunk in place
/// (the ring's second half). World size 1 gives no steps.
pub fn allgather(n: usize, rank: usize, len: usize, out: &mut Vec<Step>) {
    if n > 1 {
        ring_allgather(n, rank, len, 0, out);
    }
}

/// Largest power of two ≤ n (n ≥ 1).
fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

fn recursive_doubling(n: usize, r: usize, len: usize, out: &mut Vec<Step>) {
    let p = pow2_floor(n);
    let rem = n - p;
    let all = 0..len;
    // Fold: of the first 2·rem ranks, the even ones hand their data to the next odd one.
    if r < 2 * rem {
        if r.is_multiple_of(2) {
            out.push(Step {
                send: Some(Transfer {
                    peer: r + 1,
                    range: all.clone(),
                }),
                recv: None,
            });
            out.push(Step {
                send: None,
                recv: Some((
                    Transfer {
                        peer: r + 1,
                        range: all,
                    },
                    Action::Copy,
                )),
            });
            return;
        }
        out.push(Step {
            send: None,
            recv: Some((
                Transfer {
                    peer: r - 1,
                    range: all.clone(),
                },
                Action::Reduce { finalize: false },
            )),
        });
    }
    let vr = if r < 2 * rem { r / 2 } else { r - rem };
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
    let mut mask = 1;
    while mask < p {
        let peer = real(vr ^ mask);
        out.push(Step {
            send: Some(Transfer {
                peer,
                range: all.clone(),
            }),
            recv: Some((
                Transfer {
                    peer,
                    range: all.clone(),
                },
                Action::Reduce {
                    finalize: mask == p / 2,
                },
            )),
        });
        mask <<= 1;
    }
    // Unfold: give the result back to the folded-in rank.
    if r < 2 * rem {
        out.push(Step {
            send: Some(Transfer {
                peer: r - 1,
                range: all,
            }),
            recv: None,
        });
    }
}

/// Folds the first `2·rem` ranks pairwise (even → odd) so that a power of two `p` of ranks
/// remains; returns this rank's virtual rank among them, or `None` for a folded-out rank
/// (whose fold and unfold steps have been pushed).
fn fold(n: usize, r: usize, len: usize, out: &mut Vec<Step>) -> Option<usize> {
    let rem = n - pow2_floor(n);
    if r < 2 * rem {
        if r.is_multiple_of(2) {
            out.push(Step {
                send: Some(Transfer {
                    peer: r + 1,
                    range: 0..len,
                }),
                recv: None,
            });
            out.push(Step {
                send: None,
                recv: Some((
                    Transfer {
                        peer: r + 1,
                        range: 0..len,
                    },
                    Action::Copy,
                )),
            });
            return None;
        }
        out.push(Step {
            send: None,
            recv: Some((
                Transfer {
                    peer: r - 1,
                    range: 0..len,
                },
                Action::Reduce { finalize: false },
            )),
        });
        return Some(r / 2);
    }
    Some(r - rem)
}

fn halving(n: usize, r: usize, len: usize, out: &mut Vec<Step>) {
    let p = pow2_floor(n);
    let rem = n - p;
    let Some(vr) = fold(n, r, len, out) else {
        return;
    };
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
    // Blocks b0..b1 of the p balanced chunks, as a range of units.
    let blocks = |b0: usize, b1: usize| chunk(len, p, b0).start..chunk(len, p, b1 - 1).end;
    let (mut lo, mut hi) = (0, p);
    let mut mask = p / 2;
    while mask > 0 {
        let mid = (lo + hi) / 2;
        let peer = real(vr ^ mask);
        let (keep, give) = if vr & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        out.push(Step {
            send: Some(Transfer {
                peer,
                range: blocks(give.0, give.1),
            }),
            recv: Some((
                Transfer {
                    peer,
                    range: blocks(keep.0, keep.1),
                },
                Action::Reduce {
                    finalize: mask == 1,
                },
            )),
        });
        (lo, hi) = keep;
        mask /= 2;
    }
    let mut mask = 1;
    while mask < p {
        let a = vr & !(mask - 1);
        let b = a ^ mask;
        let peer = real(vr ^ mask);
        out.push(Step {
            send: Some(Transfer {
                peer,
                range: blocks(a, a + mask),
            }),
            recv: Some((
                Transfer {
                    peer,
                    range: blocks(b, b + mask),
                },
                Action::Copy,
            )),
        });
        mask *= 2;
    }
    if r < 2 * rem {
        out.push(Step {
            send: Some(Transfer {
                peer: r - 1,
                range: 0..len,
            }),
            recv: None,
        });
    }
}

/// Appends rank `rank`'s binomial-tree broadcast plan from `root` (latency-optimal, whole
/// buffer per message) to `out`.
pub fn broadcast_tree(n: usize, rank: usize, root: usize, len: usize, out: &mut Vec<Step>) {
    if n <= 1 {
        return;
    }
    let vr = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            out.push(Step {
                send: None,
                recv: Some((
                    Transfer {
                        peer: real(vr - mask),
                        range: 0..len,
                    },
                    Action::Copy,
                )),
            });
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            out.push(Step {
                send: Some(Transfer {
                    peer: real(vr + mask),
                    range: 0..len,
                }),
                recv: None,
            });
        }
        mask >>= 1;
    }
}

/// Appends rank `rank`'s pipelined chain broadcast plan from `root` (bandwidth-optimal for large
/// buffers: segments of `seg` units flow root → root+1 → …, each rank forwarding segment j−1
/// while receiving segment j) to `out`.
pub fn broadcast_chain(
    n: usize,
    rank: usize,
    root: usize,
    len: usize,
    seg: usize,
    out: &mut Vec<Step>,
) {
    if n <= 1 {
        return;
    }
    let seg = seg.max(1);
    let vr = (rank + n - root) % n;
    let (left, right) = ((rank + n - 1) % n, (rank + 1) % n);
    let segs = len.div_ceil(seg).max(1);
    let range = |j: usize| (j * seg).min(len)..((j + 1) * seg).min(len);
    for j in 0..=segs {
        let recv = (vr > 0 && j < segs).then(|| {
            (
                Transfer {
                    peer: left,
                    range: range(j),
                },
                Action::Copy,
            )
        });
        let send = (vr < n - 1 && j >= 1).then(|| Transfer {
            peer: right,
            range: range(j - 1),
        });
        if send.is_some() || recv.is_some() {
            out.push(Step { send, recv });
        }
    }
}

/// The peers rank `rank` must be connected to so that every plan above can run: ring
/// neighbours, recursive-doubling partners (with fold partners) and binomial-tree partners
/// (`rank ± 2^k mod n`). The relation is symmetric. Sorted, without `rank` itself.
pub fn peers(n: usize, rank: usize) -> Vec<usize> {
    let mut v = Vec::new();
    if n <= 1 {
        return v;
    }
    let mut d = 1;
    while d < n {
        v.push((rank + d) % n);
        v.push((rank + n - d % n) % n);
        d <<= 1;
    }
    let mut steps = Vec::new();
    recursive_doubling(n, rank, 0, &mut steps);
    for s in &steps {
        v.extend(s.send.iter().map(|t| t.peer));
        v.extend(s.recv.iter().map(|(t, _)| t.peer));
    }
    v.push((rank + 1) % n);
    v.push((rank + n - 1) % n);
    v.sort_unstable();
    v.dedup();
    v.retain(|&p| p != rank);
    v
}

#[cfg(test)]
pub(crate) mod sim {
    //! An in-memory executor of plans for all ranks at once, with unbounded FIFO channels:
    //! the reference the tests compare the plans against.
    use super::*;
    use std::collections::VecDeque;

    type Channel<T> = VecDeque<Vec<T>>;
    type Reduce<T> = dyn Fn(&mut [T], &[T], bool);

    /// Runs `plans[r]` for every rank `r` on `bufs[r]`; `reduce(dst, src, finalize)` applies a
    /// `Reduce` action. Panics on a deadlock, a length mismatch or a self-message.
    pub fn run<T: Copy>(plans: &[Vec<Step>], bufs: &mut [Vec<T>], reduce: &Reduce<T>) {
        let n = plans.len();
        let mut chan: Vec<Channel<T>> = vec![VecDeque::new(); n * n];
        let mut pc = vec![0usize; n];
        let mut sent = vec![false; n];
        loop {
            let mut progress = false;
            for r in 0..n {
                while let Some(step) = plans[r].get(pc[r]) {
                    if !sent[r] {
                        if let Some(t) = &step.send {
                            assert_ne!(t.peer, r);
                            chan[r * n + t.peer].push_back(bufs[r][t.range.clone()].to_vec());
                        }
                        sent[r] = true;
                        progress = true;
                    }
                    if let Some((t, action)) = &step.recv {
                        let Some(msg) = chan[t.peer * n + r].pop_front() else {
                            break;
                        };
                        assert_eq!(msg.len(), t.range.len(), "rank {r} step {}", pc[r]);
                        let dst = &mut bufs[r][t.range.clone()];
                        match action {
                            Action::Copy => dst.copy_from_slice(&msg),
                            Action::Reduce { finalize } => reduce(dst, &msg, *finalize),
                        }
                    }
                    pc[r] += 1;
                    sent[r] = false;
                    progress = true;
                }
            }
            if (0..n).all(|r| pc[r] == plans[r].len()) {
                assert!(chan.iter().all(|c| c.is_empty()), "undelivered messages");
                return;
            }
            assert!(progress, "deadlock at {pc:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reduction over u64 "sets": each rank contributes bit r, so a reduction that misses or
    /// doubles a contribution is visible; `finalize` sets bit 63, which must be set exactly once.
    fn check_allreduce(alg: Algorithm, n: usize, len: usize) {
        let plans: Vec<Vec<Step>> = (0..n)
            .map(|r| {
                let mut v = Vec::new();
                allreduce(alg, n, r, len, &mut v);
                v
            })
            .collect();
        // In-place: a received range must not be written while it is being sent, unless the
        // step is an exchange (the transport defers those); copies never overlap sends.
        for p in &plans {
            for s in p {
                if let (Some(t), Some((rt, Action::Copy))) = (&s.send, &s.recv) {
                    assert!(
                        t.range.end <= rt.range.start
                            || rt.range.end <= t.range.start
                            || t.range.is_empty()
                    );
                }
            }
        }
        let mut bufs: Vec<Vec<u64>> = (0..n).map(|r| vec![1u64 << r; len]).collect();
        sim::run(&plans, &mut bufs, &|d, s, fin| {
            for (d, s) in d.iter_mut().zip(s) {
                assert_eq!(*d & *s & ((1 << 62) - 1), 0, "contribution counted twice");
                assert_eq!((*d | *s) >> 63, 0, "reduced after finalize");
                *d |= *s;
                if fin {
                    *d |= 1 << 63;
                }
            }
        });
        let full = if n == 1 {
            1
        } else {
            ((1u64 << n) - 1) | (1 << 63)
        };
        for (r, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == full),
                "alg {alg:?} n {n} len {len} rank {r}: {b:x?}"
            );
        }
    }

    fn check_broadcast(chain: bool, n: usize, root: usize, len: usize, seg: usize) {
        let plans: Vec<Vec<Step>> = (0..n)
            .map(|r| {
                let mut v = Vec::new();
                if chain {
                    broadcast_chain(n, r, root, len, seg, &mut v)
                } else {
                    broadcast_tree(n, r, root, len, &mut v)
                }
                v
            })
            .collect();
        let mut bufs: Vec<Vec<u32>> = (0..n)
            .map(|r| {
                if r == root {
                    (0..len as u32).collect()
                } else {
                    vec![u32::MAX; len]
                }
            })
            .collect();
        sim::run(&plans, &mut bufs, &|_, _, _| {
            panic!("broadcast never reduces")
        });
        for b in &bufs {
            assert!(b.iter().copied().eq(0..len as u32));
        }
    }

    /// Reduce-scatter over bit sets (as `check_allreduce`): rank r's own chunk holds every
    /// contribution exactly once, finalized once.
    fn check_reduce_scatter(n: usize, len: usize) {
        let plans: Vec<Vec<Step>> = (0..n)
            .map(|r| {
                let mut v = Vec::new();
                reduce_scatter(n, r, len, &mut v);
                v
            })
            .collect();
        let mut bufs: Vec<Vec<u64>> = (0..n).map(|r| vec![1u64 << r; len]).collect();
        sim::run(&plans, &mut bufs, &|d, s, fin| {
            for (d, s) in d.iter_mut().zip(s) {
                assert_eq!(
                    *d & *s,
                    0,
                    "contribution counted twice or reduced after finalize"
                );
                *d |= *s | if fin { 1 << 63 } else { 0 };
            }
        });
        let full = if n == 1 {
            1
        } else {
            ((1u64 << n) - 1) | (1 << 63)
        };
        for (r, b) in bufs.iter().enumerate() {
            assert!(
                b[chunk(len, n, r)].iter().all(|&x| x == full),
                "n {n} len {len} rank {r}"
            );
        }
    }

    /// All-gather: every rank ends with rank c's chunk c, for every c.
    fn check_allgather(n: usize, len: usize) {
        let plans: Vec<Vec<Step>> = (0..n)
            .map(|r| {
                let mut v = Vec::new();
                allgather(n, r, len, &mut v);
                v
            })
            .collect();
        let mut bufs: Vec<Vec<usize>> = (0..n)
            .map(|r| {
                let mut b = vec![usize::MAX; len];
                b[chunk(len, n, r)].fill(r);
                b
            })
            .collect();
        sim::run(&plans, &mut bufs, &|_, _, _| {
            panic!("all-gather never reduces")
        });
        let want: Vec<usize> = (0..n)
            .flat_map(|c| vec![c; chunk(len, n, c).len()])
            .collect();
        assert!(bufs.iter().all(|b| *b == want), "n {n} len {len}");
    }

    #[test]
    fn exhaustive_small_worlds() {
        for n in 1..=9 {
            for len in [0, 1, 2, 3, 5, 7, 8, 13, 31, 64, 97] {
                check_allreduce(Algorithm::Ring, n, len);
                check_allreduce(Algorithm::RecursiveDoubling, n, len);
                check_allreduce(Algorithm::Halving, n, len);
                check_reduce_scatter(n, len);
                check_allgather(n, len);
                for root in 0..n {
                    check_broadcast(false, n, root, len, 4);
                    check_broadcast(true, n, root, len, 4);
                }
            }
        }
    }

    #[test]
    fn chunks_partition() {
        for n in 1..10 {
            for len in 0..40 {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk(len, n, c);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / n || r.len() == len / n + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn plans_only_use_connected_peers() {
        for n in 1..=17 {
            for r in 0..n {
                let ps = peers(n, r);
                for &p in &ps {
                    assert!(peers(n, p).contains(&r), "peer relation must be symmetric");
                }
                let mut v = Vec::new();
                allreduce(Algorithm::Ring, n, r, 10, &mut v);
                allreduce(Algorithm::RecursiveDoubling, n, r, 10, &mut v);
                allreduce(Algorithm::Halving, n, r, 10, &mut v);
                reduce_scatter(n, r, 10, &mut v);
                allgather(n, r, 10, &mut v);
                for root in 0..n {
                    broadcast_tree(n, r, root, 10, &mut v);
                    broadcast_chain(n, r, root, 10, 3, &mut v);
                }
                for s in &v {
                    for p in s
                        .send
                        .iter()
                        .map(|t| t.peer)
                        .chain(s.recv.iter().map(|(t, _)| t.peer))
                    {
                        assert!(ps.contains(&p), "n {n} rank {r} uses unconnected peer {p}");
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn allreduce_plans_reduce_everything_once(n in 1usize..=16, len in 0usize..300, alg in 0..3) {
            let alg = [Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::Halving][alg as usize];
            check_allreduce(alg, n, len);
        }

        #[test]
        fn broadcast_plans_deliver(n in 1usize..=12, root_seed in 0usize..100, len in 0usize..200, seg in 1usize..50, chain in any::<bool>()) {
            check_broadcast(chain, n, root_seed % n, len, seg);
        }
    }
}
