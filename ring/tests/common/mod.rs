//! Helpers shared by the integration tests: rings of N ranks as threads on 127.0.0.1:0.
#![allow(dead_code)]

use std::net::TcpListener;
use std::time::Duration;

use diphoma_ring::{CommError, Communicator, Config};

/// The test key (32 bytes).
pub const KEY: &[u8; 32] = b"test-key-test-key-test-key-32byt";

/// Bound listeners and configs for `n` ranks of generation `generation`.
pub fn configs(n: usize, generation: u64, timeout: Duration) -> Vec<(Config, TcpListener)> {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    ls.into_iter()
        .enumerate()
        .map(|(r, l)| {
            let mut c = Config::new(r, n, addrs.clone(), generation, "job-uid-1", KEY.to_vec());
            c.timeout = timeout;
            (c, l)
        })
        .collect()
}

/// Connects every config on its own thread; results by rank.
pub fn connect_all(cfgs: Vec<(Config, TcpListener)>) -> Vec<Result<Communicator, CommError>> {
    let hs: Vec<_> = cfgs
        .into_iter()
        .map(|(c, l)| std::thread::spawn(move || Communicator::connect(c, l)))
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A ready ring of `n` ranks.
pub fn ring(n: usize) -> Vec<Communicator> {
    connect_all(configs(n, 1, Duration::from_secs(60)))
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// Runs `f(rank, comm)` on every rank concurrently; results by rank.
pub fn on_all<R: Send + 'static>(
    comms: Vec<Communicator>,
    f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static,
) -> (Vec<Communicator>, Vec<R>) {
    let f = std::sync::Arc::new(f);
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, mut c)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let out = f(r, &mut c);
                (c, out)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).unzip()
}
