//! Diphoma's Rust trainer: elastic data-parallel training of candle MLPs on top of the ring
//! runtime (`diphoma-ring`), and the `diphoma-worker` binary that pods run.
//!
//! # Layout
//!
//! | module | owns | must not |
//! |---|---|---|
//! | [`data`] | the digits data set, the seeded synthetic set, the test split, the seeded data order and the per-rank shard (pure but for loading) | know about ranks beyond `(world, rank)` |
//! | [`model`] | the candle MLPs (digits; the synthetic model sized by parameter count), summed-loss gradients as flat `f32`, gradient fusion | touch sockets |
//! | [`optim`] | SGD (candle-nn) and AdamW (candle-nn's update) with their state as flat `f32` | know about ranks |
//! | [`checkpoint`] | safetensors checkpoints (parameters, optimizer state) with a SHA-256 and the owning job in the metadata; atomic writes, newest-valid reads, a job's own directory (or the one it resumes by name) only | decide when to write |
//! | [`balance`] | re-export of `diphoma_contract::balance`: the smoothed compute time per sample and the split of the global batch by largest remainder (pure), shared with the PyTorch sampler | (defined in the contract: one implementation for both runtimes) |
//! | [`train`] | one rank's step loop: fused allreduce (or periodic averaging), commit, roll-back, generation changes, state sync, the re-split of the batch | parse the contract's env or talk to Kubernetes |
//! | [`metrics`] | the `diphoma_worker_*` Prometheus metrics, the `/metrics` endpoint, [`metrics::Metered`] (a ring source that records them) | decide what to record |
//! | `main.rs` (binary) | the `diphoma-worker` CLI: parses it and dispatches to `train` or the benchmark | hold runtime logic |
//! | `train_cli.rs` (binary) | the `train` subcommand: standalone or one rank of a Kubernetes job (`KubeRing` in [`metrics::Metered`], `/metrics` served), the printed progress lines and summary | hold training logic |
//! | `bench.rs` (binary) | the allreduce benchmark `bench` and its hidden per-rank half `bench-rank` | train |
//!
//! The ring runtime (communicator, schedules, wire format, the membership follower) is
//! `diphoma-ring`; the operator/worker contract is `diphoma-contract`. This crate must not
//! import the operator.
//!
//! # Design decisions
//!
//! - **Training is elastic-equivalent** ([`train`]): step `s` uses samples `[s·B, (s+1)·B)` of
//!   a seeded permutation, sharded over the current ranks; each rank sends the gradient of its
//!   *summed* loss (plus the loss) in one fused f32 buffer through `allreduce(Sum)` and divides
//!   by `B`. The trajectory does not depend on the world size or its changes, up to f32
//!   summation order (~1e-7 on the parameters after 40 steps; tests allow 1e-5). The split of
//!   the batch over the ranks follows their measured speeds ([`balance`]), so a slow rank
//!   computes fewer of the same samples; the trajectory does not depend on the split either.
//! - **Periodic averaging** (local SGD, `spec.sync.mode: Periodic`): `H` local steps, then one
//!   weighted average of parameters and optimizer moments; only averages commit (see [`train`]).
//! - **Commit and state sync:** a step commits only after its allreduce succeeded on this rank;
//!   nothing changes before, so roll-back is "keep the committed copy". Because one rank's
//!   allreduce can succeed while a peer's fails, every generation starts by adopting the state of
//!   the member with the highest committed step (one small allreduce of the steps, one
//!   `broadcast_bytes` of step and parameters): joiners and off-by-one survivors are the same
//!   case. The state is the step, the parameters and the optimizer's state (none for SGD; AdamW's
//!   moments and step count), and the live model and optimizer always hold the committed state
//!   (nothing changes before the allreduce succeeded), so roll-back copies nothing.
//! - **Same loop, any model:** the digits MLP and the synthetic bandwidth model (`--model
//!   synthetic --params N`) are both an [`model::Mlp`] of some widths on some
//!   [`data::Dataset`]; the train loop does not know which.
//! - **Kubernetes mode**: `train` without `--standalone` follows the ring ConfigMap through
//!   `diphoma_ring::k8s::KubeRing`, wrapped in [`metrics::Metered`]; the e2e fault catalogue
//!   (`e2e/tests/faults.rs`) runs it against a real control plane.

pub use diphoma_contract::balance;
pub mod checkpoint;
pub mod data;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod train;
