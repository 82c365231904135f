//! The benchmark harness's ranks as real processes: a rank killed with SIGKILL mid-allreduce
//! makes every other rank's call fail promptly (`bench-rank --soak`, exit 3 with
//! `ERROR peer_lost`).
//!
//! Time bounds here are hang guards only (generous multiples of the communicator's timeout).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn killed_process_fails_every_other_rank_promptly() {
    let exe = env!("CARGO_BIN_EXE_diphoma-worker");
    let n = 3;
    let mut kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(exe)
                .args([
                    "bench-rank",
                    &format!("--rank={r}"),
                    &format!("--world={n}"),
                ])
                .args(["--soak=4M", "--op-timeout-s=10"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut outs: Vec<_> = kids
        .iter_mut()
        .map(|k| BufReader::new(k.stdout.take().unwrap()))
        .collect();
    let addrs: Vec<String> = outs
        .iter_mut()
        .map(|o| {
            let mut l = String::new();
            o.read_line(&mut l).unwrap();
            format!("127.0.0.1:{}", l.trim().strip_prefix("PORT ").unwrap())
        })
        .collect();
    for k in &mut kids {
        let mut i = k.stdin.take().unwrap();
        writeln!(i, "ADDRS {}\nKEY {}", addrs.join(","), "ab".repeat(32)).unwrap();
    }
    for o in &mut outs {
        let mut l = String::new();
        o.read_line(&mut l).unwrap();
        assert_eq!(l.trim(), "RUNNING");
    }
    kids[1].kill().unwrap(); // SIGKILL mid-allreduce
    kids[1].wait().unwrap();
    let start = Instant::now();
    for r in [0, 2] {
        let st = loop {
            if let Some(st) = kids[r].try_wait().unwrap() {
                break st;
            }
            if start.elapsed() > TIMEOUT * 3 {
                for k in &mut kids {
                    let _ = k.kill();
                }
                panic!("rank {r} still running after {:?}", start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(st.code(), Some(3), "rank {r}");
        let mut rest = String::new();
        outs[r].read_to_string(&mut rest).unwrap();
        assert!(rest.starts_with("ERROR peer_lost"), "rank {r}: {rest:?}");
    }
}
