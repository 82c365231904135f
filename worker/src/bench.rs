//! The allreduce benchmark: `bench` spawns N local `bench-rank` processes on 127.0.0.1 and
//! relays rank 0's table (nccl-tests style, `performance.md` §1); `bench-rank` is one rank
//! (reports its port on stdout, reads the peers and the key on stdin), with a hidden soak mode
//! for tests. With several `--protection` modes it forms one ring per mode and prints their
//! busbw side by side (samples interleaved), the cost of data-frame protection. It must not
//! train.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use diphoma_ring::comm::Algorithm;
use diphoma_ring::{CommError, Communicator, Config, Element, Protection, ReduceOp, bf16, f16};
use rand::RngCore;

use crate::AnyErr;

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum DTypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum AlgArg {
    Ring,
    Rd,
    Halving,
}

#[derive(Args, Clone)]
struct Common {
    /// Sizes in bytes, with K/M/G suffixes (powers of 1024).
    #[arg(long, default_value = "1K,64K,1M,16M,64M")]
    sizes: String,
    /// Element type.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Warm-up operations before calibrating k.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed samples per size.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Target duration of one sample (k back-to-back operations), in ms.
    #[arg(long, default_value_t = 20.0)]
    min_sample_ms: f64,
    /// Bound on each collective, in seconds.
    #[arg(long, default_value_t = 60)]
    op_timeout_s: u64,
    /// Busy-poll budget in µs before sleeping (default: 50 if ranks ≤ cores, else 0).
    #[arg(long)]
    spin_us: Option<u64>,
    /// Force an allreduce algorithm (default: chosen by size and world).
    #[arg(long, value_enum)]
    algorithm: Option<AlgArg>,
    /// Yield while spinning (default: true).
    #[arg(long)]
    yield_spin: Option<bool>,
    /// SO_SNDBUF/SO_RCVBUF request in bytes (0 = kernel autotuning).
    #[arg(long)]
    socket_buffer: Option<usize>,
    /// Recursive-doubling threshold in bytes.
    #[arg(long)]
    small_bytes: Option<usize>,
    /// Scratch segment in bytes.
    #[arg(long)]
    segment_bytes: Option<usize>,
    /// Data-frame protection: `none`, `integrity` or `encryption`. Several (comma-separated)
    /// form one ring per mode and print busbw side by side with the ratio to the first mode.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    protection: Vec<Protection>,
    /// Soak mode (tests): allreduce this many bytes forever, print `RUNNING` after the first,
    /// and exit 3 with `ERROR <kind>` on the first failure.
    #[arg(long, hide = true)]
    soak: Option<String>,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Number of ranks (processes).
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Kill the ranks after this many seconds.
    #[arg(long, default_value_t = 1200)]
    timeout_s: u64,
    /// The loopback address of each rank (comma-separated, rank r takes the r-th, cycling):
    /// a network profile of `worker/bench/netns.sh` shapes each rank's own address.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1")]
    hosts: Vec<std::net::IpAddr>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
pub(crate) struct RankArgs {
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    world: usize,
    /// The address this rank listens on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    #[command(flatten)]
    common: Common,
}

fn parse_size(s: &str) -> Result<usize, AnyErr> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok((num.parse::<f64>().map_err(|e| format!("size {s:?}: {e}"))? * mult as f64) as usize)
}

/// Kills and reaps every child still running when dropped.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

fn common_args(c: &Common) -> Vec<String> {
    let mut v = vec![
        format!("--sizes={}", c.sizes),
        format!(
            "--dtype={}",
            c.dtype
                .to_possible_value()
                .map(|p| p.get_name().to_string())
                .unwrap_or_default()
        ),
        format!("--warmup={}", c.warmup),
        format!("--samples={}", c.samples),
        format!("--min-sample-ms={}", c.min_sample_ms),
        format!("--op-timeout-s={}", c.op_timeout_s),
    ];
    v.extend(c.spin_us.map(|x| format!("--spin-us={x}")));
    v.extend(
        c.algorithm
            .and_then(|x| x.to_possible_value())
            .map(|p| format!("--algorithm={}", p.get_name())),
    );
    v.extend(c.yield_spin.map(|x| format!("--yield-spin={x}")));
    v.extend(c.socket_buffer.map(|x| format!("--socket-buffer={x}")));
    v.extend(c.small_bytes.map(|x| format!("--small-bytes={x}")));
    v.extend(c.segment_bytes.map(|x| format!("--segment-bytes={x}")));
    v.extend(c.soak.as_ref().map(|x| format!("--soak={x}")));
    let modes: Vec<_> = c.protection.iter().map(|p| p.as_str()).collect();
    v.push(format!("--protection={}", modes.join(",")));
    v
}

/// Runs `bench`: exit 0 when every rank succeeded, 124 on `--timeout-s`.
pub(crate) fn bench(a: BenchArgs) -> Result<ExitCode, AnyErr> {
    if a.world == 0 || a.hosts.is_empty() {
        return Err("--world and --hosts must not be empty".into());
    }
    let exe = std::env::current_exe()?;
    let mut ranks = Ranks(Vec::new());
    for r in 0..a.world {
        let child = Command::new(&exe)
            .arg("bench-rank")
            .arg(format!("--rank={r}"))
            .arg(format!("--world={}", a.world))
            .arg(format!("--host={}", a.hosts[r % a.hosts.len()]))
            .args(common_args(&a.common))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        ranks.0.push(child);
    }
    // Each rank binds its host's port 0 and reports the port; then every rank learns all addresses.
    let mut outs = Vec::new();
    let mut addrs = Vec::new();
    for (r, c) in ranks.0.iter_mut().enumerate() {
        let mut out = BufReader::new(c.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        let port: u16 = line
            .strip_prefix("PORT ")
            .ok_or(format!("bad rank hello {line:?}"))?
            .trim()
            .parse()?;
        addrs.push(SocketAddr::new(a.hosts[r % a.hosts.len()], port).to_string());
        outs.push(out);
    }
    let mut key = [0u8; 32];
    rand::rng().fill_bytes(&mut key);
    let key_hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    for c in &mut ranks.0 {
        let mut stdin = c.stdin.take().ok_or("no stdin")?;
        writeln!(stdin, "ADDRS {}\nKEY {key_hex}", addrs.join(","))?;
    }
    // Rank 0 prints the table; the others' output is drained so they never block.
    let mut drains = Vec::new();
    let mut first = None;
    for (r, out) in outs.into_iter().enumerate() {
        if r == 0 {
            first = Some(out);
            continue;
        }
        drains.push(std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                eprintln!("rank {r}: {l}");
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(a.timeout_s);
    let printer = std::thread::spawn(move || {
        let stdout = std::io::stdout();
        for l in first
            .into_iter()
            .flat_map(|o| o.lines())
            .map_while(Result::ok)
        {
            let mut so = stdout.lock();
            let _ = writeln!(so, "{l}");
            let _ = so.flush();
        }
    });
    let mut failed = false;
    for (r, c) in ranks.0.iter_mut().enumerate() {
        loop {
            if let Some(st) = c.try_wait()? {
                if !st.success() {
                    tracing::error!("rank {r} exited with {st}");
                    failed = true;
                }
                break;
            }
            if Instant::now() >= deadline {
                tracing::error!("timeout: killing ranks");
                return Ok(ExitCode::from(124));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = printer.join();
    for d in drains {
        let _ = d.join();
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs one rank of `bench` (exit 3 on the first failure in soak mode).
pub(crate) fn bench_rank(a: RankArgs) -> Result<ExitCode, AnyErr> {
    // Die with the `bench` parent, whatever kills it.
    // Best effort, as a refused request only leaves an orphan to the bench's own timeout.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let listener = TcpListener::bind((a.host, 0))?;
    println!("PORT {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let stdin = std::io::stdin();
    let (mut addrs, mut key) = (Vec::new(), Vec::new());
    for line in stdin.lock().lines() {
        let line = line?;
        if let Some(rest) = line.strip_prefix("ADDRS ") {
            addrs = rest
                .split(',')
                .map(|s| s.parse::<SocketAddr>())
                .collect::<Result<_, _>>()?;
        } else if let Some(rest) = line.strip_prefix("KEY ") {
            key = (0..rest.len() / 2)
                .map(|i| u8::from_str_radix(&rest[2 * i..2 * i + 2], 16))
                .collect::<Result<_, _>>()?;
            break;
        }
    }
    let c = &a.common;
    let mut cfg = Config::new(a.rank, a.world, addrs, 1, "diphoma-bench", key);
    cfg.timeout = Duration::from_secs(c.op_timeout_s);
    if let Some(us) = c.spin_us {
        cfg.spin = Duration::from_micros(us);
    }
    cfg.algorithm = c.algorithm.map(|a| match a {
        AlgArg::Ring => Algorithm::Ring,
        AlgArg::Rd => Algorithm::RecursiveDoubling,
        AlgArg::Halving => Algorithm::Halving,
    });
    if let Some(y) = c.yield_spin {
        cfg.yield_spin = y;
    }
    if let Some(b) = c.socket_buffer {
        cfg.socket_buffer = b;
    }
    if let Some(b) = c.small_bytes {
        cfg.small_bytes = b;
    }
    if let Some(b) = c.segment_bytes {
        cfg.segment_bytes = b;
    }
    let mut comms = Vec::new();
    for &mode in &c.protection {
        let cfg = Config {
            protection: mode,
            ..cfg.clone()
        };
        let mut comm = Communicator::connect(cfg, listener.try_clone()?)?;
        // Every rank has joined this ring before any rank joins the next on the same port.
        comm.barrier()?;
        comms.push(comm);
    }
    if let Some(soak) = &c.soak {
        return Ok(soak_loop(&mut comms[0], parse_size(soak)?));
    }
    match c.dtype {
        DTypeArg::F32 => run_table::<f32>(&mut comms, c, "f32"),
        DTypeArg::F16 => run_table::<f16>(&mut comms, c, "f16"),
        DTypeArg::Bf16 => run_table::<bf16>(&mut comms, c, "bf16"),
    }?;
    Ok(ExitCode::SUCCESS)
}

fn soak_loop(comm: &mut Communicator, bytes: usize) -> ExitCode {
    let mut buf = vec![0f32; (bytes / 4).max(1)];
    let mut n = 0u64;
    loop {
        if let Err(e) = comm.allreduce(&mut buf, ReduceOp::Sum) {
            println!("ERROR {} {e}", e.metric_label());
            let _ = std::io::stdout().flush();
            return ExitCode::from(3);
        }
        n += 1;
        if n == 1 {
            println!("RUNNING");
            let _ = std::io::stdout().flush();
        }
    }
}

/// The max over ranks of one value per rank (gathered through a sum of one-hot vectors).
fn max_over_ranks(comm: &mut Communicator, xs: &[f32]) -> Result<Vec<f32>, CommError> {
    let (n, r, m) = (comm.world(), comm.rank(), xs.len());
    let mut v = vec![0f32; n * m];
    v[r * m..(r + 1) * m].copy_from_slice(xs);
    comm.allreduce(&mut v, ReduceOp::Sum)?;
    Ok((0..m)
        .map(|i| (0..n).map(|q| v[q * m + i]).fold(f32::MIN, f32::max))
        .collect())
}

fn calibrate(t_us: f32, min_ms: f64) -> usize {
    ((min_ms * 1e3 / (t_us as f64).max(1e-3)).ceil() as usize).clamp(1, 100_000)
}

fn timed<T: Element>(comm: &mut Communicator, buf: &mut [T], k: usize) -> Result<f32, CommError> {
    let t0 = Instant::now();
    for _ in 0..k {
        comm.allreduce(buf, ReduceOp::Sum)?;
    }
    Ok((t0.elapsed().as_secs_f64() * 1e6 / k as f64) as f32)
}

/// The number of wrong elements over all ranks after one allreduce of `count` elements, where
/// rank r contributes (r+1) + (i mod 7).
fn gate<T: Element>(comm: &mut Communicator, count: usize) -> Result<u64, CommError> {
    let (n, rank) = (comm.world(), comm.rank());
    let mut buf: Vec<T> = (0..count)
        .map(|i| T::from_f32((rank + 1) as f32 + (i % 7) as f32))
        .collect();
    comm.allreduce(&mut buf, ReduceOp::Sum)?;
    let tol = if std::mem::size_of::<T>() == 2 {
        1e-2
    } else {
        1e-3
    };
    let wrong = buf
        .iter()
        .enumerate()
        .filter(|(i, x)| {
            let e = (n * (n + 1) / 2) as f32 + (n * (i % 7)) as f32;
            let close = (x.to_f32() - e).abs() <= tol * e.abs() + tol; // false for NaN
            !close
        })
        .count();
    let mut w = [wrong as f32];
    comm.allreduce(&mut w, ReduceOp::Sum)?;
    Ok(w[0] as u64)
}

/// Operations per sample so that one sample lasts about `min_sample_ms` (agreed over ranks).
fn calibrated_k<T: Element>(
    comm: &mut Communicator,
    buf: &mut [T],
    c: &Common,
) -> Result<usize, CommError> {
    comm.barrier()?;
    let tw = timed(comm, buf, c.warmup.max(1))?;
    let k = calibrate(max_over_ranks(comm, &[tw])?[0], c.min_sample_ms);
    comm.barrier()?;
    let tw = timed(comm, buf, k)?;
    Ok(calibrate(max_over_ranks(comm, &[tw])?[0], c.min_sample_ms))
}

/// The samples' max over ranks, sorted ascending.
fn sorted_over_ranks(comm: &mut Communicator, ts: &[f32]) -> Result<Vec<f32>, CommError> {
    let mut ts = max_over_ranks(comm, ts)?;
    ts.sort_by(f32::total_cmp);
    Ok(ts)
}

fn median(ts: &[f32]) -> f64 {
    let s = ts.len();
    if s % 2 == 1 {
        ts[s / 2] as f64
    } else {
        (ts[s / 2 - 1] as f64 + ts[s / 2] as f64) / 2.0
    }
}

/// busbw in GB/s of an allreduce of `nbytes` over `n` ranks taking `us`:
/// algbw·2(n−1)/n (nccl-tests, doc/PERFORMANCE.md).
fn busbw(nbytes: usize, us: f64, n: usize) -> f64 {
    nbytes as f64 / (us * 1e-6) / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64
}

/// Rank 0 prints the table of one ring (`comms` of one mode), or the side-by-side busbw of
/// several modes (samples interleaved across modes, so that load hits them alike).
fn run_table<T: Element>(comms: &mut [Communicator], c: &Common, name: &str) -> Result<(), AnyErr> {
    let (n, rank) = (comms[0].world(), comms[0].rank());
    let esize = std::mem::size_of::<T>();
    let modes: Vec<_> = c.protection.iter().map(|p| p.as_str()).collect();
    if rank == 0 {
        println!(
            "# diphoma-worker {} allreduce  nranks={n}  dtype={name} op=sum in-place  warmup={} samples={} min_sample_ms={} protection={}",
            env!("CARGO_PKG_VERSION"),
            c.warmup,
            c.samples,
            c.min_sample_ms,
            modes.join(",")
        );
        println!(
            "# time = median over samples of max-over-ranks(mean time per op within the sample); GB = 1e9 bytes"
        );
        if comms.len() == 1 {
            println!(
                "#{:>11} {:>11} {:>6} {:>12} {:>12} {:>9} {:>9} {:>7}",
                "size(B)", "count", "k/samp", "time(us)", "min(us)", "algbw", "busbw", "#wrong"
            );
        } else {
            let busbw: Vec<_> = modes.iter().map(|m| format!("busbw {m}")).collect();
            let ratio: Vec<_> = modes[1..]
                .iter()
                .map(|m| format!("{m}/{}", modes[0]))
                .collect();
            println!(
                "| size(B) | {} | {} | #wrong |",
                busbw.join(" | "),
                ratio.join(" | ")
            );
            println!("|---|{}---|", "---|".repeat(2 * modes.len() - 1));
        }
        std::io::stdout().flush()?;
    }
    for tok in c.sizes.split(',') {
        let count = (parse_size(tok)? / esize).max(1);
        let nbytes = count * esize;
        let mut wrong = 0;
        for comm in comms.iter_mut() {
            wrong += gate::<T>(comm, count)?;
        }
        let mut buf = vec![T::from_f32(0.0); count];
        let ks = comms
            .iter_mut()
            .map(|comm| calibrated_k(comm, &mut buf, c))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ts = vec![Vec::with_capacity(c.samples); comms.len()];
        for _ in 0..c.samples {
            for (m, comm) in comms.iter_mut().enumerate() {
                comm.barrier()?;
                ts[m].push(timed(comm, &mut buf, ks[m])?);
            }
        }
        let ts = comms
            .iter_mut()
            .zip(&ts)
            .map(|(comm, t)| sorted_over_ranks(comm, t))
            .collect::<Result<Vec<_>, _>>()?;
        if rank != 0 {
            continue;
        }
        let meds: Vec<f64> = ts.iter().map(|t| median(t)).collect();
        if comms.len() == 1 {
            let med = meds[0];
            println!(
                " {:>11} {:>11} {:>6} {:>12.1} {:>12.1} {:>9.3} {:>9.3} {:>7}",
                nbytes,
                count,
                ks[0],
                med,
                ts[0][0],
                nbytes as f64 / (med * 1e-6) / 1e9,
                busbw(nbytes, med, n),
                wrong
            );
        } else {
            let bw: Vec<f64> = meds.iter().map(|&t| busbw(nbytes, t, n)).collect();
            let cols: Vec<_> = bw.iter().map(|b| format!("{b:.3}")).collect();
            let ratios: Vec<_> = bw[1..]
                .iter()
                .map(|b| format!("{:.2}", b / bw[0]))
                .collect();
            println!(
                "| {nbytes} | {} | {} | {wrong} |",
                cols.join(" | "),
                ratios.join(" | ")
            );
        }
        std::io::stdout().flush()?;
    }
    Ok(())
}
