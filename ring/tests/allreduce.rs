//! Collectives over real TCP on 127.0.0.1 equal a serial reference, for 1..=8 ranks, awkward
//! sizes and every dtype.

mod common;

use diphoma_ring::{Element, ReduceOp, bf16, f16};

/// Rank r's value at index i: small integers, so every partial sum is exact in every dtype.
fn value(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32 - 5.0
}

fn check<T: Element + PartialEq + std::fmt::Debug>(
    comms: Vec<diphoma_ring::Communicator>,
    len: usize,
    op: ReduceOp,
) -> Vec<diphoma_ring::Communicator> {
    let n = comms.len();
    let (comms, bufs) = common::on_all(comms, move |r, c| {
        let mut buf: Vec<T> = (0..len).map(|i| T::from_f32(value(r, i))).collect();
        c.allreduce(&mut buf, op).unwrap();
        buf
    });
    let scale = if op == ReduceOp::Avg {
        1.0 / n as f32
    } else {
        1.0
    };
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(b.len(), len);
        for (i, x) in b.iter().enumerate() {
            let sum: f32 = (0..n).map(|q| value(q, i)).sum();
            let want = if n == 1 {
                T::from_f32(value(0, i))
            } else {
                T::from_f32(sum * scale)
            };
            assert_eq!(*x, want, "n {n} len {len} {op:?} rank {r} index {i}");
        }
        assert!(bufs[0] == *b, "ranks disagree");
    }
    comms
}

#[test]
fn allreduce_matches_serial_reference() {
    // 0, 1, odd, primes, not divisible by n, around and above the 64 KiB ring threshold,
    // spanning several 256 KiB segments and 1 MiB frames.
    let sizes = [0usize, 1, 2, 7, 13, 97, 1000, 4099, 16_411, 65_537, 300_007];
    for n in 1..=8 {
        let mut comms = common::ring(n);
        for &len in &sizes {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                comms = check::<f32>(comms, len, op);
                comms = check::<f16>(comms, len, op);
                comms = check::<bf16>(comms, len, op);
            }
        }
    }
}

#[test]
fn allreduce_64_mib() {
    // ≥ 64 MiB, a length not divisible by the world size.
    let len = (64 << 20) / 4 + 3;
    for n in [2, 3] {
        let comms = common::ring(n);
        let (_, bufs) = common::on_all(comms, move |r, c| {
            let mut buf: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
            c.allreduce(&mut buf, ReduceOp::Sum).unwrap();
            // Compare in place to keep memory bounded.
            (0..len).all(|i| buf[i] == (0..n).map(|q| value(q, i)).sum::<f32>())
        });
        assert!(bufs.iter().all(|&ok| ok), "n {n}");
    }
    // Half types at ≥ 64 MiB too (bf16 exercises the same path; kernels are checked exactly in
    // reduce.rs).
    let len = (64 << 20) / 2 + 5;
    let comms = common::ring(4);
    let (_, oks) = common::on_all(comms, move |r, c| {
        let mut buf: Vec<f16> = (0..len).map(|i| f16::from_f32(value(r, i))).collect();
        c.allreduce(&mut buf, ReduceOp::Sum).unwrap();
        (0..len).all(|i| buf[i] == f16::from_f32((0..4).map(|q| value(q, i)).sum::<f32>()))
    });
    assert!(oks.iter().all(|&ok| ok));
}

#[test]
fn broadcast_and_barrier() {
    for n in 1..=5 {
        let comms = common::ring(n);
        let (comms, oks) = common::on_all(comms, move |r, c| {
            let mut ok = true;
            for &len in &[0usize, 1, 5, 1000, 65_536, 65_537, 3 << 20] {
                for root in 0..n {
                    let mut b: Vec<u8> = if r == root {
                        (0..len).map(|i| (i * 31 + root) as u8).collect()
                    } else {
                        vec![0xEE; len]
                    };
                    c.broadcast_bytes(&mut b, root).unwrap();
                    ok &= b
                        .iter()
                        .enumerate()
                        .all(|(i, &x)| x == (i * 31 + root) as u8);
                    c.barrier().unwrap();
                }
            }
            let mut f = vec![r as f32; 10];
            c.broadcast(&mut f, n - 1).unwrap();
            ok && f.iter().all(|&x| x == (n - 1) as f32)
        });
        assert!(oks.iter().all(|&x| x), "n {n}");
        drop(comms);
    }
}

/// Max, min and the wide types over real TCP: every rank equals the serial reduction, and an
/// average of an integer is refused before anything is sent.
#[test]
fn allreduce_extremes_and_wide_types() {
    fn run<T: Element + PartialEq + std::fmt::Debug>(
        comms: Vec<diphoma_ring::Communicator>,
        len: usize,
        op: ReduceOp,
        fold: fn(f32, f32) -> f32,
    ) -> Vec<diphoma_ring::Communicator> {
        let n = comms.len();
        let (comms, bufs) = common::on_all(comms, move |r, c| {
            let mut buf: Vec<T> = (0..len).map(|i| T::from_f32(value(r, i))).collect();
            c.allreduce(&mut buf, op).unwrap();
            buf
        });
        let want: Vec<T> = (0..len)
            .map(|i| T::from_f32((1..n).fold(value(0, i), |a, q| fold(a, value(q, i)))))
            .collect();
        for b in &bufs {
            assert!(*b == want, "n {n} len {len} {op:?} {:?}", T::DTYPE);
        }
        comms
    }
    for n in [1, 2, 3, 4, 5] {
        let mut comms = common::ring(n);
        for len in [1usize, 13, 4099, 70_001] {
            comms = run::<f32>(comms, len, ReduceOp::Max, f32::max);
            comms = run::<bf16>(comms, len, ReduceOp::Min, f32::min);
            comms = run::<f16>(comms, len, ReduceOp::Max, f32::max);
            comms = run::<f64>(comms, len, ReduceOp::Sum, |a, b| a + b);
            comms = run::<f64>(comms, len, ReduceOp::Min, f32::min);
            comms = run::<i32>(comms, len, ReduceOp::Sum, |a, b| a + b);
            comms = run::<i64>(comms, len, ReduceOp::Max, f32::max);
        }
        let (_, errs) = common::on_all(comms, |_, c| c.allreduce(&mut [1i64, 2], ReduceOp::Avg));
        for e in errs {
            assert!(
                matches!(&e, Err(diphoma_ring::CommError::Config(m)) if m.contains("I64")),
                "{e:?}"
            );
        }
    }
}

/// Reduce-scatter and all-gather over real TCP, for 1..=6 ranks and lengths that do and do not
/// divide by the world.
#[test]
fn reduce_scatter_and_allgather() {
    use diphoma_ring::schedule::chunk;
    for n in 1..=6 {
        let mut comms = common::ring(n);
        for len in [0usize, 1, 7, 4099, 300_007] {
            let (c, bufs) = common::on_all(comms, move |r, c| {
                let mut buf: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                c.reduce_scatter(&mut buf, ReduceOp::Sum).unwrap();
                buf[chunk(len, n, r)].to_vec()
            });
            for (r, b) in bufs.iter().enumerate() {
                let want: Vec<f32> = chunk(len, n, r)
                    .map(|i| (0..n).map(|q| value(q, i)).sum())
                    .collect();
                assert_eq!(*b, want, "reduce_scatter n {n} len {len} rank {r}");
            }
            let per = len.div_ceil(n);
            let (c, bufs) = common::on_all(c, move |r, c| {
                let mut buf = vec![0u8; per * n];
                buf[r * per..(r + 1) * per]
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = (r * 31 + i) as u8);
                c.allgather_bytes(&mut buf).unwrap();
                buf
            });
            let want: Vec<u8> = (0..n)
                .flat_map(|r| (0..per).map(move |i| (r * 31 + i) as u8))
                .collect();
            assert!(bufs.iter().all(|b| *b == want), "allgather n {n} len {len}");
            comms = c;
        }
        if n > 1 {
            let (_, errs) =
                common::on_all(comms, move |_, c| c.allgather_bytes(&mut vec![0u8; n + 1]));
            assert!(
                errs.iter()
                    .all(|e| matches!(e, Err(diphoma_ring::CommError::Config(_))))
            );
        }
    }
}
