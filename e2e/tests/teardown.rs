//! Tear-down leaves nothing behind, also when the test that owns the control plane panics: every
//! control-plane process, every pod process and the work directory are gone afterwards.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::cluster::{ControlPlane, TempNamespace};
use diphoma_e2e::kit::{alive, pid_of};
use diphoma_e2e::kubelet::node::NodeConfig;
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;

fn main() {
    let args = Arguments::from_args();
    let t = Trial::test("panicking_owner_leaves_no_process_or_directory", || {
        check().map_err(|e| Failed::from(format!("{e:#}")))
    });
    libtest_mimic::run(&args, vec![t]).exit()
}

fn check() -> Result<()> {
    let seen: Mutex<(Vec<u32>, Option<PathBuf>)> = Mutex::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async {
            let cp = ControlPlane::start().expect("control plane");
            seen.lock().unwrap().1 = Some(cp.dir.clone());
            for f in std::fs::read_dir(&cp.dir).unwrap().flatten() {
                if f.path().extension().is_some_and(|e| e == "pid") {
                    let pid = std::fs::read_to_string(f.path())
                        .unwrap()
                        .trim()
                        .parse()
                        .unwrap();
                    seen.lock().unwrap().0.push(pid);
                }
            }
            let client = cp.client().await.unwrap();
            let _kubelet = start_kubelet(
                &cp,
                &client,
                vec![NodeConfig::gpu("n0", 1)],
                Runtime::Process,
            )
            .await
            .unwrap();
            let ns = TempNamespace::create(&client, "teardown").await.unwrap();
            create(
                &client,
                &ns.name,
                &probe_pod("sleeper", &["--sleep", "3600"], json!({})),
            )
            .await
            .unwrap();
            let p = wait_pod(&client, &ns.name, "sleeper", 90, "Running", |p| {
                phase(p) == "Running"
            })
            .await
            .unwrap();
            seen.lock().unwrap().0.push(pid_of(&p).unwrap());
            panic!("deliberate panic with the control plane, the kubelet and a pod running");
        })
    }));
    ensure!(outcome.is_err(), "the scenario should have panicked");
    drop(rt);
    let (pids, dir) = seen.into_inner().unwrap();
    let dir = dir.context("control plane never started")?;
    ensure!(
        pids.len() >= 6,
        "expected 5 control-plane ids and a pod, saw {pids:?}"
    );
    let left: Vec<u32> = pids.into_iter().filter(|&p| alive(p)).collect();
    ensure!(left.is_empty(), "processes left running: {left:?}");
    ensure!(
        !dir.exists(),
        "work directory {} left behind",
        dir.display()
    );
    Ok(())
}
