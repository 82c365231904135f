//! Slow is not hung: with [`Config::liveness`], a collective waits on a peer whose process
//! answers liveness pings however long its step takes, blames a peer that does not answer, and
//! still ends at once when aborted (a new generation). Real sockets on 127.0.0.1: each rank's
//! [`Responder`] runs at its ring address, as in a worker pod.
//!
//! Time bounds here are hang guards only.

mod common;

use std::net::UdpSocket;
use std::sync::mpsc;
use std::time::Duration;

use diphoma_ring::liveness::Responder;
use diphoma_ring::{CommError, Communicator, Config, ReduceOp};

/// The liveness window of these rings.
const WINDOW: Duration = Duration::from_millis(200);
/// Hang guard.
const GUARD: Duration = Duration::from_secs(60);

/// A ring of `n` ranks with liveness on, and a responder for each rank listed in `answering`.
fn ring(n: usize, answering: &[usize]) -> (Vec<Communicator>, Vec<Responder>) {
    let cfgs: Vec<_> = common::configs(n, 1, GUARD)
        .into_iter()
        .map(|(mut c, l): (Config, _)| {
            c.liveness = Some(WINDOW);
            (c, l)
        })
        .collect();
    let responders = answering
        .iter()
        .map(|&r| {
            let s = UdpSocket::bind(cfgs[r].0.addresses[r]).unwrap();
            Responder::spawn(s, common::KEY.to_vec()).unwrap()
        })
        .collect();
    let comms = common::connect_all(cfgs)
        .into_iter()
        .map(|c| c.unwrap())
        .collect();
    (comms, responders)
}

#[test]
fn a_peer_whose_steps_take_many_windows_is_waited_for() {
    let n = 3;
    let (comms, _responders) = ring(n, &[0, 1, 2]);
    let (_, sums) = common::on_all(comms, |r, c| {
        let mut ok = true;
        for step in 0..3 {
            if r == 2 {
                // A slow step: five windows of silence before each collective.
                std::thread::sleep(WINDOW * 5);
            }
            let mut buf = vec![(r + step) as f32; 1000];
            c.allreduce(&mut buf, ReduceOp::Sum)?;
            ok &= buf.iter().all(|&x| x == (3 * step + 3) as f32);
        }
        Ok::<_, CommError>(ok)
    });
    for (r, s) in sums.into_iter().enumerate() {
        assert!(s.as_ref().is_ok_and(|&ok| ok), "rank {r}: {s:?}");
    }
}

#[test]
fn a_peer_that_does_not_answer_is_blamed() {
    let n = 3;
    // Rank 2 holds its connections but neither sends nor answers pings: a stopped process.
    let (mut comms, _responders) = ring(n, &[0, 1]);
    let (tx, rx) = mpsc::channel::<()>();
    let frozen = comms.pop().unwrap();
    let holder = std::thread::spawn(move || {
        let _ = rx.recv_timeout(GUARD);
        drop(frozen);
    });
    let (_, errs) = common::on_all(comms, |_, c| {
        let mut buf = vec![1.0f32; 1000];
        c.allreduce(&mut buf, ReduceOp::Sum).unwrap_err()
    });
    tx.send(()).unwrap();
    holder.join().unwrap();
    // Whoever waited on rank 2 blames it; the other learns it from the cascade, never blaming a
    // live rank for silence.
    for (r, e) in errs.iter().enumerate() {
        assert!(
            matches!(
                e,
                CommError::Timeout { peer: Some(2), .. } | CommError::PeerLost { .. }
            ),
            "rank {r}: {e:?}"
        );
    }
    assert!(
        errs.iter()
            .any(|e| matches!(e, CommError::Timeout { peer: Some(2), .. })),
        "{errs:?}"
    );
}

#[test]
fn an_abort_ends_the_wait_on_a_live_peer() {
    let (mut comms, _responders) = ring(2, &[0, 1]);
    // Rank 1 is alive (it answers) but does not enter the collective until released.
    let (tx, rx) = mpsc::channel::<()>();
    let idle = comms.pop().unwrap();
    let holder = std::thread::spawn(move || {
        let _ = rx.recv_timeout(GUARD);
        drop(idle);
    });
    let mut waiting = comms.pop().unwrap();
    let abort = waiting.abort_handle();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(WINDOW * 5);
        abort.abort(); // a new generation was published
    });
    let mut buf = vec![1.0f32; 1000];
    let e = waiting.allreduce(&mut buf, ReduceOp::Sum).unwrap_err();
    aborter.join().unwrap();
    tx.send(()).unwrap();
    holder.join().unwrap();
    assert!(matches!(e, CommError::Aborted), "{e:?}");
}
