//! Data frames are protected after the handshake (issue 12, case 9): a man-in-the-middle proxy on
//! real loopback TCP between rank 1 and rank 0 flips a payload byte, replays a frame or swaps
//! two, and rank 0 refuses the frame with `IntegrityFailed` naming rank 1, under integrity
//! and under encryption. Every mode computes the same collectives, and members of
//! different modes refuse each other's handshake.
//!
//! Time bounds here are hang guards only (the communicator's timeout).

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use diphoma_ring::frame::{HEADER_LEN, Hello, Proof, Protection};
use diphoma_ring::{CommError, Communicator, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(10);
/// Elements of the tampered allreduce: 8 MiB of f32, so each ring step of 2 ranks carries
/// 4 MiB, four data frames with the same header (sequence and length).
const N: usize = 2 << 20;

/// What the proxy does to the data frames from rank 1 to rank 0: frame index and bytes in,
/// frames to forward out.
type Tamper = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Vec<u8>> + Send>;

/// Bytes rank 1 sends in its handshake before its first data frame: a hello, then (after the
/// challenge) a proof.
fn handshake_lens() -> [usize; 2] {
    let hello = Hello {
        job_uid: "job-uid-1",
        generation: 1,
        world: 2,
        from: 1,
        to: 0,
        protection: Protection::Integrity,
        nonce: [0; 32],
    };
    [
        hello.encode().as_bytes().len(),
        Proof { mac: [0; 32] }.encode().as_bytes().len(),
    ]
}

/// A proxy listening on loopback that forwards one connection to `to`: the reverse direction
/// verbatim, the forward one frame by frame through `tamper` after the handshake. Both
/// directions end (and both sockets are shut) when either side closes.
fn proxy(to: SocketAddr, tag_len: usize, mut tamper: Tamper) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut from1, _) = l.accept().unwrap();
        let mut to0 = TcpStream::connect(to).unwrap();
        let (mut back_src, mut back_dst) = (to0.try_clone().unwrap(), from1.try_clone().unwrap());
        let (a, b) = (from1.try_clone().unwrap(), to0.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut back_src, &mut back_dst);
            let _ = (a.shutdown(Shutdown::Both), b.shutdown(Shutdown::Both));
        });
        let mut forward = || -> std::io::Result<()> {
            for n in handshake_lens() {
                let mut hs = vec![0; n];
                from1.read_exact(&mut hs)?;
                to0.write_all(&hs)?;
            }
            for i in 0.. {
                let mut f = vec![0; HEADER_LEN];
                from1.read_exact(&mut f)?;
                let len = u32::from_le_bytes(f[4..8].try_into().unwrap()) as usize;
                f.resize(HEADER_LEN + len + tag_len, 0);
                from1.read_exact(&mut f[HEADER_LEN..])?;
                for out in tamper(i, f) {
                    to0.write_all(&out)?;
                }
            }
            Ok(())
        };
        let _ = forward();
        let _ = (from1.shutdown(Shutdown::Both), to0.shutdown(Shutdown::Both));
    });
    addr
}

/// Rank 0 and rank 1 of a 2-rank ring in `mode`, rank 1 reaching rank 0 through the proxy;
/// both run one allreduce of `N` ones. Returns, per rank, whether every element is the right
/// sum (2).
fn through_proxy(
    mode: Protection,
    tamper: Tamper,
) -> (Result<bool, CommError>, Result<bool, CommError>) {
    let mut cfgs = common::configs(2, 1, TIMEOUT);
    for (c, _) in &mut cfgs {
        c.protection = mode;
    }
    cfgs[1].0.addresses[0] = proxy(cfgs[0].0.addresses[0], mode.tag_len(), tamper);
    let results = cfgs
        .into_iter()
        .map(|(c, l)| {
            std::thread::spawn(move || {
                let mut comm = Communicator::connect(c, l)?;
                let mut b = vec![1f32; N];
                comm.allreduce(&mut b, ReduceOp::Sum)?;
                Ok(b.iter().all(|&x| x == 2.0))
            })
        })
        .collect::<Vec<_>>();
    let mut r = results.into_iter().map(|h| h.join().unwrap());
    (r.next().unwrap(), r.next().unwrap())
}

/// Flips one payload byte of the first data frame.
fn flip() -> Tamper {
    Box::new(|i, mut f| {
        if i == 0 {
            f[HEADER_LEN + 2] ^= 0x40;
        }
        vec![f]
    })
}

fn assert_refused(r0: Result<bool, CommError>, r1: Result<bool, CommError>) {
    let e = r0.unwrap_err();
    assert!(
        matches!(
            e,
            CommError::IntegrityFailed {
                rank: 1,
                op: "allreduce"
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("rank 1"), "{e}");
    // rank 0 closed the connection: rank 1's call fails too, never with a wrong sum
    assert!(r1.is_err(), "{r1:?}");
}

#[test]
fn a_flipped_payload_byte_is_refused_in_every_protected_mode() {
    for mode in [Protection::Integrity, Protection::Encryption] {
        let (r0, r1) = through_proxy(mode, flip());
        assert_refused(r0, r1);
    }
    // Unprotected frames (what every frame was before): the same flip passes unnoticed and
    // corrupts the sum. This is why `none` is for measurements only.
    let (r0, r1) = through_proxy(Protection::None, flip());
    assert!(!r0.unwrap(), "the proxy changed a byte of rank 1's data");
    assert!(r1.is_ok());
}

#[test]
fn a_replayed_or_reordered_frame_is_refused() {
    // Frames 1 and 2 of the first step share their header (same collective, same length), so
    // only the per-direction frame counter in the tag tells them apart.
    let mut held = None;
    let replay: Tamper = Box::new(move |i, f| match i {
        1 => {
            held = Some(f.clone());
            vec![f]
        }
        2 => vec![held.take().unwrap()],
        _ => vec![f],
    });
    let (r0, r1) = through_proxy(Protection::Integrity, replay);
    assert_refused(r0, r1);
    let mut held = None;
    let swap: Tamper = Box::new(move |i, f| match i {
        1 => {
            held = Some(f);
            vec![]
        }
        2 => vec![f, held.take().unwrap()],
        _ => vec![f],
    });
    let (r0, r1) = through_proxy(Protection::Integrity, swap);
    assert_refused(r0, r1);
    // an untouched proxy changes nothing: the ring works through it
    let (r0, r1) = through_proxy(Protection::Integrity, Box::new(|_, f| vec![f]));
    assert!(r0.unwrap() && r1.unwrap());
}

#[test]
fn every_mode_computes_the_same_collectives() {
    for mode in [
        Protection::None,
        Protection::Integrity,
        Protection::Encryption,
    ] {
        for n in [2, 3, 4] {
            let mut cfgs = common::configs(n, 1, TIMEOUT);
            for (c, _) in &mut cfgs {
                c.protection = mode;
            }
            let comms = common::connect_all(cfgs)
                .into_iter()
                .map(|c| c.unwrap())
                .collect();
            let (_, ok) = common::on_all(comms, move |r, c| {
                // sizes across frames (> 1 MiB), segments and the small-message path
                for len in [0, 7, 5000, (1 << 18) + 3, (3 << 20) / 4 + 1] {
                    let mut b: Vec<f32> = (0..len).map(|i| (i % 13 + r) as f32).collect();
                    c.allreduce(&mut b, ReduceOp::Sum).unwrap();
                    let want = |i: usize| (0..n).map(|q| (i % 13 + q) as f32).sum::<f32>();
                    assert!(
                        b.iter().enumerate().all(|(i, &x)| x == want(i)),
                        "{mode} len {len}"
                    );
                }
                let mut big = vec![r as u8; 5 << 20];
                c.broadcast_bytes(&mut big, n - 1).unwrap();
                assert!(big.iter().all(|&x| x == (n - 1) as u8));
                let mut g = vec![0u8; n * 3];
                g[r * 3..r * 3 + 3].fill(r as u8 + 1);
                c.allgather_bytes(&mut g).unwrap();
                c.barrier().unwrap();
                (0..n).all(|q| g[q * 3..q * 3 + 3].iter().all(|&x| x == q as u8 + 1))
            });
            assert!(ok.into_iter().all(|x| x), "{mode} n={n}");
        }
    }
}

#[test]
fn peers_of_different_modes_refuse_each_other() {
    let mut cfgs = common::configs(2, 1, TIMEOUT);
    cfgs[0].0.protection = Protection::Integrity;
    cfgs[1].0.protection = Protection::Encryption;
    let r = common::connect_all(cfgs);
    for (rank, r) in r.into_iter().enumerate() {
        let e = r.unwrap_err();
        assert!(
            matches!(e, CommError::ProtectionMismatch { .. }),
            "rank {rank}: {e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("integrity") && msg.contains("encryption"),
            "{msg}"
        );
    }
}
