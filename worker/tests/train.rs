//! Training: world-size independence, accuracy on the digits set, data-file errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::max_diff;
use diphoma_worker::data::{self, Dataset};
use diphoma_worker::model;
use diphoma_worker::optim::{OptState, OptimizerKind};
use diphoma_worker::train::{TrainConfig, train_standalone};

fn data_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz")
}

fn train_set() -> Dataset {
    data::load_digits(&data_path()).unwrap().split().0
}

/// A scratch directory unique to this process and `name`, emptied.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("diphoma-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Tolerance of parameters and losses between runs whose only difference is the world size.
///
/// The two runs see exactly the same samples per step and apply the same update; they differ
/// only in the order of f32 additions: one matmul over the global batch versus per-rank partial
/// sums added by the allreduce. Each gradient element is a sum of at most B = 64 terms, so one
/// step's reordering changes it by at most ~B·ε·Σ|terms| (ε = 2⁻²³ ≈ 1.2e-7), i.e. a relative
/// 1e-5 at worst and ~1e-6 typically; with lr 0.5 and |grad| ≲ 1 that moves a parameter by
/// ≲ 1e-6 per step. Measured after 40 steps: 1.8e-7 (N=1 vs N=4; weights are O(0.1)). 1e-5
/// leaves a factor 50 of margin, while a bug (a lost shard, a wrong weighting, another sample
/// order) moves parameters by ≥ 1e-3.
pub const TOL: f32 = 1e-5;

#[test]
fn world_size_does_not_change_training() {
    let train = train_set();
    let cfg = TrainConfig {
        steps: 40,
        ..TrainConfig::default()
    };
    let one = train_standalone(&cfg, &train, 1).unwrap();
    let four = train_standalone(&cfg, &train, 4).unwrap();
    let p1 = one[0].model.flat_params().unwrap();
    for (r, o) in four.iter().enumerate() {
        assert_eq!(o.step, 40);
        // All ranks of one run hold bit-identical parameters (the allreduce result is).
        assert_eq!(
            o.model.flat_params().unwrap(),
            four[0].model.flat_params().unwrap()
        );
        let d = max_diff(&p1, &o.model.flat_params().unwrap());
        assert!(d <= TOL, "rank {r}: parameters differ by {d}");
        let dl = max_diff(&one[0].losses, &o.losses);
        assert!(dl <= TOL, "rank {r}: loss curves differ by {dl}");
    }
    eprintln!(
        "max parameter gap N=1 vs N=4 after 40 steps: {:e}",
        max_diff(&p1, &four[0].model.flat_params().unwrap())
    );
    // The losses do fall: the curve is a real training curve.
    assert!(one[0].losses[39] < one[0].losses[0] * 0.7);
    // And the test has teeth: another batch size gives another trajectory.
    let other = train_standalone(&TrainConfig { batch: 32, ..cfg }, &train, 1).unwrap();
    assert!(max_diff(&p1, &other[0].model.flat_params().unwrap()) > 100.0 * TOL);
}

/// N=1 against N=4 with AdamW: parameters, losses and both moments within [`TOL`].
///
/// AdamW divides by `√v̂ + ε`, which amplifies the summation-order noise of a gradient element
/// that sums to about ε (see `synthetic_model_trains_the_same_on_any_world`). The digits MLP
/// has none: its near-zero gradients are exact zeros (pixels that are 0 in every image, dead
/// units) in both runs; measured gap 1.9e-7 after 40 steps, as with SGD.
#[test]
fn world_size_does_not_change_training_with_adamw() {
    let train = train_set();
    let cfg = TrainConfig {
        steps: 40,
        optimizer: OptimizerKind::AdamW,
        lr: 0.01,
        ..TrainConfig::default()
    };
    let one = train_standalone(&cfg, &train, 1).unwrap();
    let four = train_standalone(&cfg, &train, 4).unwrap();
    let p1 = one[0].model.flat_params().unwrap();
    let OptState::AdamW { step, m, v } = one[0].optimizer.state().unwrap() else {
        panic!("not AdamW")
    };
    assert_eq!(step, 40);
    for (r, o) in four.iter().enumerate() {
        let d = max_diff(&p1, &o.model.flat_params().unwrap());
        assert!(d <= TOL, "rank {r}: parameters differ by {d}");
        let dl = max_diff(&one[0].losses, &o.losses);
        assert!(dl <= TOL, "rank {r}: loss curves differ by {dl}");
        let OptState::AdamW {
            step: s4,
            m: m4,
            v: v4,
        } = o.optimizer.state().unwrap()
        else {
            panic!("not AdamW")
        };
        assert_eq!(s4, 40);
        let (dm, dv) = (max_diff(&m, &m4), max_diff(&v, &v4));
        assert!(
            dm <= TOL && dv <= TOL,
            "rank {r}: moments differ by {dm} {dv}"
        );
    }
    eprintln!(
        "adamw: max parameter gap N=1 vs N=4 after 40 steps: {:e}",
        max_diff(&p1, &four[0].model.flat_params().unwrap())
    );
    assert!(one[0].losses[39] < one[0].losses[0] * 0.7);
    // Teeth: the same run with SGD ends elsewhere.
    let sgd = TrainConfig {
        optimizer: OptimizerKind::Sgd,
        ..cfg
    };
    let other = train_standalone(&sgd, &train, 1).unwrap();
    assert!(max_diff(&p1, &other[0].model.flat_params().unwrap()) > 100.0 * TOL);
}

/// The synthetic bandwidth model: a deep MLP of the requested size on seeded data, trained by
/// the same loop, its loss falling; N=1 and N=2 agree.
///
/// With SGD within [`TOL`] like digits. With AdamW not element by element: its update
/// `m̂/(√v̂+ε)` has slope up to `1/ε` = 1e8 where a gradient element sums to about ε = 1e-8 by
/// cancellation, so such an element amplifies the summation-order noise of its gradient (from
/// ~1e-10 to a 2.6e-5 parameter gap here, measured: one element of 80,000, already at step 1);
/// digits has no such element (exact zeros instead) and stays within [`TOL`]. So for AdamW:
/// at most 0.1 % of the parameters beyond [`TOL`], and the relative L2 distance within
/// [`TOL`], whereas a bug (a lost shard, another sample order) moves every parameter by about
/// `lr` per step, a relative distance ~1e-2.
#[test]
fn synthetic_model_trains_the_same_on_any_world() {
    let widths = model::synthetic_widths(80_000, 2);
    let n = model::count_params(&widths);
    assert!((n as f64 / 80_000.0 - 1.0).abs() < 0.01, "{n}");
    let (f, c) = (model::SYNTHETIC_FEATURES, model::SYNTHETIC_CLASSES);
    let d = data::synthetic(640, f, c, 4);
    assert_eq!(d, data::synthetic(640, f, c, 4));
    let (train, test) = d.split();
    for (optimizer, lr) in [(OptimizerKind::Sgd, 0.5), (OptimizerKind::AdamW, 1e-3)] {
        let cfg = TrainConfig {
            steps: 10,
            batch: 32,
            seed: 4,
            widths: widths.clone(),
            optimizer,
            lr,
            ..TrainConfig::default()
        };
        let one = train_standalone(&cfg, &train, 1).unwrap();
        let two = train_standalone(&cfg, &train, 2).unwrap();
        assert_eq!(one[0].model.param_count(), n);
        let (p1, p2) = (
            one[0].model.flat_params().unwrap(),
            two[1].model.flat_params().unwrap(),
        );
        let gap = max_diff(&p1, &p2);
        let beyond = p1
            .iter()
            .zip(&p2)
            .filter(|(a, b)| (*a - *b).abs() > TOL)
            .count();
        let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = p1.iter().zip(&p2).map(|(a, b)| a - b).collect();
        let rel = norm(&diff) / norm(&p1);
        eprintln!(
            "synthetic {n} parameters, {}: max gap N=1 vs N=2 {gap:e}, {beyond} beyond {TOL:e}, relative L2 {rel:e}",
            optimizer.name()
        );
        match optimizer {
            OptimizerKind::Sgd => assert!(gap <= TOL, "parameters differ by {gap}"),
            OptimizerKind::AdamW => {
                assert!(beyond <= n / 1000, "{beyond} parameters beyond {TOL}");
                assert!(rel <= f64::from(TOL), "relative distance {rel}");
            }
        }
        assert!(max_diff(&one[0].losses, &two[0].losses) <= TOL);
        let l = &one[0].losses;
        assert!(l[9] < l[0] * 0.95, "loss {} -> {}", l[0], l[9]);
        // Every step moved the whole fused gradient: 4 bytes per parameter plus the loss, plus
        // one rate per rank (the speed-weighted split's).
        assert_eq!(two[0].stats.allreduce_bytes, 4 * (n as u64 + 1 + 2));
        assert_eq!(two[0].stats.steps, 10);
        let acc = one[0].model.accuracy(&test).unwrap();
        eprintln!("  loss {} -> {}, test accuracy {acc}", l[0], l[9]);
    }
}

#[test]
fn cli_trains_the_synthetic_model_and_reports_throughput() {
    let out = worker()
        .args([
            "train",
            "--standalone",
            "--world",
            "2",
            "--model",
            "synthetic",
        ])
        .args([
            "--params", "60000", "--layers", "2", "--steps", "6", "--batch", "32",
        ])
        .args(["--optimizer", "adamw", "--log-every", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let widths = model::synthetic_widths(60_000, 2);
    let want = format!(
        "model {widths:?}: {} parameters, optimizer adamw",
        model::count_params(&widths)
    );
    assert!(stdout.contains(&want), "{stdout}");
    let bytes_mb = 4.0 * (model::count_params(&widths) + 1) as f64 / 1e6;
    assert!(
        stdout.contains("throughput ")
            && stdout.contains(&format!("ms per step of {bytes_mb:.2} MB"))
            && stdout.contains(", 6 steps on rank 0"),
        "{stdout}"
    );
    assert!(stdout.contains("step 6 generation 1 loss "), "{stdout}");
    eprintln!("{stdout}");
}

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_diphoma-worker"))
}

#[test]
fn cli_trains_digits_to_95_percent() {
    cli_trains_digits_to_95_percent_with(&[]);
}

#[test]
fn cli_trains_digits_to_95_percent_with_adamw() {
    cli_trains_digits_to_95_percent_with(&["--optimizer", "adamw", "--lr", ADAMW_LR]);
}

/// AdamW's learning rate for the digits tests (candle-nn's default 0.001 is slow for 400 steps
/// of this small MLP).
const ADAMW_LR: &str = "0.01";

fn cli_trains_digits_to_95_percent_with(extra: &[&str]) {
    let out = worker()
        .args(["train", "--standalone", "--world", "2", "--steps", "400"])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let acc: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("test accuracy "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {stdout}"));
    eprintln!("digits test accuracy {extra:?}: {acc}");
    assert!(acc >= 0.95, "test accuracy {acc} below 0.95");
}

#[test]
fn cli_refuses_missing_or_malformed_data() {
    let dir = scratch("bad-data");
    let missing = dir.join("nope.csv.gz");
    let not_gzip = dir.join("plain.csv.gz");
    std::fs::write(&not_gzip, "1,2,3\n").unwrap();
    let bad_row = dir.join("bad-row.csv.gz");
    {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&bad_row).unwrap(),
            flate2::Compression::fast(),
        );
        gz.write_all(b"1,2,3\n").unwrap();
        gz.finish().unwrap();
    }
    for f in [&missing, &not_gzip, &bad_row] {
        let out = worker()
            .args(["train", "--standalone", "--steps", "1", "--data"])
            .arg(f)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{f:?} accepted");
        assert!(
            err.contains(&*f.to_string_lossy()),
            "error does not name {f:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `step N …` lines of rank 0's log.
fn logged_step(line: &str) -> Option<u64> {
    line.strip_prefix("step ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn killed_run_resumes_from_its_newest_checkpoint() {
    killed_run_resumes_from_its_newest_checkpoint_with(OptimizerKind::Sgd);
}

/// With AdamW the checkpoint holds the moments and the step count: the resumed run still ends
/// where an uninterrupted one ends (it would not with fresh moments).
#[test]
fn killed_run_resumes_from_its_newest_checkpoint_with_adamw() {
    killed_run_resumes_from_its_newest_checkpoint_with(OptimizerKind::AdamW);
}

fn killed_run_resumes_from_its_newest_checkpoint_with(opt: OptimizerKind) {
    use diphoma_worker::checkpoint::{Checkpoint, file_name, step_of};
    use std::io::{BufRead, BufReader};
    let dir = scratch(&format!("kill-{}", opt.name())).join("ckpt");
    let (steps, every) = (200u64, 10u64);
    let lr = match opt {
        OptimizerKind::Sgd => "0.5",
        OptimizerKind::AdamW => ADAMW_LR,
    };
    let run = || {
        let mut c = worker();
        c.args(["train", "--standalone", "--world", "2", "--log-every", "1"])
            .args(["--optimizer", opt.name(), "--lr", lr])
            .arg(format!("--steps={steps}"))
            .arg(format!("--checkpoint-every={every}"))
            .arg("--checkpoint-dir")
            .arg(&dir);
        c
    };
    // Kill every rank (the whole process) once step 25 is committed.
    let mut child = run()
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut last = 0;
    for l in lines.by_ref() {
        last = logged_step(&l.unwrap()).unwrap_or(last);
        if last >= 25 {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    for l in lines {
        last = logged_step(&l.unwrap()).unwrap_or(last);
    }
    assert!(last < steps, "the run finished before it was killed");
    let newest = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| step_of(e.unwrap().file_name().to_str()?))
        .max()
        .unwrap();
    assert!(
        last - newest <= every,
        "committed {last}, newest checkpoint {newest}"
    );
    // The restart resumes there: it repeats at most `every` steps.
    let out = run().output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}\n{se}");
    assert!(se.contains(&format!("at step {newest}")), "{se}");
    let first = so.lines().find_map(logged_step).unwrap();
    assert_eq!(first, newest + 1);
    eprintln!("killed at step {last}, resumed at step {newest}");
    // And it ends where an uninterrupted run ends.
    let end = Checkpoint::decode(&std::fs::read(dir.join(file_name(steps))).unwrap()).unwrap();
    let cfg = TrainConfig {
        steps,
        optimizer: opt,
        lr: lr.parse().unwrap(),
        ..TrainConfig::default()
    };
    let whole = train_standalone(&cfg, &train_set(), 2).unwrap();
    let d = max_diff(&end.params, &whole[0].model.flat_params().unwrap());
    assert!(
        d <= TOL,
        "resumed run ends {d} away from an uninterrupted one"
    );
    assert_eq!(end.optimizer.kind(), opt);
    if let OptState::AdamW { step, .. } = end.optimizer {
        assert_eq!(step, steps);
    }
    // A run with the other optimizer does not resume from these checkpoints: it warns and
    // starts from step 0.
    let other = match opt {
        OptimizerKind::Sgd => "adamw",
        OptimizerKind::AdamW => "sgd",
    };
    let out = worker()
        .args(["train", "--standalone", "--log-every", "1", "--steps", "1"])
        .args(["--optimizer", other, "--checkpoint-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}\n{se}");
    assert!(
        se.contains("skipping checkpoint") && !se.contains("resuming"),
        "{se}"
    );
    assert_eq!(so.lines().find_map(logged_step), Some(1));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn kubernetes_mode_names_a_missing_or_malformed_variable() {
    use diphoma_contract::*;
    let vars = [
        ENV_JOB_NAME,
        ENV_JOB_UID,
        ENV_NAMESPACE,
        ENV_POD_NAME,
        ENV_POD_IP,
        ENV_RING_PORT,
        ENV_KEY_FILE,
        ENV_MEMBERSHIP,
        ENV_DETECTION_SECONDS,
    ];
    let mut bare = worker();
    bare.arg("train");
    for v in vars {
        bare.env_remove(v);
    }
    let out = bare.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("environment variable DIPHOMA_") && err.contains("not set"),
        "{err}"
    );
    let mut bad = worker();
    bad.arg("train");
    for v in vars {
        bad.env(v, "x");
    }
    bad.env(ENV_POD_IP, "127.0.0.9").env(ENV_RING_PORT, "99999");
    let out = bad.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(ENV_RING_PORT) && err.contains("99999"),
        "{err}"
    );
    bad.env(ENV_RING_PORT, "29500");
    let out = bad.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(ENV_DETECTION_SECONDS) && err.contains("\"x\""),
        "{err}"
    );
    // A key file that is not there is named too.
    bad.env(ENV_DETECTION_SECONDS, "10")
        .env(ENV_KEY_FILE, "/nonexistent/ring.key");
    let out = bad.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/nonexistent/ring.key") && err.contains(ENV_KEY_FILE),
        "{err}"
    );
}

#[test]
fn kubernetes_mode_serves_metrics_and_exits_0_on_sigterm() {
    use diphoma_contract::*;
    use std::io::{Read, Write};
    let dir = scratch("k8s");
    let key = dir.join("ring.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    // An API server that is not there: the ring watch keeps failing (and retrying).
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:1\n\
         users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
         current-context: x\n",
    )
    .unwrap();
    let port = |_| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (ring_port, metrics_port) = (port(()), port(()));
    let mut child = worker()
        .args(["train", "--metrics-port"])
        .arg(metrics_port.to_string())
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env(ENV_JOB_NAME, "demo")
        .env(ENV_JOB_UID, "uid-1")
        .env(ENV_NAMESPACE, "ns")
        .env(ENV_POD_NAME, "demo-worker-0")
        .env(ENV_POD_IP, "127.0.0.1")
        .env(ENV_RING_PORT, ring_port.to_string())
        .env(ENV_KEY_FILE, &key)
        .env(ENV_MEMBERSHIP, "demo-ring")
        .env(ENV_DETECTION_SECONDS, "10")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // /metrics answers once the worker is up (bounded retries, no timing assertion).
    let mut body = String::new();
    for _ in 0..200 {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", metrics_port)) {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            s.read_to_string(&mut body).unwrap();
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "worker exited early");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(body.contains("diphoma_worker_step 0"), "{body}");
    // SIGTERM while waiting for a ring: exit 0.
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("child pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(dir);
}
