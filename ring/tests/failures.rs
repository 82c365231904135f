//! Failures are typed, bounded and recoverable: a rank that dies mid-allreduce makes every other
//! rank's call fail within the timeout (for a killed rank process, see the worker's
//! `tests/bench.rs`), and the survivors form a new generation in the same process; intruders (wrong key, wrong job, stale generation, garbage, truncated or oversized
//! frames) are refused, counted, and do not disturb the ring.
//!
//! Time bounds here are hang guards only (generous multiples of the communicator's timeout).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use diphoma_ring::auth::{self, AuthParams};
use diphoma_ring::frame::{Header, Hello, Kind};
use diphoma_ring::{CommError, Communicator, Protection, ProtocolError, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn dead_rank_fails_everyone_then_survivors_reform() {
    let n = 4;
    let comms: Vec<Communicator> = common::connect_all(common::configs(n, 1, TIMEOUT))
        .into_iter()
        .map(|c| c.unwrap())
        .collect();
    let victim = comms[2].abort_handle();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        victim.abort(); // rank 2's sockets vanish mid-collective, as if the process died
    });
    let start = Instant::now();
    let (comms, errs) = common::on_all(comms, |_, c| {
        let mut buf = vec![1.0f32; 1 << 20];
        loop {
            if let Err(e) = c.allreduce(&mut buf, ReduceOp::Sum) {
                return (e, Instant::now());
            }
        }
    });
    killer.join().unwrap();
    for (r, (e, at)) in errs.iter().enumerate() {
        assert!(*at - start < TIMEOUT * 2, "rank {r} took {:?}", *at - start);
        if r == 2 {
            assert!(matches!(e, CommError::Aborted), "rank {r}: {e:?}");
        } else {
            assert!(
                matches!(e, CommError::PeerLost { .. } | CommError::Timeout { .. }),
                "rank {r}: {e:?}"
            );
        }
    }
    // A poisoned communicator refuses further work.
    let mut comms = comms;
    assert!(matches!(comms[0].barrier(), Err(CommError::Poisoned)));
    drop(comms);

    // Generation 2 with the three survivors, in the same process.
    let comms: Vec<Communicator> = common::connect_all(common::configs(3, 2, TIMEOUT))
        .into_iter()
        .map(|c| c.unwrap())
        .collect();
    let (_, sums) = common::on_all(comms, |r, c| {
        let mut buf = vec![r as f32 + 1.0; 100_003];
        c.allreduce(&mut buf, ReduceOp::Sum).unwrap();
        buf.iter().all(|&x| x == 6.0)
    });
    assert!(sums.iter().all(|&ok| ok));
}

/// Connects to `addr` and runs `f` on the raw stream, with a read timeout.
fn intrude(addr: std::net::SocketAddr, f: impl FnOnce(&mut TcpStream)) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    f(&mut s);
}

#[test]
fn intruders_are_refused_typed_and_counted() {
    let mut cfgs = common::configs(2, 5, TIMEOUT);
    let (c1, l1) = cfgs.pop().unwrap();
    let (c0, l0) = cfgs.pop().unwrap();
    let addr0 = c0.addresses[0];
    let counters = c0.counters.clone();
    let r0 = std::thread::spawn(move || Communicator::connect(c0, l0));
    let good = AuthParams {
        key: common::KEY,
        job_uid: "job-uid-1",
        generation: 5,
        world: 2,
        protection: Protection::Integrity,
    };

    intrude(addr0, |s| {
        let p = AuthParams {
            key: b"not-the-key-not-the-key-not-the-",
            ..good
        };
        assert!(matches!(
            auth::initiate(s, &p, 1, 0),
            Err(CommError::AuthFailed { .. })
        ));
    });
    intrude(addr0, |s| {
        let p = AuthParams {
            job_uid: "another-job",
            ..good
        };
        assert!(matches!(
            auth::initiate(s, &p, 1, 0),
            Err(CommError::WrongJob { .. })
        ));
    });
    intrude(addr0, |s| {
        let p = AuthParams {
            generation: 4,
            ..good
        };
        let e = auth::initiate(s, &p, 1, 0);
        assert!(
            matches!(e, Err(CommError::StaleGeneration { ours: 4, theirs: 5 })),
            "{e:?}"
        );
    });
    intrude(addr0, |s| {
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b); // the acceptor hangs up
    });
    intrude(addr0, |s| {
        let hello = Hello {
            job_uid: "job-uid-1",
            generation: 5,
            world: 2,
            from: 1,
            to: 0,
            protection: Protection::Integrity,
            nonce: [1; 32],
        };
        s.write_all(&hello.encode().as_bytes()[..20]).unwrap(); // truncated
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b);
    });
    intrude(addr0, |s| {
        let mut h = Header {
            kind: Kind::Hello,
            len: 0,
            seq: 0,
        }
        .encode();
        h[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes()); // 1 GiB "hello"
        s.write_all(&h).unwrap();
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b);
    });

    // The legitimate rank 1 still joins, and the ring works.
    let r1 = std::thread::spawn(move || Communicator::connect(c1, l1));
    let mut comms = vec![r0.join().unwrap().unwrap(), r1.join().unwrap().unwrap()];
    let c = &counters;
    assert_eq!(c.auth_failed.load(Ordering::Relaxed), 1);
    assert_eq!(c.wrong_job.load(Ordering::Relaxed), 1);
    assert_eq!(c.stale_generation.load(Ordering::Relaxed), 1);
    assert_eq!(c.protocol.load(Ordering::Relaxed), 3);
    let c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    let (_, ok) = common::on_all(vec![c0, c1], |r, c| {
        let mut b = vec![r as f32; 7];
        c.allreduce(&mut b, ReduceOp::Sum).is_ok() && b == vec![1.0; 7]
    });
    assert!(ok.iter().all(|&x| x));
}

#[test]
fn wrong_key_ring_fails_to_form() {
    let mut cfgs = common::configs(2, 1, Duration::from_secs(2));
    cfgs[1].0.key = b"some-other-key-some-other-key-32".to_vec();
    let res = common::connect_all(cfgs);
    // Rank 1 (the initiator) learns it at once; rank 0 never gets a valid peer: timeout.
    assert!(
        matches!(res[1], Err(CommError::AuthFailed { .. })),
        "{:?}",
        res[1]
    );
    assert!(
        matches!(res[0], Err(CommError::Timeout { .. })),
        "{:?}",
        res[0]
    );
}

#[test]
fn stale_generation_peer_is_refused() {
    let mut cfgs = common::configs(2, 7, Duration::from_secs(2));
    cfgs[1].0.generation = 6; // rank 1 (initiator) is stale; rank 0 is at generation 7
    let counters = cfgs[0].0.counters.clone();
    let res = common::connect_all(cfgs);
    assert!(
        matches!(
            res[1],
            Err(CommError::StaleGeneration { ours: 6, theirs: 7 })
        ),
        "{:?}",
        res[1]
    );
    assert!(
        matches!(res[0], Err(CommError::Timeout { .. })),
        "{:?}",
        res[0]
    );
    assert_eq!(counters.stale_generation.load(Ordering::Relaxed), 1);
}

/// An authenticated peer that then misbehaves on the data path.
fn rogue_peer(send: impl FnOnce(&mut TcpStream) + Send + 'static) -> CommError {
    let mut cfgs = common::configs(2, 1, TIMEOUT);
    let (c1, _l1) = cfgs.pop().unwrap();
    let (c0, l0) = cfgs.pop().unwrap();
    let addr0 = c0.addresses[0];
    let r0 = std::thread::spawn(move || {
        let mut c = Communicator::connect(c0, l0).unwrap();
        let mut b = vec![0f32; 1000];
        c.allreduce(&mut b, ReduceOp::Sum).unwrap_err()
    });
    let mut s = TcpStream::connect(addr0).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let p = AuthParams {
        key: &c1.key,
        job_uid: &c1.job_uid,
        generation: 1,
        world: 2,
        protection: c1.protection,
    };
    auth::initiate(&mut s, &p, 1, 0).unwrap();
    send(&mut s);
    let e = r0.join().unwrap();
    drop(s);
    e
}

#[test]
fn malformed_data_frames_are_protocol_errors() {
    let e = rogue_peer(|s| s.write_all(&[0xAB; 64]).unwrap());
    assert!(
        matches!(e, CommError::Protocol(ProtocolError::BadMagic(_))),
        "{e:?}"
    );
    let e = rogue_peer(|s| {
        let mut h = Header {
            kind: Kind::Data,
            len: 0,
            seq: 1,
        }
        .encode();
        h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        s.write_all(&h).unwrap();
    });
    assert!(
        matches!(e, CommError::Protocol(ProtocolError::Oversized { .. })),
        "{e:?}"
    );
    let e = rogue_peer(|s| {
        s.write_all(
            &Header {
                kind: Kind::Data,
                len: 8,
                seq: 1,
            }
            .encode(),
        )
        .unwrap()
    });
    assert!(
        matches!(e, CommError::Protocol(ProtocolError::OutOfStep { .. })),
        "{e:?}"
    );
    let e = rogue_peer(|s| {
        s.write_all(
            &Header {
                kind: Kind::Proof,
                len: 0,
                seq: 1,
            }
            .encode(),
        )
        .unwrap()
    });
    assert!(
        matches!(e, CommError::Protocol(ProtocolError::Unexpected { .. })),
        "{e:?}"
    );
    // A frame cut short, then the peer vanishes.
    let e = rogue_peer(|s| {
        s.write_all(
            &Header {
                kind: Kind::Data,
                len: 4000,
                seq: 1,
            }
            .encode(),
        )
        .unwrap();
        s.write_all(&[0; 100]).unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
    });
    assert!(matches!(e, CommError::PeerLost { rank: 1, .. }), "{e:?}");
    // A silent peer: the call returns at the timeout.
    let e = rogue_peer(|_| std::thread::sleep(TIMEOUT + Duration::from_millis(500)));
    assert!(matches!(e, CommError::Timeout { .. }), "{e:?}");
}

#[test]
fn connect_times_out_without_peers() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap(); // closed at once
    let mut c = diphoma_ring::Config::new(
        1,
        2,
        vec![dead, l.local_addr().unwrap()],
        1,
        "j",
        common::KEY.to_vec(),
    );
    c.timeout = Duration::from_millis(500);
    assert!(matches!(
        Communicator::connect(c, l),
        Err(CommError::Timeout { .. })
    ));
}

/// A rank still joining generation 6 when its peer already joins 7 learns at once that its own
/// generation is stale, from the peer's connection (authenticated at generation 7), instead of
/// waiting for its connect timeout; a hello of a newer generation without the key does not
/// make it give up. It then joins 7 on the same address, and the peer, which kept retrying,
/// gets through.
#[test]
fn a_stale_member_learns_it_from_a_newer_peer() {
    let mut cfgs = common::configs(2, 7, TIMEOUT);
    let (c1, l1) = cfgs.pop().unwrap();
    let (mut c0, l0) = cfgs.pop().unwrap();
    c0.generation = 6; // rank 0 (the acceptor) has not seen generation 7 yet
    let addr0 = c0.addresses[0];
    let counters = c0.counters.clone();
    let stale = {
        let c0 = c0.clone();
        std::thread::spawn(move || Communicator::connect(c0, l0))
    };
    // A keyless intruder claiming generation 8 is refused; rank 0 keeps waiting.
    intrude(addr0, |s| {
        let p = AuthParams {
            key: b"not-the-key-not-the-key-not-the-",
            job_uid: "job-uid-1",
            generation: 8,
            world: 2,
            protection: Protection::Integrity,
        };
        let e = auth::initiate(s, &p, 1, 0);
        assert!(matches!(e, Err(CommError::AuthFailed { .. })), "{e:?}");
    });
    let newer = std::thread::spawn(move || Communicator::connect(c1, l1));
    let e = stale.join().unwrap().unwrap_err();
    assert!(
        matches!(e, CommError::StaleGeneration { ours: 6, theirs: 7 }),
        "{e:?}"
    );
    assert_eq!(counters.auth_failed.load(Ordering::Relaxed), 1);
    assert_eq!(counters.stale_generation.load(Ordering::Relaxed), 1);
    // Rank 0 joins generation 7 on the same address.
    c0.generation = 7;
    let l0 = TcpListener::bind(addr0).unwrap();
    let r0 = std::thread::spawn(move || Communicator::connect(c0, l0));
    let comms = vec![r0.join().unwrap().unwrap(), newer.join().unwrap().unwrap()];
    let (_, ok) = common::on_all(comms, |r, c| {
        let mut b = vec![r as f32 + 1.0; 5];
        c.allreduce(&mut b, ReduceOp::Sum).is_ok() && b == vec![3.0; 5]
    });
    assert!(ok.iter().all(|&x| x));
}
