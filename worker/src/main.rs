//! `diphoma-worker`: the binary that worker pods run. This file parses the CLI and dispatches;
//! the subcommands live in `train_cli.rs` and `bench.rs`.
//!
//! Subcommands: `train` (elastic data-parallel training of the digits MLP, or with
//! `--model synthetic` of a deep MLP of `--params` parameters on seeded synthetic data that
//! stresses the allreduce; `--standalone` runs N ranks as threads on 127.0.0.1), `bench`
//! (allreduce benchmark with N local rank processes, printing the table of `performance.md` §1)
//! and its hidden per-rank half `bench-rank`.
//!
//! Log lines go through `tracing` to stderr (`RUST_LOG`, default `info`); the CLI's results
//! (training progress and summary, benchmark tables) are printed on stdout.

mod bench;
mod train_cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "diphoma-worker",
    version,
    about = "Diphoma's worker: the trainer on the ring-allreduce runtime, and its benchmark"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Data-parallel training of an MLP on the digits set (or of the synthetic bandwidth model);
    /// prints samples/s, the allreduce time and the test accuracy.
    Train(train_cli::TrainArgs),
    /// Allreduce benchmark: spawns N local ranks on 127.0.0.1 and prints
    /// `size(B) count k/samp time(us) min(us) algbw busbw #wrong` (nccl-tests style).
    Bench(bench::BenchArgs),
    /// One rank of `bench` (internal: reports its port on stdout, reads peers and key on stdin).
    #[command(hide = true)]
    BenchRank(bench::RankArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let r = match cli.cmd {
        Cmd::Train(a) => train_cli::train(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::BenchRank(a) => bench::bench_rank(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The error of a subcommand: printed, then the process exits 1.
type AnyErr = Box<dyn std::error::Error + Send + Sync>;
